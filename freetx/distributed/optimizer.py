"""A run's optimizer (`build_optimizer`, through `ParallelPlan.build_optimizer`) and the
rungs of the memory ladder it takes: keys of the `optimizer:` node that freetx reads
itself (they are no arguments of the optimizer class):

    offload: cpu          ZeRO-Offload: the optimizer's states, an fp32 copy of what trains
                          and the optimizer step on the CPU; parameters and gradients on
                          the device. Each gradient is copied to the host as backward
                          produces it (after FSDP2's reduce-scatter, on a side CUDA stream,
                          and freed on the device then); DDP and ZeRO-1 copy them at the step,
                          after their all-reduce. The updated values are copied back.
    in_backward: true     each parameter's optimizer step runs in backward as soon as its
                          gradient is ready (after FSDP2's reduce-scatter: per sharded
                          parameter), and its gradient is freed then: no step holds every
                          gradient at once (torchtune's optimizer_in_bwd)
    state_dtype: bfloat16 the optimizer's states (AdamW's moments) stored in bfloat16,
                          upcast to fp32 for each parameter's step and stored back with
                          stochastic rounding (torchao's), so small updates of the second
                          moment are not rounded away; null: the parameters' dtype

Under these rungs the optimizer steps each parameter with an optimizer of the node's class
of its own (`ParameterSteps`), so any optimizer class works, torchao's low-bit ones
included; what the LR scheduler and the checkpoint see is the ordinary optimizer's shape:
one group per group, and the state keyed by parameter name (`named_state_dict`), so a run
resumes with any rung switched on or off.

What a rung cannot combine with is refused before launch (`check_optimizer`): in_backward
with gradient accumulation (each micro-batch's backward would step) and with a gradient
norm to clip to (the global norm is unknown when the first parameter steps: torchtune's
choice; the norm is still measured and logged); both rungs with pipeline parallelism and
float16 (its loss scaler unscales and checks every gradient before any step), in_backward
under ddp and zero1 on more than one process (the gradient is ready before DDP's all-reduce).
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.tensor import DTensor

from freetx.config.instantiate import COMPONENT, import_component, instantiate_except, node_path
from freetx.distributed.mesh import REPLICATED, Processes, canonical_strategy
from freetx.errors import ConfigError

OPTIMIZER_KEYS = ("offload", "in_backward", "state_dtype")  # freetx's, not the class's
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LOW_BIT = "torchao.optim"  # optimizers whose states are 8-bit, 4-bit or float8 already


@dataclass(frozen=True)
class OptimizerOptions:
    """The memory rungs an `optimizer:` node asks for (the module docstring)."""

    offload: Literal["none", "cpu"] = "none"
    in_backward: bool = False
    state_dtype: Optional[Literal["float32", "bfloat16"]] = None

    @classmethod
    def of(cls, node: Any) -> OptimizerOptions:
        """The options a node sets; a value no rung knows is refused with the ones it takes."""
        if not isinstance(node, Mapping):
            return cls()
        where = node_path(node, "optimizer")
        offload = node.get("offload", "none")
        offload = "none" if offload in (None, False) else offload
        if offload not in ("none", "cpu"):
            raise ConfigError(
                f"{where}.offload={offload}: the optimizer is offloaded to the CPU or not.",
                fix=f"Set {where}.offload=cpu (ZeRO-Offload) or none.",
            )
        in_backward = node.get("in_backward", False)
        if not isinstance(in_backward, bool):
            raise ConfigError(
                f"{where}.in_backward={in_backward}: it is true or false.",
                fix=f"Set {where}.in_backward=true (steps in backward) or false.",
            )
        state_dtype = node.get("state_dtype", None)
        if state_dtype is not None and state_dtype not in STATE_DTYPES:
            raise ConfigError(
                f"{where}.state_dtype={state_dtype}: the optimizer's states are stored in "
                "float32 or bfloat16.",
                fix=f"Set {where}.state_dtype=bfloat16, float32, or null (the parameters').",
            )
        return cls(offload, in_backward, state_dtype)

    @property
    def per_parameter(self) -> bool:
        """Whether a rung is on: the optimizer steps each parameter by itself."""
        return self.offload != "none" or self.in_backward or self.state_dtype is not None


def check_optimizer(
    node: Any,
    distributed: Any,
    processes: Processes,
    accumulation: int,
    max_grad_norm: float | None,
) -> OptimizerOptions:
    """Every refusal of the `optimizer:` node's rungs, made with what `processes` knows: by
    `check_layout` (validate, run, launch, estimate) and by the run (`TrainingRun`)."""
    options = OptimizerOptions.of(node)
    where = node_path(node, "optimizer")
    target = str(node.get(COMPONENT, "")) if isinstance(node, Mapping) else ""
    if options.state_dtype == "bfloat16" and target.startswith(_LOW_BIT):
        raise ConfigError(
            f"{where}.state_dtype=bfloat16 stores the states of {target} in bfloat16, and "
            "its states are 8-bit, 4-bit or float8 already.",
            fix=f"Leave {where}.state_dtype out (null), or use torch.optim.AdamW.",
        )
    used = (("offload", options.offload != "none"), ("in_backward", options.in_backward))
    rungs = [f"{where}.{k}" for k, on in used if on]
    if not rungs:
        return options
    if distributed.pp > 1:
        raise ConfigError(
            f"{' and '.join(rungs)} step(s) each parameter by itself, and pipeline parallelism "
            f"(distributed.pp={distributed.pp}) accumulates every micro-batch's gradients.",
            fix=f"Set distributed.pp=1, or leave {' and '.join(rungs)} out.",
        )
    if distributed.cpu_offload and options.offload != "none":
        raise ConfigError(
            f"{where}.offload=cpu with distributed.cpu_offload=true: FSDP2's CPU offload "
            "keeps the parameters, gradients and optimizer states on the CPU already.",
            fix=f"Set one of them: {where}.offload=cpu (parameters stay on the device) or "
            "distributed.cpu_offload=true.",
        )
    if distributed.mixed_precision.param_dtype == "float16":
        raise ConfigError(
            f"{' and '.join(rungs)} with float16: its loss scaler unscales and checks every "
            "gradient for overflow before the optimizer steps any.",
            fix="Set distributed.mixed_precision.param_dtype=bfloat16, or leave "
            f"{' and '.join(rungs)} out.",
        )
    if not options.in_backward:
        return options
    if options.offload != "none":
        raise ConfigError(
            f"{where}.offload=cpu and {where}.in_backward=true: the offloaded optimizer "
            "already takes each gradient off the device as backward produces it, and steps on "
            "the CPU after backward.",
            fix=f"Set one of them: {where}.offload=cpu (less device memory) or "
            f"{where}.in_backward=true (no host memory).",
        )
    if accumulation > 1:
        raise ConfigError(
            f"{where}.in_backward=true steps each parameter as its gradient is ready, and "
            f"gradient_accumulation_steps={accumulation} sums the gradients of several "
            "backward passes first.",
            fix="Set gradient_accumulation_steps=1 (a larger batch_size per process instead), "
            f"or {where}.in_backward=false.",
        )
    if max_grad_norm is not None:
        raise ConfigError(
            f"{where}.in_backward=true steps each parameter before the others' gradients "
            f"exist, so the global gradient norm that max_grad_norm={max_grad_norm} clips to "
            "is not known yet (the norm is still measured and logged).",
            fix=f"Set max_grad_norm=null, or {where}.in_backward=false.",
        )
    strategy = canonical_strategy(distributed.strategy)
    if strategy in REPLICATED and (processes.world_size or 2) > 1:
        raise ConfigError(
            f"{where}.in_backward=true under distributed.strategy={distributed.strategy}: a "
            "gradient is ready before DDP's all-reduce has averaged it.",
            fix="Set distributed.strategy=fsdp (or zero2, hsdp: the step runs after the "
            "reduce-scatter, per sharded parameter), or run on one process.",
        )
    return options


# -- the optimizer ---------------------------------------------------------------------


def build_optimizer(
    node: Any,
    model: nn.Module,
    names: dict[int, str],
    replicated: bool,
    zero: Any = None,
    fused: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer a `_component_` node names over `model`'s trainable parameters, with
    the node's rungs (`OptimizerOptions`): `names` maps id(parameter) to its name in a
    checkpoint; `replicated`: DDP or ZeRO-1 average the gradients after backward (an
    offloaded optimizer copies them at the step, not in backward); `zero`:
    ZeroRedundancyOptimizer's class under zero1 (each rank steps its share);
    `fused`: torch's fused Adam/AdamW kernels (CUDA)."""
    options = OptimizerOptions.of(node)
    extra = {"fused": True} if fused else {}
    params = [p for p in model.parameters() if p.requires_grad]
    if str(node.get(COMPONENT, "")).startswith(_LOW_BIT):
        avoid_shared_compile_cache(params)
        quiet_low_bit_cache_warning()
    make = functools.partial(instantiate_except, node, OPTIMIZER_KEYS, **extra)
    if zero is not None:
        kwargs = {k: v for k, v in node.items() if k not in (COMPONENT, *OPTIMIZER_KEYS)}
        target = zero_target(node, options, names, make)
        return zero(params, optimizer_class=target, **kwargs, **extra)
    if not options.per_parameter:
        return make(params)
    if options.offload == "cpu":
        return OffloadedOptimizer(params, make, names, options, copy_in_backward=not replicated)
    return PerParameterOptimizer(params, make, names, options)


def avoid_shared_compile_cache(params: list[torch.Tensor]) -> None:
    """torchao's low-bit optimizers compile their step per parameter shape. For FSDP2's
    DTensor shards torch 2.13's AOTAutograd cache keys a compiled step by the global shape
    only (pytorch#188390), so a rank whose shard is uneven (259 rows over 2 ranks: 130 and
    129) loads another rank's compiled step from a warm cache and fails ("expected size
    130==129"): a second run, or a resume, of the same config. That cache is turned off for
    such a run (Inductor's own cache, keyed by the local shapes, stays on)."""
    if any(isinstance(p, DTensor) for p in params):
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = False


def quiet_low_bit_cache_warning() -> None:
    """torchao's low-bit optimizers compile their step over their state tensors
    (`OptimState8bit`, `OptimState4bit`, `OptimStateFp8`), which do not implement torch's
    `_stable_hash_for_caching`, so AOTAutograd warns on every run ("OptimState8bit does not
    implement _stable_hash_for_caching ...") that it keeps that compiled step out of its
    cache on disk (a next run compiles it again). torchao's to fix (freetx builds the optimizer as torchao documents
    it), nothing a user can change: that one warning is silenced."""
    warnings.filterwarnings(
        "ignore",
        message=r"OptimState\w* does not implement _stable_hash_for_caching",
        category=UserWarning,
    )


def zero_target(node, options: OptimizerOptions, names, make) -> Callable:
    """The optimizer class ZeRO-1 builds over each rank's share: the node's, or (with
    rungs) an offloaded / per-parameter optimizer over it."""
    if not options.per_parameter:
        return import_component(node[COMPONENT], f"{node_path(node)}._component_")

    def build(params, **_hyperparameters):  # ZeRO passes the node's own keys back
        if options.offload == "cpu":
            return OffloadedOptimizer(params, make, names, options, copy_in_backward=False)
        return PerParameterOptimizer(params, make, names, options)

    return build


class GradientNorm:
    """The global L2 norm of gradients seen one at a time (in backward hooks): each one's
    sum of squares added to a running sum per mesh (a DTensor's: a partial sum, reduced
    over its mesh once, at `total`), as `freetx.training.grad.total_norm` takes them."""

    def __init__(self) -> None:
        self.sums: dict[object, torch.Tensor] = {}

    def add(self, grad: torch.Tensor) -> None:
        key = grad.device_mesh if isinstance(grad, DTensor) else None
        square = grad.detach().float().pow(2).sum()
        self.sums[key] = self.sums[key] + square if key in self.sums else square

    def total(self) -> torch.Tensor:
        """The norm so far (a plain fp32 tensor), and start again."""
        parts = [s.full_tensor() if isinstance(s, DTensor) else s for s in self.sums.values()]
        self.sums = {}
        if not parts:
            return torch.zeros(())
        return torch.stack([p.to(parts[0].device) for p in parts]).sum().sqrt()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _like(value: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """`value` (a local tensor) as `template` is: a DTensor on its mesh, or plain."""
    if not isinstance(template, DTensor):
        return value
    return DTensor.from_local(
        value,
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )


class ParameterSteps:
    """One optimizer of the node's class per tensor of `params` (`make([p])`), stepped one
    at a time (`step(i)`), its moments (floating states of the tensor's shape) kept in
    `state_dtype` between steps: upcast to fp32 for the step, stored back with stochastic
    rounding."""

    def __init__(self, params: Sequence[torch.Tensor], make, state_dtype: str | None) -> None:
        self.params = list(params)
        self.optimizers = [make([p]) for p in self.params]
        self.state_dtype = STATE_DTYPES.get(state_dtype) if state_dtype else None

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.optimizers[0].defaults) if self.optimizers else {}

    def step(self, i: int, hyperparameters: dict[str, Any]) -> None:
        optimizer, param = self.optimizers[i], self.params[i]
        copy_hyperparameters(hyperparameters, optimizer.param_groups[0])
        state = optimizer.state.get(param, {})
        for key in self._moments(param, state):
            state[key] = state[key].float()
        optimizer.step()
        self._store(i, stochastic=True)

    def initialize(self, i: int) -> None:
        """The tensor's state before its first step (a checkpoint's load template): torch's
        zero-gradient step at lr 0, the tensor's gradient put back after."""
        target = self.params[i]
        grad, target.grad = target.grad, None
        _init_optim_state(self.optimizers[i])
        target.grad = grad
        self._store(i, stochastic=False)  # zeros: no rounding, no random draw

    def state(self, i: int) -> dict[str, Any]:
        return self.optimizers[i].state.get(self.params[i], {})

    def load(self, i: int, saved: dict[str, Any]) -> None:
        """A saved state (moments, step), cast to the tensor's dtype and device by torch,
        then to state_dtype; the hyperparameters are left as they were."""
        optimizer = self.optimizers[i]
        hyperparameters = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        group = {**hyperparameters, "params": [0]}
        optimizer.load_state_dict({"state": {0: saved}, "param_groups": [group]})
        copy_hyperparameters(hyperparameters, optimizer.param_groups[0])
        self._store(i, stochastic=False)

    def _store(self, i: int, stochastic: bool) -> None:
        state = self.optimizers[i].state.get(self.params[i], {})
        for key in self._moments(self.params[i], state):
            state[key] = _stored(state[key], self.state_dtype, stochastic)

    def _moments(self, param: torch.Tensor, state: dict) -> list[str]:
        """The states kept in state_dtype; none when it is the parameter's own dtype."""
        if self.state_dtype is None or self.state_dtype == param.dtype:
            return []
        return [
            k
            for k, v in state.items()
            if torch.is_tensor(v) and v.is_floating_point() and v.shape == param.shape
        ]


def _stored(value: torch.Tensor, dtype: torch.dtype, stochastic: bool) -> torch.Tensor:
    """A moment in `dtype`: fp32 -> bfloat16 with stochastic rounding (torchao's: unbiased,
    so a second moment's small updates are not rounded away), else rounded."""
    if stochastic and dtype == torch.bfloat16 and value.dtype == torch.float32:
        from torchao.optim.quant_utils import _fp32_to_bf16_sr

        return _fp32_to_bf16_sr(value)
    return value.to(dtype)


def copy_hyperparameters(source: dict[str, Any], group: dict[str, Any]) -> None:
    """A group's hyperparameters set from `source` (the scheduler's lr among them); a
    tensor lr (torchao's optimizers) is filled in place."""
    for key, value in source.items():
        if key == "params":
            continue
        if torch.is_tensor(group.get(key)):
            group[key].fill_(float(value))
        else:
            group[key] = value.clone() if torch.is_tensor(value) else value


def _groups(params) -> list[dict[str, Any]]:
    """Parameters or param groups (ZeRO-1 passes its share as groups) as groups."""
    groups = list(params)
    return groups if groups and isinstance(groups[0], dict) else [{"params": groups}]


class StepsEachParameter(torch.optim.Optimizer):
    """The ordinary optimizer's face over per-parameter steps (`steps`: over the parameters,
    or their host copies): its param groups hold the model's parameters (what the LR
    scheduler sets, copied into each parameter's optimizer before its step), and its
    checkpoint state (`named_state_dict`) is `get_optimizer_state_dict`'s of the ordinary
    optimizer: one entry per parameter name, the groups' hyperparameters."""

    norm: GradientNorm | None = None  # the gradients' norm, when measured in backward

    def __init__(
        self,
        params,
        make,
        names: dict[int, str],
        options: OptimizerOptions,
        targets: list[torch.Tensor] | None = None,
    ) -> None:
        groups = _groups(params)
        flat = [p for g in groups for p in g["params"]]
        self.steps = ParameterSteps(targets or flat, make, options.state_dtype)
        super().__init__(groups, self.steps.defaults)
        self.group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        self.names = [name for group in self.group_names for name in group]
        self.group_of = [g for g, group in enumerate(self.group_names) for _ in group]

    def _hyperparameters(self, i: int) -> dict[str, Any]:
        return self.param_groups[self.group_of[i]]

    def named_state_dict(self) -> dict[str, Any]:
        state = {}
        for i, name in enumerate(self.names):
            if not self.steps.state(i):
                self.steps.initialize(i)
            state[name] = dict(self.steps.state(i))
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
            for g, names in zip(self.param_groups, self.group_names)
        ]
        return {"state": state, "param_groups": groups}

    def load_named_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each parameter's saved state (moments, step); the hyperparameters stay the
        config's, as `freetx.checkpoint.OptimizerState` keeps them."""
        for i, name in enumerate(self.names):
            if name in state_dict["state"]:
                self.steps.load(i, state_dict["state"][name])

    def gradient_norm(self) -> torch.Tensor | None:
        """The gradients' global norm measured in backward; None: not measured there."""
        return None if self.norm is None else self.norm.total()

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the next step uses (what clipping scales): those of what it steps
        (the parameters, or their host copies)."""
        return [t.grad for t in self.steps.params if t.grad is not None]


class PerParameterOptimizer(StepsEachParameter):
    """The node's optimizer class per parameter: `in_backward` steps each one in backward
    as its gradient is ready (a post-accumulate-grad hook, after FSDP2's reduce-scatter)
    and frees its gradient; else `step` steps them in turn (`state_dtype`)."""

    def __init__(self, params, make, names, options: OptimizerOptions) -> None:
        super().__init__(params, make, names, options)
        flat = self.steps.params
        self.in_backward = options.in_backward
        if self.in_backward:
            self.norm = GradientNorm()
            for i, p in enumerate(flat):
                p.register_post_accumulate_grad_hook(functools.partial(self._step_in_backward, i))

    def _step_in_backward(self, i: int, param: torch.Tensor) -> None:
        self.norm.add(param.grad)
        self.steps.step(i, self._hyperparameters(i))
        param.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("freetx's per-parameter optimizer takes no closure")
        if self.in_backward:  # every parameter stepped in backward already
            return None
        for i, p in enumerate(self.steps.params):
            if p.grad is not None:
                self.steps.step(i, self._hyperparameters(i))
        return None


class OffloadedOptimizer(StepsEachParameter):
    """ZeRO-Offload: an fp32 host copy of each trainable parameter (this rank's shard; pinned
    on CUDA) with its gradient and the optimizer's states there, stepped on the CPU.

    `copy_in_backward`: each gradient is copied to its host copy as backward produces it (a
    post-accumulate-grad hook: after FSDP2's reduce-scatter; on one process at the last
    micro-batch of a step, `copy_gradients(enabled)`) on a side stream, its norm measured,
    and the device's freed; else (DDP, ZeRO-1: the gradient is averaged after backward)
    at the step. The step then copies the updated values back into the parameters."""

    def __init__(self, params, make, names, options: OptimizerOptions, copy_in_backward: bool):
        flat = [p for g in _groups(params) for p in g["params"]]
        self.device_params = flat
        cuda = any(_local(p).is_cuda for p in flat)
        self.stream = torch.cuda.Stream() if cuda else None
        self.hosts = [nn.Parameter(_like(self._host_copy(p, cuda), p)) for p in flat]
        super().__init__(params, make, names, options, targets=self.hosts)
        self.copying = True
        self.in_backward = copy_in_backward
        self.norm = GradientNorm() if copy_in_backward else None
        self.pending: list[int] = []  # gradients copied in backward, not stepped yet
        if copy_in_backward:
            for i, p in enumerate(flat):
                p.register_post_accumulate_grad_hook(functools.partial(self._copy_in_backward, i))

    @staticmethod
    def _host_copy(param: torch.Tensor, pin: bool) -> torch.Tensor:
        local = _local(param).detach()
        host = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)
        host.copy_(local)
        return host

    def copy_gradients(self, enabled: bool) -> None:
        """Whether this backward is a step's last (one process, gradient accumulation: the
        device sums the micro-batches' gradients first)."""
        self.copying = enabled

    def _copy_in_backward(self, i: int, param: torch.Tensor) -> None:
        if not self.copying:
            return
        self.norm.add(param.grad)
        self._take_gradient(i, param.grad)
        param.grad = None  # freed once its copy is done (`record_stream`)
        self.pending.append(i)

    def _take_gradient(self, i: int, grad: torch.Tensor) -> None:
        host = self.hosts[i]
        if host.grad is None:
            local = torch.empty(
                _local(host).shape, dtype=torch.float32, pin_memory=self.stream is not None
            )
            host.grad = _like(local, host)
        device_grad = _local(grad)
        if self.stream is None:
            _local(host.grad).copy_(device_grad)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            _local(host.grad).copy_(device_grad, non_blocking=True)
        device_grad.record_stream(self.stream)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("freetx's offloaded optimizer takes no closure")
        if not self.in_backward:  # DDP, ZeRO-1: the averaged gradients, now
            self.pending = []
            for i, p in enumerate(self.device_params):
                if p.grad is not None:
                    self._take_gradient(i, p.grad)
                    self.pending.append(i)
        self._copies_done()
        for i in self.pending:
            self.steps.step(i, self._hyperparameters(i))
            _local(self.device_params[i]).copy_(_local(self.hosts[i]), non_blocking=True)
        self.pending = []
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            p.grad = None
        if not self.in_backward:
            self.pending = []

    def gradients(self) -> list[torch.Tensor]:
        self._copies_done()  # clipping scales the host copies: their copies must be done
        return super().gradients()

    def _copies_done(self) -> None:
        """Wait for the gradients' copies to the host (CUDA's side stream)."""
        if self.stream is not None:
            self.stream.synchronize()


def local_optimizer(optimizer: Any) -> Any:
    """The optimizer that steps this rank's parameters: ZeRO-1's local one (its share), or
    `optimizer` itself. torch.distributed.optim is imported only by the zero1 strategy (it
    scripts its optimizers on import, ~0.4 s): if it is not loaded, no optimizer is ZeRO-1's."""
    zero = sys.modules.get("torch.distributed.optim")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer.optim
    return optimizer


def offloaded(optimizer: Any) -> OffloadedOptimizer | None:
    """The offloaded optimizer under `optimizer` (ZeRO-1's local one too), or None."""
    local = local_optimizer(optimizer)
    return local if isinstance(local, OffloadedOptimizer) else None


def steps_in_backward(optimizer: Any) -> bool:
    """Whether `optimizer` updates the parameters in backward (in_backward): a non-finite
    gradient cannot be skipped once it is seen."""
    return isinstance(optimizer, PerParameterOptimizer) and optimizer.in_backward


def measured_norm(optimizer: Any) -> StepsEachParameter | None:
    """The per-parameter optimizer that measured the gradients' norm in backward (their
    device copies are gone), or None: measure the model's gradients."""
    return optimizer if isinstance(optimizer, StepsEachParameter) and optimizer.norm else None
