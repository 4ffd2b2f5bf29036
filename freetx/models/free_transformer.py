"""The Free Transformer (Fleuret, 2025): a decoder conditioned on a per-token latent Z.

    input -> first `split_layer` DecoderBlocks -> X
    training: encoder(queries = learned constant ζ at every position, keys/values = X,
              non-causal, RoPE) -> readout -> z_logits [B, T, H]
              -> binary mapper: H bits per token -> one-hot over 2^H codes
    prior:    Z uniform over the 2^H codes
    post-sampler (2^H -> hidden, zero-initialized) -> R
    block `split_layer + 1` (0-based index `split_layer`): queries from X,
              keys/values from X + R
    -> the remaining blocks -> RMSNorm -> head

It is a conditional VAE: the loss is cross-entropy plus a free-bits KL,
`CE + kl_weight * mean_t max(0, KL_t - kappa)`, with
`KL_t = H log 2 - sum_h H_b(sigmoid(z_logits_t,h))` against the uniform prior.
The only extra compute over the decoder is the encoder block.

Built from the same `DecoderBlock`s as the baseline, so FSDP2 shards the
encoder like any other block, and with the post-sampler at zero the logits equal
the baseline's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetx.models.protocol import build_config, builds
from freetx.models.transformer import DecoderBlock, Transformer, TransformerConfig

IGNORE_INDEX = -100  # torch's cross-entropy default, as in freetx.data
MODES = ("training", "prior")


@dataclass
class FreeTransformerConfig(TransformerConfig):
    """The decoder's fields plus the latent: `latent_dim` bits per token, injected
    after `split_layer` blocks (default: half of them)."""

    latent_dim: int = 8  # H: bits per token; 2^H codes
    split_layer: int | None = None  # None: num_layers // 2
    factored_post_sampler: bool = False  # R = W (2 bits - 1) instead of a 2^H x hidden table

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.split_layer is None:
            self.split_layer = self.num_layers // 2
        if not 1 <= self.split_layer < self.num_layers:
            raise ValueError(
                f"split_layer={self.split_layer} must be in [1, num_layers - 1] "
                f"(num_layers={self.num_layers})"
            )
        if self.latent_dim < 1:
            raise ValueError(f"latent_dim={self.latent_dim} must be at least 1")
        if self.latent_dim > 16 and not self.factored_post_sampler:
            raise ValueError(
                f"latent_dim={self.latent_dim} needs a 2^{self.latent_dim}-row post-sampler "
                "table; set factored_post_sampler=true"
            )


def code_table(num_bits: int, device=None) -> torch.Tensor:
    """[2^H, H]: row c holds the bits of code c (bit h has weight 2^h)."""
    codes = torch.arange(2**num_bits, device=device)
    return ((codes[:, None] >> torch.arange(num_bits, device=device)) & 1).float()


def bits_to_index(bits: torch.Tensor) -> torch.Tensor:
    """[..., H] bits -> [...] code index, sum_h 2^h bit_h."""
    weights = 2 ** torch.arange(bits.shape[-1], device=bits.device)
    return (bits.long() * weights).sum(-1)


def binary_mapper(
    z_logits: torch.Tensor, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample H bits per token and map them to a one-hot over the 2^H codes.

    Returns (codes [..., 2^H], bits [..., H]). The forward values are exactly
    one-hot; the gradient flows through the full vector G of code
    probabilities, G_c = prod_h P(bit_h = bit_h(c)), written `hard + (G - sg(G))`
    so the forward stays exact. `noise` (uniform in [0, 1), shape of z_logits)
    fixes the sampling, e.g. to compare runs.
    """
    probs = torch.sigmoid(z_logits)
    if noise is None:
        noise = torch.rand_like(probs)
    bits = (noise < probs).to(z_logits.dtype)
    table = code_table(z_logits.shape[-1], z_logits.device).to(z_logits.dtype)
    log_g = F.logsigmoid(z_logits) @ table.T + F.logsigmoid(-z_logits) @ (1 - table).T
    g = log_g.exp()
    hard = F.one_hot(bits_to_index(bits), table.shape[0]).to(z_logits.dtype)
    return hard + (g - g.detach()), bits


def kl_to_uniform(z_logits: torch.Tensor) -> torch.Tensor:
    """KL(Q(Z_t) || uniform over 2^H) per token, in nats: H log 2 - sum_h H_b(p_h)."""
    p = torch.sigmoid(z_logits)
    # binary entropy from logits, stable: p*softplus(-l) + (1-p)*softplus(l)
    entropy = p * F.softplus(-z_logits) + (1 - p) * F.softplus(z_logits)
    return z_logits.shape[-1] * math.log(2) - entropy.sum(-1)


class FreeTransformer(Transformer):
    """A decoder whose block `split_layer + 1` sees a per-token latent code."""

    config_class = FreeTransformerConfig
    hf_layout = None  # transformers has no Free Transformer

    def __init__(self, cfg: FreeTransformerConfig):
        super().__init__(cfg)
        self.encoder_query = nn.Parameter(torch.empty(cfg.hidden_dim))  # ζ
        self.encoder = DecoderBlock(cfg)
        self.encoder_readout = nn.Linear(cfg.hidden_dim, cfg.latent_dim)
        inputs = cfg.latent_dim if cfg.factored_post_sampler else 2**cfg.latent_dim
        self.post_sampler = nn.Linear(inputs, cfg.hidden_dim, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        mode: str = "training",
        z_index: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [B, T] -> (logits [B, T, V], z_logits [B, T, H] or None).

        mode="training": Z from the encoder (posterior); "prior": Z uniform.
        `z_index` [B, T] fixes every position's code (generation keeps each Z_t
        once drawn); `noise` fixes the encoder's bit sampling.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        cfg = self.config
        batch, seq_len = input_ids.shape
        cos, sin = self.rope(seq_len)
        h = self.dropout(self.tok_embeddings(input_ids))
        for layer in self.layers[: cfg.split_layer]:
            h = layer(h, cos, sin)

        z_logits = None
        if z_index is not None:
            bits = code_table(cfg.latent_dim, h.device)[z_index]
            code = F.one_hot(z_index, 2**cfg.latent_dim).to(h.dtype)
        elif mode == "training":
            queries = self.encoder_query.to(h.dtype).expand(batch, seq_len, -1)
            encoded = self.encoder(queries, cos, sin, causal=False, kv=h)
            # weight then bias, not nn.Linear's fused call: that returns a view, which
            # FSDP2 warns about for a module's outputs
            readout = self.encoder_readout
            z_logits = F.linear(encoded, readout.weight) + readout.bias
            code, bits = binary_mapper(z_logits, noise)
            if cfg.factored_post_sampler:  # straight-through bits: exact forward, sigmoid gradient
                probs = torch.sigmoid(z_logits)
                bits = bits + (probs - probs.detach())
        else:
            z_index = torch.randint(0, 2**cfg.latent_dim, (batch, seq_len), device=h.device)
            bits = code_table(cfg.latent_dim, h.device)[z_index]
            code = F.one_hot(z_index, 2**cfg.latent_dim).to(h.dtype)
        latent = 2 * bits.to(h.dtype) - 1 if cfg.factored_post_sampler else code
        r = self.post_sampler(latent)

        h = self.layers[cfg.split_layer](h, cos, sin, kv=h + r)
        for layer in self.layers[cfg.split_layer + 1 :]:
            h = layer(h, cos, sin)
        return self.head(h), z_logits

    # -- sampling (the LatentModel protocol) ---------------------------------
    def prior_codes(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """Codes [count, length] from the uniform prior: one Z per position."""
        num_codes = 2**self.config.latent_dim
        device = self.tok_embeddings.weight.device
        return torch.randint(0, num_codes, (count, length), generator=generator, device=device)

    def posterior_codes(self, input_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Codes [B, T] the encoder draws for `input_ids` (e.g. a prompt)."""
        _, z_logits = self(input_ids)
        noise = torch.rand(z_logits.shape, generator=generator, device=z_logits.device)
        _, bits = binary_mapper(z_logits, noise)
        return bits_to_index(bits)

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """The decoder's rules, plus: the post-sampler starts at zero (so the model
        starts as the baseline), ζ and the readout ~ N(0, init_std)."""
        if name == "post_sampler.weight" or name == "encoder_readout.bias":
            tensor.zero_()
        elif name == "encoder_query":
            tensor.normal_(0.0, self.config.init_std, generator=generator)
        else:
            super().init_parameter(name, tensor, generator)


class FreeTransformerLoss:
    """CE + kl_weight * mean over tokens of max(0, KL_t - kappa), and the metrics to log.

    `kappa_bits` is the free-bits budget per token in bits (converted to nats
    inside). Follows the recipe loss contract: returns the loss summed over
    loss tokens and further per-token sums (the recipe divides them by the
    global token count):

        ce            posterior cross-entropy (Z from the encoder)
        kl_bits       KL per token in bits
        honest_nll    ce + KL in nats: the bound comparable with a baseline's loss
        kl_active     the fraction of tokens whose KL exceeds `active_threshold_bits`
        prior_ce      (evaluation only) cross-entropy with Z from the uniform prior

    Never compare posterior CE alone with a baseline: it flatters the model by up
    to the KL. A collapsed latent shows prior_ce == ce.
    """

    def __init__(
        self, kappa_bits: float = 0.5, kl_weight: float = 1.0, active_threshold_bits: float = 0.01
    ) -> None:
        self.kappa = kappa_bits * math.log(2)
        self.kl_weight = kl_weight
        self.active_threshold = active_threshold_bits * math.log(2)

    def __call__(self, output, labels: torch.Tensor):
        logits, z_logits = output if isinstance(output, tuple) else (output, None)
        mask = labels != IGNORE_INDEX
        ce = F.cross_entropy(
            logits.float().flatten(0, 1),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        if z_logits is None:  # prior mode or fixed codes: no posterior, no KL
            return ce, {"ce": ce.detach()}
        kl = kl_to_uniform(z_logits.float()) * mask
        penalty = torch.clamp(kl - self.kappa, min=0.0) * mask
        loss = ce + self.kl_weight * penalty.sum()
        extras = {
            "ce": ce.detach(),
            "kl_bits": kl.sum().detach() / math.log(2),
            "honest_nll": (ce + kl.sum()).detach(),
            "kl_active": ((kl > self.active_threshold) & mask).sum().to(ce.dtype),
        }
        return loss, extras

    def evaluate(self, model, input_ids: torch.Tensor, labels: torch.Tensor):
        """Posterior loss and metrics, plus the prior CE from a second forward pass."""
        loss, extras = self(model(input_ids), labels)
        prior_logits, _ = model(input_ids, mode="prior")
        extras["prior_ce"] = F.cross_entropy(
            prior_logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
            reduction="sum",
        )  # fmt: skip
        return loss, extras


PRESETS: dict[str, dict] = {
    # ~1M parameters, 4 blocks split 2 + 2, H=8 (256 codes): the letter-block task on CPU
    "tiny": dict(vocab_size=259, hidden_dim=128, num_layers=4, num_heads=4, latent_dim=8,
                 ffn_hidden_dim=384, max_seq_len=128, rope_theta=10000.0, tie_embeddings=True),
    # a 1.5B Llama-style shape (20 blocks x 2048, split at 10), H=16 with the factored
    # post-sampler (a 2^16-row table would add 134M parameters)
    "1_5b": dict(vocab_size=128256, hidden_dim=2048, num_layers=20, num_heads=16,
                 num_kv_heads=8, ffn_hidden_dim=8192, max_seq_len=4096, latent_dim=16,
                 factored_post_sampler=True, tie_embeddings=True),
    # Llama 3.1 8B shape (32 blocks, split at 16) with H=16, factored post-sampler
    "8b": dict(vocab_size=128256, hidden_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
               ffn_hidden_dim=14336, max_seq_len=8192, latent_dim=16,
               factored_post_sampler=True),
}  # fmt: skip


@builds(FreeTransformerConfig)
def free_transformer(preset: str | None = None, **fields) -> FreeTransformer:
    """A Free Transformer: a preset (tiny, 1_5b, 8b) with any `FreeTransformerConfig`
    field changed, or any shape from its fields alone."""
    return FreeTransformer(build_config(FreeTransformerConfig, fields, preset, PRESETS))
