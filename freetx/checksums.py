"""Checksums of the files freetx writes and reads again: checkpoints and every cache (the
token cache, the shard cache's activations and learning histories, precomputed reference
log-probs and teacher top-k). Imports nothing of freetx but errors, so that data/ and
checkpoint/ share it.

    record = checksums(folder, names)        # at the write: {"sha256": {name: digest}}
    check_files(folder, record, names, ...)  # at the read: a changed byte is refused

A record is kept where its files' other metadata is (a checkpoint's meta.json, a cache's
metadata), written after them. Files are hashed whole, in threads (hashlib releases the
GIL), once per write and once when a reader opens them: sha256, about twice blake2b's
speed on CPUs with SHA instructions (1.5 GB/s a thread on this 2-core machine, which reads
at 2.1 GB/s; 280 MB/s with both cores busy: docs/data.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from freetx.errors import FreetxError

ALGORITHM = "sha256"
_RANK_FILE = ".checksums_"  # + a rank's first file + .json, until folded in


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in pieces."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, ALGORITHM).hexdigest()


def digests(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """name -> digest of each file of `folder`, hashed in up to 4 threads."""
    names = sorted(set(names))
    if not names:
        return {}
    with ThreadPoolExecutor(min(len(names), 4)) as pool:
        return dict(zip(names, pool.map(file_digest, [Path(folder) / n for n in names])))


def checksums(folder: Path, names: Iterable[str]) -> dict[str, dict[str, str]]:
    """The record of files just written into `folder`: {"sha256": {name: digest}}."""
    return {ALGORITHM: digests(folder, names)}


def record_rank_checksums(folder: Path, names: list[str]) -> None:
    """A rank's digests of the files it wrote into `folder`, in a file of its own beside
    them (each rank hashes its own files, right after writing them); `fold_rank_checksums`
    gathers them."""
    found = digests(folder, names)
    if found:
        (Path(folder) / f"{_RANK_FILE}{min(found)}.json").write_text(json.dumps(found))


def fold_rank_checksums(folder: Path, names: Iterable[str] = ()) -> dict[str, dict[str, str]]:
    """The record of every rank's files (`record_rank_checksums`; the rank files are
    removed) and of `names`, hashed here. Call it once every rank's write has finished."""
    found = digests(folder, names)
    for rank_file in sorted(Path(folder).glob(f"{_RANK_FILE}*.json")):
        found.update(json.loads(rank_file.read_text()))
        rank_file.unlink()
    return {ALGORITHM: found}


def recorded(record: Any) -> dict[str, str] | None:
    """A record's name -> digest, or None when there is none (files written by a freetx
    that recorded no checksums, or a record edited away)."""
    found = record.get(ALGORITHM) if isinstance(record, dict) else None
    return found if isinstance(found, dict) else None


def check_files(
    folder: Path,
    record: Any,
    names: Iterable[str],
    what: str,
    kept_in: str,
    harm: str,
    fix: str,
    error: type[FreetxError],
) -> None:
    """Refuse (`error`) when a file of `folder` differs from what was written: its digest
    is not the one `record` holds (a record without it counts as damaged). `what` names
    the folder's kind, `kept_in` where the record is, `harm` what reading the file would
    give, `fix` what to do: one paragraph, the same for every kind of file."""
    expected = recorded(record) or {}
    names = sorted(set(names))
    for name, digest in digests(folder, names).items():
        if expected.get(name) != digest:
            raise error(
                f"{what} {folder}: {name} is damaged: its bytes differ from what was saved (its "
                f"checksum in {kept_in} does not match), and reading it would give {harm}. {fix}"
            )
