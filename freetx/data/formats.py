"""Formats: what a source's records hold, turned into what a dataset trains on.

`dataset.format` names the layout of the records, `dataset.columns` maps its column
names onto the data's (only those that differ); without them the format is found from the
columns of the source's first rows, and every dataset checks them against its format
before the split (`source_format`):

| format          | columns (defaults)                                  | becomes                 |
|-----------------|-----------------------------------------------------|-------------------------|
| messages        | messages, role, content                             | a conversation          |
| sharegpt        | messages: conversations, role: from, content: value | a conversation (roles human, gpt, system -> user, assistant, system) |
| alpaca          | instruction, input (optional), output               | a prompt (ALPACA_PROMPT) and a response |
| prompt_response | prompt, response (role, content in messages)       | a prompt and a response (lists of messages: TRL's conversational prompt-completion) |
| text            | text                                                | a document              |
| preference      | prompt, chosen, rejected (and role, content in messages) | a preference pair (`Pair`) |
| prompt          | prompt (a string or messages), else messages; role, content | a prompt (`Format.prompt`) |

ChatDataset takes conversations (a prompt and response become one user turn and one
assistant turn), InstructDataset prompts and responses (a conversation of exactly one
user turn and one assistant reply becomes one), PackedTextDataset documents,
PromptDataset prompts (a string, or a conversation ending in the user's turn; the other
columns are the row's fields, for the rewards), PreferenceDataset preference pairs
(`Pair`): a prompt and a chosen and a rejected
completion of it, all strings, or all conversations: `{prompt: [messages], chosen:
[messages], rejected: [messages]}` (TRL's), or `{chosen: [messages], rejected:
[messages]}`, the prompt being the messages the two share from their start.

A row that does not fit (not JSON, a missing column, a wrong type, no assistant turn,
a conversation the chat template cannot render) is a bad row: `dataset.on_bad_row:
error` (the default) stops with one paragraph naming it (file and line or row) and the
fix; `skip` skips it and counts it, and the run prints the count once at start-up
(`BadRows.line`, beside the seq_len cuts).

The train/validation split takes a row by a seeded hash of its content (the columns
the format reads), so it does not depend on the row's position: stable as a file grows,
in any row order, blind to any period in the data (`freetx.data.sampling.Split`).
With `dataset.validation_source` the validation split is that source, whole, and
`source` is all training.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar, runtime_checkable

from freetx.data.sampling import Split
from freetx.data.sources import (
    RECORD_SUFFIXES,
    Record,
    first_rows,
    format_of_shape,
    format_overrides,
)
from freetx.errors import DataError

Messages = list[dict[str, str]]
T = TypeVar("T")

DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "messages": {"messages": "messages", "role": "role", "content": "content", "tools": "tools"},
    "sharegpt": {"messages": "conversations", "role": "from", "content": "value", "tools": "tools"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output"},
    "prompt_response": {
        "prompt": "prompt",
        "response": "response",
        "role": "role",
        "content": "content",
    },
    "text": {"text": "text"},
    "preference": {
        "prompt": "prompt",
        "chosen": "chosen",
        "rejected": "rejected",
        "margin": "margin",  # optional: how much better the chosen is (a reward model's)
        "role": "role",
        "content": "content",
    },
    "prompt": {"prompt": "prompt", "messages": "messages", "role": "role", "content": "content"},
    "unpaired": {
        "prompt": "prompt",
        "completion": "completion",
        "label": "label",
        "role": "role",
        "content": "content",
    },
}
# the roles whose columns a row of each format has (a prompt's: its prompt, or its messages;
# a preference pair's prompt may be the start its chosen and rejected messages share)
NEEDED: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("messages",),
    "alpaca": ("instruction", "output"),
    "prompt_response": ("prompt", "response"),
    "text": ("text",),
    "preference": ("chosen", "rejected"),
    "prompt": ("prompt",),
    "unpaired": ("prompt", "completion", "label"),
}
# the datasets that read each kind of data, for a format the dataset at hand does not read
CONVERSATIONS_READER = (
    "conversations and prompt/response pairs are freetx.data.ChatDataset's and "
    "freetx.data.InstructDataset's"
)
READERS = {
    "text": "plain text is freetx.data.PackedTextDataset's",
    "preference": "preference pairs are freetx.data.PreferenceDataset's",
    "prompt": "prompts alone are freetx.data.PromptDataset's",
    "unpaired": "unpaired completions with a label are freetx.data.UnpairedPreferenceDataset's",
    **{
        name: CONVERSATIONS_READER for name in ("messages", "sharegpt", "alpaca", "prompt_response")
    },
}
FLOAT32_MAX = 3.4028234663852886e38  # the largest margin a pair keeps (as a float32)
MESSAGE_KEYS = ("role", "content")  # the keys inside a message, not columns of a row
# a message's keys of tool use, kept as they are (the chat template renders them)
TOOL_KEYS = ("tool_calls", "name", "tool_call_id")
CONVERSATIONS = ("messages", "sharegpt")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
SHAREGPT_ROLES |= {role: role for role in ("user", "assistant")}
ON_BAD_ROW = ("error", "skip")

# Stanford Alpaca's prompts (what its models were trained with); the output is the response
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


class BadRow(Exception):
    """What is wrong with one row and how to fix it, worded to follow where it is."""


@dataclass(frozen=True)
class Pair:
    """A preference pair: a prompt and two completions of it, the chosen one preferred.
    All strings, or all conversations: the prompt's messages, and each completion's
    (starting with the assistant's reply; the loss is on its assistant messages)."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages
    margin: float = 0.0  # the row's `margin` (TRL's reward modeling), 0 where it has none

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass(frozen=True)
class Unpaired:
    """An unpaired preference example (KTO's): a prompt, a completion of it, and whether
    the completion is desirable. Strings, or conversations as a `Pair`'s."""

    prompt: str | Messages
    completion: str | Messages
    desirable: bool


def canonical(value: Any) -> bytes:
    """A value's canonical JSON: equal for equal content, whatever the key order."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return text.encode()


@dataclass(frozen=True)
class Format:
    """A record layout (`name`) with its column names (`columns`: role -> the data's)."""

    name: str
    columns: dict[str, str]

    def __hash__(self) -> int:  # a key of the text datasets' token streams
        return hash((self.name, tuple(sorted(self.columns.items()))))

    @classmethod
    def of(
        cls,
        name: str | None,
        columns: dict[str, str] | None,
        dataset: str,
        reads: Sequence[str],
        default: str,
    ) -> Format:
        """The format a dataset's config names (None: `default`), checked against what the
        dataset reads and its column mapping against the format's columns."""
        name = default if name is None else name
        if name not in DEFAULT_COLUMNS:
            raise DataError(
                f"dataset.format={name!r} is not a format freetx reads; use one of "
                f"{', '.join(DEFAULT_COLUMNS)} (docs/data.md)."
            )
        if name not in reads:
            raise DataError(
                f"{dataset} reads the formats {', '.join(reads)}, not {name}; {READERS[name]}."
            )
        given = dict(columns or {})
        unknown = sorted(set(given) - set(DEFAULT_COLUMNS[name]))
        if unknown:
            raise DataError(
                f"dataset.columns names {', '.join(unknown)}, which format {name} does not "
                f"read; its columns are {', '.join(DEFAULT_COLUMNS[name])}: map those onto "
                "your data's column names (docs/data.md)."
            )
        for role, column in given.items():
            if not isinstance(column, str) or not column:
                raise DataError(f"dataset.columns.{role} must be a column name, got {column!r}.")
        return cls(name, {**DEFAULT_COLUMNS[name], **given})

    @property
    def record_columns(self) -> list[str]:
        """The columns a record is read for (a conversation's role and content are inside
        its messages column)."""
        if self.name in CONVERSATIONS:
            return [self.columns["messages"]]
        return [column for role, column in self.columns.items() if role not in MESSAGE_KEYS]

    def needs(self) -> str:
        """The columns a row of this format has, said."""
        columns = ", ".join(self.columns[role] for role in NEEDED[self.name])
        if self.name == "prompt":
            return f"{columns} (or {self.columns['messages']})"
        if self.name == "preference":
            return f"{columns} (and {self.columns['prompt']}, unless they hold messages)"
        return columns

    def fits(self, fields: dict[str, Any]) -> bool:
        """Whether a row has the columns this format reads (`needs`)."""
        if self.name == "prompt" and self.columns["messages"] in fields:
            return True
        return all(self.columns[role] in fields for role in NEEDED[self.name])

    def key(self, record: Record) -> bytes:
        """What the train/validation split hashes: the columns the format reads."""
        if record.fields is None:
            return record.raw.encode()
        margin = self.columns.get("margin")  # a pair's margin moves it to no other split
        return canonical({c: record.fields.get(c) for c in self.record_columns if c != margin})

    def _fix(self, fields: dict[str, Any]) -> str:
        """What to do about a row this format cannot read: the format and columns that read
        its shape, when that is another format's (`format_of_shape`), else fix the row."""
        found = format_of_shape(fields)
        if (
            found is not None
            and Format(found[0], {**DEFAULT_COLUMNS[found[0]], **found[1]}) != self
        ):
            return f"the row looks like format {found[0]}: set {format_overrides(*found)}"
        return "fix the row, or set dataset.format / map the columns with dataset.columns"

    def _string(self, fields: dict[str, Any], role: str, optional: bool = False) -> str:
        column = self.columns[role]
        value = fields.get(column)
        if value is None and optional:
            return ""
        if value is None:
            raise BadRow(
                f"has no '{column}' column (format {self.name} reads "
                f"{', '.join(self.record_columns)}; it has {', '.join(sorted(fields)) or 'none'}); "
                f"{self._fix(fields)}."
            )
        if not isinstance(value, str):
            raise BadRow(
                f"has a {type(value).__name__} in '{column}' where format {self.name} reads a "
                "string; fix the row."
            )
        return value

    def _messages(
        self, fields: dict[str, Any], role: str = "messages", needs_reply: bool = True
    ) -> Messages:
        column, role_key, content_key = (self.columns[k] for k in (role, "role", "content"))
        messages = fields.get(column)
        if not isinstance(messages, list) or not messages:
            raise BadRow(
                f"has no '{column}' list; format {self.name} reads rows like "
                f'{{"{column}": [{{"{role_key}": ..., "{content_key}": ...}}, ...]}}: '
                f"{self._fix(fields)}."
            )
        out = []
        for n, message in enumerate(messages):
            role = message.get(role_key) if isinstance(message, dict) else None
            content = message.get(content_key) if isinstance(message, dict) else None
            if content is None and isinstance(message, dict) and message.get("tool_calls"):
                content = ""  # OpenAI's form of a reply that only calls tools
            if not isinstance(role, str) or not isinstance(content, str):
                raise BadRow(
                    f"has a message {n} ({str(message)[:60]}) without a '{role_key}' string "
                    f"and a '{content_key}' string; fix the row."
                )
            if self.name == "sharegpt":
                if role not in SHAREGPT_ROLES:
                    raise BadRow(
                        f"has a message {n} from {role!r}; format sharegpt reads messages from "
                        f"{', '.join(SHAREGPT_ROLES)}: fix the row."
                    )
                role = SHAREGPT_ROLES[role]
            tool_use = {k: message[k] for k in TOOL_KEYS if message.get(k) is not None}
            out.append({"role": role, "content": content, **tool_use})
        if needs_reply and not any(message["role"] == "assistant" for message in out):
            raise BadRow(
                "has no assistant message, so it has nothing to learn from; add the "
                "assistant's reply or remove the row."
            )
        return out

    def _turns(self, fields: dict[str, Any]) -> Messages | None:
        """A prompt_response row of messages (TRL's conversational prompt-completion:
        `{"prompt": [messages], "completion": [messages]}`) as one conversation; None for a
        row of strings."""
        if self.name != "prompt_response" or not isinstance(
            fields.get(self.columns["prompt"]), list
        ):
            return None
        return self._messages(fields, "prompt", needs_reply=False) + self._messages(
            fields, "response"
        )

    def prompt_response(self, fields: dict[str, Any]) -> tuple[str, str]:
        """A record's prompt and response (InstructDataset)."""
        turns = self._turns(fields)
        if self.name == "prompt_response" and turns is None:
            return self._string(fields, "prompt"), self._string(fields, "response")
        if self.name == "alpaca":
            instruction = self._string(fields, "instruction")
            given = self._string(fields, "input", optional=True)
            output = self._string(fields, "output")
            if given.strip():
                return ALPACA_PROMPT.format(instruction=instruction, input=given), output
            return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction), output
        messages = self._messages(fields) if turns is None else turns
        if [m["role"] for m in messages] != ["user", "assistant"]:
            raise BadRow(
                f"is a conversation of {[m['role'] for m in messages]}, and InstructDataset "
                "reads one user turn and one assistant reply; train on it with "
                "freetx.data.ChatDataset, or fix the row."
            )
        return messages[0]["content"], messages[1]["content"]

    def conversation(self, fields: dict[str, Any]) -> Messages:
        """A record's conversation (ChatDataset)."""
        if self.name in CONVERSATIONS:
            return self._messages(fields)
        turns = self._turns(fields)
        if turns is not None:
            return turns
        prompt, response = self.prompt_response(fields)
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]

    def conversation_and_tools(self, fields: dict[str, Any]) -> tuple[Messages, list | None]:
        """A record's conversation and the JSON schemas of the tools it may call (its
        `tools` column, TRL's: rendered into the prompt by the chat template; None: none)."""
        tools = fields.get(self.columns.get("tools", "tools"))
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise BadRow(
                f"has a '{self.columns.get('tools', 'tools')}' column that is no list of tool "
                'schemas ({"type": "function", "function": {...}}); fix the row.'
            )
        return self.conversation(fields), tools

    def preference(self, fields: dict[str, Any]) -> Pair:
        """A record's preference pair (PreferenceDataset): strings, or conversations when
        `chosen` holds messages. An empty prompt or completion, a completion that does not
        start with the assistant's reply, or a chosen equal to its rejected is a bad row."""
        if isinstance(fields.get(self.columns["chosen"]), list):
            pair = self._conversation_pair(fields)
        else:
            pair = Pair(*(self._string(fields, role) for role in ("prompt", "chosen", "rejected")))
        pair = replace(pair, margin=self._margin(fields))
        if pair.chosen == pair.rejected:
            raise BadRow(
                f"has the same chosen and rejected completion ({str(pair.chosen)[:60]!r}), so "
                "there is nothing to prefer; fix or remove the row."
            )
        for role in ("prompt", "chosen", "rejected"):
            value = getattr(pair, role)
            if isinstance(value, list):  # what is said: the prompt's, the assistant's replies
                if role != "prompt" and value and value[0]["role"] != "assistant":
                    raise BadRow(
                        f"has a {role} conversation that goes on after the prompt with a "
                        f"{value[0]['role']} message, not the assistant's reply; fix the row."
                    )
                said = [m["content"] for m in value if role == "prompt" or m["role"] == "assistant"]
                value = "".join(said)
            if not value.strip():
                raise BadRow(
                    f"has an empty {role} ('{self.columns[role]}'): a pair is a prompt and two "
                    "different completions of it; fix or remove the row."
                )
        return pair

    def _margin(self, fields: dict[str, Any]) -> float:
        """A pair's `margin` column: a number a float32 holds (0 where the row has none, or
        NaN: a missing value of a table)."""
        value = fields.get(self.columns["margin"])
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return 0.0
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            held = number and math.isfinite(value) and abs(float(value)) <= FLOAT32_MAX
        except OverflowError:  # an integer past any float
            held = False
        if not held:
            raise BadRow(
                f"has {str(value)[:40]} in '{self.columns['margin']}', where a pair's margin "
                "(how much the chosen completion's reward should exceed the rejected's, read "
                "by reward models) is a finite number; fix the row, or map the column away "
                "(dataset.columns.margin=UNUSED)."
            )
        return float(value)

    def unpaired(self, fields: dict[str, Any]) -> Unpaired:
        """A record's unpaired example (UnpairedPreferenceDataset, TRL's unpaired
        preference format): a prompt, a completion and a label (true: desirable), strings
        or conversations (`completion` holding messages, starting with the assistant's
        reply). An empty prompt or completion, or a label that is no boolean, is a bad row."""
        label = fields.get(self.columns["label"])
        if label not in (True, False) or isinstance(label, float):  # True, False, 1, 0
            raise BadRow(
                f"has {label!r} in '{self.columns['label']}' where format unpaired reads a "
                "boolean (true: a desirable completion, false: an undesirable one); fix the row."
            )
        if isinstance(fields.get(self.columns["completion"]), list):
            prompt = self._messages(fields, "prompt", needs_reply=False)
            completion = self._messages(fields, "completion")
            if completion[0]["role"] != "assistant":
                raise BadRow(
                    f"has a completion conversation that starts with a {completion[0]['role']} "
                    "message, not the assistant's reply; fix the row."
                )
            said = ["".join(m["content"] for m in prompt),
                    "".join(m["content"] for m in completion if m["role"] == "assistant")]  # fmt: skip
        else:
            prompt, completion = (self._string(fields, role) for role in ("prompt", "completion"))
            said = [prompt, completion]
        for role, text in zip(("prompt", "completion"), said):
            if not text.strip():
                raise BadRow(
                    f"has an empty {role} ('{self.columns[role]}'): an unpaired example is a "
                    "prompt, a completion of it and its label; fix or remove the row."
                )
        return Unpaired(prompt, completion, bool(label))

    def prompt(self, fields: dict[str, Any]) -> tuple[str | Messages, str | None]:
        """A record's prompt (PromptDataset): its prompt string, or a conversation ending in
        the user's turn (format prompt: `prompt` holding messages, or no `prompt` column and
        a `messages` one); a conversation's final assistant turn is dropped, and returned as
        the answer (else None). An empty prompt is a bad row."""
        column = self.columns.get("prompt")
        conversation = self.name in CONVERSATIONS or isinstance(fields.get(column), list)
        if not conversation and (column in fields or self.columns["messages"] not in fields):
            text = self._string(fields, "prompt")
            if not text.strip():
                raise BadRow(f"has an empty prompt ('{column}'); fix or remove the row.")
            return text, None
        role = "prompt" if isinstance(fields.get(column), list) else "messages"
        messages, answer = self._messages(fields, role, needs_reply=False), None
        if messages[-1]["role"] == "assistant":
            messages, answer = messages[:-1], messages[-1]["content"]
        if not messages or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
            roles = [m["role"] for m in messages]
            raise BadRow(
                f"is a conversation of {roles} (a final assistant turn taken as its answer), "
                "and a prompt ends with the user's turn, not empty, for the model to reply "
                "to; fix or remove the row."
            )
        return messages, answer

    def _conversation_pair(self, fields: dict[str, Any]) -> Pair:
        """A pair of conversations: the prompt's messages given (TRL's conversational
        format), or (no prompt column) the messages the chosen and rejected share from
        their start, each completion the rest."""
        chosen, rejected = self._messages(fields, "chosen"), self._messages(fields, "rejected")
        if fields.get(self.columns["prompt"]) is not None:
            return Pair(self._messages(fields, "prompt", needs_reply=False), chosen, rejected)
        shared = next(
            (n for n, (a, b) in enumerate(zip(chosen, rejected)) if a != b),
            min(len(chosen), len(rejected)),
        )
        return Pair(chosen[:shared], chosen[shared:], rejected[shared:])

    def text(self, fields: dict[str, Any]) -> str:
        """A record's document (PackedTextDataset)."""
        return self._string(fields, "text")


def source_format(
    source: str | Sequence[str],
    name: str | None,
    columns: dict[str, str] | None,
    dataset: str,
    reads: Sequence[str],
    default: str,
    suffixes: Sequence[str] = RECORD_SUFFIXES,
) -> Format:
    """The format of a source's records, by its first rows (`first_rows`: of its files of
    `suffixes` that hold records; not `builtin`'s): `dataset.format`'s (its columns mapped
    by `dataset.columns`) when given, else `default`'s when the rows have its columns, else
    the format their columns are in (`format_of_shape`: TRL's standard datasets, `text`,
    `prompt`/`completion`, `messages`, `prompt`/`chosen`/`rejected`, and sharegpt's and
    alpaca's) among those `dataset` reads. Checked before any split (rows without the
    format's columns would all hash one way): rows it cannot read are refused
    (`wrong_format`)."""
    fmt = Format.of(name, columns, dataset, reads, default)
    items = [source] if isinstance(source, str) else list(source)
    first = first_rows([item for item in items if item != "builtin"], suffixes)
    if not first or any(fmt.fits(row) for row in first):
        return fmt
    shape = format_of_shape(first[0], reads)
    if name is None and not columns and shape is not None and shape[0] in reads:
        found = Format(shape[0], {**DEFAULT_COLUMNS[shape[0]], **shape[1]})
        if any(found.fits(row) for row in first):
            return found
    raise wrong_format(first, fmt, name is not None, dataset, reads, source)


def wrong_format(
    first: Sequence[dict[str, Any]],
    fmt: Format,
    given: bool,
    dataset: str,
    reads: Sequence[str],
    source: str | Sequence[str],
) -> DataError:
    """One paragraph: the columns of a source's first rows, the format `dataset` reads them
    as (`given`: by dataset.format) and its columns, and the keys that would read them."""
    shape = format_of_shape(first[0])
    missing = [role for role in NEEDED[fmt.name] if fmt.columns[role] not in first[0]]
    if shape is not None and shape[0] in reads:
        fix = (
            f"The data looks like format {shape[0]}: set {format_overrides(*shape)}, or leave "
            "dataset.format and dataset.columns out (the format is then found from the columns)."
        )
    elif shape is not None:
        fix = f"The data looks like format {shape[0]}: {READERS[shape[0]]}, in a recipe that "
        fix += "trains on it."
    elif len(missing) < len(NEEDED[fmt.name]):  # some of its columns: the others named apart
        fix = "Name yours with " + ", ".join(f"dataset.columns.{r}=COLUMN" for r in missing) + "."
    else:
        fix = (
            "Map those columns onto yours with dataset.columns (dataset.columns.ROLE=COLUMN), "
            f"or give rows of a format {dataset} reads ({', '.join(reads)}; docs/data.md)."
        )
    how = "dataset.format" if given else "its default: dataset.format is not set"
    found = ", ".join(dict.fromkeys(column for row in first for column in row))
    return DataError(
        f"The first rows of {source} have the columns {found}, and {dataset} reads them as "
        f"format {fmt.name} ({how}), whose rows have the columns {fmt.needs()}. {fix}"
    )


@dataclass
class BadRows:
    """What `dataset.on_bad_row` did with the rows of one read that did not fit."""

    on_bad_row: str
    source: str
    split: str
    seen: int = 0  # rows of the source read
    rows: int = 0  # of those, the split's
    skipped: int = 0
    first: str = ""  # the first skipped row: where, and what was wrong
    refused: int = 0  # bad rows found with on_bad_row=error (`refuse` raises for them)

    def __post_init__(self) -> None:
        if self.on_bad_row not in ON_BAD_ROW:
            raise DataError(
                f"dataset.on_bad_row={self.on_bad_row!r}; use error (stop at the first bad row, "
                "naming it) or skip (skip bad rows, counted and reported)."
            )

    def bad(self, where: str, problem: BadRow) -> None:
        """A bad row at `where`: an error, or counted and skipped."""
        message = f"{where} {problem}"
        self.first = self.first or message
        if self.on_bad_row == "error":
            self.refused += 1  # `refuse` raises once the read counted them all
            return
        self.skipped += 1

    def refuse(self, read: int) -> None:
        """With on_bad_row=error, raise for the bad rows among the `read` rows: the first
        named, and `on_bad_row=skip` offered only when it keeps most of the rows."""
        if not self.refused:
            return
        count = f"{self.refused} of the {read} rows" if read > 1 else "the row"
        if 2 * self.refused < read:
            fix = (
                f" Or set dataset.on_bad_row=skip to skip such rows ({count} "
                f"{'is' if self.refused == 1 else 'are'} bad; they are counted and reported "
                "at start-up)."
            )
        else:
            fix = f" ({count} {'is' if count == 'the row' else 'are'} bad.)"
        raise DataError(f"{self.first}{fix}")

    def notes(self) -> dict[str, Any]:
        """What the read counted, kept with a token cache entry (`noted` reads it back)."""
        return {"bad_rows": {k: getattr(self, k) for k in ("seen", "rows", "skipped", "first")}}

    def noted(self, notes: dict[str, Any]) -> BadRows:
        """These counts as `notes` (a token cache entry's) recorded them, if they did."""
        counts = notes.get("bad_rows")
        return self if counts is None else replace(self, **counts)

    def line(self) -> str:
        return (
            f"dataset {self.source} ({self.split}): {self.skipped} of {self.rows} rows skipped "
            f"(dataset.on_bad_row=skip); the first: {self.first}"
        )


@runtime_checkable
class SkipsBadRows(Protocol):
    """A dataset that may skip bad rows; the run reports `bad_rows.line()` when it did."""

    bad_rows: BadRows


def read_split(
    records: Iterable[Record],
    fmt: Format,
    convert: Callable[[dict[str, Any]], T],
    split: Split,
    bad_rows: BadRows,
) -> list[tuple[str, T]]:
    """(where, example) for each record the split takes that `convert` turns into an
    example; the others are bad rows (`bad_rows` counts them, or raises)."""
    examples = []
    for record in records:
        bad_rows.seen += 1
        if not split.takes(fmt.key(record)):
            continue
        bad_rows.rows += 1
        try:
            if record.fields is None:
                raise BadRow(record.problem)
            examples.append((record.where, convert(record.fields)))
        except BadRow as problem:
            bad_rows.bad(record.where, problem)
    bad_rows.refuse(bad_rows.rows)
    return examples


def encode_rows(
    examples: Sequence[tuple[str, T]], encode: Callable[[T], Any], bad_rows: BadRows
) -> tuple[list[Any], list[int]]:
    """Each example encoded, a BadRow counted (or raised) instead; and the indices of the
    examples that were encoded."""
    encoded, kept = [], []
    for i, (where, example) in enumerate(examples):
        try:
            encoded.append(encode(example))
        except BadRow as problem:
            bad_rows.bad(where, problem)
            continue
        kept.append(i)
    bad_rows.refuse(len(examples))
    return encoded, kept


def check_not_empty(count: int, split: Split, source: str, bad_rows: BadRows) -> None:
    """A split with no example is an error naming why: no rows, every row bad, or none
    hashed into it."""
    if count:
        return
    if bad_rows.rows and bad_rows.skipped == bad_rows.rows:
        raise DataError(
            f"every one of the {bad_rows.rows} rows of {source} in the {split.name} split is "
            f"bad and was skipped; the first: {bad_rows.first} Fix the data or its "
            "dataset.format / dataset.columns."
        )
    if split.whole or not bad_rows.seen:
        raise DataError(f"{source} holds no rows; add some.")
    raise DataError(
        f"the {split.name} split of {source} is empty: the split takes a row by a seeded hash "
        f"of its content (val_fraction={split.val_fraction}), and none of the "
        f"{bad_rows.seen} rows went this way. Add rows, raise dataset.val_fraction, or "
        "give the validation rows as dataset.validation_source."
    )
