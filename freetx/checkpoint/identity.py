"""What a run's inputs are, by identity: the checkpoint a path meant when the run read it,
and a fingerprint of its files.

A run folder given as initial weights (`checkpoint.initial_weights`, a LoRA run's
`model_dir`) or as an activation source means its newest checkpoint *now*; when
that run trains on, the same path means another checkpoint. So a run records
each input as `{"given", "path", "fingerprint"}` in its checkpoints' meta.json
(`inputs`), and a resume or a cache compares: the resolved checkpoint and the
sizes and modification times of its weight files (stat only: cheap for 8B
models; a file rewritten in place changes its time).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from freetx.checkpoint.loading import resolve_checkpoint

# the files that hold a model: DCP's, safetensors and torch files, HF's config.json (a
# folder's other files, such as spectrum's scores cached beside a model, do not count)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".distcp", ".pt", ".pth")
WEIGHT_NAMES = (".metadata", "config.json")


def input_identity(path: str | Path) -> dict[str, Any]:
    """The identity of an input given as `path` (a run folder, checkpoint, file, HF folder)."""
    resolved = resolve_checkpoint(path)
    if resolved.is_file():
        files = [resolved]
    else:
        files = sorted(
            p for p in resolved.rglob("*")
            if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in WEIGHT_NAMES)
        )  # fmt: skip
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        name = file.name if file == resolved else str(file.relative_to(resolved))
        digest.update(f"{name}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return {
        "given": str(path),
        "path": str(resolved.resolve()),
        "fingerprint": digest.hexdigest()[:16],
    }


def same_input(recorded: dict[str, Any], now: dict[str, Any]) -> bool:
    return recorded.get("path") == now["path"] and recorded.get("fingerprint") == now["fingerprint"]


def changed_inputs(recorded: dict[str, dict], given: dict[str, str]) -> list[str]:
    """One line per input in `given` (name -> path) that is not what `recorded` (from a
    checkpoint's meta.json) says the run read: another checkpoint, or other files."""
    lines = []
    for name, path in given.items():
        before = recorded.get(name)
        if before is None:  # recorded by an older freetx, or a new input: nothing to compare
            continue
        now = input_identity(path)
        if same_input(before, now):
            continue
        if before.get("path") != now["path"]:
            what = f"now means {now['path']}"
        else:
            what = "has other files now (rewritten or retrained in place)"
        lines.append(f"{name}: the run read {before['path']}; {path} {what}")
    return lines
