"""A DCP checkpoint folder on disk, read safely: its index, its data files, its meta.json.

Before any load, `check_checkpoint_files` reads DCP's `.metadata` and checks
that every data file it points into exists and is long enough, so a truncated
or missing file is named, not a stack trace. Non-tensor entries (optimizer
hyperparameters, loader and RNG states) are read with
`torch.load(weights_only=True)` (`SafeLoadPlanner`): a checkpoint is data,
never code. JSON files (meta.json, an HF folder's config.json) are read by
`read_json`; a failed save or load is described by the first failing rank's
cause (`describe_save_error`, `describe_dcp_error`).
"""

from __future__ import annotations

import errno
import io
import json
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from freetx.errors import CheckpointError, first_line, os_error_in

META_FILE = "meta.json"
FROZEN_FROM = "frozen_from"  # meta.json: the base of a checkpoint without its frozen weights
MODEL_PREFIX = "model."
# DCP raises CheckpointException, a BaseException (not an Exception), for errors on any rank
DCP_ERRORS = (Exception, CheckpointException)


@contextmanager
def quiet_single_process():
    """Silence DCP's warning that it runs without a process group (convert, inspect)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def describe_dcp_error(error: BaseException) -> str:
    """The root cause of a DCP failure: the first failing rank's own exception."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _trace) = sorted(error.failures.items())[0]
        return f"{type(cause).__name__}: {first_line(cause)} (on rank {rank})"
    return first_line(error)


# below this much free space on the disk of a failed save, the disk is taken to be full
FULL_DISK_BYTES = 64 * 2**20


def describe_save_error(error: BaseException, folder: Path) -> str:
    """Why a save into `folder` failed: the OS error in any rank's failure (a full disk,
    a read-only folder; torch.save hides ENOSPC behind "unexpected pos"), else DCP's own
    message, with the free space when the disk holding `folder` is (nearly) full."""
    causes = [error]
    if isinstance(error, CheckpointException):
        causes = [cause for _, (cause, _trace) in sorted(error.failures.items())] + causes
    for cause in causes:
        found = os_error_in(cause)
        if found is not None:
            full = found.errno in (errno.ENOSPC, errno.EDQUOT)
            cause = found.strerror or str(found)
            if full:
                return f"the disk is full ({cause})"
            return f"{found.filename}: {cause}" if found.filename else cause
    message = describe_dcp_error(error)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return message
    if free < FULL_DISK_BYTES:
        return f"{message}; the disk holding it has {free // 2**20} MiB free: it is full"
    return message


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor entries load with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint entry '{read_item.dest_index.fqn}' holds something other than "
                f"tensors, numbers, strings, lists and dicts ({first_line(e)}); freetx does not "
                "unpickle code from checkpoints."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's `.metadata` of a checkpoint folder, or a CheckpointError naming the problem."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; check the path.")
    if not path.is_dir() or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a DCP checkpoint folder (it has no .metadata file). Point at a "
            "folder like <output_dir>/checkpoints/step_000200."
        )
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"the checkpoint index {path / '.metadata'} cannot be read ({first_line(e)}); "
            "the checkpoint is corrupt. Use an earlier one."
        ) from None


def missing_data(path: Path, metadata: Metadata) -> str | None:
    """The first data file DCP's index points into that is missing or too short, or None."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = Path(path) / name
        if not file.is_file():
            return f"file {name} is missing"
        actual = file.stat().st_size
        if actual < size:
            return f"file {name} is truncated ({actual:,} bytes, needs {size:,})"
    return None


def check_checkpoint_files(path: Path) -> Metadata:
    """The checkpoint's metadata, after checking every data file is there and long enough."""
    metadata = read_dcp_metadata(path)
    problem = missing_data(path, metadata)
    if problem:
        raise CheckpointError(
            f"checkpoint {path}: {problem}; the checkpoint is incomplete or corrupt. Use an "
            "earlier one."
        )
    return metadata


def read_json(path: Path, what: str) -> Any:
    """A JSON file freetx or transformers wrote, or a CheckpointError naming it."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} does not exist.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{what} {path} is not valid JSON ({first_line(e)}); it was damaged or hand-edited. "
            "Restore it from a copy, or use another checkpoint."
        ) from None
    except OSError as e:
        raise CheckpointError(f"{what} {path} cannot be read ({e.strerror}).") from None


def read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint folder's meta.json ({} when it has none)."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        return {}
    meta = read_json(meta_path, "checkpoint metadata")
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"checkpoint metadata {meta_path} holds a {type(meta).__name__}, not a JSON object; "
            "it was damaged or hand-edited. Use another checkpoint."
        )
    return meta
