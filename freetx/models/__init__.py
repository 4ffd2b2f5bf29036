"""Models: plain nn.Modules following the model protocol; parallelism comes from outside.

protocol.py           what freetx asks of a model; presets through one builder per family
memory.py             what `estimate` tells a model counting its activations, and its answer
transformer.py        the Llama-style decoder (Transformer: the core and every capability),
                      presets tiny ... llama3_8b
decoder/              the decoder in parts: config, RoPE, layers, core, and the capabilities
                      a model lists (tensor_parallel, pipeline, masks, incremental)
kv_cache.py           its KV cache (generation): keys and values per layer, left padding
moe.py                its mixture-of-experts MLP (Mixtral, Qwen3-MoE): router, grouped experts
hf_families.py        the HF families it reads and writes natively, one record each (Llama,
                      Mistral, Qwen2, Qwen3, OLMo 2, Mixtral, Qwen3-MoE, Phi-3, Gemma 2 and
                      3, SmolLM3)
transformer_hf.py     its HF layouts: tensor names, config.json (by a family's record)
hf_export_checks.py   whether it can be written as the HF family it names (blocks,
                      projections, RoPE, biases, fields), else the family that fits
hf.py                 finding a model's HF layout (the checkpoint package asks here);
                      `hf_model(path)`: a folder's model, native or generic
hf_generic.py         the generic transformers path: any other causal LM transformers knows
free_transformer.py   the Free Transformer: the decoder + a per-token latent
ad.py                 the Algorithm Distillation transformer
"""

from freetx.models.hf import hf_model
from freetx.models.protocol import (
    DecodesIncrementally,
    LatentModel,
    Model,
    OutputLayer,
    OutputLoss,
    PacksDocuments,
    ProjectsInChunks,
    build_config,
    build_model,
    builds,
    flops_per_token,
    model_class,
    num_active_parameters,
    num_parameters,
    training_flops_per_token,
)

__all__ = [
    "DecodesIncrementally",
    "PacksDocuments",
    "LatentModel",
    "Model",
    "OutputLayer",
    "OutputLoss",
    "ProjectsInChunks",
    "build_config",
    "build_model",
    "builds",
    "flops_per_token",
    "training_flops_per_token",
    "hf_model",
    "model_class",
    "num_active_parameters",
    "num_parameters",
]
