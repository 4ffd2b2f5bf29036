"""A shard cache: data made once by all ranks together, one safetensors shard each, reused.

    <root>/<prefix>_<hash of the settings>/
      shard_00000.safetensors ...   one per rank that made the data
      metadata.json                 written last, by rank 0: the set is complete

Data that is costly to make (learning histories, model activations) is made
once, split across the ranks, and found again by later runs with the same
settings: the folder name is a hash of them, so other settings never read a
stale set. A set without metadata.json is incomplete (an interrupted run) and
is made again; a damaged shard is named with the fix.

Each rank hashes the shard it wrote (`freetx.checksums`) and metadata.json records
them all; `load` hashes every shard once before reading it and refuses one whose bytes
changed, as a checkpoint's are refused. A set an earlier freetx made without checksums
is not complete: it is made again (said on the console), since trusting it unverified is
what the checksums end, and a remade set is what deleting it by hand would give.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from freetx.checksums import check_files, fold_rank_checksums, record_rank_checksums, recorded
from freetx.errors import DataError

METADATA_FILE = "metadata.json"


class ShardCache:
    """The shards of one data set in one folder (see the module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    @classmethod
    def for_settings(cls, root: str | Path, prefix: str, settings: dict[str, Any]) -> ShardCache:
        """The cache of data made with `settings` (any JSON-able dict) under `root`."""
        text = json.dumps(settings, sort_keys=True, default=str)
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        return cls(Path(root) / f"{prefix}_{digest}")

    def complete(self) -> bool:
        """Whether a whole set is there, with its checksums (one an earlier freetx made
        without them is made again: `build`)."""
        made = self.made()
        return made is not None and recorded(made.get("checksums")) is not None

    def made(self) -> dict[str, Any] | None:
        """metadata.json of a finished set (by this freetx or an earlier one), or None."""
        path = self.folder / METADATA_FILE
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise self._unreadable(error) from None

    def _unreadable(self, error: Exception) -> DataError:
        return DataError(
            f"The data cached in {self.folder} cannot be read ({type(error).__name__}: "
            f"{error}). Delete that folder and run again: it is made again."
        )

    def shard_path(self, rank: int) -> Path:
        return self.folder / f"shard_{rank:05d}.safetensors"

    def build(
        self,
        rank: int,
        world_size: int,
        make_shard: Callable[[], dict[str, Any]],
        metadata: dict[str, Any],
        barrier: Callable[[], None],
    ) -> None:
        """Every rank calls it: make and write this rank's shard (numpy arrays, or torch
        tensors, e.g. bf16) and its checksum, wait for all of them, then rank 0 writes
        metadata.json (the set is complete), and all wait again."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if rank == 0 and self.made() is not None:  # an earlier freetx's, without checksums
            print(
                f"{self.folder} was made by an earlier freetx, without checksums; making it again",
                file=sys.stderr,
                flush=True,
            )
        shard = make_shard()
        if all(isinstance(v, np.ndarray) for v in shard.values()):
            from safetensors.numpy import save_file
        else:
            from safetensors.torch import save_file
        save_file(shard, str(self.shard_path(rank)))
        record_rank_checksums(self.folder, [self.shard_path(rank).name])
        barrier()
        if rank == 0:
            record = {
                **metadata,
                "shards": [self.shard_path(r).name for r in range(world_size)],
                "checksums": fold_rank_checksums(self.folder),
            }
            tmp = self.folder / f".{METADATA_FILE}"
            tmp.write_text(json.dumps(record, indent=2))
            tmp.replace(self.folder / METADATA_FILE)
        barrier()

    def load(self, framework: str = "np") -> tuple[dict[str, Any], dict[str, Any]]:
        """(every shard's arrays, concatenated in shard order; the metadata), as numpy
        arrays or (framework="pt") torch tensors."""
        if framework == "pt":
            from safetensors.torch import load_file
        else:
            from safetensors.numpy import load_file

        meta = self.made() or {}
        try:
            check_files(
                self.folder, meta.get("checksums"), meta["shards"], "data cache",
                METADATA_FILE, "corrupted data to train and evaluate on",
                "Delete that folder and run again: it is made again. If it happens again, "
                "check the disk.",
                DataError,
            )  # fmt: skip
            parts = [load_file(str(self.folder / name)) for name in meta["shards"]]
        except DataError:
            raise
        except Exception as error:  # a deleted, truncated or hand-edited file
            raise self._unreadable(error) from None
        if framework == "pt":
            import torch

            return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}, meta
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, meta
