"""A mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a router picks `experts_per_token`
of `num_experts` SwiGLU experts for each token and sums their outputs, weighted.

    router     gate: Linear(hidden -> E, no bias); softmax over the experts in float32;
               top-k; with norm_topk_prob the k weights are divided by their sum
               (Mixtral always, Qwen3-MoE as its config.json says); Qwen3-MoE casts the
               weights to the compute dtype (`expert_weights_fp32=False`), Mixtral keeps
               them in float32 for the weighting (as transformers 5 does for each)
    experts    ONE grouped tensor per projection for all experts of a block:
               `experts.w1` [E, F, H] (gate), `experts.w3` [E, F, H] (up), `experts.w2`
               [E, H, F] (down); expert e computes w2[e] (silu(w1[e] x) * w3[e] x). FSDP2
               shards them along dim 0, so a rank's rows are whole experts.

The experts' matmuls run as one grouped matmul where the device has a kernel for it
(`grouped_mm_fits`: torch's CPU kernel, `F.grouped_mm` of torch 2.10+, which gives the
loop's sums exactly and ~5x faster; CUDA sm90+ in bfloat16 with 16-byte aligned sizes),
else as a loop over the experts; both read the same tokens sorted by expert.

Routers of other kinds (`RouterKind`, `route`): DeepSeek-V3's and GLM-4.5's sigmoid scores
with a stored bias that steers the choice (`e_score_correction_bias`, a float32
buffer, not trained) and grouped top-k (the experts in groups, a token's chosen from its
best groups); DeepSeek-V2's group-limited softmax; the weights times
`routed_scaling_factor`. A block may add an MLP every token goes through (`shared`:
DeepSeek's shared experts).

The block returns its output and its `Routing` (tokens per expert, router probabilities
summed over tokens); the decoder turns every layer's routing into the load-balancing
loss (`load_balancing_loss`, as transformers' `load_balancing_loss_func` computes it),
which the model returns in training (`freetx.models.protocol.LMOutput`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor


class Routing(NamedTuple):
    """One MoE layer's routing of a micro-batch (or several layers' summed)."""

    counts: torch.Tensor  # [E] float32: (token, slot) pairs sent to each expert (no gradient)
    probs: torch.Tensor  # [E] float32: router probabilities summed over the tokens
    tokens: torch.Tensor  # [] float32: the tokens routed

    def packed(self) -> torch.Tensor:
        """One tensor [2E + 1] (for a collective, or to the next pipeline stage)."""
        return torch.cat([self.counts, self.probs, self.tokens.reshape(1)])

    @classmethod
    def unpacked(cls, packed: torch.Tensor) -> Routing:
        experts = (len(packed) - 1) // 2
        return cls(packed[:experts], packed[experts:-1], packed[-1])


def empty_routing(num_experts: int, like: torch.Tensor) -> torch.Tensor:
    """The packed statistics of no routing (a pipeline stage without MoE blocks), which
    still carries a gradient back (every stage's statistics join the router loss)."""
    return torch.zeros(2 * num_experts + 1, device=like.device, requires_grad=True)


def grouped_mm_fits(
    device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None, sizes: tuple
) -> bool:
    """Whether one grouped matmul computes the experts here: on the CPU torch's kernel
    (`F.grouped_mm`, torch 2.10+; float32, bfloat16, float16), on CUDA sm90+ (Hopper and
    later, its CUTLASS kernel) in bfloat16; either with every inner size a multiple of 16
    bytes (a LoRA rank of 2 in float32 is not); elsewhere the loop over experts does."""
    aligned = all(size * dtype.itemsize % 16 == 0 for size in sizes)
    if device_type == "cpu":
        return (
            hasattr(F, "grouped_mm")
            and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and aligned
        )
    return (
        device_type == "cuda"
        and hasattr(torch, "_grouped_mm")
        and dtype == torch.bfloat16
        and capability is not None
        and capability >= (9, 0)
        and aligned
    )


def _uses_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if isinstance(weight, DTensor) or isinstance(x, DTensor):
        return False  # the loop's F.linear takes DTensors
    if isinstance(x, FakeTensor) and x.dtype != torch.bfloat16:
        return False  # torch 2.13's shape function (estimate --measure) takes bf16 alone
    capability = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    return grouped_mm_fits(x.device.type, x.dtype, capability, tuple(weight.shape[1:]))


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous: the grouped matmul's
    backward refuses a broadcast one (strides 0, e.g. the gradient of a sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of `x` [N, in] sorted by expert (`counts[e]` rows for expert e) times their
    expert's `weight[e]`ᵀ ([E, out, in]): [N, out]. Under autocast (one process: the
    weights stay float32) the rows are cast first, as a Linear's would be, so that the
    grouped kernel's dtype rule sees the compute dtype."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    if _uses_grouped_mm(x, weight):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
        out = grouped_mm(x.contiguous(), weight.to(x.dtype).transpose(-2, -1), offs=offsets)
        return _ContiguousGradient.apply(out)
    parts = [F.linear(rows, weight[e]) for e, rows in enumerate(x.split(counts))]
    return torch.cat(parts)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three grouped tensors (w1, w3: [E, F, H]; w2: [E, H, F])."""

    def __init__(self, num_experts: int, hidden_dim: int, ffn_hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_hidden_dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_hidden_dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, ffn_hidden_dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [N, H]: token copies sorted by expert, `counts[e]` for expert e (this rank's
        experts under expert parallelism: its local rows of the DTensors)."""
        w1, w3, w2 = (local_rows(w) for w in (self.w1, self.w3, self.w2))
        hidden = F.silu(grouped_linear(x, w1, counts)) * grouped_linear(x, w3, counts)
        return grouped_linear(hidden, w2, counts)


def local_rows(weight: torch.Tensor) -> torch.Tensor:
    """A weight's rows on this rank: an expert-parallel DTensor's local experts
    (freetx.distributed.expert_parallel), any other tensor itself."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


@dataclass(frozen=True)
class RouterKind:
    """How a router turns its logits into each token's experts and their weights (`route`).

    scores     "softmax" over the experts (Mixtral, Qwen, DeepSeek-V2) or "sigmoid" per
               expert (DeepSeek-V3, GLM-4.5)
    bias       a float32 buffer `e_score_correction_bias` [E] added to the scores for the
               choice only (DeepSeek-V3's load balancing; read from and written to folders)
    groups     the experts in `groups` equal groups; a token's experts are chosen from its
               best `groups_per_token` groups, ranked by the sum of their top-2 (biased)
               scores (sigmoid) or by their best score (softmax: DeepSeek-V2's
               group_limited_greedy); 1: no groups
    norm       the k weights divided by their sum (norm_topk_prob)
    scaling    the weights times this (routed_scaling_factor)
    fp32       the logits' matmul in float32 (DeepSeek, GLM-4.5), else in the compute dtype
    """

    scores: Literal["softmax", "sigmoid"] = "softmax"
    bias: bool = False
    groups: int = 1
    groups_per_token: int = 1
    norm: bool = True
    scaling: float = 1.0
    fp32: bool = False


def route(
    logits: torch.Tensor, kind: RouterKind, top_k: int, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [N, E] -> (weights [N, k] float32, chosen experts [N, k], probabilities [N, E]
    float32 for the load-balancing statistics: the softmax, or the sigmoid scores over
    their sum), as transformers 5.24's routers compute them (`bias`: the correction
    added for the choice, `RouterKind.bias`)."""
    if kind.scores == "softmax":
        scores = F.softmax(logits, dim=-1, dtype=torch.float32)
        probs = scores
    else:
        scores = logits.float().sigmoid()
        probs = scores / scores.sum(dim=-1, keepdim=True)
    choice = scores if bias is None else scores + bias
    if kind.groups_per_token < kind.groups:
        grouped = choice.view(len(choice), kind.groups, -1)
        if kind.scores == "sigmoid":
            rank = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            rank = grouped.amax(dim=-1)
        kept = rank.topk(kind.groups_per_token, dim=-1, sorted=False).indices
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, kept, True)
        # sigmoid: DeepSeek-V3 masks the others with -inf; softmax: V2 with 0.0
        masked = float("-inf") if kind.scores == "sigmoid" else 0.0
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[2], dim=1), masked)
    chosen = torch.topk(choice, top_k, dim=-1).indices  # [N, k]
    weights = scores.gather(1, chosen)
    if kind.norm:  # DeepSeek-V3 adds 1e-20 to the sum; Mixtral and Qwen do not
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if kind.scores == "sigmoid" else total)
    return weights * kind.scaling, chosen, probs


class Router(nn.Linear):
    """A block's router (`gate`): Linear(hidden -> E, no bias), its matmul in float32 where
    `fp32` (DeepSeek's). LoRA's `all-linear` leaves it, as PEFT's does on transformers'
    models (whose routers are no Linear modules)."""

    def __init__(self, hidden_dim: int, num_experts: int, fp32: bool = False) -> None:
        super().__init__(hidden_dim, num_experts, bias=False)
        self.fp32 = fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> logits [N, E]."""
        if self.fp32:
            return F.linear(x.float(), self.weight.float())
        return super().forward(x)


class MoEFeedForward(nn.Module):
    """The router (`gate`) and the experts of one block, and an MLP beside them that every
    token goes through where given (`shared`: DeepSeek's shared experts, named
    `shared_experts`); with `kind.bias` the float32 persistent buffer
    `e_score_correction_bias` [E] (zero until a folder's is read; HF's
    `mlp.gate.e_score_correction_bias`). `forward` returns the output and the layer's
    `Routing`."""

    def __init__(
        self,
        hidden_dim: int,
        ffn_hidden_dim: int,
        num_experts: int,
        experts_per_token: int,
        norm_topk_prob: bool,
        expert_weights_fp32: bool,
        kind: RouterKind | None = None,
        shared: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, experts_per_token
        self.expert_weights_fp32 = expert_weights_fp32
        # `kind`: the router's other settings (None: Mixtral's and Qwen's softmax)
        self.kind = replace(kind or RouterKind(), norm=norm_topk_prob)
        self.gate = Router(hidden_dim, num_experts, self.kind.fp32)
        if self.kind.bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.experts = GroupedExperts(num_experts, hidden_dim, ffn_hidden_dim)
        self.shared_experts = shared

    def forward(
        self, x: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Routing]:
        """x [..., H]; `valid` [...] (a packed batch's): False on padding positions, which
        are routed but not counted in the `Routing` (the load-balancing statistics)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        bias = self.get_buffer("e_score_correction_bias") if self.kind.bias else None
        weights, chosen, probs = route(logits, self.kind, self.top_k, bias)
        if not self.expert_weights_fp32:
            weights = weights.to(flat.dtype)
        order = chosen.reshape(-1).argsort(stable=True)  # (token, slot) pairs by expert
        counts = expert_counts(chosen, self.num_experts)
        tokens = order // self.top_k
        out = self.experts(flat[tokens], group_sizes(counts, len(order)))
        out = out * weights.reshape(-1)[order, None]
        mixed = torch.zeros_like(flat).index_add_(0, tokens, out.to(flat.dtype))
        if self.shared_experts is not None:
            mixed = mixed + self.shared_experts(flat)
        if valid is not None:
            return mixed.reshape(shape), valid_routing(chosen, probs, valid, self.num_experts)
        routing = Routing(counts.float(), probs.sum(dim=0), probs.new_tensor(len(flat)))
        return mixed.reshape(shape), routing


def valid_routing(
    chosen: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor, num_experts: int
) -> Routing:
    """A layer's `Routing` from its choices [N, k] and router probabilities [N, E], over
    the `valid` tokens only: weighted sums, no data-dependent shapes."""
    weight = valid.reshape(-1).to(probs.dtype)
    slots = weight.repeat_interleave(chosen.shape[1])
    counts = expert_counts(chosen, num_experts, slots)
    return Routing(counts.float(), (probs * weight[:, None]).sum(dim=0), weight.sum())


def expert_counts(
    chosen: torch.Tensor, num_experts: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The (token, slot) pairs `chosen` [N, k] sends to each expert [E] (summed `weights`
    per pair, if given): a sum into a fixed shape, so fake tensors (`freetx estimate
    --measure`) count too (a bincount's shape depends on the data)."""
    flat = chosen.reshape(-1)
    ones = torch.ones_like(flat) if weights is None else weights
    return ones.new_zeros(num_experts).scatter_add_(0, flat, ones)


def group_sizes(counts: torch.Tensor, rows: int) -> list[int]:
    """The experts' row counts as Python ints (the grouped matmul's groups); on fake tensors
    (`freetx estimate --measure`), which hold no values, the `rows` split evenly."""
    if not isinstance(counts, FakeTensor):
        return counts.tolist()
    each, extra = divmod(rows, len(counts))
    return [each + (expert < extra) for expert in range(len(counts))]


def combine_routings(routings: list[Routing]) -> Routing | None:
    """Every MoE layer's statistics of a micro-batch summed (None: no MoE layer)."""
    if not routings:
        return None
    return Routing(*(torch.stack(parts).sum(0) for parts in zip(*routings)))


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """Switch / Mixtral's auxiliary loss over every MoE layer of a micro-batch
    (`combine_routings`), as transformers' `load_balancing_loss_func` computes it (no
    attention mask): E x sum over experts of (the share of routed (token, slot) pairs it
    got) x (its mean router probability), both over all layers' tokens: k when perfectly
    balanced."""
    rows = routing.tokens  # tokens x layers
    return num_experts * torch.sum((routing.counts / rows) * (routing.probs / rows))


def expert_load_max(routing: Routing) -> torch.Tensor:
    """The busiest expert's routed tokens over the mean (1.0: perfectly balanced), over
    every MoE layer of a micro-batch (`combine_routings`)."""
    return routing.counts.max() / routing.counts.mean().clamp(min=1e-9)
