"""The decoder's activation memory, for `freetx estimate` (`EstimatesActivations`).

Per token and block, in the compute dtype: the norm inputs and outputs, q, k, v and the
attention output kept by SDPA, the input of wo, and the four MLP tensors (gate, up,
silu(gate), their product): 7h + 2 h_kv + 4 f elements (an MoE block: k (4 f_expert + 2h)
+ 2E instead of 4 f: each token's k experts, its copies and weighted outputs, the router's
logits and probs; and, for soft-capped attention where the explicit kernel computes it,
the rows of T scores per head it keeps: `attention_score_bytes`); full checkpointing keeps
a block's input (h) instead, selective every n-th; and the loss: bf16 logits, their fp32
copy and log-softmax (10 bytes per token per vocabulary entry), which dominate small
models with large vocabularies. And what tensor and context parallelism move per step:
two sums of a block's output per block and pass (tp), the whole sequence's keys and values
gathered per block in forward, a recomputed forward and backward (cp).
"""

from __future__ import annotations

import math

from freetx.models.attention import AttentionSpec, choose_kernel
from freetx.models.chunked_loss import default_num_chunks
from freetx.models.decoder.config import TransformerConfig
from freetx.models.memory import ActivationBytes, TrainingShape


class DecoderActivations:
    """A model whose `config` is a `TransformerConfig` (its blocks `DecoderBlock`s) counts
    its activations as the decoder (`EstimatesActivations`)."""

    config: TransformerConfig

    @property
    def head_width(self) -> int:
        """The logits per token its loss makes: the vocabulary (a sequence scorer's: 1)."""
        return self.config.vocab_size

    def activation_bytes(self, run: TrainingShape) -> ActivationBytes:
        c = self.config
        mlp = None
        if c.num_experts:  # MoE blocks: k experts' MLP tensors per token, the token copies
            # sent to them and their weighted outputs, the router's logits and probs
            layers, dense = max(1, run.blocks), 4 * c.ffn_hidden_dim
            moe = c.experts_per_token * (4 * c.moe_ffn_hidden_dim + 2 * c.hidden_dim)
            moe += 2 * c.num_experts + 4 * c.shared_expert_ffn_dim  # and a shared MLP's
            share = sum(c.is_moe_layer(i) for i in range(layers)) / layers
            mlp = share * moe + (1 - share) * dense
        kv = c.num_kv_heads * c.head_dim
        if c.kv_lora_rank is not None:  # latent attention: every head's keys and values
            kv = c.num_heads * (c.qk_nope_head_dim + c.head_dim + c.v_head_dim) // 2
        return decoder_activations(
            run,
            c.hidden_dim,
            c.ffn_hidden_dim,
            kv,
            self.head_width,
            c.tie_embeddings,
            mlp,
            attention_score_bytes(c, run),
        )


def attention_score_bytes(cfg: TransformerConfig, run: TrainingShape) -> float:
    """Bytes per token and block (averaged over the blocks) that the explicit attention
    kernel keeps for backward where `freetx.models.attention.choose_kernel` picks it on
    the run's device (soft-capped layers on CPU; with attention dropout on CUDA too): each
    query's row of seq_len scores per head, as the tanh output and the weights (compute
    dtype) and the float32 softmax. SDPA and compiled FlexAttention keep no such rows."""
    softcap = cfg.attn_logit_softcap
    if softcap is None:
        return 0.0

    def kernel(sliding: bool) -> str:
        spec = AttentionSpec(window=cfg.sliding_window if sliding else None, softcap=softcap)
        return choose_kernel(run.device_type, spec, cfg.attention_dropout)

    explicit = sum(kernel(sliding) == "explicit" for sliding in cfg.sliding_layers())
    return explicit / cfg.num_layers * cfg.num_heads * run.seq_len * (2 * run.compute_bytes + 4)


def decoder_activations(
    run: TrainingShape,
    hidden: int,
    ffn: int,
    kv_width: int,
    vocab: int,
    tied: bool = True,
    mlp: float | None = None,
    scores: float = 0.0,
) -> ActivationBytes:
    """A decoder's micro-batch of `run.tokens` tokens (per rank) of width `hidden`, MLP
    width `ffn` and keys (or values) `kv_width` wide per token: each block's saved
    tensors per token (see the module docstring; `mlp`: an MoE block's MLP elements per
    token, averaged over the blocks, where not the dense 4 `ffn`; `scores`: the attention's
    score rows, `attention_score_bytes`), less what activation checkpointing recomputes,
    and the loss's logits: all of them, or one of `loss_chunks` chunks plus the gradients
    the chunked loss holds from forward to backward (the output layer's in float32, the
    hidden states'). Under tp, what attention and a dense MLP keep inside (q, the
    attention output and wo's input, k and v, the MLP's four tensors, the score rows) is
    1/tp; the norms' inputs and outputs and an MoE block's experts are whole; a head not
    `tied` to the embedding is sliced by vocabulary. Under cp a rank holds 1/cp of the
    tokens, and its blocks keep the whole sequence's keys and values (cp times its own)
    for attention's backward. With sequence parallelism the norms' inputs and outputs,
    and the blocks' inputs that activation checkpointing keeps, are 1/tp too."""
    tp, cp, compute, blocks = run.tp, run.cp, run.compute_bytes, run.blocks
    tokens = run.tokens // cp
    h, kv = hidden, kv_width * cp  # keys and values gathered from the cp ranks
    layers = max(1, blocks)
    dense_share = 1 / tp if mlp is None else 1.0  # experts stay whole
    mlp = 4 * ffn if mlp is None else mlp
    # a block's saved activations: norms whole; attention, a dense MLP and scores 1/tp
    stream = tp if run.sequence_parallel else 1  # the residual stream's share
    per_token = (4 * h / stream + (3 * h + 2 * kv) / tp + mlp * dense_share) * compute
    per_token += scores / tp
    block_input = h * compute / stream
    if run.checkpointing == "full":
        kept = layers * block_input + per_token  # inputs, and one block being recomputed
    elif run.checkpointing == "selective":
        checkpointed = math.ceil(layers / run.every_n)
        kept = (layers - checkpointed) * per_token + checkpointed * block_input + per_token
    else:
        kept = layers * per_token
    # tensor parallelism's sums: two all-reduces of the block's output per block and pass;
    # context parallelism's gathers of the whole sequence's keys and values (this rank's
    # kv heads: 1/tp), per block: forward, a recomputed forward, backward's reduce-scatter
    passes = 3 if run.checkpointing != "none" else 2
    tp_bytes = 4 * blocks * run.tokens / cp * hidden * compute * 2 * (tp - 1) / tp
    cp_bytes = passes * blocks * run.tokens * 2 * kv_width / tp * compute * (cp - 1) / cp
    chunks = run.loss_chunks or default_num_chunks(vocab)
    logits = vocab / tp if tp > 1 and not tied else vocab  # a vocabulary-parallel loss
    if chunks == 1:
        return ActivationBytes(
            tokens * kept, tokens * logits * (compute + 4 + 4), tp_bytes + cp_bytes
        )
    held = logits * h * 4 + tokens * h * compute  # the head's (slice's) gradient, the hidden's
    loss = math.ceil(tokens / chunks) * logits * (compute + 4 + 4) + held
    return ActivationBytes(tokens * kept, loss, tp_bytes + cp_bytes)
