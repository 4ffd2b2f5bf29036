"""Fault injection for checkpoint tests, loaded only when a test puts this folder
on PYTHONPATH. With FREETX_TEST_KILL_SAVE=<step name> (e.g. step_000006), rank 1
writes a partial data file into that save's folder and dies on the spot, the
way a node crash would leave a save half done; FREETX_TEST_KILL_SAVE_SIGNAL=1 makes it
die of SIGKILL instead (kill -9, the OOM killer)."""

import os

_target = os.environ.get("FREETX_TEST_KILL_SAVE")
if _target:
    import signal

    from torch.distributed.checkpoint import filesystem

    _write_data = filesystem._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if os.environ.get("RANK") == "1" and str(self.path).endswith(_target):
            with open(os.path.join(str(self.path), "__1_0.distcp"), "wb") as f:
                f.write(b"\0" * 1000)
            if os.environ.get("FREETX_TEST_KILL_SAVE_SIGNAL"):
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)
        return _write_data(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data

# With FREETX_TEST_DISK_FULL=<step name>, every rank's writes into that save fail as on a
# full disk: the first 4 KiB of a data file land, then write() raises ENOSPC.
_full = os.environ.get("FREETX_TEST_DISK_FULL")
if _full:
    import contextlib
    import errno

    from torch.distributed.checkpoint import filesystem

    class _FullDisk:
        def __init__(self, stream):
            self._stream, self._left = stream, 4096

        def write(self, data):
            size = len(memoryview(data).cast("B"))
            if size > self._left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._left -= size
            return self._stream.write(data)

        def __getattr__(self, name):
            return getattr(self._stream, name)

    _create_stream = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with _create_stream(self, path, mode) as stream:
            yield _FullDisk(stream) if _full in str(path) and "w" in mode else stream

    filesystem.FileSystem.create_stream = create_stream

# Faults at a training step (counted by the calls of the per-step all-reduce, on the
# first attempt only, so a restarted group runs clean):
#   FREETX_TEST_FAULT=kill:<step>:<rank>     the rank dies on the spot (kill -9)
#   FREETX_TEST_FAULT=sigterm:<step>:<rank>  the rank gets SIGTERM (a pre-emption)
#   FREETX_TEST_FAULT=hang:<step>:<rank>     the rank sleeps before the collective
#   FREETX_TEST_FAULT=nan:<step>:<rank>      a NaN lands in one gradient of the rank
_fault = os.environ.get("FREETX_TEST_FAULT")
if _fault and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import signal
    import time

    import torch

    from freetx.training import step as _step

    _kind, _at, _rank = _fault.split(":")
    _calls = {"count": 0}
    _mine = os.environ.get("RANK", "0") == _rank
    _count_over_ranks, _clip = _step.count_over_ranks, _step.clip_grad_norm
    _nan = torch.tensor([float("nan")])

    def count_over_ranks(groups, counts):
        _calls["count"] += 1
        if _mine and _calls["count"] == int(_at):
            if _kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif _kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif _kind == "hang":
                time.sleep(600)
        return _count_over_ranks(groups, counts)

    def clip_grad_norm(model, max_norm, groups=None, optimizer=None):
        if _kind == "nan" and _mine and _calls["count"] == int(_at):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if not grads:  # optimizer.in_backward: stepped and freed, its norm measured
                optimizer.norm.add(_nan)
            else:
                local = grads[0].to_local() if hasattr(grads[0], "to_local") else grads[0]
                local.view(-1)[0] = float("nan")
        return _clip(model, max_norm, groups, optimizer)

    _step.count_over_ranks, _step.clip_grad_norm = count_over_ranks, clip_grad_norm
    del torch
