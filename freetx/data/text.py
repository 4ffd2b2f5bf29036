"""Packed text: documents joined with BOS/EOS into fixed-length sequences.

Sources: `builtin` (the corpus in `corpus.py`), or local files and folders:
`.txt` (one document per file), and records of the `text` format from any source
of `freetx.data.sources` (`.jsonl`, `.json`, `.parquet`, folders of shards, `datasets`
save_to_disk folders): one document a record, in the `text` column
(`columns: {text: body}` maps it; `text_field: body` still does). The token
stream is cut into windows of `seq_len + 1` tokens that overlap by one (inputs
are the first `seq_len`, labels the last), so nothing is padded away and no
token pair is lost; a trailing partial window is dropped. `packed: true` keeps the
windows and marks each window's documents (a new one after each EOS; positions restart
and attention stays within each, `freetx.models.PacksDocuments`): EOS's next token, the
next document's first, is no label then.

The tokens come from the token cache (`freetx.data.token_cache`): one row per document,
memory-mapped, shared by both splits. Train/validation split: a sequence is validation
when a seeded hash of its place (its window index) falls below val_fraction
(`freetx.data.sampling.Split.takes_windows`): no period in the data aliases with it,
both splits cover the whole corpus, a corpus of a single document splits too, a
sequence keeps its split as text is appended after it, and the split costs no reading
of the tokens (a cached 1 GB source starts in the same time as a small one). With
`validation_source`, the validation split is that source's sequences, all of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from freetx.data.batch import token_sample
from freetx.data.corpus import builtin_documents
from freetx.data.formats import DEFAULT_COLUMNS, BadRows, Format, read_split, source_format
from freetx.data.packing import DataSummary, stream_documents
from freetx.data.sampling import Split, check_split, split_of, split_problems
from freetx.data.sources import (
    RECORD_SUFFIXES,
    TEXT_SUFFIX,
    Record,
    not_text,
    read_part,
    source_files,
    source_parts,
)
from freetx.data.token_cache import cached_rows, settings_of
from freetx.data.tokenizers import leading_bos
from freetx.errors import DataError

TEXT_SUFFIXES = (*RECORD_SUFFIXES, TEXT_SUFFIX)
TEXT_FORMAT = Format("text", DEFAULT_COLUMNS["text"])


def text_format(
    format: str | None, columns, text_field: str, source: str | Sequence[str]
) -> Format:
    """The format of a text dataset's records: `text`, its column from `columns` or
    `text_field` (the older key, still read); checked against the first rows of the record
    files of `source` (`source_format`)."""
    if text_field != "text" and columns:
        raise DataError(
            "dataset.text_field and dataset.columns both name the text column; keep "
            "dataset.columns ({text: COLUMN}) alone."
        )
    columns = columns or ({"text": text_field} if text_field != "text" else None)
    return source_format(
        source, format, columns, "PackedTextDataset", ("text",), "text", TEXT_SUFFIXES
    )


def document_records(source: str | Sequence[str], fmt: Format) -> Iterator[Record]:
    """The records of a text source: `builtin`'s documents, each `.txt` file whole (one
    document), and the records of every other source (`freetx.data.sources`)."""
    column = fmt.columns["text"]
    for item in [source] if isinstance(source, str) else list(source):
        if item == "builtin":
            for n, doc in enumerate(builtin_documents()):
                yield Record(f"builtin document {n}", {column: doc})
            continue
        for part in source_parts(item, TEXT_SUFFIXES):
            if part.suffix != TEXT_SUFFIX:
                yield from read_part(part, fmt.record_columns)
                continue
            try:
                yield Record(str(part), {column: part.read_text(encoding="utf-8")})
            except UnicodeDecodeError as e:
                raise not_text(part, e) from None


def read_documents(
    source: str | Sequence[str], fmt: Format = TEXT_FORMAT, bad_rows: BadRows | None = None
) -> list[str]:
    """The non-empty documents of a source: `builtin`, a file, a folder, or a list of those."""
    bad_rows = bad_rows or BadRows("error", str(source), "train and validation")
    every = Split("train", 0.5, whole=True)
    docs = [
        doc for _, doc in read_split(document_records(source, fmt), fmt, fmt.text, every, bad_rows)
    ]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"dataset.source {source!r} holds no text: every document is empty.")
    return docs


def _encode_documents(source: str | Sequence[str], fmt: Format, bad_rows: BadRows, tokenizer):
    """Each document's tokens, BOS (where the tokenizer adds one) + text + EOS."""
    for doc in read_documents(source, fmt, bad_rows):
        yield [*leading_bos(tokenizer), *tokenizer.encode(doc), tokenizer.eos_id], ()


class PackedTextDataset(Dataset):
    """Fixed-length token windows from packed documents, one split of them."""

    meaningless = staticmethod(split_problems)  # checked before it is built

    def __init__(
        self,
        tokenizer,
        source: str | list[str] = "builtin",
        seq_len: int = 256,
        split: str = "train",
        val_fraction: float = 0.05,
        text_field: str = "text",  # the text column (dataset.columns: {text: ...} says it too)
        format: str | None = None,  # text, the only one
        columns: dict[str, str] | None = None,
        on_bad_row: str = "error",  # or skip (counted and reported)
        validation_source: str | list[str] | None = None,  # the validation split, whole
        seed: int = 0,  # of the split's hash
        packed: bool = False,  # each window's documents attend only to themselves
        cache: bool = True,  # tokenized once into the token cache (freetx.data.token_cache)
        cache_dir: str | None = None,
    ) -> None:
        # first: every argument, before other names; the split is made of windows, later
        settings = settings_of(locals(), served=("split", "val_fraction", "seed"))
        check_split(split, val_fraction, seq_len)
        source, rule = split_of(source, validation_source, split, val_fraction, seed)
        fmt = text_format(format, columns, text_field, source)
        self.packed = packed
        # the splits of one source share its read: one line at start-up for both
        bad_rows = BadRows(on_bad_row, str(source), split if rule.whole else "train and validation")
        self.files_read = source_files(source, TEXT_SUFFIXES)
        rows, self.token_cache = cached_rows(
            "PackedTextDataset",
            f"{source} (all splits)",
            settings,
            self.files_read,
            tokenizer,
            lambda: _encode_documents(source, fmt, bad_rows, tokenizer),
            cache,
            cache_dir,
            text=True,
            notes=bad_rows.notes,
        )
        self.bad_rows = bad_rows.noted(self.token_cache.notes)  # a hit's, as built
        self.tokens = rows.ids  # the documents back to back, one row each
        self.documents = len(rows)
        self.seq_len = seq_len
        self.tokenizer = tokenizer
        total = (len(self.tokens) - 1) // seq_len
        if total < (1 if rule.whole else 2):
            raise DataError(
                f"dataset.source {source!r} has {len(self.tokens)} tokens, fewer than "
                f"{'one sequence' if rule.whole else 'two sequences'} of seq_len={seq_len}; "
                "add text or lower dataset.seq_len."
            )
        self.starts = np.flatnonzero(rule.takes_windows(total)) * seq_len
        if not len(self.starts):
            raise DataError(
                f"the {split} split of {source!r} is empty: the split takes a sequence by a "
                f"seeded hash of its place in the text (val_fraction={val_fraction}), and none "
                f"of its {total} sequences of seq_len={seq_len} went this way. Add text, raise "
                "dataset.val_fraction, or give the validation text as "
                "dataset.validation_source."
            )

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = int(self.starts[index])
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        if not self.packed:
            real = torch.tensor(self.seq_len)  # a window of the stream: no padding
            return token_sample(window[:-1], window[1:], real_tokens=real)
        input_ids = window[:-1]
        documents, labels = stream_documents(input_ids, window[1:], self.tokenizer.eos_id)
        return token_sample(input_ids, labels, documents, real_tokens=self.seq_len)

    def summary(self) -> DataSummary:
        """The documents of both splits -> this split's windows, no padding
        (`freetx.data.SummarizesData`)."""
        return DataSummary(
            self.documents,
            len(self),
            self.seq_len,
            self.num_tokens,
            self.packed,
            unit="documents (both splits, as one token stream)",
        )

    @property
    def num_tokens(self) -> int:
        return len(self.starts) * self.seq_len
