"""Materialize a meta-device model and initialize it, one parameter at a time.

`fill_parameters` sets every parameter from a full value, one at a time; each
rank keeps its shard. `load_parameters` reads weights from a file, each rank only
the rows of its own shard. `materialize` uses it with a seeded generator: each
parameter is generated whole on the device from a generator seeded by
(seed, parameter name), then each rank keeps its own shard. So the initial
weights are the same at any world size and under any strategy, and no rank ever
holds more than one full parameter beside its shards: an 8B model never
materializes whole on one rank.

The model supplies `init_parameter(name, full_tensor, generator)` (how to fill
a parameter) and, when it has buffers to compute, `init_buffers()` (e.g. RoPE
tables). Modules may follow the module hooks of `freetx.models.protocol`
(`SelfInitialized`, `DerivedFromWeights`, `StoredInOwnForm`); this module is
where DTensors are unwrapped before those hooks are called and wrapped again
after, so that they see local shards only.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from freetx.errors import ConfigError
from freetx.models.protocol import (
    DerivedFromWeights,
    InitBuffers,
    ReplacesLanguageHead,
    SelfInitialized,
    StoredInOwnForm,
)

# Wrappers that insert a prefix into parameter names (none of freetx's own do).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def canonical_name(name: str) -> str:
    """A parameter name without wrapper prefixes: the model's own name for it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def parameter_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed (Python's hash() differs between processes)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device,
    seed: int,
    buffer_device: torch.device | None = None,
    init_weights: bool = True,
) -> None:
    """Allocate a meta model's storage on `device` and fill it deterministically.

    `init_weights=False` leaves the parameters' memory as allocated, for a run that
    loads every weight from a checkpoint next (no full tensor is made for nothing).
    """
    model.to_empty(device=device)
    if buffer_device is not None and buffer_device != device:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module.register_buffer(
                    name,
                    buffer.to(buffer_device),
                    persistent=name not in module._non_persistent_buffers_set,
                )

    own = self_initialized(model)

    def initial_value(name: str, param: torch.Tensor) -> torch.Tensor:
        device = _local(param).device
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        generator = torch.Generator(device=device).manual_seed(parameter_seed(seed, name))
        if name in own:  # an adapter's parameter: its module knows its initialization
            module, local_name = own[name]
            module.reset_parameter(local_name, full, generator)
        else:
            model.init_parameter(name, full, generator)
        return full

    # adapters are initialized even when the weights are loaded: a base file never has them;
    # so is a head that replaces a language model's (read over it when the weights have one)
    new_head = set(model.NEW_HEAD) if isinstance(model, ReplacesLanguageHead) else set()

    def drawn(name: str) -> bool:
        return name in own or name in new_head

    fill_parameters(model, initial_value, only=None if init_weights else drawn)
    if isinstance(model, InitBuffers):  # optional: models with no buffers
        model.init_buffers()
    if init_weights:
        init_from_weights(model)


def self_initialized(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Parameters that a submodule initializes itself (it lists them in `own_parameters`
    and fills them in `reset_parameter(name, full_tensor, generator)`): adapters."""
    own = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, SelfInitialized):
            continue
        for local_name in module.own_parameters:
            full_name = f"{module_name}.{local_name}" if module_name else local_name
            own[full_name] = (module, local_name)
    return own


def init_from_weights(model: nn.Module) -> None:
    """Let modules whose values follow from the weights (DoRA's magnitudes) set them, once
    the weights are final (initialized, or loaded from a file): each gets its own
    parameters' local shards."""
    for module in model.modules():
        if isinstance(module, DerivedFromWeights) and module is not model:
            module.init_from_weights(local_parameters(module))


def local_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's own parameters by name, as this rank's local tensors (a DTensor's local
    shard): what a hook that sets values from other parameters is given."""
    return {name: _local(p) for name, p in module.named_parameters(recurse=False)}


def self_stored(model: nn.Module) -> set[str]:
    """Parameters that their module stores its own way (set from a full value only)."""
    return {
        canonical_name(name)
        for name, _ in model.named_parameters()
        if _stored_by_owner(model, name)
    }


def set_full_parameter(model: nn.Module, name: str, full: torch.Tensor) -> None:
    """Set one self-stored parameter from its full value (every rank, the same value)."""
    if not _set_by_owner(model, name, full):
        raise KeyError(name)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, local_name = name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), local_name


def _stored_by_owner(model: nn.Module, name: str) -> bool:
    """Whether the module owning parameter `name` stores it its own way (`StoredInOwnForm`,
    e.g. a QLoRA layer's NF4 base: quantized whole, then sharded)."""
    owner, local_name = _owner(model, name)
    return isinstance(owner, StoredInOwnForm) and owner.stores_parameter(local_name)


@torch.no_grad()
def _set_by_owner(model: nn.Module, name: str, full: torch.Tensor) -> bool:
    """Set parameter `name` from its full value when its module stores it its own way:
    the module makes this rank's stored value (its chunk of rows when the parameter is a
    DTensor), which becomes the parameter, as a DTensor of the same spec when sharded.
    False for any other parameter."""
    if not _stored_by_owner(model, name):
        return False
    owner, local_name = _owner(model, name)
    param = getattr(owner, local_name)
    device = _local(param).device
    if device.type == "meta":
        device = torch.device("cpu")
    shard = None
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        if mesh.ndim != 1:
            raise ConfigError(
                f"{name} is kept in its own form (QLoRA's NF4 weights), which shards on a 1-D "
                f"mesh only (fsdp, zero2); this run uses a {mesh.ndim}-D mesh (hsdp). Use "
                "distributed.strategy=fsdp."
            )
        shard = (mesh.get_local_rank(), mesh.size())
    value = owner.stored_value(local_name, full.to(device), shard)
    if isinstance(param, DTensor):
        meta = TensorMeta(param.size(), param.stride(), param.dtype)
        spec = DTensorSpec(param.device_mesh, param.placements, meta)
        value = DTensor(local_tensor=value, spec=spec, requires_grad=False)
    setattr(owner, local_name, nn.Parameter(value, requires_grad=False))
    return True


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole on every rank, detached: a sharded one (DTensor) is gathered, which
    is a collective every rank of its mesh must call."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


@torch.no_grad()
def full_norm(tensor: torch.Tensor) -> float:
    """The 2-norm of a whole tensor (of a sharded DTensor: the shards' squares summed over
    its mesh, a collective of one number that every rank of the mesh must call)."""
    norm = torch.linalg.vector_norm(tensor.detach(), dtype=torch.float32)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


@torch.no_grad()
def fill_parameters(
    model: nn.Module,
    full_value: Callable[[str, torch.Tensor], torch.Tensor],
    only: Callable[[str], bool] | None = None,
) -> None:
    """Set every parameter from its full (unsharded) value, one parameter at a time.

    `full_value(name, param)` returns the whole tensor for the parameter's
    canonical name; each rank keeps its own shard of it. Used for initial
    weights (from a generator or from a file).
    """
    for name, param in list(model.named_parameters()):
        if only is not None and not only(canonical_name(name)):
            continue
        full = full_value(canonical_name(name), param)
        if _set_by_owner(model, name, full):
            continue
        local = _local(param)
        if isinstance(param, DTensor):
            full = distribute_tensor(
                full.to(local.device), param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
        local.copy_(full)


@torch.no_grad()
def load_parameters(
    model: nn.Module,
    read_into: Callable[[str, slice | None, torch.Tensor], None],
    only: Callable[[str], bool] | None = None,
) -> None:
    """Set every parameter from a file, each rank reading only the rows of its own shard.

    `read_into(name, rows, out)` fills `out` with rows `rows` of the first dimension
    of the parameter called `name` (canonical), or the whole tensor for `rows=None`.
    FSDP2 shards the first dimension, so a rank's shard is one run of rows, read
    straight into its local tensor: peak memory per rank stays near its shard.
    `only` picks the parameters to read (default: all). A parameter its module stores its
    own way (an NF4 base) is not read here: `set_full_parameter` sets it from the whole
    value, in the shape the file holds it.
    """
    for name, param in list(model.named_parameters()):
        left_out = only is not None and not only(canonical_name(name))
        if left_out or _stored_by_owner(model, name):
            continue
        local = _local(param)
        rows = None
        if isinstance(param, DTensor):
            if any(p.is_shard() and p.dim != 0 for p in param.placements):  # not FSDP2's
                full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
                read_into(canonical_name(name), None, full)
                local.copy_(
                    distribute_tensor(
                        full, param.device_mesh, param.placements, src_data_rank=None
                    ).to_local()
                )
                continue
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            rows = slice(offset[0], offset[0] + shape[0]) if param.dim() else None
        if local.device.type == "cpu":
            read_into(canonical_name(name), rows, local)
        else:  # through host memory, one tensor at a time
            host = torch.empty(local.shape, dtype=local.dtype)
            read_into(canonical_name(name), rows, host)
            local.copy_(host)
