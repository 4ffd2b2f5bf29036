"""The keys of a dataset of rows read from a source, one split of them, written once.

InstructDataset, ChatDataset, PreferenceDataset and PromptDataset read records from a
source (`freetx.data.sources`, or `builtin`: the dataset's own examples) and keep one
split of them. Each is a dataclass subclass of `RowsDataset` (PromptDataset) or of
`TokenRowsDataset` (the others, whose rows are tokenized through the token cache and
served at seq_len): the keys below are their constructors' keys, a dataset adds its own
after them, and builds itself in `__post_init__`. `tokenizer`, `source` and `seq_len`
may be given by position; the rest by name. A dataset is compared by identity
(`eq=False`), as any object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any

from torch.utils.data import Dataset

from freetx.data.formats import BadRows
from freetx.data.sampling import Split, split_of
from freetx.data.sources import RECORD_SUFFIXES, source_files
from freetx.data.token_cache import cached_rows, settings_of
from freetx.data.token_rows import Encoded, TokenRows


@dataclass(eq=False, repr=False)
class RowsDataset(Dataset):
    """One split of the rows of a source: the keys every such dataset takes."""

    tokenizer: Any
    source: str = "builtin"
    _: KW_ONLY
    split: str = "train"
    val_fraction: float = 0.05
    num_builtin_examples: int = 20000
    seed: int = 0
    format: str | None = None  # the records' format (freetx.data.formats); None: the dataset's
    columns: dict[str, str] | None = None  # the format's column names -> the data's
    on_bad_row: str = "error"  # or skip (counted and reported)
    validation_source: str | None = None  # the validation split, whole

    @property
    def split_source(self) -> str:
        """The source this split reads (`split_of`)."""
        return self._split()[0]

    def _split(self) -> tuple[str, Split]:
        return split_of(
            self.source, self.validation_source, self.split, self.val_fraction, self.seed
        )

    def split_rows(self) -> tuple[str, Split]:
        """The source this split reads and the rows it takes (`split_of`); sets `bad_rows`
        (what reading it skips or refuses) and `files_read` (its files)."""
        source, rule = self._split()
        self.bad_rows = BadRows(self.on_bad_row, source, self.split)
        self.files_read = source_files(source, RECORD_SUFFIXES)
        return source, rule


@dataclass(eq=False, repr=False)
class TokenRowsDataset(RowsDataset):
    """A `RowsDataset` whose rows are tokenized once into the token cache and served at
    `seq_len`: the keys such a dataset adds."""

    seq_len: int = 64
    _: KW_ONLY
    packed: bool = False  # several samples per sequence (freetx.data.packing), by seed
    cache: bool = True  # tokenized once into the token cache (freetx.data.token_cache)
    cache_dir: str | None = None

    def cached(
        self,
        dataset: str,
        source: str,
        encode: Callable[[], Iterable[Encoded]],
        served: Sequence[str] = (),
    ) -> TokenRows:
        """This split's token rows (`cached_rows`, under the class name `dataset`, keyed by
        the dataset's keys but those in `served`, applied when samples are served), made by
        `encode` on a miss; `bad_rows` then holds what the build noted, on a hit too."""
        arguments = {f.name: getattr(self, f.name) for f in fields(self)}
        rows, self.token_cache = cached_rows(
            dataset,
            f"{source} ({self.split})",
            settings_of(arguments, served),
            self.files_read,
            self.tokenizer,
            encode,
            self.cache,
            self.cache_dir,
            notes=self.bad_rows.notes,
        )
        self.bad_rows = self.bad_rows.noted(self.token_cache.notes)  # a hit's, as built
        return rows
