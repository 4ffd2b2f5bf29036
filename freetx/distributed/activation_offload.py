"""Activation offloading (`distributed.activation_offloading`): the tensors a forward
saves for its backward moved to host memory as they are saved, and brought back to the
device as the backward needs them (torchtune's idea, written here from its description).

`OffloadActivations` is a `torch.autograd.graph.saved_tensors_hooks` context around the
forward. Its pack hook copies each saved activation into pinned host memory on a side
CUDA stream, the device tensor kept alive until its copy has finished (then dropped,
so the allocator reuses its memory for the next activations; with more than
`in_flight` copies unfinished the compute stream waits for the oldest, which bounds
the device memory of a forward that computes faster than PCIe copies); its unpack hook brings a
tensor back, first waiting on the copy made ahead for it, and copies the next
`prefetch` tensors the backward will need (the reverse of the packing order) on the
side stream, which the compute stream waits on through an event. The hooks stay with
the autograd graph: a tensor's host copy is freed when its backward node has run.

Kept where they are: parameters, their views and buffers (the model holds them), tensor
subclasses (float8's, DTensors), tensors that are not on the compute device, and those
under `min_bytes` (1 KiB: not worth a copy). On the CPU the same hooks keep the tensor
itself (nothing to move to), with the same bookkeeping; `copy_on_cpu=True` makes a real
copy there, so that the copy and its restore (views, strides, dtypes) are tested
without a GPU.

With activation checkpointing (torch's non-reentrant checkpoint, which `parallelize`
applies) a checkpointed block saves only its inputs through these hooks (its recomputed
forward saves under checkpoint's own hooks), so only the blocks' inputs and what runs
outside the blocks (embedding, final norm, head, loss) are offloaded.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

MIN_BYTES = 1024  # smaller saved tensors stay where they are
PREFETCH = 2  # tensors brought back ahead of the backward
IN_FLIGHT = 5  # host copies the forward runs ahead of; beyond, its stream waits for one

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream per CUDA device that offloading's copies run on."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


@dataclass(eq=False)
class _Saved:
    """One offloaded activation, what the pack hook returns to autograd (so it lives as
    long as the graph's reference to it)."""

    index: int  # its position in packing order
    device_tensor: torch.Tensor | None  # alive until its host copy is done (CPU: kept)
    host: torch.Tensor | None = None  # the copy in host memory
    copied: torch.cuda.Event | None = None  # the host copy's end, on the side stream
    restored: torch.Tensor | None = None  # on the device again (prefetched or fetched)
    restored_event: torch.cuda.Event | None = None  # a prefetch's end, on the side stream


class OffloadActivations(saved_tensors_hooks):
    """Saved activations to host memory in forward, back to `device` in backward (see
    the module docstring). Use it around a forward (`with OffloadActivations(device):
    loss = model(x)`); the backward may run outside it. `keep`: tensors whose storage
    stays put (the model's buffers, which RoPE tables are views of). Counts the tensors
    it offloads (`offloaded`: each once, however many ops save it) and the saves it
    keeps (`kept`)."""

    def __init__(
        self,
        device: torch.device,
        keep: Iterable[torch.Tensor] = (),
        min_bytes: int = MIN_BYTES,
        prefetch: int = PREFETCH,
        in_flight: int = IN_FLIGHT,
        copy_on_cpu: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda and self.device.index is None:  # as saved tensors name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.copies = self.on_cuda or copy_on_cpu
        self.kept_storages = {t.untyped_storage().data_ptr() for t in keep}
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.in_flight = in_flight
        self.stream = side_stream(self.device) if self.on_cuda else None
        self.order: list[weakref.ref[_Saved]] = []  # every offloaded tensor, packing order
        self.pending: deque[_Saved] = deque()  # host copies not yet known to be done
        # id(tensor) -> (the tensor, its _Saved), weakly: a tensor saved by several ops
        # (the input of q, k and v) is offloaded once
        self.seen: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[_Saved]]] = {}
        self.offloaded = 0
        self.kept = 0
        super().__init__(self.pack, self.unpack)

    def __enter__(self) -> OffloadActivations:
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.release_copied()

    def stays(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor is kept where it is rather than offloaded."""
        return (
            isinstance(tensor, nn.Parameter)
            or isinstance(tensor._base, nn.Parameter)  # a Linear saves its weight's .t()
            or type(tensor) is not torch.Tensor  # subclasses: float8's, DTensors
            or tensor.device != self.device
            or tensor.numel() * tensor.element_size() < self.min_bytes
            or tensor.untyped_storage().data_ptr() in self.kept_storages
        )

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        if self.stays(tensor):
            self.kept += 1
            return tensor
        known = self.seen.get(id(tensor))
        shared = known[1]() if known is not None and known[0]() is tensor else None
        if shared is not None:
            return shared
        self.offloaded += 1
        saved = _Saved(len(self.order), tensor)
        self.order.append(weakref.ref(saved))
        self.seen[id(tensor)] = (weakref.ref(tensor), self.order[-1])
        if self.copies:
            self.copy_to_host(saved)
        return saved

    def copy_to_host(self, saved: _Saved) -> None:
        """The host copy, with the tensor's strides (dense ones; others contiguous): on the
        side stream after what the compute stream has queued (CUDA), or at once (CPU)."""
        tensor = saved.device_tensor
        saved.host = torch.empty_like(tensor, device="cpu", pin_memory=self.on_cuda)
        if not self.on_cuda:
            saved.host.copy_(tensor)
            saved.device_tensor = None
            return
        self.release_copied()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            saved.host.copy_(tensor, non_blocking=True)
            saved.copied = self.stream.record_event()
        self.pending.append(saved)

    def release_copied(self) -> None:
        """Drop the device tensors whose host copies have finished (in order: one stream),
        and the oldest beyond `in_flight` once the compute stream waits for their copies
        (what it runs next may reuse their memory)."""
        while self.pending and (
            len(self.pending) > self.in_flight or self.pending[0].copied.query()
        ):
            saved = self.pending.popleft()
            torch.cuda.current_stream(self.device).wait_event(saved.copied)
            saved.device_tensor = None

    def unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.device_tensor is not None:  # kept (CPU), or its copy still running
            return saved.device_tensor
        if saved.restored is None:
            self.restore(saved)
        if saved.restored_event is not None:  # prefetched: the compute stream waits
            torch.cuda.current_stream(self.device).wait_event(saved.restored_event)
            saved.restored.record_stream(torch.cuda.current_stream(self.device))
            saved.restored_event = None
        tensor = saved.restored
        for earlier in range(saved.index - 1, max(saved.index - 1 - self.prefetch, -1), -1):
            ahead = self.order[earlier]()
            if ahead is not None and ahead.restored is None and ahead.device_tensor is None:
                self.restore(ahead, on_side_stream=True)
        return tensor

    def restore(self, saved: _Saved, on_side_stream: bool = False) -> None:
        """The host copy back on the device: on the compute stream (needed now), or on
        the side stream with an event to wait on (a prefetch). On the CPU the host copy
        is the tensor."""
        if not self.on_cuda:
            saved.restored = saved.host
            return
        if not on_side_stream:
            saved.restored = saved.host.to(self.device, non_blocking=True)
            return
        with torch.cuda.stream(self.stream):
            saved.restored = saved.host.to(self.device, non_blocking=True)
            saved.restored_event = self.stream.record_event()
