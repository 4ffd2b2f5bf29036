"""Instruction data: `prompt`/`response` pairs, loss on the response tokens only.

Each example is BOS + prompt + response + EOS, cut to `seq_len + 1` tokens and
padded with PAD; labels are IGNORE_INDEX on the prompt and the padding, so only
response tokens (and the closing EOS) count in the loss.

Source: records in any format of `freetx.data.formats` that holds a prompt and a
response (prompt_response, the default: `prompt` and `response` fields; alpaca;
conversations of one user turn and one assistant reply), from any source of
`freetx.data.sources` (JSON lines, JSON, parquet, a folder of shards, a `datasets`
save_to_disk folder), or `builtin`:
string tasks made from the words of the built-in corpus (reverse a word, spell
it in capitals, say its length), deterministic from the seed. They need no
download and have exact answers, so a falling loss is easy to read.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from freetx.data.corpus import builtin_documents
from freetx.data.env_tasks import (
    environment_demonstrations,
    environment_problem,
    environment_tasks,
)
from freetx.data.formats import Format, check_not_empty, read_split, source_format
from freetx.data.row_datasets import TokenRowsDataset
from freetx.data.sampling import check_split, split_problems
from freetx.data.sources import Record, read_records
from freetx.data.token_rows import Encoded
from freetx.data.token_samples import TokenSamples
from freetx.data.tokenizers import leading_bos
from freetx.envs import BUILTIN_ENVS
from freetx.errors import DataError

# the formats a prompt/response or chat dataset reads
READS = ("messages", "sharegpt", "alpaca", "prompt_response")


# the built-in string tasks: a prompt of the word, and the right answer
BUILTIN_TASKS = {
    "reverse": ("Reverse the word: {w}\nAnswer: ", lambda w: w[::-1]),
    "capitals": ("Write the word in capitals: {w}\nAnswer: ", lambda w: w.upper()),
    "length": ("How many letters are in {w}?\nAnswer: ", lambda w: str(len(w))),
}


def builtin_draws(
    count: int, seed: int, tasks: Sequence[str] | None = None
) -> list[tuple[str, str]]:
    """`count` (word, task) draws: words of the built-in corpus, tasks of `tasks` (names of
    BUILTIN_TASKS; None: all of them)."""
    words = sorted({w for doc in builtin_documents() for w in re.findall(r"[a-z]{4,12}", doc)})
    rng = random.Random(seed)
    names = list(BUILTIN_TASKS if tasks is None else tasks)
    return [(rng.choice(words), rng.choice(names)) for _ in range(count)]


def builtin_examples(
    count: int, seed: int, tasks: Sequence[str] | None = None
) -> list[dict[str, str]]:
    """`count` string-task examples over words from the built-in corpus (`tasks`: which;
    None: all)."""
    examples = []
    for word, task in builtin_draws(count, seed, tasks):
        prompt, answer = BUILTIN_TASKS[task]
        examples.append({"prompt": prompt.format(w=word), "response": answer(word)})
    return examples


def builtin_records(count: int, seed: int, tasks: Sequence[str] | None = None) -> list[Record]:
    """The built-in examples as prompt/response records."""
    examples = builtin_examples(count, seed, tasks)
    return [Record(f"builtin example {i}", example) for i, example in enumerate(examples)]


def builtin_tasks_problem(tasks: Any, environments: bool = False) -> str | None:
    """Why a dataset's `tasks` (which built-in tasks it draws) cannot be, and the fix;
    `environments`: it may instead name built-in environments (`freetx.data.env_tasks`),
    all of them or none."""
    if tasks is None:
        return None
    if environments and environment_tasks(tasks):
        return environment_problem(tasks)
    unknown = [t for t in tasks if t not in BUILTIN_TASKS] if isinstance(tasks, list) else []
    if isinstance(tasks, list) and tasks and not unknown:
        return None
    return (
        f"it picks among the built-in tasks {', '.join(BUILTIN_TASKS)}"
        + (f" or the built-in environments {', '.join(BUILTIN_ENVS)}" if environments else "")
        + (f" ({', '.join(map(str, unknown))} is none of them)" if unknown else "")
        + "; list some of them, or leave it out for all."
    )


def check_builtin_tasks(source: str, tasks: list[str] | None) -> None:
    """`tasks` with a source that is not `builtin` is an error (it picks built-in tasks)."""
    if source != "builtin" and tasks is not None:
        raise DataError(
            f"dataset.tasks={tasks!r} picks among the built-in tasks, and dataset.source "
            f"is {source}; drop dataset.tasks, or set dataset.source=builtin."
        )


def check_builtin_format(format: str | None, columns, name: str, what: str) -> None:
    """`builtin`'s examples are in format `name` (`what` they are): a format or column
    mapping given with them is an error."""
    if format not in (None, name) or columns:
        raise DataError(
            f"dataset.source=builtin is freetx's own {what}; drop dataset.format and "
            "dataset.columns, or point dataset.source at your data."
        )


def prompt_response_tokens(tok, prompt: str, response: str) -> Encoded:
    """BOS + prompt + response + EOS (a tokenizer without a chat template), and for each
    token whether it is a target: the response's and the EOS."""
    prompt_ids = [*leading_bos(tok), *tok.encode(prompt)]
    response_ids = [*tok.encode(response), tok.eos_id]
    return prompt_ids + response_ids, [False] * len(prompt_ids) + [True] * len(response_ids)


def dataset_records(
    source: str,
    format: str | None,
    columns,
    dataset: str,
    default: str,
    count: int,
    seed: int,
    tasks: Sequence[str] | None = None,
) -> tuple[Iterable[Record], Format]:
    """A chat or instruction dataset's records and their format (`source_format`: the
    config's, else found from the first rows' columns, checked against them before the
    split); `builtin`'s examples are prompt/response pairs of the string `tasks`, or the
    conversations of the built-in environments `tasks` names (a format or column mapping
    given with them is an error)."""
    if source == "builtin" and environment_tasks(tasks):
        check_builtin_format(format, columns, "messages", "conversations")
        fmt = Format.of("messages", None, dataset, READS, "messages")
        return environment_demonstrations(list(tasks), count, seed), fmt
    if source == "builtin":
        check_builtin_format(format, columns, "prompt_response", "prompt/response examples")
        fmt = Format.of("prompt_response", None, dataset, READS, "prompt_response")
        return builtin_records(count, seed, tasks), fmt
    fmt = source_format(source, format, columns, dataset, READS, default)
    return read_records(source, fmt.record_columns), fmt


@dataclass(eq=False, repr=False)
class InstructDataset(TokenRowsDataset, TokenSamples):
    """Prompt/response pairs as fixed-length, response-only-loss samples. Its keys:
    `TokenRowsDataset`'s (format: prompt_response, the default, alpaca, messages, sharegpt)."""

    meaningless = staticmethod(split_problems)  # checked before it is built

    def __post_init__(self) -> None:
        check_split(self.split, self.val_fraction, self.seq_len)
        source, rule = self.split_rows()

        def encode() -> Iterable[Encoded]:
            """Every pair of the split encoded (on a cache miss)."""
            records, fmt = dataset_records(
                source,
                self.format,
                self.columns,
                "InstructDataset",
                "prompt_response",
                self.num_builtin_examples,
                self.seed,
            )
            pairs = read_split(records, fmt, fmt.prompt_response, rule, self.bad_rows)
            return [self.encode({"prompt": p, "response": r}) for _, (p, r) in pairs]

        rows = self.cached("InstructDataset", source, encode)
        check_not_empty(len(rows), rule, source, self.bad_rows)
        pad_id = self.tokenizer.pad_id
        TokenSamples.__init__(
            self, rows, self.seq_len, pad_id, self.split, source, self.packed, self.seed
        )

    def encode(self, example: dict[str, str]) -> Encoded:
        """BOS + prompt + response + EOS, and for each token whether it is a target."""
        return prompt_response_tokens(self.tokenizer, example["prompt"], example["response"])
