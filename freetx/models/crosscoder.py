"""Sparse crosscoders (Lindsey et al., Anthropic 2024): one dictionary of features read
from, and written back to, several activation sources at once: layers of one model
(cross-layer, acausal) or the same site of two models (model diffing).

    pre   = sum_s x_s W_enc[s] + b_enc                      x: [B, n_src, d] -> [B, m]
            (x_s - b_dec,s in place of x_s with `apply_b_dec_to_input`)
    f     = act(pre)                                        the feature activations
    x_hat = f W_dec + b_dec                                 W_dec: [m, n_src, d]
    loss  = sum_{s,d} (x - x_hat)^2  +  sparsity(f)  (+ pre-activation / AuxK terms)

The decoder norm of feature i is `sum_s ||W_dec[i, s]||` (the L1 of per-source
norms), which lets a feature live in one source only. Activations:

- relu: f = ReLU(pre); sparsity = lambda * sum_i f_i * ||W_dec,i|| (the original).
- jumprelu: f = pre * H(pre - exp(t)), straight-through gradients with a
  rectangle kernel of bandwidth 2 for the threshold t; sparsity = lambda *
  sum_i tanh(c * f_i * ||W_dec,i||) with c = 4, plus lambda_P * sum_i
  ReLU(exp(t_i) - pre_i) * ||W_dec,i|| (Anthropic, January 2025).
- batchtopk: the k * B largest ReLU(pre) of the batch are kept (the batch over
  all ranks); AuxK (weight 1/32) reconstructs the residual from the top k_aux
  pre-activations of dead features; inference uses a threshold, the EMA
  (0.999) of the smallest kept activation (Minder et al. 2025).

`shared_features` (Anthropic, February 2025): the first n features are
designated shared; their sparsity penalty is scaled by `shared_penalty`.

The model encodes and decodes; `CrosscoderLoss` is the training objective and
its bookkeeping (AuxK's dead-feature counters and BatchTopK's threshold EMA,
advanced in training mode only), with its collectives through a `Reducer`.
`forward(x, loss, sparsity_weight)` runs the loss inside the model's forward,
where FSDP2 has gathered the sharded weights, and returns a `CrosscoderOutput`:
the loss summed over the batch's rows, the sums to log (reconstruction, the
other terms, L0) and the statistics (`ReconstructionStats`) that
`CrosscoderStats` adds up over a window for explained variance and dead features.
Activations are scaled by a per-source constant (`input_scale`, a buffer kept
in checkpoints) so that their mean norm is sqrt(d).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, NamedTuple, Protocol

import torch
from torch import nn

from freetx.fields import refuse_meaningless
from freetx.models.memory import ActivationBytes, TrainingShape
from freetx.models.protocol import build_config, builds

BANDWIDTH = 2.0  # JumpReLU's straight-through kernel width
# activation -> elements per row held at a training step's peak: (x dict_size, x n_src * d);
# measured with torch's MemTracker on CPU (float32, 8192 rows, m 512-1024, n d 128-512:
# relu 4.0 m + 2.3 n d, jumprelu 8.0 m + 2.3 n d, batchtopk 6.0 m + 3.4 n d), rounded up
ACTIVATION_ELEMENTS = {"relu": (4, 3), "jumprelu": (8, 3), "batchtopk": (6, 4)}


@dataclass
class CrosscoderConfig:
    """The shape of a crosscoder and its sparsity (names as the seed and papers use)."""

    num_sources: int  # layers or models read at once
    source_dim: int  # d_model of each source
    dict_size: int  # m, the seed's ae_dim
    activation: Literal["relu", "jumprelu", "batchtopk"] = "relu"
    dec_init_norm: float = 0.08  # each feature's decoder norm per source at init
    # the encoder reads x - b_dec, b_dec starting at the data's mean (SAELens' name; the
    # SAE papers' b_pre): features start on centered data (the seed: false)
    apply_b_dec_to_input: bool = False
    # jumprelu
    tanh_c: float = 4.0
    pre_act_coeff: float = 3e-6  # lambda_P
    log_threshold_init: float = 0.1  # t; the threshold is exp(t)
    # batchtopk
    k: int = 32  # active features per row, on average over the batch
    aux_k: int | None = None  # None: source_dim / 2
    aux_coeff: float = 1 / 32
    dead_after_rows: int = 10_000_000  # a feature is dead after this many rows unfired
    threshold_beta: float = 0.999
    # designated shared features (model diffing)
    shared_features: int = 0
    shared_penalty: float = 0.1

    def __post_init__(self) -> None:
        if self.activation not in ("relu", "jumprelu", "batchtopk"):
            raise ValueError(
                f"activation must be relu, jumprelu or batchtopk, got {self.activation!r}"
            )
        refuse_meaningless(self)
        if self.aux_k is None:
            self.aux_k = max(1, self.source_dim // 2)

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values that leave a knob nothing to do (freetx.fields: checked by `freetx validate`,
        before a run, and here), by key: why, and the fix."""
        found = {}
        for name in ("num_sources", "source_dim", "dict_size"):
            if name in values and values[name] < 1:
                found[name] = "it is a count or a width; set it to 1 or more."
        m = values.get("dict_size")
        if m is not None and not 0 <= values["shared_features"] <= m:
            found["shared_features"] = f"it counts features of the {m}; set it in [0, {m}]."
        if values["activation"] == "batchtopk":
            k, aux_k = values["k"], values.get("aux_k")
            if k < 1:
                found["k"] = "BatchTopK keeps k features per row; set k to 1 or more."
            elif m is not None and k >= m:
                found["k"] = (
                    f"BatchTopK would keep every one of the {m} features (dict_size), so the "
                    f"crosscoder would not be sparse; set k below {m} (a few percent of it)."
                )
            if aux_k is not None and aux_k < 1:
                found["aux_k"] = (
                    "AuxK reconstructs from aux_k dead features; set it to 1 or more, or leave "
                    "it out (source_dim / 2)."
                )
            if values["dead_after_rows"] < 1:
                found["dead_after_rows"] = (
                    "every feature would count as dead at once; set the rows a feature may go "
                    "unfired to 1 or more (e.g. 10000000)."
                )
            if not 0 <= values["threshold_beta"] < 1:
                found["threshold_beta"] = (
                    "the inference threshold is an EMA with this decay; set it in [0, 1) "
                    "(e.g. 0.999): 1 never moves it."
                )
        if values["activation"] == "jumprelu" and values["tanh_c"] <= 0:
            found["tanh_c"] = "JumpReLU's sparsity is tanh(c * f * ||W_dec||); set c above 0."
        return found


class _JumpReLU(torch.autograd.Function):
    """f = z * H(z - e^t); df/dz = H, df/dt = -(e^t / eps) * z * K((z - e^t) / eps)."""

    @staticmethod
    def forward(ctx, z, log_threshold):
        threshold = log_threshold.exp()
        ctx.save_for_backward(z, threshold)
        return z * (z > threshold)

    @staticmethod
    def backward(ctx, grad):
        z, threshold = ctx.saved_tensors
        active = (z > threshold).to(grad.dtype)
        kernel = (((z - threshold) / BANDWIDTH).abs() < 0.5).to(grad.dtype)
        grad_t = -(threshold / BANDWIDTH) * z * kernel * grad
        return grad * active, grad_t.sum(0)


class Reducer(Protocol):
    """The collectives the loss needs over the data-parallel ranks (`freetx.distributed.
    ParallelGroups` is one; `LocalReducer` is one process's)."""

    @property
    def dp_size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", over: str = "dp") -> torch.Tensor:
        """`tensor` reduced in place over the ranks; returns it."""
        ...

    def all_gather_varying(self, tensor: torch.Tensor, over: str = "dp") -> torch.Tensor:
        """Every rank's 1-D `tensor` concatenated in rank order (lengths may differ)."""
        ...


class LocalReducer:
    """A `Reducer` for one process: every collective is the identity."""

    dp_size = 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", over: str = "dp") -> torch.Tensor:
        return tensor

    def all_gather_varying(self, tensor: torch.Tensor, over: str = "dp") -> torch.Tensor:
        return tensor


@dataclass
class ReconstructionStats:
    """Sums over rows for explained variance and dead features: per batch from the loss,
    added up over a window of batches (`CrosscoderStats`) and summed over ranks."""

    sq_error: torch.Tensor  # [n] per source: sum of squared reconstruction errors
    x_sum: torch.Tensor  # [n, d] sum of the (scaled) inputs
    x_sq: torch.Tensor  # [n] sum of their squares
    fired: torch.Tensor  # [m] features that fired (a batch: bool; a window: batches fired)
    rows: torch.Tensor  # [] rows seen

    @classmethod
    def zeros(cls, num_sources: int, source_dim: int, dict_size: int) -> ReconstructionStats:
        n, d, m = num_sources, source_dim, dict_size
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64)  # noqa: E731
        return cls(zeros(n), zeros(n, d), zeros(n), zeros(m), zeros())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class CrosscoderOutput(NamedTuple):
    """What `Crosscoder.forward` returns: the objective and what to log, each summed over
    the batch's rows (a NamedTuple: FSDP2 and DDP find the loss tensor inside it)."""

    loss: torch.Tensor  # the objective (backward on this)
    recon_loss: torch.Tensor  # sum of squared errors over sources and dimensions
    penalties: dict[str, torch.Tensor]  # the other terms: sparsity_loss (+ pre_act_loss, aux_loss)
    l0: torch.Tensor  # active features
    stats: ReconstructionStats  # for explained variance and dead features over a window

    def log_sums(self) -> dict[str, torch.Tensor]:
        """The sums a training step logs (divided by the rows of the global batch)."""
        return {"recon_loss": self.recon_loss, **self.penalties, "l0": self.l0}


class Crosscoder(nn.Module):
    """Encode and decode x [B, n_src, d], with the state checkpoints keep; `forward` runs a
    `CrosscoderLoss` on the gathered dictionary (see the module docstring)."""

    block_types = ()  # one unit: FSDP2 shards its tensors, the dictionary on dim 0
    config_class = CrosscoderConfig
    fsdp_forward_methods = ("reconstruct",)  # called outside forward: FSDP2 gathers there too

    def __init__(self, cfg: CrosscoderConfig) -> None:
        super().__init__()
        self.config = cfg
        n, d, m = cfg.num_sources, cfg.source_dim, cfg.dict_size
        self.W_dec = nn.Parameter(torch.empty(m, n, d))
        self.W_enc = nn.Parameter(torch.empty(m, n, d))  # stored [m, ...]: sharded by feature
        self.b_enc = nn.Parameter(torch.empty(m))
        self.b_dec = nn.Parameter(torch.empty(n, d))
        if cfg.activation == "jumprelu":
            self.log_threshold = nn.Parameter(torch.empty(m))
        # activations are scaled by this per source (mean norm sqrt(d)); set from data
        self.register_buffer("input_scale", torch.ones(n))
        if cfg.activation == "batchtopk":  # CrosscoderLoss's state, here to be checkpointed
            self.register_buffer("rows_since_fired", torch.zeros(m, dtype=torch.long))
            self.register_buffer("inference_threshold", torch.zeros(()))

    # -- the math -------------------------------------------------------------
    def decoder_norms(self) -> torch.Tensor:
        """sum over sources of ||W_dec[i, s]|| [m]."""
        return self.W_dec.norm(dim=-1).sum(-1)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.apply_b_dec_to_input:
            x = x - self.b_dec
        return torch.einsum("bsd,msd->bm", x, self.W_enc) + self.b_enc

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bm,msd->bsd", f, self.W_dec) + self.b_dec

    def penalty_weights(self, norms: torch.Tensor) -> torch.Tensor:
        """Decoder norms, with the designated shared features' scaled down."""
        n = self.config.shared_features
        if n == 0:
            return norms
        scale = torch.ones_like(norms)
        scale[:n] = self.config.shared_penalty
        return norms * scale

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations of (already scaled) inputs, as at inference."""
        pre = self.pre_activations(x)
        cfg = self.config
        if cfg.activation == "relu":
            return torch.relu(pre)
        if cfg.activation == "jumprelu":
            return pre * (pre > self.log_threshold.exp())
        return torch.relu(pre) * (pre > self.inference_threshold)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """Raw activations [B, n, d] scaled per source to mean norm sqrt(d)."""
        return x * self.input_scale[None, :, None].to(x.dtype)

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """Unscaled activations [B, n, d] in, their reconstruction (unscaled) out, with the
        inference activation (as used when splicing it back into a model)."""
        scale = self.input_scale[None, :, None].to(x.dtype)
        return self.decode(self.encode(x * scale)) / scale

    def forward(
        self, x: torch.Tensor, loss: CrosscoderLoss, sparsity_weight: float = 1.0
    ) -> CrosscoderOutput:
        """`loss` on the unscaled rows `x`, run here so that FSDP2 has gathered the
        sharded dictionary (and the backward finds its hooks)."""
        return loss(self, self.scale(x), sparsity_weight)

    # -- initialization (the model protocol) -----------------------------------
    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """W_dec and W_enc: random directions, `dec_init_norm` per (feature, source);
        biases zero; thresholds at t0. `tie_encoder` then starts W_enc as W_dec."""
        cfg = self.config
        if name in ("W_dec", "W_enc"):
            tensor.normal_(0.0, 1.0, generator=generator)
            tensor.div_(tensor.norm(dim=-1, keepdim=True)).mul_(cfg.dec_init_norm)
        elif name == "log_threshold":
            tensor.fill_(cfg.log_threshold_init)
        else:
            tensor.zero_()

    @torch.no_grad()
    def tie_encoder(self, local: dict[str, torch.Tensor]) -> None:
        """W_enc = W_dec (the encoder reads each feature along its decoder direction), the
        start ckkissane's and Anthropic's crosscoders use; `local`: this model's parameters
        as this rank's shards (`freetx.distributed.local_parameters`). Both are sharded
        alike (by feature), so each rank copies its own rows."""
        local["W_enc"].copy_(local["W_dec"])

    def init_buffers(self) -> None:
        self.input_scale.fill_(1.0)
        if self.config.activation == "batchtopk":
            self.rows_since_fired.zero_()
            self.inference_threshold.zero_()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:  # per row: encode + decode, x3 for bwd
        c = self.config
        return float(6 * 2 * c.num_sources * c.source_dim * c.dict_size)

    def activation_bytes(self, run: TrainingShape) -> ActivationBytes:
        """A training micro-batch of `run.tokens` rows (1/cp of them per rank) at its peak
        (in backward), loss included: per row, `ACTIVATION_ELEMENTS` [m] and [n, d] tensors
        in the compute dtype (pre-activations, features, their gradients; the scaled input,
        reconstruction, error), and the batch itself in float32."""
        c, rows, element = self.config, run.tokens // run.cp, run.compute_bytes
        per_dict, per_source = ACTIVATION_ELEMENTS[c.activation]
        nd = c.num_sources * c.source_dim
        per_row = (per_dict * c.dict_size + per_source * nd) * element + nd * 4
        return ActivationBytes(float(rows * per_row))


@builds(CrosscoderConfig)
def crosscoder(**fields) -> Crosscoder:
    """A crosscoder from `CrosscoderConfig` fields (num_sources, source_dim, dict_size, ...)."""
    return Crosscoder(build_config(CrosscoderConfig, fields))


def relative_decoder_norms(model: Crosscoder, a: int = 0, b: int = 1) -> torch.Tensor:
    """||W_dec_b|| / (||W_dec_a|| + ||W_dec_b||) per feature: ~0 A-only, ~0.5 shared, ~1 B-only."""
    norms = model.W_dec.detach().norm(dim=-1)
    return norms[:, b] / (norms[:, a] + norms[:, b]).clamp_min(1e-12)


class CrosscoderLoss:
    """The training objective of a `Crosscoder` and its bookkeeping: the loss summed over
    rows (reconstruction + `sparsity_weight` x sparsity, + JumpReLU's pre-activation term
    or BatchTopK's AuxK), and, for batchtopk, the rows since each feature last fired and
    the EMA of the inference threshold. That state lives in the model's buffers (so
    checkpoints hold it) and advances only when the model is in training mode: evaluation
    leaves it as it is. `reducer` runs the collectives over the data-parallel ranks
    (BatchTopK's threshold over the whole batch, the features fired on any rank)."""

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer

    def __call__(
        self, model: Crosscoder, x: torch.Tensor, sparsity_weight: float
    ) -> CrosscoderOutput:
        """On scaled rows `x`, inside `model.forward` (the dictionary gathered)."""
        cfg = model.config
        pre = model.pre_activations(x)
        norms = model.decoder_norms()
        weights = model.penalty_weights(norms)
        penalties: dict[str, torch.Tensor] = {}
        if cfg.activation == "relu":
            f = torch.relu(pre)
            sparsity = (f * weights).sum()
        elif cfg.activation == "jumprelu":
            f = _JumpReLU.apply(pre, model.log_threshold)
            sparsity = torch.tanh(cfg.tanh_c * f.abs() * weights).sum()
            threshold = model.log_threshold.exp()
            penalties["pre_act_loss"] = (
                cfg.pre_act_coeff * (torch.relu(threshold - pre) * norms).sum()
            )
        else:
            relu = torch.relu(pre)
            threshold = self.batch_topk_threshold(relu, cfg.k * x.shape[0] * self.reducer.dp_size)
            f = relu * (relu >= threshold).to(relu.dtype) * (relu > 0).to(relu.dtype)
            sparsity = torch.zeros((), device=x.device)
            if model.training:
                self.advance(model, f, threshold)
        error = x - model.decode(f)
        recon = error.pow(2).sum()
        if cfg.activation == "batchtopk":
            penalties["aux_loss"] = cfg.aux_coeff * self.aux_loss(model, pre, error)
        loss = recon + sparsity_weight * sparsity
        for term in penalties.values():  # pre_act_loss (jumprelu) or aux_loss (batchtopk)
            loss = loss + term
        with torch.no_grad():
            penalties = {"sparsity_loss": (sparsity_weight * sparsity).detach(), **penalties}
            stats = ReconstructionStats(
                sq_error=error.detach().pow(2).sum((0, 2)),
                x_sum=x.detach().sum(0),
                x_sq=x.detach().pow(2).sum((0, 2)),
                fired=(f > 0).any(0),
                rows=torch.tensor(x.shape[0]),
            )
            return CrosscoderOutput(
                loss,
                recon.detach(),
                {k: v.detach() for k, v in penalties.items()},
                (f > 0).sum(),
                stats,
            )

    def batch_topk_threshold(self, values: torch.Tensor, keep: int) -> torch.Tensor:
        """The `keep`-th largest entry of `values` over all ranks' batches: the same
        threshold on every rank, so the result does not depend on how the batch is split."""
        local = values.flatten()
        top = torch.topk(local, min(keep, local.numel())).values.detach()
        top = self.reducer.all_gather_varying(top)
        return torch.topk(top, min(keep, top.numel())).values[-1].detach()

    @torch.no_grad()
    def advance(self, model: Crosscoder, f: torch.Tensor, threshold: torch.Tensor) -> None:
        """BatchTopK, training only: rows since each feature last fired (all ranks), and
        the EMA of the smallest kept activation for inference."""
        fired = self.reducer.all_reduce((f > 0).any(0).to(torch.int32)) > 0
        rows = f.shape[0] * self.reducer.dp_size
        model.rows_since_fired.add_(rows).masked_fill_(fired, 0)
        beta = model.config.threshold_beta
        model.inference_threshold.mul_(beta).add_((1 - beta) * threshold.to(torch.float32))

    def aux_loss(self, model: Crosscoder, pre: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
        """AuxK: the residual reconstructed from the top k_aux pre-activations of the dead
        features (zero when none is dead)."""
        dead = model.rows_since_fired >= model.config.dead_after_rows
        if not bool(dead.any()):
            return torch.zeros((), device=pre.device, dtype=pre.dtype) + 0 * pre.sum()
        masked = torch.where(dead[None, :], torch.relu(pre), torch.zeros_like(pre))
        k = min(model.config.aux_k, int(dead.sum()))
        top = torch.topk(masked, k, dim=-1)
        f_aux = torch.zeros_like(pre).scatter(-1, top.indices, top.values)
        x_aux = torch.einsum("bm,msd->bsd", f_aux, model.W_dec)
        return (error.detach() - x_aux).pow(2).sum()


class CrosscoderStats:
    """Explained variance (total and per source) and the features that fired, over the
    rows seen since the last `read` (a window: dead features are counted over it, not on
    one batch)."""

    def __init__(self, num_sources: int, source_dim: int, dict_size: int) -> None:
        self.shape = (num_sources, source_dim, dict_size)
        self.window = ReconstructionStats.zeros(*self.shape)

    def add(self, batch: ReconstructionStats) -> None:
        for name, total in self.window.tensors().items():
            total += getattr(batch, name).detach().to("cpu", torch.float64)

    def read(self, reduce) -> dict[str, float]:
        """The window's metrics (`reduce` sums the tensors over ranks), then a new window."""
        totals = reduce(self.window.tensors())
        rows = max(float(totals["rows"]), 1.0)
        variance = totals["x_sq"] - totals["x_sum"].pow(2).sum(-1) / rows  # [n]
        ev = 1.0 - totals["sq_error"] / variance.clamp_min(1e-12)
        metrics = {
            "explained_variance": float(1.0 - totals["sq_error"].sum() / variance.sum()),
            "dead_fraction": float((totals["fired"] == 0).to(torch.float64).mean()),
            "window_rows": rows,
        }
        metrics.update({f"explained_variance/source_{i}": float(v) for i, v in enumerate(ev)})
        self.window = ReconstructionStats.zeros(*self.shape)
        return metrics


@torch.no_grad()
def exported_tensors(
    tensors: dict[str, torch.Tensor], apply_b_dec_to_input: bool = False
) -> dict[str, torch.Tensor]:
    """A crosscoder's tensors (`W_enc`, `W_dec`, `b_enc`, `b_dec`, and `input_scale`,
    `log_threshold` or `inference_threshold` where it has them) as one computation on raw
    activations: f = act(sum_s x_s @ W_enc[s] + b_enc), thresholded at `threshold` where
    there is one, x_hat = f @ W_dec + b_dec. The input scale and, with
    `apply_b_dec_to_input`, the centering are folded into the weights."""
    w_dec, w_enc, b_enc = (tensors[k].float() for k in ("W_dec", "W_enc", "b_enc"))
    b_dec = tensors["b_dec"].float()
    scale = tensors.get("input_scale", torch.ones(w_dec.shape[1])).float()
    if apply_b_dec_to_input:  # (x - b_dec) W_enc = x W_enc - b_dec W_enc
        b_enc = b_enc - torch.einsum("sd,msd->m", b_dec, w_enc)
    out = {
        "W_enc": (w_enc * scale[None, :, None]).permute(1, 2, 0).contiguous(),  # [n, d, m]
        "W_dec": (w_dec / scale[None, :, None]).contiguous(),  # [m, n, d]
        "b_enc": b_enc,
        "b_dec": (b_dec / scale[:, None]).contiguous(),
    }
    if "log_threshold" in tensors:
        out["threshold"] = tensors["log_threshold"].float().exp()
    if "inference_threshold" in tensors:
        out["threshold"] = tensors["inference_threshold"].float().expand(w_dec.shape[0]).clone()
    return out


@torch.no_grad()
def relative_decoder_norm(decoder: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Each feature's decoder norm in source b over its norms in a and b together [m]: 0
    only in a, 1 only in b (0 where both are 0)."""
    norms = decoder.float().norm(dim=-1)
    return norms[:, b] / (norms[:, a] + norms[:, b]).clamp_min(1e-12)


def diffing_analysis(decoder: torch.Tensor, a: int = 0, b: int = 1, bins: int = 20) -> dict:
    """Model diffing from the decoder [m, n, d]: the relative decoder norm of each feature
    between sources a and b (a histogram of `bins`), the features that are A-only (< 0.1),
    B-only (> 0.9) and shared (0.3 to 0.7), and the cosine of the shared features'
    decoder directions in the two sources."""
    norms = decoder.float().norm(dim=-1)
    alive = (norms[:, a] + norms[:, b]) > 1e-8
    relative = relative_decoder_norm(decoder, a, b)[alive]
    counts = torch.histc(relative, bins=bins, min=0.0, max=1.0).long().tolist()
    shared = alive.clone()
    shared[alive] = (relative >= 0.3) & (relative <= 0.7)
    da, db = decoder[shared][:, a].float(), decoder[shared][:, b].float()
    cosine = torch.nn.functional.cosine_similarity(da, db, dim=-1)
    return {
        "features": int(decoder.shape[0]),
        "sources": [a, b],
        "relative_norm_histogram": {"bins": bins, "counts": counts},
        "a_only": int((relative < 0.1).sum()),
        "b_only": int((relative > 0.9).sum()),
        "shared": int(shared.sum()),
        "shared_decoder_cosine_mean": float(cosine.mean()) if len(cosine) else None,
        "shared_decoder_cosine_median": float(cosine.median()) if len(cosine) else None,
    }
