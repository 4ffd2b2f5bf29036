"""Packed text: documents joined with BOS/EOS into fixed-length sequences.

Sources: `builtin` (the corpus in `corpus.py`), or local files and folders:
`.txt` (one document per file), `.jsonl` (one document per line, in
`text_field`), `.parquet` (the `text_field` column; needs pyarrow). The token
stream is cut into windows of `seq_len + 1` tokens that overlap by one (inputs
are the first `seq_len`, labels the last), so nothing is padded away and no
token pair is lost; a trailing partial window is dropped. `packed: true` keeps the
windows and marks each window's documents (a new one after each EOS; positions restart
and attention stays within each, `freetx.models.PacksDocuments`): EOS's next token, the
next document's first, is no label then.

Train/validation split: every k-th sequence (k = round(1 / val_fraction)) goes
to validation, so both splits cover the whole corpus.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from freetx.data.corpus import builtin_documents
from freetx.data.packing import stream_documents
from freetx.data.sampling import check_split
from freetx.data.token_cache import cached_rows, settings_of
from freetx.data.tokenizers import leading_bos
from freetx.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def _expand(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"data folder {source} holds no {', '.join(TEXT_SUFFIXES)} files.")
        return files
    if not path.exists():
        raise DataError(
            f"data file {source} does not exist; fix dataset.source (a file, a folder, a "
            "list of them, or `builtin` for the built-in corpus)."
        )
    if path.suffix not in TEXT_SUFFIXES:
        raise DataError(f"data file {source} is not one of {', '.join(TEXT_SUFFIXES)}.")
    return [path]


def source_files(source: str | Sequence[str]) -> list[Path]:
    """The files a dataset source reads (`builtin`: none), recorded by identity in a run's
    checkpoints (`freetx.checkpoint.ReadsFiles`)."""
    sources = [source] if isinstance(source, str) else list(source)
    files: list[Path] = []
    for item in sources:
        path = Path(item).expanduser()
        if item == "builtin":
            continue
        files.extend(_expand(item) if path.is_dir() else [path])
    return files


def _not_text(path: Path, error: UnicodeDecodeError) -> DataError:
    return DataError(
        f"data file {path} is not UTF-8 text (byte {error.start}: {error.reason}); is it a binary "
        "file? Point the dataset at UTF-8 .txt or .jsonl files (or .parquet)."
    )


def read_jsonl(path: Path):
    """(line number, record) for every non-empty line; bad JSON or bytes name the line."""
    with open(path, encoding="utf-8") as f:
        try:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{line_no} is not valid JSON: {e.msg}.") from None
        except UnicodeDecodeError as e:
            raise _not_text(path, e) from None


def _read_file(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".txt":
        try:
            return [path.read_text(encoding="utf-8")]
        except UnicodeDecodeError as e:
            raise _not_text(path, e) from None
    if path.suffix == ".jsonl":
        docs = []
        for line_no, record in read_jsonl(path):
            if text_field not in record:
                raise DataError(
                    f"{path}:{line_no} has no field '{text_field}'; set dataset.text_field "
                    f"to one of {sorted(record)}."
                )
            docs.append(str(record[text_field]))
        return docs
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow.") from None
    table = pq.read_table(path, columns=[text_field])
    return [str(t) for t in table.column(text_field).to_pylist()]


def read_documents(source: str | Sequence[str], text_field: str = "text") -> list[str]:
    """The documents of a source: `builtin`, a file, a folder, or a list of those."""
    sources = [source] if isinstance(source, str) else list(source)
    docs: list[str] = []
    for item in sources:
        if item == "builtin":
            docs.extend(builtin_documents())
            continue
        for path in _expand(item):
            docs.extend(_read_file(path, text_field))
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"dataset.source {source!r} holds no text: every document is empty.")
    return docs


def _encode_documents(source: str | Sequence[str], text_field: str, tokenizer):
    """Each document's tokens, BOS (where the tokenizer adds one) + text + EOS."""
    for doc in read_documents(source, text_field):
        yield [*leading_bos(tokenizer), *tokenizer.encode(doc), tokenizer.eos_id], ()


class PackedTextDataset(Dataset):
    """Fixed-length token windows from packed documents, one split of them."""

    def __init__(
        self,
        tokenizer,
        source: str | list[str] = "builtin",
        seq_len: int = 256,
        split: str = "train",
        val_fraction: float = 0.05,
        text_field: str = "text",
        packed: bool = False,  # each window's documents attend only to themselves
        cache: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        # first: every argument, before other names; the split is made of windows, later
        settings = settings_of(locals(), served=("split", "val_fraction"))
        check_split(split, val_fraction, seq_len)
        self.packed = packed
        self.files_read = source_files(source)
        rows, self.token_cache = cached_rows(
            "PackedTextDataset", f"{source} (all splits)", settings, self.files_read, tokenizer,
            lambda: _encode_documents(source, text_field, tokenizer), cache, cache_dir, text=True,
        )  # fmt: skip
        self.tokens = rows.ids  # the documents back to back, one row each
        self.seq_len = seq_len
        self.tokenizer = tokenizer
        total = (len(self.tokens) - 1) // seq_len
        if total < 2:
            raise DataError(
                f"dataset.source {source!r} has {len(self.tokens)} tokens, fewer than two "
                f"sequences of seq_len={seq_len}; add text or lower dataset.seq_len."
            )
        every = max(2, round(1 / val_fraction))
        windows = np.arange(total, dtype=np.int64)
        is_val = windows % every == every - 1
        self.starts = windows[is_val == (split == "validation")] * seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = int(self.starts[index])
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        if not self.packed:
            return {"input_ids": window[:-1], "labels": window[1:]}
        input_ids = window[:-1]
        documents, labels = stream_documents(input_ids, window[1:], self.tokenizer.eos_id)
        return {
            "input_ids": input_ids, "labels": labels, "documents": documents,
            "real_tokens": torch.tensor(self.seq_len),
        }  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return len(self.starts) * self.seq_len
