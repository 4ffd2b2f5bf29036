"""The Free Transformer (Fleuret, 2025): a decoder conditioned on a per-token latent Z.

    input -> first `split_layer` DecoderBlocks -> X
    training: encoder(queries = learned constant ζ at every position, keys/values = X,
              non-causal, RoPE) -> readout -> z_logits [B, T, H]
              -> binary mapper: H bits per token (code c = sum_h 2^h bit_h)
    prior:    Z uniform over the 2^H codes (H uniform bits)
    post-sampler (zero-initialized) -> R: the table's row c (2^H x hidden), or
              factored, W (2 bits - 1) (H x hidden)
    block `split_layer + 1` (0-based index `split_layer`): queries from X,
              keys/values from X + R
    -> the remaining blocks -> RMSNorm -> head

It is a conditional VAE: the loss is cross-entropy plus a free-bits KL,
`CE + kl_weight * mean_t max(0, KL_t - kappa)`, with
`KL_t = H log 2 - sum_h H_b(sigmoid(z_logits_t,h))` against the uniform prior.
The only extra compute over the decoder is the encoder block.

A code is carried as its H bits ([..., H]), never as a one-hot over the 2^H codes:
the table post-sampler looks its row up by index (H <= 16) and gets the paper's
gradient through all 2^H code probabilities in chunks (`TableLookup`); the
factored one never touches 2^H, so it works at any H (64, say).

Built from the same `DecoderBlock`s as the baseline, so FSDP2 shards the
encoder like any other block, and with the post-sampler at zero the logits equal
the baseline's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetx.models.chunked_loss import (
    IGNORE_INDEX,
    SumsBySource,
    check_num_chunks,
    forward_with_loss,
    num_chunks_problem,
)
from freetx.models.decoder.config import TransformerConfig
from freetx.models.decoder.core import DecoderCore
from freetx.models.decoder.estimate import DecoderActivations
from freetx.models.decoder.layers import DecoderBlock
from freetx.models.protocol import OutputLoss, build_config, builds

MODES = ("training", "prior")
MAX_TABLE_BITS = 16  # the table post-sampler has 2^H rows: 65,536 at H = 16
WORD_BITS = 62  # bits drawn per integer (torch.randint's bound must stay below 2^63)
# the table's backward holds a few [tokens, codes] float32 temporaries per chunk of codes:
# chunks of ~2^26 / tokens codes keep each at 256 MiB
CHUNK_ELEMENTS = 2**26


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

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """A table post-sampler too large to build (freetx.fields: checked by `freetx
        validate`, before a run, and here), by key: why, and the fix."""
        found = TransformerConfig.meaningless(values)
        if values.get("num_experts"):
            found["num_experts"] = (
                "the Free Transformer's blocks have a dense MLP; mixtures of experts are the "
                "decoder's (freetx.models.transformer.decoder). Set num_experts=0."
            )
        if values.get("kv_lora_rank") is not None:
            found["kv_lora_rank"] = (
                "the Free Transformer's encoder attends across streams, which multi-head "
                "latent attention does not; set kv_lora_rank=null (grouped-query attention)."
            )
        if values.get("rope_local_theta") is not None:
            found["rope_local_theta"] = (
                "the Free Transformer's layers share one RoPE; set rope_local_theta=null."
            )
        split, layers = values.get("split_layer"), values.get("num_layers")
        if layers is not None and layers >= 1:
            if split is None and layers < 2 or split is not None and not 1 <= split < layers:
                found["split_layer"] = (
                    f"the latent joins after split_layer of the num_layers={layers} blocks, with "
                    "blocks before and after it; set it in [1, num_layers - 1] (null: half), "
                    "with num_layers of 2 or more."
                )
        bits = values.get("latent_dim")
        if bits is not None and bits < 1:
            found["latent_dim"] = (
                "it is the latent's bits per token (2^latent_dim codes); set it to 1 or more "
                "(free_transformer/tiny: 8)."
            )
            return found
        if bits is None or bits <= MAX_TABLE_BITS or values["factored_post_sampler"]:
            return found
        return {
            **found,
            "latent_dim": (
                f"the table post-sampler has one row of hidden_dim parameters per code, "
                f"2^{bits} rows, and stops at latent_dim={MAX_TABLE_BITS} (2^16 = 65,536 rows); "
                f"set factored_post_sampler=true (R = W (2 bits - 1): {bits} x hidden_dim "
                f"parameters, any latent_dim), or latent_dim <= {MAX_TABLE_BITS}."
            ),
        }


def index_to_bits(index: torch.Tensor, num_bits: int) -> torch.Tensor:
    """[...] integer codes -> [..., num_bits] their bits (int64 0/1; bit h has weight 2^h)."""
    return (index[..., None] >> torch.arange(num_bits, device=index.device)) & 1


def code_table(num_bits: int, device=None) -> torch.Tensor:
    """[2^H, H]: row c holds the bits of code c (bit h has weight 2^h)."""
    return index_to_bits(torch.arange(2**num_bits, device=device), num_bits).float()


def bits_to_index(bits: torch.Tensor) -> torch.Tensor:
    """[..., H] bits -> [...] code index, sum_h 2^h bit_h (H <= 62)."""
    weights = 2 ** torch.arange(bits.shape[-1], device=bits.device)
    return (bits.long() * weights).sum(-1)


def uniform_bits(
    shape: tuple[int, ...], num_bits: int, device=None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Bits [*shape, H] (bool) of codes drawn uniformly from the 2^H, for any H: integers
    of up to 62 bits each, so for H <= 62 one `randint(0, 2^H, shape)` (the same draw
    and random stream as an index over the codes)."""
    words = []
    for start in range(0, num_bits, WORD_BITS):
        width = min(WORD_BITS, num_bits - start)
        word = torch.randint(0, 2**width, shape, generator=generator, device=device)
        words.append(index_to_bits(word, width))
    return torch.cat(words, -1).bool()


def sample_bits(z_logits: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """H bits per token, bit h ~ Bernoulli(sigmoid(z_logits_h)), in z_logits' dtype and
    without gradient. `noise` (uniform in [0, 1), shape of z_logits) fixes the draw."""
    probs = torch.sigmoid(z_logits)
    if noise is None:
        noise = torch.rand_like(probs)
    return (noise < probs).to(z_logits.dtype)


def code_probabilities(
    z_logits: torch.Tensor, table: torch.Tensor, z_zeros: torch.Tensor | None = None
) -> torch.Tensor:
    """G [..., C]: the probability of each code (row) of `table` [C, H] under independent
    bits, G_c = prod_h P(bit_h = bit_h(c)). `z_zeros` (z_logits' values) stands in for
    z_logits in the factors P(bit_h = 0), so that autograd gives the two terms apart."""
    table = table.to(z_logits.dtype)
    z_zeros = z_logits if z_zeros is None else z_zeros
    log_g = F.logsigmoid(z_logits) @ table.T + F.logsigmoid(-z_zeros) @ (1 - table).T
    return log_g.exp()


def binary_mapper(
    z_logits: torch.Tensor, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The binary mapper as the paper writes it: sample H bits per token, map them to a
    one-hot over the 2^H codes. The model does not call it (it materializes [..., 2^H]
    per token: 64 GiB of int64 one-hot for 131,072 tokens at H = 16); it is the
    reference that `TableLookup` equals, in tests and benchmarks/free_transformer_latent.py.

    Returns (codes [..., 2^H], bits [..., H]). The forward values are exactly
    one-hot; the gradient flows through the full vector G of code probabilities,
    G_c = prod_h P(bit_h = bit_h(c)), written `hard + (G - sg(G))`.
    """
    bits = sample_bits(z_logits, noise)
    g = code_probabilities(z_logits, code_table(z_logits.shape[-1], z_logits.device))
    hard = F.one_hot(bits_to_index(bits), g.shape[-1]).to(z_logits.dtype)
    return hard + (g - g.detach()), bits


class TableLookup(torch.autograd.Function):
    """R = the table's row of each token's code, with `binary_mapper`'s gradient and
    without its [..., 2^H] tensors: forward, an embedding lookup of `index` in the
    columns of `weight` [hidden, 2^H]; backward, the table's gradient (dL/dR summed
    per code) and, when z_logits are given, theirs through the code
    probabilities G, dL/dz = sum_c <dL/dR, W[:, c]> dG_c/dz. Both over chunks of codes
    (`CHUNK_ELEMENTS`), with the operations of autograd on `binary_mapper` and a linear
    layer (the table's gradient: dL/dR^T times the chunk's one-hot columns).

    z_logits come twice (`apply(index, weight, z_logits, z_logits)`): their gradient
    through the factors P(bit = 0), then through P(bit = 1), reach z_logits as two terms
    in the order autograd adds them for `binary_mapper`, so that with one chunk (2^H x
    tokens <= CHUNK_ELEMENTS: the tiny configs) training is bit-identical to it."""

    @staticmethod
    def forward(ctx, index, weight, z_zeros, z_logits):
        ctx.save_for_backward(index, weight, z_logits)
        return F.embedding(index, weight.t())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_r):
        index, weight, z_logits = ctx.saved_tensors
        num_codes = weight.shape[1]
        chunk = max(1, CHUNK_ELEMENTS // max(1, index.numel()))
        grad_weight = grad_zeros = grad_ones = None
        if ctx.needs_input_grad[1]:  # as a linear layer's on the one-hot, a chunk at a time
            grad_weight = torch.empty_like(weight)
            tokens, flat_index = grad_r.flatten(0, -2), index.flatten()
            for start in range(0, num_codes, chunk):
                codes = torch.arange(start, min(start + chunk, num_codes), device=index.device)
                one_hot = (flat_index[:, None] == codes).to(grad_r.dtype)
                grad_weight[:, start : start + chunk] = tokens.t().mm(one_hot)
        if z_logits is not None and ctx.needs_input_grad[3]:
            ones, zeros = (z_logits.detach().requires_grad_() for _ in range(2))
            grad_ones, grad_zeros = torch.zeros_like(ones), torch.zeros_like(zeros)
            with torch.enable_grad():
                for start in range(0, num_codes, chunk):
                    codes = torch.arange(start, min(start + chunk, num_codes), device=ones.device)
                    g = code_probabilities(ones, index_to_bits(codes, ones.shape[-1]), zeros)
                    grad_g = grad_r @ weight[:, start : start + chunk]
                    through_ones, through_zeros = torch.autograd.grad(g, (ones, zeros), grad_g)
                    grad_ones += through_ones
                    grad_zeros += through_zeros
        return None, grad_weight, grad_zeros, grad_ones


class PostSampler(nn.Module):
    """Z's bits [..., H] -> R [..., hidden], from `weight` (zero-initialized): a table
    [hidden, 2^H] whose column c is code c's R, or factored, R = W (2 bits - 1) with W
    [hidden, H]. Given `z_logits` (training), the gradient reaches them: through all
    code probabilities (table, `TableLookup`) or straight through the bits' sigmoids
    (factored)."""

    def __init__(self, latent_dim: int, hidden_dim: int, factored: bool) -> None:
        super().__init__()
        self.factored = factored
        inputs = latent_dim if factored else 2**latent_dim
        self.weight = nn.Parameter(torch.empty(hidden_dim, inputs))

    def forward(self, bits: torch.Tensor, z_logits: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight
        if self.factored:
            if z_logits is not None:  # straight-through bits: exact forward, sigmoid gradient
                probs = torch.sigmoid(z_logits)
                bits = bits + (probs - probs.detach())
            return F.linear(2 * bits.to(weight.dtype) - 1, weight)
        device = weight.device.type
        if torch.is_autocast_enabled(device):  # the compute dtype, as a linear layer has
            weight = weight.to(torch.get_autocast_dtype(device))
        return TableLookup.apply(bits_to_index(bits), weight, z_logits, z_logits)


def kl_to_uniform(z_logits: torch.Tensor) -> torch.Tensor:
    """KL(Q(Z_t) || uniform over 2^H) per token, in nats: H log 2 - sum_h H_b(p_h)."""
    p = torch.sigmoid(z_logits)
    # binary entropy from logits, stable: p*softplus(-l) + (1-p)*softplus(l)
    entropy = p * F.softplus(-z_logits) + (1 - p) * F.softplus(z_logits)
    return z_logits.shape[-1] * math.log(2) - entropy.sum(-1)


class FreeTransformer(DecoderCore, DecoderActivations):
    """A decoder whose block `split_layer + 1` sees a per-token latent code.

    It has the decoder's core and none of its capabilities (`freetx.models.decoder`):
    its encoder reads the whole sequence, bidirectionally, so it takes no packed batches,
    no part of a sequence per rank (context parallelism) and no pipeline stages (the
    encoder reads a middle block's input); generate samples it with a full forward per
    token (`LatentModel`), without a KV cache; freetx does not slice its encoder and
    latent path over tensor-parallel ranks; transformers has no HF layout for it."""

    config_class = FreeTransformerConfig

    def __init__(self, cfg: FreeTransformerConfig):
        super().__init__(cfg)
        self.encoder_query = nn.Parameter(torch.empty(cfg.hidden_dim))  # ζ
        self.encoder = DecoderBlock(cfg)
        self.encoder_readout = nn.Linear(cfg.hidden_dim, cfg.latent_dim)
        self.post_sampler = PostSampler(cfg.latent_dim, cfg.hidden_dim, cfg.factored_post_sampler)

    def describe(self) -> str:
        return f"Free Transformer ({self.config.latent_dim}-bit latent per token)"

    def forward(
        self,
        input_ids: torch.Tensor,
        mode: str = "training",
        codes: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        output_loss: OutputLoss | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [B, T] -> (logits [B, T, V], z_logits [B, T, H] or None).

        mode="training": Z from the encoder (posterior); "prior": Z uniform.
        `codes` [B, T, H] (bits, as `prior_codes` returns them) fixes every position's
        code (generation keeps each Z_t once drawn); `noise` fixes the encoder's bit
        sampling; `output_loss` takes the logits' place (`ProjectsInChunks`).
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        cfg = self.config
        batch, seq_len = input_ids.shape
        cos, sin = self.rope(seq_len)
        h = self.embed(input_ids)
        for layer in self.layers[: cfg.split_layer]:
            h = layer(h, cos, sin)

        z_logits = None
        if codes is not None:
            bits = codes
        elif mode == "training":
            queries = self.encoder_query.to(h.dtype).expand(batch, seq_len, -1)
            encoded = self.encoder(queries, cos, sin, causal=False, kv=h)
            # weight then bias, not nn.Linear's fused call: that returns a view, which
            # FSDP2 warns about for a module's outputs
            readout = self.encoder_readout
            z_logits = F.linear(encoded, readout.weight) + readout.bias
            bits = sample_bits(z_logits, noise)
        else:
            bits = uniform_bits((batch, seq_len), cfg.latent_dim, h.device)
        r = self.post_sampler(bits, z_logits)

        h = self.layers[cfg.split_layer](h, cos, sin, kv=h + r)
        for layer in self.layers[cfg.split_layer + 1 :]:
            h = layer(h, cos, sin)
        return self.finish(h, output_loss), z_logits

    # -- sampling (the LatentModel protocol) ---------------------------------
    def prior_codes(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """Codes [count, length, H] (bits) from the uniform prior: one Z per position."""
        device = self.tok_embeddings.weight.device
        return uniform_bits((count, length), self.config.latent_dim, device, generator)

    def posterior_codes(self, input_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Codes [B, T, H] (bits) the encoder draws for `input_ids` (e.g. a prompt)."""
        _, z_logits = self(input_ids)
        noise = torch.rand(z_logits.shape, generator=generator, device=z_logits.device)
        return sample_bits(z_logits, noise).bool()

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

    meaningless = staticmethod(num_chunks_problem)  # checked before it is built

    def __init__(
        self,
        kappa_bits: float = 0.5,
        kl_weight: float = 1.0,
        active_threshold_bits: float = 0.01,
        num_chunks: int | None = None,  # the logits a chunk of tokens at a time (output_loss)
    ) -> None:
        self.kappa = kappa_bits * math.log(2)
        self.kl_weight = kl_weight
        self.active_threshold = active_threshold_bits * math.log(2)
        self.num_chunks = check_num_chunks(num_chunks)

    def __call__(
        self,
        model,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        sources: SumsBySource | None = None,
        **inputs,
    ):
        (_, z_logits), losses, sums = forward_with_loss(
            model, input_ids, labels, self.num_chunks, IGNORE_INDEX, sources, **inputs
        )
        ce = losses.total
        if z_logits is None:  # fixed codes: no posterior, no KL
            return ce, {"ce": ce.detach(), **sums}
        mask = labels != IGNORE_INDEX
        kl = kl_to_uniform(z_logits.float()) * mask
        penalty = torch.clamp(kl - self.kappa, min=0.0) * mask
        loss = ce + self.kl_weight * penalty.sum()
        extras = {
            "ce": ce.detach(),
            "kl_bits": kl.sum().detach() / math.log(2),
            "honest_nll": (ce + kl.sum()).detach(),
            "kl_active": ((kl > self.active_threshold) & mask).sum().to(ce.dtype),
            **sums,
        }
        return loss, extras

    def evaluate(self, model, input_ids: torch.Tensor, labels: torch.Tensor, **inputs):
        """Posterior loss and metrics, plus the prior CE from a second forward pass."""
        loss, extras = self(model, input_ids, labels, **inputs)
        inputs.pop("sources", None)
        prior = forward_with_loss(model, input_ids, labels, self.num_chunks, mode="prior", **inputs)
        extras["prior_ce"] = prior[1].total
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


@builds(FreeTransformerConfig, PRESETS)
def free_transformer(preset: str | None = None, **fields) -> FreeTransformer:
    """A Free Transformer: a preset (tiny, 1_5b, 8b) with any `FreeTransformerConfig`
    field changed, or any shape from its fields alone."""
    return FreeTransformer(build_config(FreeTransformerConfig, fields, preset, PRESETS))
