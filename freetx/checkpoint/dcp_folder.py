"""A DCP checkpoint folder on disk, read safely: its index, its data files, its meta.json.

Before any load, `check_checkpoint_files` reads DCP's `.metadata` and checks
that every data file it points into exists and is long enough, so a truncated
or missing file is named, not a stack trace. Non-tensor entries (optimizer
hyperparameters, loader and RNG states) are read with
`torch.load(weights_only=True)` (`SafeLoadPlanner`), and DCP's `.metadata` (a
pickle) by `DCPReader`, whose unpickler admits DCP's index classes, torch sizes and
dtypes and plain containers only: a checkpoint is data, never code. JSON files (meta.json, an HF folder's config.json) are read by
`read_json`; a failed save or load is described by the first failing rank's
cause (`describe_save_error`, `describe_dcp_error`).
"""

from __future__ import annotations

import errno
import io
import json
import pickle
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from freetx.checksums import check_files, fold_rank_checksums, recorded
from freetx.errors import CheckpointError, first_line, os_error_in

STEP_PREFIX = "step_"
_STEP_NAME = re.compile(rf"^{STEP_PREFIX}(\d+)$")
META_FILE = "meta.json"
FROZEN_FROM = "frozen_from"  # meta.json: the base of a checkpoint without its frozen weights
MODEL_PREFIX = "model."
# meta.json: {"sha256": {file: digest}}, every data file and .metadata as saved
# (freetx.checksums; each rank records its own files' with `record_rank_checksums`)
CHECKSUMS = "checksums"
# DCP raises CheckpointException, a BaseException (not an Exception), for errors on any rank
DCP_ERRORS = (Exception, CheckpointException)


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def step_of(name: str) -> int | None:
    """The step a folder name like `step_000200` stands for, or None."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


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


# what DCP's `.metadata` pickle may name besides its own index classes (its module's
# classes): torch's sizes, dtypes, layouts and memory formats, paths, plain containers
_METADATA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePath",
                                     "PurePosixPath", "PureWindowsPath")),
    *(("builtins", name) for name in ("set", "frozenset", "dict", "list", "tuple", "bytes",
                                      "bytearray", "int", "float", "complex", "bool", "str",
                                      "slice")),
}  # fmt: skip


class NotDCPMetadata(CheckpointError):
    """A `.metadata` file whose pickle names something DCP's index never holds."""

    def __init__(self, file: str, named: str) -> None:
        self.reason = f"its pickle names {named}"
        super().__init__(
            f"{file} is not a DCP metadata file: {self.reason}, which DCP's index never holds "
            "(a planted file runs code when unpickled), so freetx did not read it. Do not use "
            "this checkpoint; use another one, or one you saved yourself."
        )


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream: Any, file: str) -> None:
        super().__init__(stream)
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        elif (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise NotDCPMetadata(self.file, f"{module}.{name}")


class DCPReader(FileSystemReader):
    """DCP's file reader, but `.metadata` is unpickled admitting only what DCP's index holds
    (`_MetadataUnpickler`); every read of a DCP folder (the index, `dcp.load`) uses it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        file = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream, str(file)).load()
        if not isinstance(metadata, Metadata):
            raise NotDCPMetadata(str(file), f"a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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
        return DCPReader(str(path)).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"the checkpoint index {path / '.metadata'} cannot be read ({first_line(e)}); "
            "the checkpoint is corrupt. Use an earlier one."
        ) from None


def fold_checksums(folder: Path) -> dict[str, dict[str, str]]:
    """Every rank's digests (`record_rank_checksums`) and .metadata's, for meta.json; the
    rank files are removed. Call it once every rank's write has finished (DCP's index is
    written after all of them)."""
    return fold_rank_checksums(folder, [".metadata"])


def has_checksums(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint's meta.json records its files' checksums (freetx has since
    November 2026; a meta.json may have lost them to an edit)."""
    return recorded(meta.get(CHECKSUMS)) is not None


def earlier_checkpoint(path: Path) -> Path | None:
    """The newest checkpoint saved before `path` beside it (both files a finished save
    writes are there), or None."""
    step = step_of(Path(path).name)
    if step is None or not Path(path).parent.is_dir():
        return None
    earlier = [
        (step_of(p.name), p)
        for p in Path(path).parent.iterdir()
        if (step_of(p.name) or step) < step
        and (p / ".metadata").is_file()
        and (p / META_FILE).is_file()
    ]
    return max(earlier)[1] if earlier else None


def check_checksums(path: Path, metadata: Metadata, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint a file of which is not what was saved (its digest in meta.json
    differs), naming the file and an earlier checkpoint. One saved without digests (before
    freetx recorded them) is read as it is, but a resume refuses it unless told
    (`unverifiable`)."""
    if not has_checksums(meta):
        return
    names = {".metadata", *(i.relative_path for i in (metadata.storage_data or {}).values())}
    earlier = earlier_checkpoint(path)
    fix = (
        f"Use the earlier checkpoint {earlier} (to resume from it, move {Path(path).name} "
        f"out of {Path(path).parent}, or resume={earlier} checkpoint.overwrite=true)."
        if earlier
        else "Use another checkpoint, or restore this one from a copy."
    )
    check_files(
        path, meta[CHECKSUMS], names, "checkpoint", META_FILE,
        "corrupted weights or optimizer state", fix, CheckpointError,
    )  # fmt: skip


def unverifiable(path: Path) -> CheckpointError:
    """A resume of a checkpoint whose meta.json records no checksums (`has_checksums`)."""
    return CheckpointError(
        f"checkpoint {path} cannot be verified: its {META_FILE} records no checksums of its "
        "files (freetx saved none before November 2026, or the file was edited), so a "
        "damaged byte in it would be resumed from without a word. If you trust it, resume "
        "with checkpoint.resume_unverified=true (the checkpoints this run saves have "
        "checksums); else resume from another checkpoint (resume=PATH)."
    )


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
