"""Sources: the records a dataset's `source` holds, each with where it is.

A source is a path, or a list of them, read in order:

- `.jsonl`: one JSON object a line (blank lines skipped); a record is at `FILE:LINE`.
- `.json`: a JSON list of objects (read whole; a record is at `FILE, item N`, from 0),
  or JSON lines like `.jsonl`.
- `.parquet`: read a row group at a time, only the columns the format reads; a record
  is at `FILE, row N` (from 0).
- a folder written by `datasets`' `save_to_disk` (it holds `state.json`, or
  `dataset_dict.json` for a DatasetDict: point at one split's folder), read through
  the `datasets` library (`pip install datasets`); a record is at `FOLDER, row N`.
- any other folder: a directory of shards, every `.jsonl` / `.json` / `.parquet` under
  it, sorted by path (`.txt` too for text datasets, one document a file).

A row that cannot be read (not JSON, not an object) is still a `Record`, with its
problem, so that `dataset.on_bad_row` decides what becomes of it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetx.errors import DataError

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
TEXT_SUFFIX = ".txt"
_ROWS_AT_ONCE = 1024  # parquet and `datasets` rows turned into Python objects at a time
FIRST_ROWS = 5  # the rows of a source whose columns say its format, checked before its split


@dataclass(frozen=True)
class Record:
    """One row of a source: its fields, or (`fields` None) why it could not be read."""

    where: str  # "FILE:LINE", "FILE, row N", "FILE, item N"
    fields: dict[str, Any] | None
    problem: str = ""  # set when fields is None
    raw: str = ""  # the row's text when it could not be read (what the split hashes)


def _message_keys(value: Any) -> set[str]:
    """The keys of a conversation's first message (none when it is not one)."""
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return set(value[0])
    return set()


def format_of_shape(
    fields: dict[str, Any] | Sequence[str], reads: Sequence[str] | None = None
) -> tuple[str, dict[str, str]] | None:
    """The format a row of this shape is in (its fields, or only its column names) and the
    columns to map for it: (`sharegpt`, {}) for `conversations` of from/value messages,
    (`prompt_response`, {response: completion}), ...; None when it is none of the formats'.
    `reads`: the formats the dataset at hand reads; a prompt, completion and label are
    unpaired examples where it reads them, else a prompt and its response (SFT)."""
    names = set(fields)
    if {"chosen", "rejected"} <= names:
        return "preference", {}
    if {"prompt", "completion", "label"} <= names and (reads is None or "unpaired" in reads):
        return "unpaired", {}
    for column in ("conversations", "messages"):
        if column in names:
            inner = _message_keys(fields[column]) if isinstance(fields, dict) else set()
            if {"from", "value"} <= inner or (not inner and column == "conversations"):
                name, default = "sharegpt", "conversations"
            else:
                name, default = "messages", "messages"
            return name, {} if column == default else {"messages": column}
    if {"instruction", "output"} <= names:
        return "alpaca", {}
    for response in ("response", "completion", "output", "answer"):
        if "prompt" in names and response in names:
            return "prompt_response", {} if response == "response" else {"response": response}
    if "text" in names:
        return "text", {}
    return None


def format_overrides(name: str, columns: dict[str, str]) -> str:
    """`dataset.format=NAME dataset.columns.ROLE=COLUMN ...`: what reads rows of a shape."""
    return " ".join(
        [f"dataset.format={name}"] + [f"dataset.columns.{k}={v}" for k, v in columns.items()]
    )


def format_fix(fields: dict[str, Any] | Sequence[str]) -> str:
    """How to read rows of this shape: the overrides when it is one of the formats', else
    where to say it."""
    found = format_of_shape(fields)
    if found:
        return f"the data looks like format {found[0]}: set {format_overrides(*found)}"
    return (
        "set dataset.format to the format of the data, or map its columns with "
        "dataset.columns (see docs/data.md)"
    )


def _is_datasets_folder(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


MISSING_SOURCE = (
    "does not exist; fix dataset.source (a file, a folder of shards, a datasets "
    "save_to_disk folder, a list of them, or `builtin`)."
)


def source_problems(values: dict[str, Any]) -> dict[str, str]:
    """A dataset node's `source` naming a file or folder that is not there, by key
    (`freetx validate` and `freetx run` check every node's before anything is launched:
    `freetx.training.check_read_paths`; `source_parts` refuses the same when a dataset is
    built). Not `freetx estimate`'s: a run planned elsewhere has its data there."""
    source = values.get("source")
    items = [source] if isinstance(source, str) else source if isinstance(source, list) else []
    for item in items:
        if isinstance(item, str) and item not in ("builtin", "???"):
            if not Path(item).expanduser().exists():
                return {"source": f"data file {item} {MISSING_SOURCE}"}
    return {}


def source_parts(source: str | Sequence[str], suffixes: Sequence[str]) -> list[Path]:
    """The files (and `datasets` folders) a source names, in reading order."""
    parts: list[Path] = []
    for item in [source] if isinstance(source, str) else list(source):
        path = Path(item).expanduser()
        if path.is_dir() and not _is_datasets_folder(path):
            files = sorted(p for p in path.rglob("*") if p.suffix in suffixes and p.is_file())
            if not files:
                raise DataError(
                    f"data folder {item} holds no {', '.join(suffixes)} files (nor is it a "
                    "folder written by datasets' save_to_disk); point dataset.source at one."
                )
            parts.extend(files)
        elif path.is_dir():
            parts.append(path)
        elif not path.exists():
            raise DataError(f"data file {item} {MISSING_SOURCE}")
        elif path.suffix not in suffixes:
            raise DataError(
                f"data file {item} is not one of {', '.join(suffixes)}; point dataset.source "
                "at such a file or a folder of them."
            )
        else:
            parts.append(path)
    return parts


def source_files(source: str | Sequence[str], suffixes: Sequence[str]) -> list[Path]:
    """Every file a source reads (`builtin`: none), recorded by identity in a run's
    checkpoints (`freetx.checkpoint.ReadsFiles`); a `datasets` folder: all its files."""
    items = [source] if isinstance(source, str) else list(source)
    files: list[Path] = []
    for part in source_parts([s for s in items if s != "builtin"], suffixes):
        files.extend(sorted(p for p in part.rglob("*") if p.is_file()) if part.is_dir() else [part])
    return files


def not_text(path: Path, error: UnicodeDecodeError) -> DataError:
    return DataError(
        f"data file {path} is not UTF-8 text (byte {error.start}: {error.reason}); is it a binary "
        "file? Point the dataset at UTF-8 .txt, .jsonl or .json files (or .parquet)."
    )


def read_records(source: str | Sequence[str], columns: Sequence[str] | None) -> Iterator[Record]:
    """Every record of a source (see the module docstring). `columns`: those the format
    reads; parquet and `datasets` read only those of them the data has (None: all its
    columns, for a dataset that hands a row's other fields on: prompts to rewards)."""
    for part in source_parts(source, RECORD_SUFFIXES):
        yield from read_part(part, columns)


def first_rows(
    source: str | Sequence[str], suffixes: Sequence[str] = RECORD_SUFFIXES
) -> list[dict]:
    """The fields of a source's first FIRST_ROWS rows (those that can be read), whose columns
    say its format (`freetx.data.formats.source_format`): its record files' (a text source's
    `.txt` files are documents, not rows)."""
    parts = (p for p in source_parts(source, suffixes) if p.suffix in RECORD_SUFFIXES or p.is_dir())
    records = (record for part in parts for record in read_part(part, None))
    return [r.fields for r in itertools.islice(records, FIRST_ROWS) if r.fields is not None]


def read_part(path: Path, columns: Sequence[str] | None) -> Iterator[Record]:
    """The records of one file or `datasets` folder."""
    if path.is_dir():
        yield from _read_saved_dataset(path, columns)
    elif path.suffix == ".parquet":
        yield from _read_parquet(path, columns)
    elif path.suffix == ".json" and _starts_with(path, "["):
        yield from _read_json_list(path)
    else:
        yield from _read_json_lines(path)


def _starts_with(path: Path, char: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head[:1] == char.encode()


def _object_or_problem(where: str, value: Any, raw: str) -> Record:
    if isinstance(value, dict):
        return Record(where, value)
    kind = type(value).__name__
    return Record(where, None, f"is a JSON {kind}, not an object of fields", raw)


def _read_json_lines(path: Path) -> Iterator[Record]:
    with open(path, encoding="utf-8") as f:
        try:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    yield Record(where, None, f"is not valid JSON ({e.msg})", line)
                    continue
                yield _object_or_problem(where, value, line)
        except UnicodeDecodeError as e:
            raise not_text(path, e) from None


def _read_json_list(path: Path) -> Iterator[Record]:
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise not_text(path, e) from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}); a .json source holds a "
            "list of objects, or one object a line."
        ) from None
    if not isinstance(items, list):
        raise DataError(f"{path} holds a JSON {type(items).__name__}, not a list of objects.")
    for n, item in enumerate(items):
        yield _object_or_problem(f"{path}, item {n}", item, json.dumps(item, sort_keys=True))


def _rows_of_batches(where: Path, batches) -> Iterator[Record]:
    """Records from batches of columns ({name: [values]}), numbered from 0."""
    n = 0
    for batch in batches:
        names = list(batch)
        for values in zip(*(batch[name] for name in names)):
            yield Record(f"{where}, row {n}", dict(zip(names, values)))
            n += 1


def _present(path: Path, columns: Sequence[str] | None, names: Sequence[str]) -> list[str]:
    """The columns a columnar source has of those the format reads (None: every column it
    has); none is an error."""
    if columns is None:
        return list(names)
    present = [c for c in columns if c in names]
    if not present:
        raise DataError(
            f"{path} has none of the columns the dataset's format reads ({', '.join(columns)}); "
            f"its columns are {', '.join(names)}; {format_fix(names)}."
        )
    return present


def _read_parquet(path: Path, columns: Sequence[str] | None) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow.") from None
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors have no common public base
        raise DataError(f"{path} is not a readable parquet file ({e}); fix or replace it.") from e
    present = _present(path, columns, file.schema_arrow.names)
    batches = file.iter_batches(batch_size=_ROWS_AT_ONCE, columns=present)
    try:
        yield from _rows_of_batches(path, (batch.to_pydict() for batch in batches))
    except (OSError, ValueError) as e:  # pyarrow's read errors (ArrowInvalid is a ValueError)
        raise DataError(f"{path} could not be read to its end ({e}); fix or replace it.") from e


def _read_saved_dataset(path: Path, columns: Sequence[str] | None) -> Iterator[Record]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path} is a folder written by datasets' save_to_disk, and reading it needs the "
            "datasets library: pip install datasets (or pip install 'freetx[datasets]')."
        ) from None
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets' errors have no common public base
        raise DataError(
            f"{path} looks like a datasets save_to_disk folder (it has state.json or "
            f"dataset_dict.json) but datasets cannot load it ({e}); save it again."
        ) from e
    if isinstance(data, datasets.DatasetDict):
        splits = ", ".join(f"{path}/{name}" for name in data)
        raise DataError(
            f"{path} holds a DatasetDict of several splits; point dataset.source at one of "
            f"them ({splits}), and dataset.validation_source at another if you want it."
        )
    data = data.select_columns(_present(path, columns, data.column_names))
    yield from _rows_of_batches(path, data.iter(batch_size=_ROWS_AT_ONCE))
