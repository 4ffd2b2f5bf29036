"""Tensor parallelism: a model's layers sliced over the `tp` ranks of a (dp, tp) mesh.

The model says which module plays which role (`freetx.models.protocol.SlicesLayers`,
`TP_ROLES`); this module maps the roles to torch's parallel styles and applies them to
the meta model, before activation checkpointing, compile and FSDP2 (which then shards
each slice over the dp ranks: 2-D DTensors). Attention is sliced by heads (queries,
keys and values column-wise, the output projection row-wise), the MLP by hidden units
(gate and up column-wise, down row-wise): two sums over the tp ranks per block in
forward, two in backward, as Megatron-LM. The embedding and the head are sliced by
vocabulary; the head makes this rank's slice of the logits, and the loss reduces
its log-sum-exp and the labels' logits over the slices (`VocabularySlice`: a
vocabulary-parallel cross-entropy, no logits gathered).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from freetx.errors import ConfigError
from freetx.models.protocol import TP_ROLES, SlicesLayers, SlicesWithLinear, require_hook


def parallel_style(role: str):
    """The torch parallel style of a role (`TP_ROLES`)."""
    if role == "colwise":
        return ColwiseParallel()
    if role == "rowwise":
        return RowwiseParallel()
    if role == "embedding":
        return RowwiseParallel(input_layouts=Replicate())
    if role == "output":  # this rank's slice of the vocabulary's logits (`VocabularySlice`)
        return ColwiseParallel()
    if role == "heads_norm":  # input [B, T, heads, head_dim], sliced by heads (dim 2)
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    # sequence parallelism: the residual stream a DTensor sliced by sequence (dim 1)
    if role == "sequence_norm":
        return SequenceParallel(use_local_output=False)
    if role == "gather_sequence":
        return FirstInputGathered()
    if role == "gather_experts":  # (hidden, valid) in, (hidden, routing) out
        return PrepareModuleInputOutput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_input=True,
            output_layouts=(Replicate(), None),
            desired_output_layouts=(Shard(1), None),
            use_local_output=False,
        )
    if role == "rowwise_sequence":
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    if role == "embedding_sequence":
        return RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if role == "split_sequence":
        return PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        )
    raise ValueError(f"no tensor-parallel role {role!r}; the roles are {', '.join(TP_ROLES)}")


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """`distributed.async_tp` (CUDA, compiled blocks): Inductor's micro-pipelined tensor
    parallelism, which splits the tp all-gathers and reduce-scatters into pieces that
    overlap the matmuls consuming them, through symmetric memory on the tp group (as
    torchtitan enables it)."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


class FirstInputGathered(ParallelStyle):
    """A module's first input (the residual stream, sliced by sequence) gathered whole
    before it runs, as a plain tensor; its other inputs as they are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module, args):
            first = args[0]
            if not isinstance(first, DTensor):
                first = DTensor.from_local(first, device_mesh, (Shard(1),), run_check=False)
            return (first.redistribute(device_mesh, (Replicate(),)).to_local(), *args[1:])

        module.register_forward_pre_hook(gather)
        return module


def check_slices(model: nn.Module | type) -> None:
    """distributed.tp > 1 needs a model with a tensor-parallel plan (`SlicesLayers`):
    the model, or the class a config builds (`check_layout`, before launching)."""
    require_hook(
        model,
        SlicesLayers,
        "has no tensor-parallel plan (freetx slices the native decoder's attention and MLP), so "
        "distributed.tp > 1 cannot run it.",
        fix="Set distributed.tp=1 (fsdp alone shards it).",
    )


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False
) -> None:
    """Slice `model`'s layers over `tp_mesh` as its plan says (`SlicesLayers`); refuses a
    model without a plan. A layer with parameters of its own (a LoRA adapter) says how
    they slice (`SlicesWithLinear`)."""
    check_slices(model)
    plan = model.tensor_parallel_plan(tp_mesh.size(), sequence_parallel)
    styles = {}
    for name, role in plan.items():
        module = model.get_submodule(name)
        plain = (nn.Embedding,) if role.startswith("embedding") else (nn.Linear,)
        if role in WHOLE_MODULE_ROLES:  # a module's inputs or outputs, any module
            styles[name] = parallel_style(role)
        elif isinstance(module, SlicesWithLinear):
            styles[name] = adapter_style(role, module.tensor_parallel_dims(role))
        elif type(module) not in plain:  # torch's styles slice every
            # parameter of a module alike: another's would be cut along the wrong side
            raise ConfigError(
                f"distributed.tp: {name} is a {type(module).__name__}, which freetx does not "
                "slice over tensor-parallel ranks.",
                fix="Set distributed.tp=1 (fsdp alone shards it).",
            )
        else:
            styles[name] = parallel_style(role)
    trains = {name: p.requires_grad for name, p in model.named_parameters()}
    parallelize_module(model, tp_mesh, styles)
    for name, p in model.named_parameters():  # torch's SequenceParallel makes its norms'
        p.requires_grad_(trains[name])  # weights anew, trainable: a frozen one stays frozen
    heads = [name for name, role in plan.items() if role == "output"]
    if heads:  # the loss reduces over the slices of the vocabulary; no logits gathered
        vocab_size = model.get_submodule(heads[0]).weight.shape[0]  # the global shape
        model.slice_vocabulary(VocabularySlice(tp_mesh, vocab_size))


class VocabularySlice:
    """`VocabSlice` of a head sliced by vocabulary over `tp_mesh` (torch's row chunks:
    the first ranks hold ceil(vocab / tp) entries)."""

    def __init__(self, tp_mesh: DeviceMesh, vocab_size: int) -> None:
        self.group, ranks = tp_mesh.get_group(), tp_mesh.size()
        width = -(-vocab_size // ranks)
        self.widths = [max(0, min(width, vocab_size - r * width)) for r in range(ranks)]
        self.start = min(tp_mesh.get_local_rank() * width, vocab_size)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every slice's logits joined along the last dimension (no gradient)."""
        width = max(self.widths)
        padded = torch.nn.functional.pad(x.detach(), (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in self.widths]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[..., :w] for p, w in zip(parts, self.widths)], dim=-1)


# roles that take a module's inputs or outputs (or a norm's weight whole), whatever it is
WHOLE_MODULE_ROLES = (
    "heads_norm",
    "sequence_norm",
    "gather_sequence",
    "gather_experts",
    "split_sequence",
)


def adapter_style(role: str, dims: dict[str, int | None]):
    """The parallel style of a layer with an adapter: its input and output as the role's
    plain style takes them, each parameter sliced along its dimension in `dims`."""
    base = parallel_style(role)

    class AdapterStyle(type(base)):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            def partition(prefix: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
                for local, param in list(submodule.named_parameters(recurse=False)):
                    dim = dims[f"{prefix}.{local}".lstrip(".")]
                    placement = Replicate() if dim is None else Shard(dim)
                    sliced = distribute_tensor(param, mesh, [placement])
                    submodule.register_parameter(
                        local, nn.Parameter(sliced, requires_grad=param.requires_grad)
                    )

            return distribute_module(
                module,
                device_mesh,
                partition,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )

    style = AdapterStyle()
    style.__dict__.update(base.__dict__)  # the role's layouts (AdapterStyle() has defaults)
    # what the input becomes (torch's rowwise style sets it when it meets a Linear)
    style.desired_input_layouts = (Replicate(),) if role == "colwise" else (Shard(-1),)
    return style
