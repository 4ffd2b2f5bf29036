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
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from freetx.checkpoint.files import (
    DCP_ERRORS,
    MODEL_PREFIX,
    SafeLoadPlanner,
    check_checkpoint_files,
    describe_dcp_error,
    quiet_single_process,
    read_json,
    read_meta,
)
from freetx.errors import CheckpointError
from freetx.models.hf import layout_for_hf_config

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
MODEL_CONFIG_KEY = "freetx_model_config"
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

    @abc.abstractmethod
    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (a key of `infos`), on the CPU."""

    def model_names(self) -> list[str]:
        """Names of the model's tensors, without the `model.` prefix."""
        return [n[len(MODEL_PREFIX) :] for n in self.infos if n.startswith(MODEL_PREFIX)]

    def model_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.model_names():
            yield name, self.get(MODEL_PREFIX + name)

    @property
    def model_config(self) -> dict[str, Any] | None:
        return self.meta.get("model_config")


class DCPSource(TensorSource):
    kind = "dcp"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        metadata = check_checkpoint_files(self.path)
        for key, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                self.infos[key] = TensorInfo(tuple(meta.size), meta.properties.dtype)
            elif isinstance(meta, BytesStorageMetadata):
                self.extras[key] = None
        self.meta = read_meta(self.path)

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
                    state, checkpoint_id=str(self.path), planner=SafeLoadPlanner(), no_dist=True
                )
        except CheckpointError:
            raise
        except DCP_ERRORS as e:
            raise CheckpointError(
                f"reading {', '.join(state)} from checkpoint {self.path} failed ({describe_dcp_error(e)}); "
                "its files may be corrupt."
            ) from e


class SafetensorsSource(TensorSource):
    kind = "safetensors"

    def __init__(self, path: Path, rename=None) -> None:
        super().__init__(path)
        from safetensors import safe_open

        try:
            self._file = safe_open(str(path), framework="pt")
        except Exception as e:
            raise CheckpointError(
                f"{path} is not a readable safetensors file ({describe_dcp_error(e)})."
            ) from None
        self._names: dict[str, str] = {}
        for stored in self._file.keys():
            name = rename(stored) if rename else MODEL_PREFIX + stored
            sliced = self._file.get_slice(stored)
            dtype = _dtype_from_safetensors(sliced.get_dtype())
            self.infos[name] = TensorInfo(tuple(sliced.get_shape()), dtype)
            self._names[name] = stored
        file_meta = self._file.metadata() or {}
        if MODEL_CONFIG_KEY in file_meta:
            self.meta["model_config"] = json.loads(file_meta[MODEL_CONFIG_KEY])
        if MODEL_CLASS_KEY in file_meta:
            self.meta["model_class"] = file_meta[MODEL_CLASS_KEY]

    def get(self, name: str) -> torch.Tensor:
        return self._file.get_tensor(self._names[name])


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
    """An HF-style folder: config.json + model.safetensors, read through the HF layout of
    the model its `model_type` names (freetx.models.hf)."""

    kind = "hf"

    def __init__(self, path: Path) -> None:
        folder = Path(path)
        hf = read_json(folder / "config.json", "HF model config")
        if not isinstance(hf, dict):
            raise CheckpointError(
                f"{folder / 'config.json'} is not a JSON object of model settings."
            )
        layout = layout_for_hf_config(hf)
        files = sorted(folder.glob("*.safetensors"))
        if len(files) != 1:
            raise CheckpointError(
                f"HF folder {folder} must hold exactly one .safetensors file (found {len(files)}); "
                "sharded HF checkpoints are not supported yet."
            )
        super().__init__(files[0], rename=lambda n: MODEL_PREFIX + layout.from_hf_name(n))
        self.path = folder
        self.meta["model_class"] = layout.model_class
        self.meta["model_config"] = layout.from_hf_config(hf)


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
            f"{path} is a folder but neither a DCP checkpoint (.metadata) nor an HF-style "
            "folder (config.json + model.safetensors)."
        )
    if path.suffix == ".safetensors":
        return SafetensorsSource(path)
    return TorchSource(path)


def _dtype_from_safetensors(name: str) -> torch.dtype:
    for dtype, code in SAFETENSORS_DTYPES.items():
        if code == name:
            return dtype
    raise CheckpointError(f"safetensors dtype {name} is not supported.")


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
