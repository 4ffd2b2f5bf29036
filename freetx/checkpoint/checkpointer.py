"""The checkpointer every recipe uses: DCP sharded saves, atomic, resumable.

    <output_dir>/checkpoints/
      step_000200/          a complete DCP checkpoint (every rank wrote its shards)
        .metadata           DCP's index of every tensor
        __0_0.distcp ...    one data file per rank
        meta.json           freetx version, step, world size, strategy, model class,
                            model config and its hash
      LATEST                the name of the newest complete checkpoint

A save writes to `.tmp_step_000200/`; only when every rank has finished
(DCP's final metadata write is collective) does rank 0 add meta.json, rename
the folder to `step_000200/` and then update LATEST. A rank that dies during a
save leaves only a `.tmp_*` folder (removed at the next start): LATEST still
names the previous checkpoint, which is untouched. Older complete checkpoints
beyond `keep_last` are pruned. With `async_save`, DCP copies the state to CPU
memory (a copy kept between saves: one more copy of the state per rank),
training goes on, and a background thread writes; the next save (or the end
of training) waits for it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.stateful import Stateful

import freetx
from freetx.checkpoint.files import (
    DCP_ERRORS,
    META_FILE,
    SafeLoadPlanner,
    check_checkpoint_files,
    check_model_matches,
    describe_dcp_error,
)
from freetx.checkpoint.state import PerRankState
from freetx.errors import CheckpointError

LATEST_FILE = "LATEST"
WRITE_THREADS = (
    2  # DCP writer threads per rank: 1.3-1.9x a single thread here (benchmarks/checkpoint.py)
)
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"


@dataclass
class CheckpointConfig:
    """The `checkpoint:` section."""

    every_n_steps: int = 0  # 0: no periodic saves (only the final one, if save_final)
    keep_last: Optional[int] = None  # None: keep every checkpoint
    async_save: bool = False
    save_final: bool = True
    initial_weights: Optional[str] = None  # safetensors file, DCP folder or HF folder


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def config_hash(model_config: dict[str, Any]) -> str:
    """A short, stable hash of a model's shape (what decides whether weights fit)."""
    text = json.dumps(model_config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _StagingWriter(FileSystemWriter):
    """A DCP writer for async saves that keeps its CPU copy of the state between saves.

    Staging then copies into memory it already has instead of allocating the
    whole state again every time: the loop's blocked time fell from 0.27 to 0.11
    of a synchronous save's (benchmarks/checkpoint.py). DCP's own cache always
    pins memory, which needs CUDA; this one pins only on CUDA.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path, thread_count=WRITE_THREADS)
        self._staged: dict[str, Any] | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._staged is None:
            self._staged = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self._staged)


class Checkpointer:
    """Saves and loads the Stateful objects of a run; one instance per run, on every rank."""

    def __init__(self, output_dir: str, cfg: CheckpointConfig, rank: int, meta: dict[str, Any]):
        self.dir = Path(output_dir) / "checkpoints"
        self.cfg = cfg
        self.rank = rank
        self.meta = meta
        # a separate gloo group: background (async) writes must not interleave with
        # the training loop's collectives on the default group
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: tuple[Any, Path, Path, dict] | None = None
        # async saves reuse one writer, which keeps its CPU copy of the state between saves
        self._async_writer = _StagingWriter(str(self.dir)) if cfg.async_save else None
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)  # a save that never finished

    # -- finding checkpoints -------------------------------------------------
    def latest(self) -> Path | None:
        """The newest complete checkpoint of this run, or None."""
        pointer = self.dir / LATEST_FILE
        if not pointer.is_file():
            return None
        path = self.dir / pointer.read_text().strip()
        return path if (path / ".metadata").is_file() else None

    def resolve_resume(self, resume: str) -> Path | None:
        """`auto` -> LATEST or None; `never` -> None; otherwise a checkpoint path."""
        if resume == "auto":
            return self.latest()
        if resume == "never":
            latest = self.latest()
            if latest is not None:
                raise CheckpointError(
                    f"resume=never, but {self.dir} already holds checkpoints (latest: "
                    f"{latest.name}) that new saves would replace. Continue them with "
                    "resume=auto, or pick another output_dir.",
                )
            return None
        path = Path(resume).expanduser()
        check_checkpoint_files(path)
        return path

    def restore(
        self, resume: str, state: dict[str, Stateful], model, initial_weights: str | None
    ) -> str | None:
        """Resume (`resume`: auto | never | path), else load initial weights, else nothing.

        Returns a line for the log, or None when training starts from scratch.
        """
        path = self.resolve_resume(resume)
        if path is not None:
            saved = self.load(path, state, model=model)
            return (
                f"resumed from {path} (step {state['train'].step}, saved at world size "
                f"{saved.get('world_size', '?')} with {saved.get('strategy', '?')})"
            )
        if initial_weights:
            from freetx.checkpoint.convert import load_initial_weights

            load_initial_weights(model, initial_weights)
            return f"initial weights from {initial_weights}"
        return None

    # -- loading --------------------------------------------------------------
    def load(self, path: Path, state: dict[str, Stateful], model=None) -> dict[str, Any]:
        """Load `state` in place from a checkpoint; returns its meta.json (or {})."""
        metadata = check_checkpoint_files(path)
        if model is not None and "model" in state:
            check_model_matches(metadata, model, path)
        for key, value in state.items():
            if isinstance(value, PerRankState):
                own = f"{key}.rank_{value.rank}"
                value.source_rank = value.rank if own in metadata.state_dict_metadata else 0
        try:
            dcp.load(state, checkpoint_id=str(path), planner=SafeLoadPlanner())
        except CheckpointError:
            raise
        except DCP_ERRORS as e:
            raise CheckpointError(
                f"loading checkpoint {path} failed: {describe_dcp_error(e)}. Its files may be "
                "truncated or corrupt; resume from an earlier checkpoint (resume=PATH)."
            ) from e
        meta_path = path / META_FILE
        return json.loads(meta_path.read_text()) if meta_path.is_file() else {}

    # -- saving ----------------------------------------------------------------
    def save(self, step: int, state: dict[str, Stateful], extra_meta: dict[str, Any]) -> None:
        """Save `state` as step `step`; asynchronously when configured."""
        self.wait()
        tmp = self.dir / f"{TMP_PREFIX}{step_name(step)}"
        final = self.dir / step_name(step)
        meta = {**self.meta, **extra_meta, "step": step, "saved_at": time.time()}
        try:
            if self._async_writer is not None:
                future = dcp.async_save(
                    state, checkpoint_id=str(tmp), storage_writer=self._async_writer,
                    process_group=self.group,
                )  # fmt: skip
                self._pending = (future, tmp, final, meta)
                return
            writer = FileSystemWriter(str(tmp), thread_count=WRITE_THREADS)
            dcp.save(state, storage_writer=writer, process_group=self.group)
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
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = self.latest()
        raise CheckpointError(
            f"saving checkpoint {step_name(step)} to {self.dir} failed: {describe_dcp_error(error)}. "
            f"Earlier checkpoints are untouched (latest: {latest.name if latest else 'none'}); "
            "fix the cause (disk space, permissions) and resume with resume=auto."
        ) from error

    def _finalize(self, tmp: Path, final: Path, meta: dict) -> None:
        """Rank 0: meta.json, rename into place, LATEST, prune. Then all ranks agree."""
        if self.rank == 0:
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
            if final.exists():  # the same step from an abandoned timeline
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer = self.dir / f"{TMP_PREFIX}{LATEST_FILE}"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.dir / LATEST_FILE)
            self._prune(keep=final)
        if self.group is not None:
            dist.barrier(group=self.group)

    def _prune(self, keep: Path) -> None:
        if not self.cfg.keep_last:
            return
        complete = sorted(p for p in self.dir.glob(f"{STEP_PREFIX}*") if p.is_dir())
        for old in complete[: max(0, len(complete) - self.cfg.keep_last)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def build_meta(model, model_config: dict[str, Any], world_size: int, strategy: str) -> dict:
    """The fields meta.json records about a run."""
    cls = type(model)
    model_class = getattr(cls, "__wrapped_class__", None) or _original_class(cls)
    return {
        "freetx_version": freetx.__version__,
        "world_size": world_size,
        "strategy": strategy,
        "model_class": f"{model_class.__module__}.{model_class.__qualname__}",
        "model_config": model_config,
        "model_config_hash": config_hash(model_config),
    }


def _original_class(cls: type) -> type:
    """FSDP2 makes `FSDP<Class>` subclasses; name the model's own class."""
    for base in cls.__mro__:
        if (
            not base.__name__.startswith("FSDP")
            and base.__module__ != "torch.nn.parallel.distributed"
        ):
            return base
    return cls
