"""The token cache: a dataset tokenized once into memory-mapped files, reused by later runs.

    <cache_dir>/                          dataset.cache_dir, else $FREETX_CACHE, else
                                          ~/.cache/freetx/tokens
      ChatDataset_<key>/                  one complete entry (a folder renamed into place)
        ids.bin  targets.bin  offsets.bin TokenRows' arrays, raw (text: no targets.bin)
        meta.json                         dtypes, counts, the key's settings
      ChatDataset_<key>.lock              held (flock) while one process builds the entry
      hashes/<path hash>.json             a source file's content hash, by (size, mtime_ns)

The key is a hash of what decides the tokens: the dataset class and its settings (all
but seq_len, which is applied when samples are served), the tokenizer's identity (its
files' contents; ByteTokenizer by name) and the contents of the source files. Content
hashes are remembered per (path, size, mtime_ns), so a later start stats the files and
reads none of them: its start-up time does not grow with the data.

Every rank maps the same files (`numpy.memmap`) and reads only the rows it is given. On
first use the ranks (or several runs) meet at the entry's lock: one builds, into a
temporary folder renamed into place when complete, the others wait and then map it; a
process that dies mid-build leaves nothing that is used. An entry that is damaged (a
missing or truncated array, a meta.json that does not parse, offsets that do not match
the arrays) is named on the console and built again, never used.

meta.json records the sha256 of every array (`freetx.checksums`), and every process that
maps an entry hashes its arrays once first: an array whose bytes changed since it was
written (a flipped bit, a hand edit) is refused naming the file, as a checkpoint's is,
never trained on. An entry an earlier freetx wrote without checksums is built again (said
on the console): the cache is freetx's to remake, so a rebuild costs the user nothing a
refusal would not, while trusting it unverified is what the checksums are there to end.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from freetx.checksums import check_files, checksums, file_digest, recorded
from freetx.data.token_rows import Encoded, RowsBuilder, TokenRows, all_targets, ids_dtype
from freetx.data.tokenizers import ByteTokenizer, HFTokenizer
from freetx.errors import DataError

FORMAT = 1  # the entries' layout and the encoders' output: a change makes new keys
META = "meta.json"
ARRAYS = ("ids", "targets", "offsets")
_MEMORY: dict[str, tuple[Any, TokenRows]] = {}  # builtin rows made here: (tokenizer, rows)
_MEMORY_ENTRIES = 4
BUILTIN = "a builtin source, made in memory"
NOT_IN_KEY = ("self", "__class__", "tokenizer", "seq_len", "packed", "cache", "cache_dir")


@dataclass(frozen=True)
class CacheReport:
    """What the token cache did for one dataset: `state` is "hit" (mapped an entry),
    "built" (tokenized into a new entry), "waited" (for another process building it, then
    mapped it), "rebuilt" (a damaged entry replaced) or "off" (held in memory; `reason`
    says why)."""

    label: str  # e.g. "chat.jsonl (train)"
    state: str
    rows: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    folder: Path | None = None
    reason: str = ""
    notes: dict[str, Any] = field(default_factory=dict)  # what the build noted (`notes`)

    @property
    def builtin(self) -> bool:
        """Made in memory from a builtin source (nothing worth saying in a run)."""
        return self.reason == BUILTIN

    def line(self) -> str:
        if self.state == "off":
            return f"token cache: {self.label} not cached ({self.reason})"
        what = {
            "hit": "reused",
            "built": "built",
            "rebuilt": "rebuilt (it was damaged)",
            "waited": "built by another process",
        }
        took = "" if self.state == "hit" else f" in {self.seconds:.1f} s"
        return (
            f"token cache: {self.label} {what[self.state]}{took}: {self.rows:,} rows, "
            f"{self.tokens:,} tokens, {self.bytes / 2**20:,.1f} MiB in {self.folder}"
        )


@runtime_checkable
class UsesTokenCache(Protocol):
    """A dataset whose tokens come from the token cache; the run prints `token_cache`."""

    token_cache: CacheReport


def cache_root(cache_dir: str | None) -> Path:
    """dataset.cache_dir, else $FREETX_CACHE, else ~/.cache/freetx/tokens."""
    given = cache_dir or os.environ.get("FREETX_CACHE") or "~/.cache/freetx/tokens"
    return Path(given).expanduser()


def cached_rows(
    dataset: str,
    label: str,
    settings: dict[str, Any],
    files: Sequence[Path],
    tokenizer: Any,
    encode: Callable[[], Iterable[Encoded]],
    cache: bool = True,
    cache_dir: str | None = None,
    text: bool = False,
    notes: Callable[[], dict[str, Any]] | None = None,
) -> tuple[TokenRows, CacheReport]:
    """A dataset's TokenRows: mapped from its cache entry, or made by `encode` (which reads
    the source and yields each sample's ids and target flags) and written there first.

    `dataset` names the class, `settings` what else decides the tokens (JSON-able),
    `files` the source files (none: a builtin source, held in memory). `text`: every
    token is a target, so no targets are stored. `notes`: what the reading found besides
    the tokens (e.g. the bad rows it skipped), asked once `encode` is done and kept with
    the entry, so that a hit reports it too (`CacheReport.notes`).
    """
    notes = notes or dict
    if not cache:
        reason = "dataset.cache is false"
    elif not files:
        reason = BUILTIN
    elif not all(Path(f).is_file() for f in files):
        reason = "a source file is missing"
    else:
        reason = ""
    root = cache_root(cache_dir)
    tokenizer_key = None if reason else tokenizer_identity(tokenizer, root)
    if not reason and tokenizer_key is None:
        reason = f"{type(tokenizer).__name__} is not a tokenizer the cache can identify"
    dtype = ids_dtype(tokenizer.vocab_size)
    if reason:  # in memory; the reader says what is wrong with a missing file
        rows = _in_memory(dataset, settings, tokenizer, encode, dtype, text, files)
        report = CacheReport(label, "off", len(rows), len(rows.ids), reason=reason)
        return rows, replace(report, notes=notes())
    hashes = [content_hash(path, root) for path in files]
    folder = root / f"{dataset}_{_digest(dataset, settings, tokenizer_key, hashes)}"
    key = {"dataset": dataset, "settings": settings, "tokenizer": tokenizer_key, "files": hashes}
    return _open_or_build(folder, key, encode, dtype, text, label, notes)


def _in_memory(dataset, settings, tokenizer, encode, dtype, text: bool, files) -> TokenRows:
    """The rows made by `encode`, in memory. A builtin source's are remembered in this
    process for the same tokenizer object (the other split makes them again)."""
    memo = json.dumps([dataset, settings], sort_keys=True, default=str)
    remembered = _MEMORY.get(memo)
    if not files and remembered is not None and remembered[0] is tokenizer:
        return remembered[1]
    rows = _fill(RowsBuilder(dtype, with_targets=not text), encode, text).rows()
    if not files:
        _MEMORY[memo] = (tokenizer, rows)
        while len(_MEMORY) > _MEMORY_ENTRIES:
            del _MEMORY[next(iter(_MEMORY))]
    return rows


def settings_of(arguments: dict[str, Any], served: Sequence[str] = ()) -> dict[str, Any]:
    """The settings of a dataset that decide its tokens, for the key: its constructor's
    arguments (a `freetx.data.row_datasets.TokenRowsDataset`'s fields, or `locals()` as
    the constructor starts) but the tokenizer (identified on its
    own), seq_len and the arguments in `served` (applied when samples are served) and the
    cache's own, so that an argument a dataset gains is in the key without a change here
    (a setting that does not change the tokens costs a rebuild; one left out would reuse
    wrong tokens)."""
    settings = {k: v for k, v in arguments.items() if k not in (*NOT_IN_KEY, *served)}
    settings["source"] = source_key(settings["source"])
    return settings


def source_key(source: str | Sequence[str]) -> list[str]:
    """A dataset's `source` for the key: each file or folder by absolute path (the same
    from any working directory), `builtin` as it is."""
    items = [source] if isinstance(source, str) else list(source)
    return [s if s == "builtin" else str(Path(s).expanduser().resolve()) for s in items]


def tokenizer_identity(tokenizer: Any, root: Path) -> dict[str, Any] | None:
    """What makes a tokenizer's ids: ByteTokenizer's are fixed (its special tokens' spellings
    read as the tokens) but for its chat template; an HFTokenizer's come from its files
    and the special tokens it was given. Another class: None (not cached)."""
    if type(tokenizer) is ByteTokenizer:
        return {"class": "ByteTokenizer", "specials": "spelled", "chat": tokenizer.chat_template}
    if type(tokenizer) is HFTokenizer:
        return {
            "class": "HFTokenizer",
            "files": [content_hash(Path(path), root) for path in tokenizer.files_read],
            "special_tokens": tokenizer.special_tokens,
            "ids": [tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id],
            "add_bos_token": tokenizer.add_bos_token,
        }
    return None


def content_hash(path: Path, root: Path) -> str:
    """sha256 of a file's bytes, remembered in `root`/hashes by (path, size, mtime_ns): a
    file not touched since is only stat'ed."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    stamp = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    memo = root / "hashes" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:24]}.json"
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(memo.read_text())
        if {k: known.get(k) for k in stamp} == stamp:
            return known["sha256"]
    digest = file_digest(path)
    with contextlib.suppress(OSError):  # a read-only cache folder: hashed again next time
        _write_atomically(memo, json.dumps({**stamp, "sha256": digest}))
    return digest


def _digest(dataset: str, settings: dict, tokenizer: dict, hashes: list[str]) -> str:
    key = {
        "format": FORMAT,
        "dataset": dataset,
        "settings": settings,
        "tokenizer": tokenizer,
        "files": hashes,
    }
    if "builtin" in json.dumps(settings):  # the built-in corpus is this Python's text
        key["python"] = sys.version
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _open_or_build(
    folder: Path, key: dict, encode, dtype: np.dtype, text: bool, label: str, notes
) -> tuple[TokenRows, CacheReport]:
    start = time.perf_counter()
    rows, problem = open_entry(folder)
    state = "hit"
    if rows is None:  # absent or damaged: build it, or wait for the process building it
        with _locked(folder) as waited:
            rows, problem = open_entry(folder)  # built meanwhile by the one we waited for
            state = "waited" if waited else "hit"
            if rows is None:
                if problem:
                    print(
                        f"token cache: {folder} cannot be used ({problem}); building it again",
                        file=sys.stderr,
                        flush=True,
                    )
                state = "rebuilt" if problem else "built"
                _write_entry(folder, key, encode, dtype, text, notes)
                rows, problem = open_entry(folder)
                if rows is None:
                    raise DataError(
                        f"the token cache {folder} just written cannot be read back "
                        f"({problem}); check the disk, or set dataset.cache=false."
                    )
    size = sum(p.stat().st_size for p in folder.iterdir())
    seconds = time.perf_counter() - start
    noted = json.loads((folder / META).read_text()).get("notes", {})
    report = CacheReport(label, state, len(rows), len(rows.ids), size, seconds, folder)
    return rows, replace(report, notes=noted)


def open_entry(folder: Path) -> tuple[TokenRows | None, str]:
    """(the entry's rows, memory-mapped; "") or (None, "" when there is no entry, else
    what is wrong with it: it is built again). An array whose checksum does not match is
    refused (DataError), after every array was found to have its size."""
    if not folder.exists():
        return None, ""
    try:
        meta = json.loads((folder / META).read_text())
        counts = {name: int(meta["counts"][name]) for name in meta["counts"]}
        dtypes = {name: np.dtype(meta["dtypes"][name]) for name in counts}
        if meta["format"] != FORMAT or "ids" not in counts or "offsets" not in counts:
            raise ValueError("another layout")
    except FileNotFoundError:
        return None, f"{META} is missing"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"{META} does not parse: {error}"
    if recorded(meta.get("checksums")) is None:
        return None, f"{META} records no checksums: an earlier freetx wrote it"
    arrays = {}
    for name, count in counts.items():
        path = folder / f"{name}.bin"
        if not path.is_file():
            return None, f"{path.name} is missing"
        expected = count * dtypes[name].itemsize
        if path.stat().st_size != expected:
            return None, f"{path.name} holds {path.stat().st_size:,} bytes, not {expected:,}"
        arrays[name] = _map(path, dtypes[name], count)
    check_files(
        folder, meta["checksums"], [f"{name}.bin" for name in counts], "token cache", META,
        "other tokens than the dataset's",
        "Delete that folder and run again (or `freetx data prepare` with the run's config): "
        "it is built again. If it happens again, check the disk.",
        DataError,
    )  # fmt: skip
    offsets, ids = arrays["offsets"], arrays["ids"]
    if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(ids):
        return None, f"offsets.bin does not span ids.bin's {len(ids):,} tokens"
    if (np.diff(offsets) < 0).any():
        return None, "offsets.bin is not in order"
    targets, first_targets = arrays.get("targets"), arrays.get("first_targets")
    if targets is None:
        targets = all_targets(len(ids))
    elif len(targets) != len(ids):
        return None, f"targets.bin holds {len(targets):,} flags for {len(ids):,} tokens"
    if first_targets is not None and len(first_targets) != len(offsets) - 1:
        return (
            None,
            f"first_targets.bin holds {len(first_targets):,} rows, not {len(offsets) - 1:,}",
        )
    return TokenRows(ids, targets, offsets, first_targets), ""


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """`count` items of a raw file, memory-mapped read-only (numpy cannot map 0 bytes)."""
    return np.memmap(path, dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)


@contextlib.contextmanager
def _locked(folder: Path):
    """Hold `folder`'s lock file (flock: released when the process ends, however it ends);
    say so when another process holds it. Yields whether it waited for one."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        handle = open(folder.parent / f"{folder.name}.lock", "a")
    except OSError as error:
        raise _unwritable(folder.parent, error) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            print(
                f"token cache: waiting for another process to build {folder}",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = True
        yield waited


def _write_entry(folder: Path, key: dict, encode, dtype: np.dtype, text: bool, notes) -> None:
    """Build the entry in a temporary folder beside it, then rename it into place (the
    caller holds the lock: no one else writes this entry)."""
    for stale in folder.parent.glob(f".{folder.name}.*"):  # a build that died, a damaged one
        shutil.rmtree(stale, ignore_errors=True)
    if folder.exists():  # damaged: moved aside in one step, then removed
        aside = folder.parent / f".{folder.name}.damaged-{secrets.token_hex(4)}"
        folder.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(parents=True)
        with open(tmp / "ids.bin", "wb") as ids_file, open(tmp / "targets.bin", "wb") as flags:

            def write(ids: np.ndarray, targets: np.ndarray | None) -> None:
                ids_file.write(ids.tobytes())
                if targets is not None:
                    flags.write(targets.tobytes())

            builder = _fill(RowsBuilder(dtype, write, with_targets=not text), encode, text)
            builder.flush()
            offsets = builder.offsets()
            for f in (ids_file, flags):
                f.flush()
                os.fsync(f.fileno())
        counts = {"ids": int(offsets[-1]), "offsets": len(offsets)}
        arrays = {"offsets": offsets}
        if text:
            (tmp / "targets.bin").unlink()
        else:  # what fit_to_seq_len reads, so that a hit does not read every target flag
            counts["targets"] = counts["ids"]
            targets = _map(tmp / "targets.bin", np.dtype(np.bool_), counts["ids"])
            arrays["first_targets"] = TokenRows(np.zeros(0), targets, offsets).first_targets
            counts["first_targets"] = len(offsets) - 1
        for name, array in arrays.items():
            with open(tmp / f"{name}.bin", "wb") as f:
                f.write(array.tobytes())
                os.fsync(f.fileno())
        dtypes = {"ids": dtype.str, "targets": "|b1", **{k: a.dtype.str for k, a in arrays.items()}}
        dtypes = {name: dtypes[name] for name in counts}
        meta = {
            "format": FORMAT,
            "rows": len(offsets) - 1,
            "counts": counts,
            "dtypes": dtypes,
            "key": key,
            "notes": notes(),
            "checksums": checksums(tmp, [f"{name}.bin" for name in counts]),
        }
        (tmp / META).write_text(json.dumps(meta, indent=2, default=str))
        tmp.rename(folder)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _unwritable(folder.parent, error) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fill(builder: RowsBuilder, encode, text: bool) -> RowsBuilder:
    """`builder` given every sample `encode` yields (text: their ids only)."""
    for ids, targets in encode():
        builder.add(ids, None if text else targets)
    return builder


def _unwritable(root: Path, error: OSError) -> DataError:
    return DataError(
        f"the token cache cannot be written in {root} ({error.strerror or error}); free space "
        "there, point dataset.cache_dir (or the FREETX_CACHE environment variable) at a "
        "writable folder, or set dataset.cache=false to tokenize in memory on every start."
    )


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}"
    tmp.write_text(text)
    tmp.replace(path)
