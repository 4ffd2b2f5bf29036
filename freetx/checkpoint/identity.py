"""What a run's inputs are, by identity: the checkpoint a path meant when the run read it,
and a fingerprint of its files.

A run folder given as initial weights (`checkpoint.initial_weights`, a LoRA run's
`model_dir`) or as an activation source means its newest checkpoint *now*; when
that run trains on, the same path means another checkpoint. So a run records
each input as `{"given", "path", "fingerprint"}` in its checkpoints' meta.json
(`inputs`), and a resume or a cache compares: the resolved checkpoint and the
sizes and modification times of its weight files (stat only: cheap for 8B
models; a file rewritten in place changes its time). The files a dataset or a
tokenizer read (`ReadsFiles`) are recorded the same way, as the list of them, and by
content as well (`content`: their sha256s, remembered by size and modification time as
the token cache remembers them, so a file is hashed again only when those changed): a
file rewritten with the same bytes (a copy, a checkout) is the same input.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from freetx.checkpoint.run_folder import resolve_checkpoint
from freetx.data.token_cache import cache_root, content_hash
from freetx.fields import ReadsFiles

# the files that hold a model: DCP's, safetensors and torch files, HF's config.json (a
# folder's other files, such as spectrum's scores cached beside a model, do not count)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".distcp", ".pt", ".pth")
WEIGHT_NAMES = (".metadata", "config.json")


def files_read_by(**readers: Any) -> dict[str, list[Path]]:
    """Name -> files, for each of `readers` that read files (`ReadsFiles`)."""
    return {
        name: list(reader.files_read)
        for name, reader in readers.items()
        if isinstance(reader, ReadsFiles) and reader.files_read
    }


def input_identity(path: str | Path | list[Path], resolved: Path | None = None) -> dict[str, Any]:
    """The identity of an input given as `path` (a run folder, checkpoint, file, HF
    folder; `resolved`: the checkpoint it means, when already found), or as the list of
    files a dataset or tokenizer read."""
    if isinstance(path, list):
        files = sorted(Path(p).resolve() for p in path)
        root = cache_root(None)  # where the token cache remembers its sources' hashes
        contents = "\n".join(f"{f.name}\t{content_hash(f, root)}" for f in files)
        return {
            "given": [str(p) for p in path],
            "path": [str(p) for p in files],
            "fingerprint": _fingerprint(files, base=None),
            "content": hashlib.sha256(contents.encode()).hexdigest()[:16],
        }
    resolved = resolved or resolve_checkpoint(path)
    if resolved.is_file():
        files = [resolved]
    else:
        files = sorted(
            p
            for p in resolved.rglob("*")
            if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in WEIGHT_NAMES)
        )
    return {
        "given": str(path),
        "path": str(resolved.resolve()),
        "fingerprint": _fingerprint(files, base=None if resolved.is_file() else resolved),
    }


def _fingerprint(files: list[Path], base: Path | None) -> str:
    """A hash of the files' names (relative to `base`, else bare), sizes and modification
    times."""
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        name = file.name if base is None else str(file.relative_to(base))
        digest.update(f"{name}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def same_input(recorded: dict[str, Any], now: dict[str, Any]) -> bool:
    """The same path, and the same files: untouched (sizes and times), or for the files a
    dataset or tokenizer read, the same bytes (a copy or a checkout gives new times)."""
    if recorded.get("path") != now["path"]:
        return False
    if recorded.get("fingerprint") == now["fingerprint"]:
        return True
    return "content" in now and recorded.get("content") == now["content"]


def changed_inputs(recorded: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """One line per input in `now` (name -> its `input_identity`) that is not what
    `recorded` (from a checkpoint's meta.json) says the run read: another checkpoint, or
    other files."""
    lines = []
    for name, identity in now.items():
        before = recorded.get(name)
        if before is None:  # recorded by an older freetx, or a new input: nothing to compare
            continue
        if same_input(before, identity):
            continue
        if isinstance(identity["given"], list):  # the files a dataset or tokenizer read
            read = ", ".join(before.get("path") or [])
            if before.get("path") != identity["path"]:
                lines.append(
                    f"{name}: the run read {read}; it reads {', '.join(identity['path'])} now"
                )
            else:
                lines.append(f"{name}: {read} changed since the run read them (rewritten)")
            continue
        if before.get("path") != identity["path"]:
            what = f"now means {identity['path']}"
        else:
            what = "has other files now (rewritten or retrained in place)"
        lines.append(f"{name}: the run read {before['path']}; {identity['given']} {what}")
    return lines
