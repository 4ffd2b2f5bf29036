"""Multi-head latent attention (MLA: DeepSeek-V2 and V3), as transformers 5.24 computes it
(`DeepseekV3Attention`), through `freetx.models.attention.attend` like the decoder's
grouped-query `Attention`.

    queries   wq x (`q_proj`), or with q_lora_rank wq_b(RMSNorm(wq_a x)) (`q_a_proj`,
              `q_a_layernorm`, `q_b_proj`): [heads, qk_nope_head_dim + head_dim]
    latent    wkv_a x (`kv_a_proj_with_mqa`) = [c | k_rot]: c of kv_lora_rank dims, RMS-
              normalized (`kv_a_layernorm`), and ONE RoPE key head of head_dim
              (qk_rope_head_dim) that every head shares
    keys      [k_nope | k_rot] per head, values [v_head_dim] per head: wkv_b c
              (`kv_b_proj`) split into k_nope and v
    RoPE      on the last head_dim dims of queries and keys; `rope_interleave` (DeepSeek's
              checkpoints): on interleaved pairs (x0, x1), (x2, x3), ... as transformers'
              `apply_rotary_pos_emb_interleave` (computed here as rotate-half RoPE on the
              de-interleaved dims: the same products, in another order of the dims that
              queries and keys share)
    scale     (qk_nope_head_dim + head_dim)^-0.5, times yarn's mscale(factor,
              mscale_all_dim)^2 where the RoPE is scaled and gives mscale_all_dim

The projections' biases are transformers': `attention_bias` on wq_a, wkv_a and wo (here
qkv_bias on the first two, wo_bias on wo), none on wq, wq_b, wkv_b. The two inner RMSNorms
have transformers' fixed eps 1e-6.

Training forwards take SDPA (causal), or a packed batch's document mask and a context
shard's mask as the decoder's attention does (the keys and values are expanded per head
first, so `attend` sees ordinary heads of qk and v dims). The paged KV cache of the
generation engine (`freetx.models.paged_cache`) holds transformers' compressed latent
(kv_lora_rank + head_dim per token: the normed latent and the rotated rope key), each
read expanded to every head's keys and values in attention (`keys_values`); the dense
cache of the static batch (`freetx.models.kv_cache`) holds the expanded keys and values
(heads x (qk_nope_head_dim + head_dim + v_head_dim) per token). Tensor parallelism is refused before a
run (`freetx.models.decoder.tensor_parallel.check_tensor_parallel`); keys and values from
another stream (`kv_input`, the Free Transformer's) and bidirectional attention are
refused when called.
"""

from __future__ import annotations

import torch
from torch import nn

from freetx.models.attention import AttentionMask, AttentionSpec, attend
from freetx.models.decoder.config import TransformerConfig
from freetx.models.decoder.rope import apply_rope, yarn_mscale
from freetx.models.kv_cache import LayerCache
from freetx.models.paged_cache import PagedLayer
from freetx.models.protocol import SequenceShard

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a/kv_a norms keep


def latent_attention_scale(cfg: TransformerConfig) -> float:
    """The softmax scale of MLA: (qk_nope_head_dim + head_dim)^-0.5, times
    yarn_mscale(factor, mscale_all_dim)^2 where the RoPE is scaled and gives
    mscale_all_dim (transformers' `yarn_apply_mscale`)."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return scale


def deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """x's last dim (x0, x1, x2, x3, ...) reordered as (x0, x2, ..., x1, x3, ...): the pairs
    DeepSeek rotates become rotate-half's halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module's docstring): the decoder block's
    attention where `kv_lora_rank` is set."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        assert cfg.kv_lora_rank is not None and cfg.v_head_dim is not None
        self.num_heads = cfg.num_heads
        self.rope_dim, self.nope_dim = cfg.head_dim, cfg.qk_nope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        self.attention_dropout = cfg.attention_dropout
        q_size = cfg.num_heads * (self.nope_dim + self.rope_dim)
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(cfg.hidden_dim, q_size, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.hidden_dim, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_norm = nn.RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, q_size, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden_dim, cfg.kv_lora_rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_norm = nn.RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(
            cfg.kv_lora_rank, cfg.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.wo = nn.Linear(cfg.num_heads * self.v_dim, cfg.hidden_dim, bias=cfg.wo_bias)
        self.q_lora_rank = cfg.q_lora_rank
        self.spec = AttentionSpec(scale=latent_attention_scale(cfg))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(deinterleaved(x) if self.interleave else x, cos, sin)

    def keys_values(self, latent: torch.Tensor, k_rot: torch.Tensor):
        """Every head's keys [B, heads, S, nope + rope dims] and values [B, heads, S, v dims]
        from the normed latent [B, S, kv_lora_rank] and the shared rotated rope key [B, 1,
        S, rope dims]."""
        batch, keys, _ = latent.shape
        kv = self.wkv_b(latent).view(batch, keys, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal: bool = True,
        kv_input: torch.Tensor | None = None,
        cache: LayerCache | PagedLayer | None = None,
        mask: AttentionMask | None = None,
        context: SequenceShard | None = None,
    ) -> torch.Tensor:
        """As `freetx.models.decoder.layers.Attention.forward`, causal, keys and values from
        `x` itself."""
        if kv_input is not None or not causal:
            raise ValueError(
                "multi-head latent attention is causal and takes its keys and values from "
                "its own input; build the model with grouped-query attention "
                "(kv_lora_rank=None) for bidirectional or cross attention"
            )
        batch, seq_len, _ = x.shape
        q = self.wq(x) if self.q_lora_rank is None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q = q.view(batch, seq_len, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, self.rotate(q_rot, cos, sin)], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent)
        k_rot = self.rotate(k_rot.view(batch, 1, seq_len, self.rope_dim), cos, sin)
        if isinstance(cache, PagedLayer):  # the compressed latent and rope key, as transformers
            cache.store(latent, k_rot[:, 0])
            latent, k_rot = cache.read()
            k, v = self.keys_values(latent, k_rot[:, None])
            out = attend(q, k, v, self.spec, mask=cache.mask(self.spec))
            return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))
        k, v = self.keys_values(latent, k_rot)
        dropout = self.attention_dropout if self.training else 0.0
        key_valid = None
        if cache is not None:
            k, v, key_valid = cache.extend(k, v)
        if context is not None:  # the whole sequence's keys and values
            k, v = context.gather(k, dim=2), context.gather(v, dim=2)
        out = attend(
            q, k, v, self.spec, causal=True, dropout=dropout, key_valid=key_valid, mask=mask
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))
