"""The Llama-style decoder freetx builds natively: RoPE, RMSNorm, grouped-query attention,
SwiGLU; with the variants of Qwen3 (q/k RMSNorm per head), OLMo 2 (q/k RMSNorm over the
whole projections, norms after attention and MLP instead of before), Phi-3/Phi-4 (fused
q/k/v and gate/up projections, RoPE on part of each head, LongRoPE), Gemma 2 and 3, SmolLM3
(layers without RoPE), a mixture of experts in the MLP (Mixtral, Qwen3-MoE, DeepSeek-V3's
sigmoid router and shared experts: `num_experts`; freetx.models.moe), and DeepSeek's
multi-head latent attention (`kv_lora_rank`; decoder/latent_attention.py).

It is made of parts (`freetx/models/decoder/`): its config (`config.py`), RoPE
(`rope.py`), its layers (`layers.py`: `DecoderBlock`, the unit that parallelism wraps),
the core model (`core.py`: `DecoderCore`), and the capabilities a model opts into by
listing them among its bases, one per parallel axis or input: tensor parallelism
(`tensor_parallel.py`), pipeline stages (`pipeline.py`), packed documents and context
shards (`masks.py`), generation with a KV cache (`incremental.py`), its activation memory
for `freetx estimate` (`estimate.py`). `Transformer` lists
them all; a model without one simply does not follow its protocol
(`freetx/models/protocol.py`), and freetx refuses it for that axis before any work.

Parameter names and the rotate-half RoPE convention follow HF Llama closely enough that
weights convert by renaming; the HF families are records in `hf_families.py`, their
layouts (names, config.json) in `transformer_hf.py`. One builder, `decoder(preset=None, **fields)`, makes every shape: a
preset of `PRESETS` with any field changed, or any shape from its fields;
`hf_decoder(path)` the shape of an HF folder.
"""

from __future__ import annotations

from freetx.models.decoder.config import TransformerConfig
from freetx.models.decoder.estimate import DecoderActivations
from freetx.models.decoder.incremental import IncrementalDecoding
from freetx.models.decoder.masks import ContextMasks, DocumentMasks
from freetx.models.decoder.pipeline import PipelineStages
from freetx.models.decoder.tensor_parallel import TensorParallelPlan
from freetx.models.protocol import build_config, builds
from freetx.models.transformer_hf import LLAMA_LAYOUT, hf_config_fields


class Transformer(
    IncrementalDecoding,
    DocumentMasks,
    ContextMasks,
    PipelineStages,
    TensorParallelPlan,
    DecoderActivations,
):
    """The decoder with every capability: KV-cache generation, packed batches, context
    and tensor parallelism, pipeline stages, its activation memory; and its HF layouts."""

    hf_layout = LLAMA_LAYOUT


# The shapes users know, as the fields they fix; `decoder(preset, **fields)` changes any.
PRESETS: dict[str, dict] = {
    # ~1.6M parameters with the byte vocabulary: CPU tests and the demo
    "tiny": dict(vocab_size=259, hidden_dim=192, num_layers=4, num_heads=6, num_kv_heads=2,
                 ffn_hidden_dim=512, max_seq_len=256, rope_theta=10000.0, tie_embeddings=True),
    # ~52M parameters: a real model that still trains on one GPU or a patient CPU
    "small": dict(vocab_size=259, hidden_dim=640, num_layers=10, num_heads=10, num_kv_heads=5,
                  ffn_hidden_dim=2048, max_seq_len=1024, rope_theta=10000.0,
                  tie_embeddings=True),
    # Llama 3.2 1B: 16 layers, 2048 hidden, 32 heads / 8 KV, tied embeddings
    "llama3_1b": dict(vocab_size=128256, hidden_dim=2048, num_layers=16, num_heads=32,
                      num_kv_heads=8, ffn_hidden_dim=8192, max_seq_len=8192,
                      rope_theta=500000.0, tie_embeddings=True),
    # Llama 3.1 8B: 32 layers, 4096 hidden, 32 heads / 8 KV, untied head
    "llama3_8b": dict(vocab_size=128256, hidden_dim=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, ffn_hidden_dim=14336, max_seq_len=8192,
                      rope_theta=500000.0, tie_embeddings=False),
}  # fmt: skip


@builds(TransformerConfig, PRESETS)
def decoder(preset: str | None = None, **fields) -> Transformer:
    """A decoder: a preset's shape (tiny, small, llama3_1b, llama3_8b) with any
    `TransformerConfig` field changed, or any shape from its fields alone."""
    return Transformer(build_config(TransformerConfig, fields, preset, PRESETS))


@builds(TransformerConfig)
def hf_decoder(path: str, **fields) -> Transformer:
    """The decoder an HF model folder's config.json describes (Llama 2/3/3.1/3.2, Mistral,
    Qwen2/2.5, Qwen3, OLMo 2, Phi-3/3.5/4, Gemma 2, Gemma 3 text, Mixtral, Qwen3-MoE,
    DeepSeek-V3, DeepSeek-V2, GLM-4.5, SmolLM3), with any `TransformerConfig` field changed (e.g. max_seq_len, dropout).
    Its weights: `checkpoint.initial_weights=<the same folder>`."""
    return Transformer(build_config(TransformerConfig, hf_config_fields(path, fields)))
