"""Writing an export without ever losing what is there: checked, staged, renamed.

A conversion refuses a destination that is its source, holds its source or
lies inside it, and one that exists unless `--overwrite` says to replace it.
It writes under a temporary name beside the destination
(`.<name>.freetx-tmp-<pid>`) and renames it into place when complete, so an
interrupted conversion leaves the destination as it was (and a temporary
entry that the next attempt does not need; delete it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from freetx.errors import CheckpointError


def check_destination(source: Path, destination: Path, overwrite: bool) -> None:
    """Refuse a destination that would destroy the source or replace an existing path."""
    src, dst = Path(source).resolve(), Path(destination).resolve()
    if dst == src or dst in src.parents or src in dst.parents:
        relation = "is" if dst == src else ("holds" if dst in src.parents else "lies inside")
        raise CheckpointError(
            f"the destination {destination} {relation} the source {source}; a conversion never "
            "writes over what it reads. Write to another path."
        )
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise CheckpointError(
                f"{destination} already exists and freetx does not replace it unasked. Pick "
                "another path, or pass --overwrite to replace it."
            )
        if not os.access(dst.parent, os.W_OK):
            raise CheckpointError(f"{destination} cannot be replaced: its folder is read-only.")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _replace(staged: Path, destination: Path) -> None:
    """Move `staged` onto `destination`; an existing folder is swapped out, then removed."""
    if not destination.exists() or (staged.is_file() and destination.is_file()):
        os.replace(staged, destination)  # atomic for files
        return
    old = destination.parent / f".{destination.name}.freetx-old-{os.getpid()}"
    os.replace(destination, old)
    try:
        os.replace(staged, destination)
    except OSError:
        os.replace(old, destination)
        raise
    _remove(old)


@contextmanager
def staged_output(destination: Path) -> Iterator[Path]:
    """Yield a temporary path beside `destination`; on success it becomes `destination`.

    On any failure (an error, Ctrl-C) the temporary path is removed and the
    destination is untouched. OS errors (permissions, a full disk) become a
    CheckpointError naming the destination.
    """
    destination = Path(destination)
    staged = destination.parent / f".{destination.name}.freetx-tmp-{os.getpid()}"
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        _remove(staged)
        yield staged
        _replace(staged, destination)
    except OSError as e:
        raise CheckpointError(
            f"writing {destination} failed ({e.strerror or e}); nothing was replaced. Check "
            "that its folder exists, is writable and has space, or pick another path."
        ) from None
    finally:
        _remove(staged)
