"""RoPE as HF Llama computes it (rotate-half): the inverse frequencies with HF's scalings
(llama3, linear, Phi-3's longrope; `rope_frequencies`), the cos and sin tables
(`rope_tables`, `RotaryTables`: non-persistent buffers, longrope's short and long pair),
and their application to queries and keys (`apply_rope`: partial rotary included)."""

from __future__ import annotations

import math

import torch
from torch import nn

ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    # Phi-3/3.5-mini-128k, Phi-4-mini: per-frequency factors, short up to original_max_..., long
    # beyond; factor: the context's extension (max / original), which sets the cos/sin scale
    # unless attention_factor gives it
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor"),
    # YaRN (DeepSeek-V2/V3): frequencies between interpolated (/ factor) and kept, by a
    # linear ramp over the dims between beta_fast and beta_slow rotations (32 and 1 when
    # absent); cos and sin times attention_factor (else from mscale / mscale_all_dim)
    "yarn": ("factor", "original_max_position_embeddings"),
}


def check_rope_scaling(scaling: dict | None, rotary_dim: int) -> None:
    """A RoPE scaling freetx computes exactly, with every number it needs, or ValueError."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"rope_scaling rope_type {kind!r} is not supported; freetx computes "
            f"{', '.join(ROPE_SCALING_KEYS)} (or no scaling: rope_scaling=None)"
        )
    missing = [k for k in ROPE_SCALING_KEYS[kind] if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {kind} lacks {', '.join(missing)}")
    for key in ("short_factor", "long_factor") if kind == "longrope" else ():
        if not isinstance(scaling[key], list) or len(scaling[key]) != rotary_dim // 2:
            raise ValueError(
                f"rope_scaling's {key} must be a list of {rotary_dim // 2} numbers (one per "
                f"frequency of the {rotary_dim} rotated dims), not {scaling[key]!r}"
            )


def rope_frequencies(
    rotary_dim: int, theta: float, scaling: dict | None, device=None, long: bool = False
):
    """RoPE's inverse frequencies [rotary_dim / 2], with HF's frequency scaling applied.

    llama3: wavelengths longer than original_max / low_freq_factor are divided by
    `factor`, those shorter than original_max / high_freq_factor are kept, and the
    ones between are interpolated smoothly (as Llama 3.1's reference code does).
    linear: every frequency divided by `factor` (positions interpolated).
    longrope: frequency i divided by short_factor[i] (`long`: long_factor[i]).
    """
    exponents = (
        torch.arange(0, rotary_dim, 2, device=device, dtype=torch.int64).float() / rotary_dim
    )
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "yarn":
        return yarn_frequencies(inv_freq, rotary_dim, theta, scaling)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    between = (wavelength >= original / high) & (wavelength <= original / low)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(between, interpolated, scaled)


def yarn_frequencies(inv_freq: torch.Tensor, rotary_dim: int, theta: float, scaling: dict):
    """YaRN's inverse frequencies, as transformers 5.24's `_compute_yarn_parameters`: each
    between inv_freq / factor (interpolated) and inv_freq (kept) by a linear ramp over the
    dims whose wavelengths fit between beta_fast and beta_slow rotations in
    original_max_position_embeddings (bounds floored / ceiled unless `truncate` is false)."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if low == high else high  # no singularity
    index = torch.arange(rotary_dim // 2, dtype=torch.float32, device=inv_freq.device)
    kept = 1 - torch.clamp((index - low) / (high - low), 0, 1)
    return (inv_freq / factor) * (1 - kept) + inv_freq * kept


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's temperature for a context extended `scale` times (transformers'
    `get_mscale`): 0.1 mscale ln(scale) + 1, and 1 where scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: longrope's attention_factor, or as transformers
    derives it from `factor`, sqrt(1 + ln(factor) / ln(original_max_position_embeddings))
    (1 where factor <= 1); yarn's attention_factor, or mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) where both are given, else mscale(factor); 1 for every
    other RoPE."""
    if scaling is not None and scaling["rope_type"] == "yarn":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor, mscale = float(scaling["factor"]), scaling.get("mscale")
        all_dim = scaling.get("mscale_all_dim")
        if mscale and all_dim:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
        return yarn_mscale(factor)
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_tables(
    rotary_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: dict | None = None,
    device=None,
    long: bool = False,
):
    """cos and sin tables [max_seq_len, rotary_dim] for rotate-half RoPE (HF Llama), scaled
    by the attention factor (`rope_attention_factor`); `long`: longrope's long factors."""
    inv_freq = rope_frequencies(rotary_dim, theta, scaling, device, long)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    scale = rope_attention_factor(scaling)
    return angles.cos() * scale, angles.sin() * scale


class RotaryTables(nn.Module):
    """RoPE's cos and sin tables as non-persistent buffers (never in a checkpoint).

    `tables(seq_len)` gives the first `seq_len` rows; `reset()` recomputes them
    on their device after a meta-device model is materialized. With longrope there are
    two pairs, and a sequence longer than original_max_position_embeddings takes the
    long one for all its positions, a shorter one the short one (as transformers picks
    them by the length of what it is given). With a KV cache, `tables(seq_len, positions)`
    gives the rows of `positions` [B, T] ([B, 1, T, rotary_dim]), longrope's pair picked
    per row by its largest position + 1 (transformers' `longrope_frequency_update` picks
    by the batch's largest: one prompt at a time, the same). A packed batch gives
    `lengths` [B, T] too, its documents' lengths: longrope's pair is picked per document,
    as transformers picks it for each document alone.
    """

    def __init__(
        self, rotary_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        self.rotary_dim, self.max_seq_len, self.theta = rotary_dim, max_seq_len, theta
        self.scaling = scaling
        longrope = scaling is not None and scaling["rope_type"] == "longrope"
        self.long_after = scaling["original_max_position_embeddings"] if longrope else None
        self.kinds = {"": False, "long_": True} if longrope else {"": False}  # prefix -> long
        for prefix, long in self.kinds.items():
            cos, sin = rope_tables(rotary_dim, max_seq_len, theta, scaling, long=long)
            self.register_buffer(f"{prefix}cos", cos, persistent=False)
            self.register_buffer(f"{prefix}sin", sin, persistent=False)

    def forward(
        self,
        seq_len: int,
        positions: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is not None:
            cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
            if self.long_after is None:
                return cos, sin
            if lengths is None:  # one sequence per row
                lengths = positions.amax(dim=1, keepdim=True) + 1
            long = (lengths > self.long_after)[:, None, :, None]
            long_cos, long_sin = (
                self.long_cos[positions][:, None],
                self.long_sin[positions][:, None],
            )
            return torch.where(long, long_cos, cos), torch.where(long, long_sin, sin)
        long = self.long_after is not None and seq_len > self.long_after
        cos, sin = (self.long_cos, self.long_sin) if long else (self.cos, self.sin)
        return cos[:seq_len], sin[:seq_len]

    def rereads(self, cached: torch.Tensor, new: int) -> bool:
        """Whether a KV cache whose rows hold `cached` [B] tokens each (padding aside) must
        be computed again now that `new` tokens follow: a row's keys were computed with the
        short tables and it grows past original_max_position_embeddings, where transformers'
        Phi-3 drops its cache once (`Phi3ForCausalLM.prepare_inputs_for_generation`). Every
        row is computed again, each with its own tables (the same for the rows that do not
        cross)."""
        if self.long_after is None:
            return False
        crossing = (cached > 0) & (cached <= self.long_after) & (cached + new > self.long_after)
        return bool(crossing.any())

    @torch.no_grad()
    def reset(self) -> None:
        for prefix, long in self.kinds.items():
            cos, sin = rope_tables(
                self.rotary_dim, self.max_seq_len, self.theta, self.scaling, self.cos.device, long
            )
            getattr(self, f"{prefix}cos").copy_(cos)
            getattr(self, f"{prefix}sin").copy_(sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, rotary_dim]: the first rotary_dim dims of
    each head rotated, the rest passed through (partial rotary)."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
