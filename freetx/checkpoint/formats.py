"""Tensor files freetx reads and writes, one tensor at a time.

`open_tensors(path)` gives a `TensorSource` (names, shapes, dtypes, and one
tensor on demand) for a DCP folder, a safetensors file, a torch.save file, or
an HF-style folder. `SafetensorsStreamWriter` writes a safetensors file tensor
by tensor, so converting a large checkpoint never holds more than one tensor
beside the file's header. No process group is needed for any of it.
"""

from __future__ import annotations

import abc
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from freetx.checkpoint.dcp_folder import (
    DCP_ERRORS,
    MODEL_PREFIX,
    DCPReader,
    SafeLoadPlanner,
    check_checkpoint_files,
    check_checksums,
    describe_dcp_error,
    quiet_single_process,
    read_json,
    read_meta,
)
from freetx.errors import CheckpointError
from freetx.models.hf import layout_for_hf_config
from freetx.user_files import as_plain_file

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
MODEL_CONFIG_KEY = "freetx_model_config"
READ_CHUNK = 64 * 2**20  # the largest read buffer when a tensor is cast while read
MODEL_CLASS_KEY = "freetx_model_class"


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


class TensorSource(abc.ABC):
    """Names, shapes and dtypes of a file's tensors; `get(name)` loads one."""

    kind = "?"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.infos: dict[str, TensorInfo] = {}
        self.extras: dict[str, Any] = {}  # non-tensor entries (names only for DCP)
        self.meta: dict[str, Any] = {}  # freetx meta.json, or what the file carries
        self.skipped: list[str] = []  # stored tensors that are not the model's (not read)

    @abc.abstractmethod
    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (a key of `infos`), on the CPU."""

    def read_into(self, name: str, rows: slice | None, out: torch.Tensor) -> None:
        """Fill `out` with tensor `name`, or rows `rows` of its first dimension (formats
        that can read only those bytes, straight into `out`, do)."""
        tensor = self.get(name)
        out.copy_(tensor if rows is None else tensor[rows])

    def model_names(self) -> list[str]:
        """Names of the model's tensors, without the `model.` prefix."""
        return [n[len(MODEL_PREFIX) :] for n in self.infos if n.startswith(MODEL_PREFIX)]

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """The model's tensors (without the `model.` prefix) -> their shapes."""
        return {name: self.infos[MODEL_PREFIX + name].shape for name in self.model_names()}

    def where(self, name: str) -> str:
        """Tensor `name` (a key of `infos`) as stored and the file that holds it, for
        messages: `NAME in FILE`."""
        return f"{name.removeprefix(MODEL_PREFIX)} in {self.path}"

    def model_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.model_names():
            yield name, self.get(MODEL_PREFIX + name)

    @property
    def model_config(self) -> dict[str, Any] | None:
        return self.meta.get("model_config")


class DCPSource(TensorSource):
    """A DCP checkpoint folder: its index (`.metadata`, every data file it points into
    checked) and its meta.json; `metadata` and `meta`: both, when already read and
    checked (a run folder's survey)."""

    kind = "dcp"

    def __init__(
        self, path: Path, metadata: Metadata | None = None, meta: dict | None = None
    ) -> None:
        super().__init__(path)
        opened = metadata is None  # by its path, not by a run folder's survey
        if metadata is None:
            metadata = check_checkpoint_files(self.path)
        self.index = metadata
        self._verified = False
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                self.infos[key] = TensorInfo(tuple(entry.size), entry.properties.dtype)
            elif isinstance(entry, BytesStorageMetadata):
                self.extras[key] = None
        self.meta = read_meta(self.path) if meta is None else meta
        if opened:
            self.verify()

    def verify(self) -> None:
        """Refuse it when a file is not what was saved (`check_checksums`: every byte read
        once). A survey's checkpoints are verified by whoever picks one."""
        if not self._verified:
            check_checksums(self.path, self.index, self.meta)
            self._verified = True

    def get(self, name: str) -> torch.Tensor:
        info = self.infos[name]
        out = {name: torch.empty(info.shape, dtype=info.dtype)}
        self._load(out)
        return out[name]

    def get_extra(self, name: str) -> Any:
        out: dict[str, Any] = {name: None}
        self._load(out)
        return out[name]

    def _load(self, state: dict[str, Any]) -> None:
        try:
            with quiet_single_process():
                dcp.load(
                    state,
                    storage_reader=DCPReader(str(self.path)),
                    planner=SafeLoadPlanner(),
                    no_dist=True,
                )
        except CheckpointError:
            raise
        except DCP_ERRORS as e:
            raise CheckpointError(
                f"reading {', '.join(state)} from checkpoint {self.path} failed ({describe_dcp_error(e)}); "
                "its files may be corrupt."
            ) from e


class SafetensorsFile:
    """One .safetensors file, read without mmap: the header at open, then any tensor, or
    any rows of one, with a positioned read of just its bytes. So a rank that needs a
    slice of a tensor reads that slice and holds nothing else (mmap'd pages would count
    in its resident memory)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                if size > 100 * 2**20:
                    raise ValueError(f"header of {size:,} bytes")
                header = json.loads(f.read(size))
            self.data_start = 8 + size
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            self.entries: dict[str, tuple[TensorInfo, int, int]] = {}
            for name, entry in header.items():
                begin, end = entry["data_offsets"]
                info = TensorInfo(tuple(entry["shape"]), _dtype_from_safetensors(entry["dtype"]))
                if end - begin != info.nbytes:
                    raise ValueError(f"tensor {name} has {end - begin} bytes for {info.nbytes}")
                self.entries[name] = (info, begin, end)
        except CheckpointError:
            raise
        except OSError as e:
            raise CheckpointError(f"{self.path} cannot be read ({e.strerror}).") from None
        except Exception as e:
            raise CheckpointError(
                f"{self.path} is not a readable safetensors file ({describe_dcp_error(e)})."
            ) from None
        file_size = self.path.stat().st_size
        needed = self.data_start + max((end for _, _, end in self.entries.values()), default=0)
        if file_size < needed:
            raise CheckpointError(
                f"{self.path} is truncated ({file_size:,} bytes, its header needs {needed:,}); "
                "copy it again from its source."
            )

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor `name`, or only rows `rows` of its first dimension, as a new CPU tensor."""
        info = self.entries[name][0]
        shape = list(info.shape)
        if rows is not None and shape:
            shape[0] = len(range(*rows.indices(shape[0])))
        out = torch.empty(shape, dtype=info.dtype)
        self.read_into(name, rows, out)
        return out

    def read_into(self, name: str, rows: slice | None, out: torch.Tensor) -> None:
        """Fill `out` with tensor `name` (or rows `rows` of it), cast to out's dtype. The
        bytes go straight into `out` when the dtypes match, else through a buffer of at
        most READ_CHUNK bytes: reading never holds a second copy of what it reads."""
        info, begin, _ = self.entries[name]
        shape = info.shape
        row_bytes = info.nbytes // shape[0] if shape and shape[0] else info.nbytes
        start, stop = (0, shape[0] if shape else 1) if rows is None else rows.indices(shape[0])[:2]
        if out.numel() == 0:  # a shard of no rows (a [1, H] gate's on the second rank)
            return
        target = out.reshape(max(stop - start, 0), -1) if shape else out.reshape(1, -1)
        direct = out.dtype == info.dtype and out.is_contiguous() and out.device.type == "cpu"
        step = max(1, READ_CHUNK // max(row_bytes, 1))
        with open(self.path, "rb") as f:
            for first in range(start, stop, step):
                last = min(stop, first + step)
                count = (last - first) * row_bytes
                f.seek(self.data_start + begin + first * row_bytes)
                if direct:
                    view = target[first - start : last - start].view(torch.uint8).reshape(-1)
                else:
                    view = torch.empty(count, dtype=torch.uint8)
                if f.readinto(view.numpy()) != count:
                    raise CheckpointError(
                        f"{self.path}: tensor {name} is cut short; the file is damaged."
                    )
                if not direct:
                    chunk = view.view(info.dtype).reshape(last - first, -1)
                    target[first - start : last - start].copy_(chunk)


class SafetensorsSource(TensorSource):
    """One or several safetensors files (an HF folder's shards), tensors by name.

    `rename(stored)` names each stored tensor: a name, None (skipped), `(name, i)`:
    slice i along dim 0 of tensor `name`, stacked from several stored tensors (an HF
    folder's per-expert weights; the layout says which, `HFLayout.stack_index`), or
    `(name, i, p)`: part p of slice i, a slice's parts joined along its first dim in
    order (an expert's gate and up projections, held as one)."""

    kind = "safetensors"

    def __init__(self, path: Path, files: list[Path] | None = None, rename=None) -> None:
        super().__init__(path)
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        # a stacked tensor: per slice, its parts in order
        self._stacks: dict[str, list[list[tuple[SafetensorsFile, str]]]] = {}
        slices: dict[str, dict[int, dict[int, tuple[SafetensorsFile, str]]]] = {}
        for file in [SafetensorsFile(f) for f in (files or [Path(path)])]:
            for stored, (info, _, _) in file.entries.items():
                name = rename(stored) if rename else MODEL_PREFIX + stored
                if isinstance(name, tuple):
                    part = name[2] if len(name) > 2 else 0
                    slices.setdefault(name[0], {}).setdefault(name[1], {})[part] = (file, stored)
                elif name is not None:
                    self.infos[name] = info
                    self._where[name] = (file, stored)
            if MODEL_CONFIG_KEY in file.metadata:
                self.meta["model_config"] = json.loads(file.metadata[MODEL_CONFIG_KEY])
            if MODEL_CLASS_KEY in file.metadata:
                self.meta["model_class"] = file.metadata[MODEL_CLASS_KEY]
        for name, rows in slices.items():
            count = max(len(row) for row in rows.values())  # the parts of each slice
            stack = []
            for i in _complete_stack(name, rows, self.path):
                order = _complete_stack(f"{name} (slice {i}'s parts)", rows[i], self.path, count)
                stack.append([rows[i][p] for p in order])
            self._stacks[name] = stack
            self.infos[name] = _stacked_info(name, self._stacks[name], self.path)

    def get(self, name: str) -> torch.Tensor:
        info = self.infos[name]
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(name, None, out)
        return out

    def where(self, name: str) -> str:
        file, stored = self._where[name] if name in self._where else self._stacks[name][0][0]
        return f"{stored} in {file.path}"

    def read_into(self, name: str, rows: slice | None, out: torch.Tensor) -> None:
        if name not in self._stacks:
            file, stored = self._where[name]
            file.read_into(stored, rows, out)
            return
        stack = self._stacks[name]  # rows of a stacked tensor: whole stored tensors, each
        for row, index in enumerate(range(*(rows or slice(None)).indices(len(stack)))):
            offset = 0  # its parts one after the other along its first dim
            for file, stored in stack[index]:
                size = file.entries[stored][0].shape[0] if len(stack[index]) > 1 else None
                target = out[row] if size is None else out[row][offset : offset + size]
                file.read_into(stored, None, target)
                offset += size or 0


def _complete_stack(name: str, parts: dict[int, Any], path: Path, count: int = 0) -> range:
    """The slice indices 0..n-1 of a stacked tensor (n at least `count`), or an error
    naming the missing ones."""
    total = max(max(parts) + 1, count)
    missing = sorted(set(range(total)) - set(parts))
    if missing:
        raise CheckpointError(
            f"{path} lacks slices {missing[:5]} of {name.removeprefix(MODEL_PREFIX)} (it has "
            f"{len(parts)} of {total}: one file per expert is missing); the download "
            "or copy is incomplete, fetch it again."
        )
    return range(len(parts))


def _stacked_info(
    name: str, rows: list[list[tuple[SafetensorsFile, str]]], path: Path
) -> TensorInfo:
    """The shape and dtype of a tensor stacked from `rows` (each row's parts joined along
    their first dim), which must all agree."""
    infos = {tuple(file.entries[stored][0] for file, stored in parts) for parts in rows}
    parts = next(iter(infos))
    if len(infos) > 1 or any(
        (p.shape[1:], p.dtype) != (parts[0].shape[1:], parts[0].dtype) for p in parts
    ):
        shapes = {str((list(p.shape), p.dtype)) for row in infos for p in row}
        raise CheckpointError(
            f"{path}: the slices of {name.removeprefix(MODEL_PREFIX)} differ in shape or dtype "
            f"({', '.join(sorted(shapes))}); every expert's tensor must have the same; the "
            "folder is damaged."
        )
    if len(parts) == 1:
        return TensorInfo((len(rows), *parts[0].shape), parts[0].dtype)
    joined = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    return TensorInfo((len(rows), *joined), parts[0].dtype)


class TorchSource(TensorSource):
    kind = "torch"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointError(
                f"{path} cannot be read as a torch.save file with weights_only=True "
                f"({describe_dcp_error(e)}); freetx reads data, never code."
            ) from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path} holds a {type(data).__name__}, not a dict of tensors.")
        prefixed = any(str(k).startswith(MODEL_PREFIX) for k in data)
        self._tensors: dict[str, torch.Tensor] = {}
        for key, value in data.items():
            name = str(key) if prefixed else MODEL_PREFIX + str(key)
            if torch.is_tensor(value):
                self._tensors[name] = value
                self.infos[name] = TensorInfo(tuple(value.shape), value.dtype)
            else:
                self.extras[name] = value

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


class HFFolderSource(SafetensorsSource):
    """A model folder as transformers writes it: config.json, and model.safetensors or
    shards listed in model.safetensors.index.json, read through the HF layout of the
    model its `model_type` names (freetx.models.hf)."""

    kind = "hf"

    def __init__(self, path: Path) -> None:
        folder = Path(path)
        hf = read_json(folder / "config.json", "HF model config")
        if not isinstance(hf, dict):
            raise CheckpointError(
                f"{folder / 'config.json'} is not a JSON object of model settings."
            )
        layout = layout_for_hf_config(hf)
        tied = bool(hf.get("tie_word_embeddings", False))

        def rename(stored: str) -> str | tuple | None:
            if tied and stored == "lm_head.weight":  # a copy of the embedding some folders keep
                return None
            name = layout.from_hf_name(stored)
            if name is None:  # not a weight of the model: a buffer, another modality's
                self.skipped.append(stored)
                return None
            index = layout.stack_index(stored)
            if index is None:
                return MODEL_PREFIX + name
            return (
                (MODEL_PREFIX + name, *index)
                if isinstance(index, tuple)
                else (MODEL_PREFIX + name, index)
            )

        super().__init__(folder, hf_weight_files(folder), rename=rename)
        self.meta["model_class"] = layout.model_class
        self.layout, self.hf_config = layout, hf

    @property
    def model_config(self) -> dict[str, Any]:
        """The model's config fields, read when asked (loading weights into a model built
        from the same folder does not need them; a conversion does, and refuses what
        freetx cannot compute)."""
        return self.layout.from_hf_config(self.hf_config)


def skipped_note(source: TensorSource) -> list[str]:
    """What of a source is not read (a multimodal folder's vision tower), by its first name
    part, as a line for the user; [] when everything is."""
    if not source.skipped:
        return []
    parts: dict[str, int] = {}
    for name in source.skipped:
        parts[name.split(".")[0]] = parts.get(name.split(".")[0], 0) + 1
    listed = ", ".join(f"{part}.* ({count})" for part, count in parts.items())
    return [
        f"Not read from {source.path}: {len(source.skipped)} tensors that are not weights of "
        f"the model freetx reads from it: {listed}."
    ]


def hf_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder: the shards its index names, or the one file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "safetensors index")
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise CheckpointError(f"{index} has no weight_map; it is not a safetensors index.")
        names = sorted(set(weight_map["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names {len(missing)} shard(s) that are not in the folder: "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}. The download or "
                "copy is incomplete; fetch the missing files."
            )
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return files
    if not files:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pth")
        )
        hint = (
            f" It has {', '.join(others[:3])}: freetx reads weights as safetensors only (data, "
            "never pickled code); re-save the folder with transformers' save_pretrained "
            "(safe_serialization is its default)."
            if others
            else ""
        )
        raise CheckpointError(f"HF folder {folder} holds no .safetensors weights.{hint}")
    raise CheckpointError(
        f"HF folder {folder} holds {len(files)} .safetensors files but no "
        "model.safetensors.index.json saying which tensors each holds; restore the index."
    )


def open_tensors(path: str | Path) -> TensorSource:
    """The right reader for a DCP folder, HF folder, .safetensors or torch file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; check the path.")
    if path.is_dir():
        if (path / ".metadata").is_file():
            return DCPSource(path)
        if (path / "config.json").is_file():
            return HFFolderSource(path)
        raise CheckpointError(
            f"{path} is a folder but neither a DCP checkpoint (.metadata) nor an HF model "
            "folder (config.json + model.safetensors or shards with their index)."
        )
    if path.suffix == ".safetensors":
        return SafetensorsSource(path)
    return TorchSource(path)


def _dtype_from_safetensors(name: str) -> torch.dtype:
    for dtype, code in SAFETENSORS_DTYPES.items():
        if code == name:
            return dtype
    raise CheckpointError(f"safetensors dtype {name} is not supported.")


def save_tensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """safetensors' save_file, the file then given the permissions of the files beside it
    (`as_plain_file`: save_file leaves it 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    as_plain_file(path)


class SafetensorsStreamWriter:
    """Write a safetensors file one tensor at a time (header first, then the data)."""

    def __init__(self, path: Path, infos: dict[str, TensorInfo], metadata: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self.order = list(infos)
        for name in self.order:
            info = infos[name]
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self.infos = infos
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self._next]
        if name != expected:
            raise ValueError(
                f"tensors must be written in header order: expected {expected}, got {name}"
            )
        info = self.infos[name]
        tensor = tensor.detach().to("cpu", info.dtype).contiguous()
        self._file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)  # no copy
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self.order):
            raise ValueError(
                f"{self.path}: {len(self.order) - self._next} tensors were not written"
            )
