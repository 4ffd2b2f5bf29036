"""Writing a user's file or an export without ever losing what is there: checked, staged,
renamed. Imports nothing of freetx but errors (and no torch), so any command may use it.

Every file or folder freetx writes outside a run folder it owns (a conversion, an
export, a Spectrum selection, an analysis, a batch script) is refused when it exists,
unless `--overwrite` says to replace it (`refuse_existing`, called before any costly
work), and is written atomically (`staged_output`; `write_user_file` for one file).
A conversion also refuses a destination that is its source, holds its source or lies
inside it (`check_destination`). Everything is written under a temporary name beside
the destination (`.<name>.freetx-tmp-<pid>`) and renamed into place when complete, so
an interrupted command leaves the destination as it was (and a temporary entry that
the next attempt does not need; delete it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from freetx.errors import FreetxError


def check_destination(source: Path, destination: Path, overwrite: bool) -> None:
    """Refuse a destination that would destroy the source or replace an existing path."""
    src, dst = Path(source).resolve(), Path(destination).resolve()
    if dst == src or dst in src.parents or src in dst.parents:
        relation = "is" if dst == src else ("holds" if dst in src.parents else "lies inside")
        raise FreetxError(
            f"the destination {destination} {relation} the source {source}; a conversion never "
            "writes over what it reads. Write to another path."
        )
    refuse_existing(destination, overwrite, replaces_folder=True)


def refuse_existing(
    destination: Path,
    overwrite: bool,
    elsewhere: str = "another path",
    replaces_folder: bool = False,
) -> None:
    """Refuse `destination` when it exists, unless `overwrite` (then refuse a read-only folder).

    Call it before any costly work, so a refusal costs nothing; `elsewhere` says how the
    command is given another destination (e.g. "another -o FILE"). A folder where a file
    is to go is refused even with `overwrite`, unless `replaces_folder` (an export folder).
    """
    dst = Path(destination)
    if not (dst.exists() or dst.is_symlink()):
        check_writable_folder(dst.absolute().parent, elsewhere=elsewhere)
        return
    if dst.is_dir() and not replaces_folder:
        raise FreetxError(
            f"{destination} is a folder, and freetx writes a file there; nothing was written. "
            f"Give {elsewhere} (a file name)."
        )
    if not overwrite:
        raise FreetxError(
            f"{destination} already exists and freetx does not replace it unasked; nothing "
            f"was written. Pass --overwrite to replace it, or give {elsewhere}."
        )
    if not os.access(dst.absolute().parent, os.W_OK):
        raise FreetxError(f"{destination} cannot be replaced: its folder is read-only.")


def write_user_file(
    destination: Path, content: str | bytes, overwrite: bool, elsewhere: str = "another path"
) -> None:
    """Write `content` to `destination` atomically, refusing an existing file unless
    `overwrite` (`refuse_existing`; call that first too when the content is costly)."""
    refuse_existing(destination, overwrite, elsewhere)
    with staged_output(Path(destination)) as staged:
        if isinstance(content, str):
            staged.write_text(content, encoding="utf-8")
        else:
            staged.write_bytes(content)


def as_plain_file(path: Path) -> None:
    """Give a file the permissions a plain open() gives (0666 less the umask: 0644 by
    default), for one a library wrote through a private temporary file (safetensors'
    save_file: 0600), so that every file of an export is readable alike."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


class WriteFailed(FreetxError):
    """Writing a staged output failed (an OS error: a full disk, permissions); `cause`
    says why, and nothing was replaced."""

    def __init__(self, destination: Path, cause: str) -> None:
        self.destination, self.cause = destination, cause
        super().__init__(
            f"writing {destination} failed ({cause}); nothing was replaced. Check that its "
            "folder exists, is writable and has space, or pick another path."
        )


def _replace(staged: Path, destination: Path, keep: Callable[[str], bool] | None) -> None:
    """Move `staged` onto `destination`; an existing folder is swapped out, then removed,
    but its entries that `keep` names (and `staged` has not) are moved into it first."""
    if not destination.exists() or (staged.is_file() and destination.is_file()):
        os.replace(staged, destination)  # atomic for files
        return
    carried: list[str] = []
    old = destination.parent / f".{destination.name}.freetx-old-{os.getpid()}"
    try:
        if keep is not None and destination.is_dir() and staged.is_dir():
            for entry in sorted(destination.iterdir()):
                if keep(entry.name) and not (staged / entry.name).exists():
                    os.replace(entry, staged / entry.name)
                    carried.append(entry.name)
        os.replace(destination, old)
    except OSError:
        for name in carried:  # back where they were
            os.replace(staged / name, destination / name)
        raise
    try:
        os.replace(staged, destination)
    except OSError:
        os.replace(old, destination)
        for name in carried:
            os.replace(staged / name, destination / name)
        raise
    _remove(old)


@contextmanager
def staged_output(destination: Path, keep: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `destination`; on success it becomes `destination`.

    On any failure (an error, Ctrl-C) the temporary path is removed and the
    destination is untouched. OS errors (permissions, a full disk) become a
    `WriteFailed` naming the destination. `keep`: for a folder replacing a folder, the
    names of the old folder's entries that go on into the new one (files a user added to
    an export: freetx deletes nothing it did not write).
    """
    destination = Path(destination)
    staged = destination.parent / f".{destination.name}.freetx-tmp-{os.getpid()}"
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        _remove(staged)
        yield staged
        _replace(staged, destination, keep)
    except OSError as e:
        raise WriteFailed(destination, str(e.strerror or e)) from None
    finally:
        _remove(staged)


def check_writable_folder(
    folder: str | Path, key: str | None = None, own: bool = False, elsewhere: str = "another path"
) -> None:
    """Refuse, before any work, a folder a command is to write into that cannot be: a
    file in its place or above it, a read-only disk, no permission; with `own` (a cache
    freetx alone writes), also an existing folder holding files that are not freetx's.
    `key`: the config key that names it; else the fix is to give `elsewhere`."""
    path = Path(folder).expanduser().absolute()
    name = f"{key}={folder}" if key else str(folder)
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"lies under {existing}, which is a file"
        fix = f"Point {key} at a folder (or a path that does not exist yet)" if key else ""
        raise FreetxError(
            f"{name} {what}, and freetx writes a folder there; nothing was written. "
            f"{fix or 'Give ' + elsewhere}."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        cause = "Read-only file system" if read_only else "Permission denied"
        fix = f"Point {key} at a writable folder" if key else f"Give {elsewhere}"
        raise FreetxError(
            f"{name} cannot be written: {existing}: {cause}; nothing was written. {fix}"
            + ("." if read_only else ", or make it writable for this user.")
        )
    if own and existing == path and any(path.iterdir()) and not _is_shard_cache(path):
        raise FreetxError(
            f"{name} is a folder holding other files, and freetx writes its cache there "
            f"alone; nothing was written. Point {key} at a new folder (or an existing cache "
            "of freetx)."
        )


def _is_shard_cache(path: Path) -> bool:
    """A folder freetx's shard cache wrote (complete or interrupted)."""
    return all(
        p.name == "metadata.json" or p.name.startswith(("shard_", ".")) for p in path.iterdir()
    )
