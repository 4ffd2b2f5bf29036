"""How the checkpointer's saves are written (`CheckpointSaver`): each save into
`.tmp_step_N/` by every rank, `WRITE_THREADS` writer threads a rank, each rank's file
digests recorded; once every rank has written, rank 0 adds meta.json (the digests folded
in), renames the folder to `step_N/`, then updates LATEST, and prunes older complete
checkpoints beyond `keep_last`. A save that fails is removed, and its error names the
cause and the checkpoint a resume would start from. With `async_save` the state is
staged into a CPU copy kept between saves and written by a background thread; the next
save (or the end of training) waits for it first.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _write_files_from_queue
from torch.distributed.checkpoint.stateful import Stateful
from torch.futures import Future

from freetx.checkpoint.dcp_folder import (
    CHECKSUMS,
    DCP_ERRORS,
    META_FILE,
    STEP_PREFIX,
    describe_dcp_error,
    describe_save_error,
    fold_checksums,
    step_name,
    step_of,
)
from freetx.checkpoint.run_folder import LATEST_FILE, TMP_PREFIX, is_complete_fast, read_latest
from freetx.checksums import record_rank_checksums
from freetx.distributed.groups import HostGroup
from freetx.errors import CheckpointError, lost_a_peer

WRITE_THREADS = (
    2  # DCP writer threads per rank: 1.3-1.9x a single thread here (benchmarks/checkpoint.py)
)


class _Writer(FileSystemWriter):
    """DCP's file writer, `WRITE_THREADS` threads a rank, whose threads hand a failure to
    the save. DCP's own threads print their traceback and end, and the save goes on
    without their files (a full disk: a traceback per thread, then a failure elsewhere
    that names no cause); here the first failure is raised by the rank's write, which
    DCP reports to every rank."""

    def __init__(self, path: str) -> None:
        super().__init__(path, thread_count=WRITE_THREADS)

    def _write_data(self, planner, file_queue: queue.Queue) -> Future:
        results: queue.Queue = queue.Queue()
        failures: list[BaseException] = []

        def work() -> None:
            try:
                _write_files_from_queue(
                    create_stream=self.fs.create_stream,
                    file_queue=file_queue,
                    result_queue=results,
                    planner=planner,
                    transforms=self.transforms,
                    inflight_threshhold=self.per_thread_copy_ahead,
                    use_fsync=self.sync_files,
                    thread_count=self.thread_count,
                    serialization_format=self.serialization_format,
                )
            except BaseException as e:  # raised below, in the rank's own thread
                failures.append(e)

        threads = [threading.Thread(target=work) for _ in range(1, self.thread_count)]
        for thread in threads:
            thread.start()
        work()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        written: list = []
        while not results.empty():
            written += results.get_nowait()
        # this rank's digests of its files (in the background thread of an async save)
        record_rank_checksums(Path(self.path), [r.storage_data.relative_path for r in written])
        future: Future = Future()
        future.set_result(written)
        return future


class _StagingWriter(_Writer):
    """A DCP writer for async saves that keeps its CPU copy of the state between saves.

    Staging then copies into memory it already has instead of allocating the
    whole state again every time: the loop's blocked time fell from 0.27 to 0.11
    of a synchronous save's (benchmarks/checkpoint.py). DCP's own cache always
    pins memory, which needs CUDA; this one pins only on CUDA.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._staged: dict[str, Any] | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._staged is None:
            self._staged = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self._staged)


class CheckpointSaver:
    """Saves a run's state as step folders of `folder` (`<output_dir>/checkpoints`), on every
    rank: synchronously, or asynchronously with `checkpoint.async_save` (`cfg`: the
    `checkpoint:` section); the `Checkpointer` hands it each save with meta.json's fields."""

    def __init__(self, folder: Path, cfg: Any, rank: int, host: HostGroup) -> None:
        self.dir = folder
        self.cfg = cfg
        self.rank = rank
        self.host = host  # the saves' gloo group, apart from the training loop's collectives
        self._pending: tuple[Any, Path, Path, dict] | None = None
        # async saves reuse one writer, which keeps its CPU copy of the state between saves
        self._async_writer = _StagingWriter(str(self.dir)) if self.cfg.async_save else None

    def latest(self) -> Path | None:
        """The checkpoint LATEST names, when it is there."""
        name, _problem = read_latest(self.dir)
        return self.dir / name if name and is_complete_fast(self.dir / name) else None

    def save(self, step: int, state: dict[str, Stateful], meta: dict[str, Any]) -> None:
        """Save `state` as step `step`, its meta.json holding `meta`; asynchronously when
        configured."""
        self.wait()
        tmp = self.dir / f"{TMP_PREFIX}{step_name(step)}"
        final = self.dir / step_name(step)
        meta = {**meta, "step": step, "saved_at": time.time()}
        try:
            if self._async_writer is not None:
                future = dcp.async_save(
                    state,
                    checkpoint_id=str(tmp),
                    storage_writer=self._async_writer,
                    process_group=self.host.group,
                )
                self._pending = (future, tmp, final, meta)
                return
            writer = _Writer(str(tmp))
            dcp.save(state, storage_writer=writer, process_group=self.host.group)
        except DCP_ERRORS as e:
            self._fail(tmp, step, e)
        self._finalize(tmp, final, meta)

    def wait(self) -> None:
        """Block until an asynchronous save has finished, then make it visible."""
        if self._pending is None:
            return
        future, tmp, final, meta = self._pending
        self._pending = None
        try:
            future.result()
        except DCP_ERRORS as e:
            self._fail(tmp, meta["step"], e)
        self._finalize(tmp, final, meta)

    def _fail(self, tmp: Path, step: int, error: Exception) -> None:
        cause = describe_save_error(error, self.dir)  # before the partial save is removed
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = self.latest()
        untouched = (
            f"Earlier checkpoints are untouched (latest: {latest.name if latest else 'none'})"
        )
        if any(lost_a_peer(e) for e in (error, describe_dcp_error(error), cause)):
            raise CheckpointError(  # the cause is the rank that ended, not this save
                f"saving checkpoint {step_name(step)} to {self.dir} stopped because another "
                f"rank's process ended during the save. {untouched}; the partial save was "
                "removed. Once that rank's cause is fixed, run the same command to resume."
            ) from error
        resume = (
            f"run the same command to resume from {latest.name} (resume=auto)"
            if latest
            else "run the same command again (no checkpoint was saved yet)"
        )
        raise CheckpointError(
            f"saving checkpoint {step_name(step)} to {self.dir} failed: {cause}. {untouched} "
            f"and the incomplete save was removed. Fix the cause (free disk space, fewer kept "
            f"checkpoints with checkpoint.keep_last, or another output_dir), then {resume}."
        ) from error

    def _finalize(self, tmp: Path, final: Path, meta: dict) -> None:
        """Rank 0: meta.json, rename into place, LATEST, prune. Then all ranks agree."""
        if self.rank == 0:
            meta[CHECKSUMS] = fold_checksums(tmp)  # every rank's write has finished
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
            if final.exists():
                # the plan refused a run whose saves would land on a checkpoint it did
                # not write, unless checkpoint.overwrite; so this is that consent
                if not self.cfg.overwrite:
                    raise CheckpointError(
                        f"{final} appeared while this run was training (does another process "
                        f"write into {self.dir}?). It was left as it is; this run's save of "
                        f"the same step is in {tmp}."
                    )
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer = self.dir / f"{TMP_PREFIX}{LATEST_FILE}"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.dir / LATEST_FILE)
            self._prune(meta["step"])
        self.host.barrier()

    def _prune(self, step: int) -> None:
        """Keep the newest `keep_last` complete checkpoints up to `step`; never touch an
        incomplete folder or a later one (neither was written by this run)."""
        if not self.cfg.keep_last:
            return
        complete = sorted(
            (step_of(p.name), p)
            for p in self.dir.glob(f"{STEP_PREFIX}*")
            if step_of(p.name) is not None and step_of(p.name) <= step and is_complete_fast(p)
        )
        for _, old in complete[: max(0, len(complete) - self.cfg.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
