"""Prompt data: prompts alone, for a run that generates the completions itself (GRPO).

Source: records of format `prompt` (the default: `{"prompt": "...", ...}`,
`{"prompt": [messages], ...}`, or `{"messages": [...], ...}`), `messages` or
`sharegpt` (`freetx.data.formats`) from any source of `freetx.data.sources`. A
conversation that ends in an assistant turn loses it, and its content becomes the row's
field `answer` (unless the row has one). Every other column is kept as the row's fields,
handed to the rewards with the completion (`freetx.objectives.rewards`): an `answer`, a
task name, test cases. Or `builtin`: InstructDataset's built-in string tasks over the
corpus words (`tasks` picks which), with the fields `answer` (the right answer) and
`task` (its name), deterministic from the seed.

A prompt is encoded for generation: with a chat template (an `HFTokenizer` of a folder
that has one) rendered with its generation prompt (a string prompt is one user turn)
and tokenized as rendered; without one, BOS + the prompt's text (a conversation must then
be one user turn). A prompt longer than `max_prompt_len` tokens keeps its end (the
question, and the header the model replies after); the prompts cut are counted (`fit`,
printed at start-up).

A sample is {"prompt_ids": [n] int64, "prompt": the prompt's text as the rewards see it
(the string, or the last user message's content), "fields": the row's other fields,
"id": where the row is ("FILE:LINE", "builtin prompt 17"), "conversation": the prompt's
messages, or None for a string prompt (a TRL-style reward reads them)}; `collate_prompts` makes a
`PromptBatch` of them (lists: prompts differ in length; the recipe pads them as its
generation wants).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
import torch

from freetx.data.batch import PADDING
from freetx.data.chat import chat_prompt_ids
from freetx.data.env_tasks import environment_rows, environment_tasks
from freetx.data.formats import (
    BadRow,
    Messages,
    check_not_empty,
    encode_rows,
    read_split,
)
from freetx.data.instruct import BUILTIN_TASKS, builtin_draws
from freetx.data.packing import DataSummary
from freetx.data.preference import preference_problems, prompts_format
from freetx.data.row_datasets import RowsDataset
from freetx.data.sampling import check_split
from freetx.data.seq_len import SeqLenFit
from freetx.data.sources import Record, read_records
from freetx.data.tokenizers import leading_bos
from freetx.errors import DataError

READS = ("prompt", "messages", "sharegpt")


def builtin_prompts(count: int, seed: int, tasks: list[str] | None = None) -> list[Record]:
    """`count` prompt records of the built-in tasks (`tasks`: which; None: all), each
    with its right `answer` and its `task`; or of the built-in environments `tasks` names,
    with the fields each reads (`freetx.data.env_tasks`)."""
    if environment_tasks(tasks):
        return environment_rows(list(tasks), count, seed)
    records = []
    for i, (word, task) in enumerate(builtin_draws(count, seed, tasks)):
        prompt, answer = BUILTIN_TASKS[task]
        fields = {"prompt": prompt.format(w=word), "answer": answer(word), "task": task}
        records.append(Record(f"builtin prompt {i}", fields))
    return records


def prompt_problems(values: dict[str, Any]) -> dict[str, str]:
    """`preference_problems` (the split's, max_prompt_len, tasks), where `tasks` may also
    name built-in environments (all of them, or none)."""
    return preference_problems(values, environments=True)


@dataclass(frozen=True)
class PromptsFit(SeqLenFit):
    """What cutting a split's prompts to max_prompt_len did (`seq_len` is it; `dropped` 0)."""

    def line(self) -> str:
        return (
            f"dataset {self.source} ({self.split}): {self.cut} of {self.samples} prompts cut "
            f"to max_prompt_len={self.seq_len} tokens (their start; their end kept); none "
            "dropped"
        )


@dataclass
class PromptBatch:
    """A micro-batch of prompts (`collate_prompts`): each one's tokens, its text as the
    rewards see it, its row's other fields and its row's id; `padding`: which are an
    evaluation shard's repeats (`freetx.data.EvalShard`), for the recipe to leave out."""

    prompt_ids: list[list[int]]
    prompts: list[str]
    fields: list[dict[str, Any]]
    ids: list[str]
    padding: list[bool] = field(default_factory=list)
    conversations: list[Messages | None] = field(default_factory=list)  # None: a string

    @classmethod
    def join(cls, batches: list[PromptBatch]) -> PromptBatch:
        """Batches one after another, as one."""
        names = ("prompt_ids", "prompts", "fields", "ids", "padding", "conversations")
        return cls(*([x for b in batches for x in getattr(b, name)] for name in names))

    def take(self, count: int) -> PromptBatch:
        """The first `count` prompts."""
        return PromptBatch(
            self.prompt_ids[:count],
            self.prompts[:count],
            self.fields[:count],
            self.ids[:count],
            self.padding[:count],
            self.conversations[:count],
        )

    def real_rows(self) -> torch.Tensor:
        """[prompts] bools: those that are no evaluation shard's repeat."""
        return ~torch.tensor(self.padding or [False] * len(self.ids), dtype=torch.bool)


def collate_prompts(samples: list[dict[str, Any]]) -> PromptBatch:
    """A PromptBatch of PromptDataset samples (an EvalShard's with `padding`)."""
    return PromptBatch(
        [s["prompt_ids"].tolist() for s in samples],
        [s["prompt"] for s in samples],
        [s["fields"] for s in samples],
        [s["id"] for s in samples],
        [bool(s.get(PADDING, False)) for s in samples],
        [s.get("conversation") for s in samples],
    )


@dataclass(eq=False, repr=False)
class PromptDataset(RowsDataset):
    """Prompts with their rows' fields, encoded for generation (module docstring). Its
    keys: `RowsDataset`'s (format: prompt, the default, messages, sharegpt), then these."""

    _: KW_ONLY
    max_prompt_len: int | None = None  # prompt tokens kept at most (its end)
    tasks: list[str] | None = None  # builtin only: which of BUILTIN_TASKS (None: all)
    meaningless = staticmethod(prompt_problems)  # checked before it is built

    def __post_init__(self) -> None:
        check_split(self.split, self.val_fraction)
        fmt = prompts_format(
            self, self.split_source, "PromptDataset", READS, "prompt", "prompts", prompt_problems
        )
        source, rule = self.split_rows()
        self.chat = getattr(self.tokenizer, "chat_template", None) is not None
        records = (
            builtin_prompts(self.num_builtin_examples, self.seed, self.tasks)
            if source == "builtin"
            else read_records(source, None)  # every column: the rewards read them
        )
        read = set(fmt.record_columns)

        def example(fields: dict[str, Any]) -> tuple[str | Messages, dict[str, Any]]:
            """A row's prompt, and its other fields (a dropped reply's content: `answer`)."""
            prompt, answer = fmt.prompt(fields)
            others = {k: v for k, v in fields.items() if k not in read}
            if answer is not None:
                others.setdefault("answer", answer)
            return prompt, others

        examples = read_split(records, fmt, example, rule, self.bad_rows)
        encoded, kept = encode_rows(
            [(where, prompt) for where, (prompt, _) in examples], self.encode, self.bad_rows
        )
        check_not_empty(len(encoded), rule, source, self.bad_rows)
        self.ids = [examples[i][0] for i in kept]
        self.prompts = [_text(examples[i][1][0]) for i in kept]
        self.conversations = [_messages(examples[i][1][0]) for i in kept]
        self.fields = [examples[i][1][1] for i in kept]
        lengths = np.array([len(ids) for ids in encoded])
        limit = self.max_prompt_len if self.max_prompt_len is not None else int(lengths.max())
        self.prompt_ids = [ids[max(len(ids) - limit, 0) :] for ids in encoded]
        cut = int((lengths > limit).sum())
        self.fit = PromptsFit(self.split, source, limit, len(encoded), cut, 0)

    def encode(self, prompt: str | Messages) -> list[int]:
        """The prompt's tokens for generation (module docstring); a BadRow when the chat
        template cannot render it, or it is a conversation and there is no template."""
        tok = self.tokenizer
        if self.chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            try:
                return chat_prompt_ids(tok, messages)
            except DataError as e:
                raise BadRow(f"cannot be rendered: {e}") from None
        if isinstance(prompt, list) and [m["role"] for m in prompt] != ["user"]:
            raise BadRow(
                f"is a conversation (roles {[m['role'] for m in prompt]}), and "
                f"{type(tok).__name__} has no chat template to render it; use "
                "freetx.data.HFTokenizer with a model folder that has one, or give the "
                "prompt as a string."
            )
        return [*leading_bos(tok), *tok.encode(_text(prompt))]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Prompt `index`: its tokens, text, fields (a copy) and id (module docstring)."""
        return {
            "prompt_ids": torch.tensor(self.prompt_ids[index], dtype=torch.long),
            "prompt": self.prompts[index],
            "fields": dict(self.fields[index]),
            "id": self.ids[index],
            "conversation": self.conversations[index],
        }

    def summary(self) -> DataSummary:
        """Prompts -> sequences of the longest prompt kept (`freetx.data.SummarizesData`):
        the padding is what a batch of them padded to the longest holds at most."""
        longest = max(len(ids) for ids in self.prompt_ids)
        real = sum(len(ids) for ids in self.prompt_ids)
        return DataSummary(len(self), len(self), longest, real, False, unit="prompts")


def _messages(prompt: str | Messages) -> Messages | None:
    """A conversation's messages (a copy), or None for a string prompt."""
    return None if isinstance(prompt, str) else [dict(m) for m in prompt]


def _text(prompt: str | Messages) -> str:
    """A prompt's text as the rewards see it: the string, or the last user message's."""
    if isinstance(prompt, str):
        return prompt
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")
