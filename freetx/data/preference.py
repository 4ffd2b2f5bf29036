"""Preference data: a prompt and two completions of it, the chosen one preferred (DPO and kin).

Source: records of format `preference` (`freetx.data.formats`: `{prompt, chosen,
rejected}` strings; `{prompt: [messages], chosen: [messages], rejected: [messages]}`,
TRL's conversational format; `{chosen: [messages], rejected: [messages]}`, the prompt
being the messages the two share from their start) from any source of
`freetx.data.sources`, or `builtin`: InstructDataset's built-in string tasks with the
right answer chosen and a plausible wrong one rejected (reverse: the word not reversed,
or two neighbouring letters swapped; capitals: the word in lower case, or one letter not
capitalised; length: one off; a word of one letter repeated: a letter short),
deterministic from the seed.

A pair is encoded as four token rows: the prompt, the chosen completion and the
rejected one, each completion with its target flags, and its margin (`margin_row`: the
`margin` column a reward model reads, 0 where the row has none). With a chat template (an
`HFTokenizer` of a folder that has one) the prompt is rendered up to the assistant's
reply (its generation prompt: a string prompt is one user turn) and a completion is
its reply (a string: one assistant turn) located as ChatDataset locates replies
(`freetx.data.chat.rendered_replies`), up to its end-of-turn; without one, the prompt
is BOS + prompt and a completion its text + EOS, as InstructDataset encodes them. The
prompt and the completions are tokenized apart, so chosen and rejected share the
prompt's tokens exactly.

A pair is served as two samples (`token_sample`, [seq_len] each, padded), the prompt's
tokens then the completion's, labels only on the completion (its closing EOS or
end-of-turn included). Cut to seq_len + 1 tokens, the prompt keeps its end: first cut
from its start to `max_prompt_len`, then further as the longer completion needs to
fit, but never below min(its length, seq_len // 2) tokens; then the completions' ends
are cut. The same prompt tokens go with both completions, and at least
seq_len + 1 - seq_len // 2 completion tokens always fit, so no pair is dropped; the
pairs cut are counted (`fit`, printed at start-up).

`collate_pairs` (`freetx.data.batch`) makes a micro-batch of pairs: row 2i the chosen,
row 2i + 1 the rejected of pair i.

`packed=True` serves packs of pairs instead (`freetx.data.packing`: placed by the seed,
each pair taking the positions of its longer completion): a pack is two samples, the
chosen completions of its pairs one after another as documents 0, 1, ... of the first
and their rejected ones in the same order in the second, each document with its own
prompt (`documents` marks them: the model attends within each); the dataset's length is
then the number of packs, and the loss sums each document's log-probs
(`freetx.objectives.sequence_logps`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from freetx.data.batch import with_label, with_margin
from freetx.data.chat import in_spans, rendered_replies
from freetx.data.formats import (
    BadRow,
    Format,
    Messages,
    Pair,
    Unpaired,
    check_not_empty,
    encode_rows,
    read_split,
    source_format,
)
from freetx.data.instruct import (
    BUILTIN_TASKS,
    builtin_draws,
    builtin_tasks_problem,
    check_builtin_format,
    check_builtin_tasks,
    prompt_response_tokens,
)
from freetx.data.packing import DataSummary, pack_lengths, packed_sample, positions_taken
from freetx.data.row_datasets import TokenRowsDataset
from freetx.data.sampling import check_split, split_problems
from freetx.data.seq_len import SeqLenFit, fixed_length_sample
from freetx.data.sources import Record, read_records
from freetx.data.token_rows import Encoded
from freetx.errors import DataError

READS = ("preference",)
# token rows a pair is kept as: the prompt, the chosen, the rejected, its margin (`margin_row`)
ROWS = 4
COMPLETIONS = slice(1, 3)  # of those, the two completions


def margin_row(margin: float) -> Encoded:
    """A pair's margin kept as a token row beside its tokens (in the token cache): its
    float32 bits as two 16-bit ids (a cache of a small vocabulary keeps ids in uint16)."""
    bits = int(np.array(margin, dtype=np.float32).view(np.uint32))
    return [bits >> 16, bits & 0xFFFF], [False, False]


def row_margin(row: Encoded) -> float:
    """The margin `margin_row` kept."""
    high, low = row[0]
    return float(np.array((high << 16) | low, dtype=np.uint32).view(np.float32))


def plausible_wrong(task: str, word: str, rng: random.Random) -> str:
    """A wrong answer to a built-in task that looks like the right one (module docstring)."""
    right = BUILTIN_TASKS[task][1](word)
    if task == "length":
        return str(len(word) + rng.choice((-1, 1)))
    if task == "reverse":
        near = [right[:i] + right[i + 1] + right[i] + right[i + 2 :] for i in range(len(right) - 1)]
    else:
        near = [right[:i] + right[i].lower() + right[i + 1 :] for i in range(len(right))]
    kinds = [[c for c in kind if c != right] for kind in ([word], near)]
    kinds = [kind for kind in kinds if kind] or [[right[:-1]]]  # "xxxx": a letter short
    return rng.choice(rng.choice(kinds))


def builtin_pairs(count: int, seed: int, tasks: list[str] | None = None) -> list[Record]:
    """`count` preference records of the built-in tasks (`tasks`: which; None: all): the
    prompts and right answers of `builtin_examples(count, seed)`, each with a plausible
    wrong answer rejected."""
    rng = random.Random(f"rejected {seed}")
    records = []
    for i, (word, task) in enumerate(builtin_draws(count, seed, tasks)):
        prompt, answer = BUILTIN_TASKS[task]
        fields = {
            "prompt": prompt.format(w=word),
            "chosen": answer(word),
            "rejected": plausible_wrong(task, word, rng),
        }
        records.append(Record(f"builtin pair {i}", fields))
    return records


def preference_problems(values: dict[str, Any], environments: bool = False) -> dict[str, str]:
    """A preference (or prompt) dataset node's settings that no run can have, by key: the
    split's (`split_problems`), a max_prompt_len below 1, tasks that are no built-in
    task (`environments`: or built-in environment)."""
    found = split_problems(values)
    tasks_problem = builtin_tasks_problem(values.get("tasks"), environments)
    if tasks_problem:
        found["tasks"] = tasks_problem
    limit = values.get("max_prompt_len")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        found["max_prompt_len"] = (
            "it is the most prompt tokens a pair keeps (its end); set 1 or more, or leave it "
            "out to cut prompts only as seq_len needs."
        )
    return found


def prompts_format(
    data: Any,
    source: str,
    dataset: str,
    reads: tuple[str, ...],
    default: str,
    what: str,
    problems=preference_problems,
) -> Format:
    """The format of the records of `source` (this split's) for a dataset (`dataset`: its
    class's name; `reads`: the formats it reads, `default`'s by default, or the one its
    first rows' columns are in: `source_format`; the format of `builtin`'s records: `what`),
    once the keys a preference or prompt dataset adds (`data.max_prompt_len`, `data.tasks`)
    are checked (`problems`): a DataError naming the key."""
    values = {"max_prompt_len": data.max_prompt_len, "tasks": data.tasks}
    for key, why in problems(values).items():
        raise DataError(f"dataset.{key}={values[key]!r}: {why}")
    check_builtin_tasks(data.source, data.tasks)
    if data.source == "builtin":
        check_builtin_format(data.format, data.columns, default, what)
    return source_format(source, data.format, data.columns, dataset, reads, default)


@dataclass(frozen=True)
class PairsFit(SeqLenFit):
    """What cutting a split's pairs to seq_len did (`samples`: pairs; `dropped` is 0)."""

    prompts_cut: int = 0  # pairs whose prompt lost its start
    completions_cut: int = 0  # pairs whose longer completion lost its end
    unit: str = "pairs"  # an unpaired dataset's: examples (with their KL rows)

    def line(self) -> str:
        return (
            f"dataset {self.source} ({self.split}): {self.cut} of {self.samples} {self.unit} cut at "
            f"seq_len={self.seq_len} (prompts cut at their start, their end kept: "
            f"{self.prompts_cut}; completions cut at their end: {self.completions_cut}); "
            "none dropped"
        )


@dataclass(eq=False, repr=False)
class PreferenceDataset(TokenRowsDataset):
    """Preference pairs as (chosen, rejected) token samples sharing the prompt's tokens.
    Its keys: `TokenRowsDataset`'s (format: preference, the default and only one; packed:
    several pairs per two sequences, the module docstring), then these."""

    ROWS: ClassVar[int] = ROWS
    UNIT: ClassVar[str] = "pairs"  # what a sample is, said at start-up
    FITTED: ClassVar[slice] = COMPLETIONS  # the completions the prompt's cut makes room for
    _: KW_ONLY
    max_prompt_len: int | None = None  # prompt tokens kept at most (its end)
    tasks: list[str] | None = None  # builtin only: which of its tasks (None: all)
    meaningless = staticmethod(preference_problems)  # checked before it is built

    def __post_init__(self) -> None:
        check_split(self.split, self.val_fraction, self.seq_len)
        fmt = prompts_format(
            self, self.split_source, "PreferenceDataset", READS, "preference", "preference pairs"
        )
        source, rule = self.split_rows()

        def encode() -> Iterable[Encoded]:
            """Every pair of the split encoded (on a cache miss): prompt, chosen, rejected,
            margin."""
            records = (
                builtin_pairs(self.num_builtin_examples, self.seed, self.tasks)
                if source == "builtin"
                else read_records(source, fmt.record_columns)
            )
            pairs = read_split(records, fmt, fmt.preference, rule, self.bad_rows)
            encoded = encode_rows(pairs, self.encode_with_margin, self.bad_rows)[0]
            return [row for rows in encoded for row in rows]

        # max_prompt_len is applied when served; "-margins": the rows' layout since it has one
        rows = self.cached("PreferenceDataset-margins", source, encode, served=("max_prompt_len",))
        check_not_empty(len(rows) // self.ROWS, rule, source, self.bad_rows)
        self.rows, self.pad_id = rows, self.tokenizer.pad_id
        self.prompt_kept, self.fit = self._fit(self.max_prompt_len, self.split, source)
        # packed: the pairs of each pack, placed by the longer completion's positions
        self.packs = (
            pack_lengths(self._lengths().max(axis=1), self.seq_len, self.seed)
            if self.packed
            else None
        )

    def _fit(self, max_prompt_len: int | None, split: str, source: str):
        """The prompt tokens each pair keeps (module docstring), and what the cut did."""
        lengths = self.rows.lengths.reshape(-1, self.ROWS)
        prompt, longest = lengths[:, 0], lengths[:, self.FITTED].max(axis=1)
        kept = prompt if max_prompt_len is None else np.minimum(prompt, max_prompt_len)
        room = self.seq_len + 1
        kept = np.minimum(kept, np.maximum(room - longest, np.minimum(kept, self.seq_len // 2)))
        prompts_cut, completions_cut = kept < prompt, kept + longest > room
        fit = PairsFit(
            split,
            source,
            self.seq_len,
            len(lengths),
            int((prompts_cut | completions_cut).sum()),
            0,
            int(prompts_cut.sum()),
            int(completions_cut.sum()),
            self.UNIT,
        )
        return kept, fit

    def __len__(self) -> int:
        return len(self.rows) // self.ROWS if self.packs is None else len(self.packs)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the chosen sample, the rejected sample) of pair `index`, both with the pair's
        margin; packed: of pack `index`, its pairs' chosen completions in one sample and
        their rejected ones in the other, document d of each being pair d's (no margin)."""
        samples = self.pair_samples(index)
        if self.packs is not None:
            return samples
        margin = torch.tensor(row_margin(self.rows[self.ROWS * index + 3]))
        return tuple(with_margin(sample, margin) for sample in samples)

    def pair_samples(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Sample `index`'s two token samples (`__getitem__`'s, without the margin)."""
        if self.packs is None:
            chosen, rejected = self._encoded(index)
            return tuple(
                fixed_length_sample(e, self.seq_len, self.pad_id) for e in (chosen, rejected)
            )
        pairs = [self._encoded(i) for i in self.packs[index]]
        return tuple(
            packed_sample([pair[k] for pair in pairs], self.seq_len, self.pad_id) for k in (0, 1)
        )

    def _encoded(self, index: int) -> tuple[Encoded, Encoded]:
        """Pair `index` as two token rows: the prompt's kept tokens, then each completion."""
        prompt = self.rows[self.ROWS * index][0]
        prompt = prompt[len(prompt) - int(self.prompt_kept[index]) :]
        rows = (self.rows[self.ROWS * index + k] for k in (1, 2))
        return tuple((prompt + ids, [False] * len(prompt) + targets) for ids, targets in rows)

    def _lengths(self) -> np.ndarray:
        """[pairs, 2]: the tokens of each pair's chosen and rejected rows, as served."""
        lengths = self.rows.lengths.reshape(-1, self.ROWS)[:, COMPLETIONS]
        return lengths + self.prompt_kept[:, None]

    def summary(self) -> DataSummary:
        """Pairs -> sequences, two a pair or a pack (`freetx.data.SummarizesData`)."""
        lengths = self._lengths()
        real = int(positions_taken(lengths.reshape(-1), self.seq_len).sum())
        taken = np.sort(positions_taken(lengths.max(axis=1), self.seq_len))  # a pair's room
        two = tuple(int(n) for n in taken[:2]) if len(taken) > 1 else None
        pairs = len(self.rows) // self.ROWS
        return DataSummary(
            pairs,
            2 * len(self),
            self.seq_len,
            real,
            self.packed,
            unit=self.UNIT,
            two_shortest=two,
            sequences_per_sample=2,
        )

    def encode_with_margin(self, pair: Pair) -> tuple[Encoded, ...]:
        """A pair's token rows as kept: `encode`'s three, then its margin (`margin_row`)."""
        return (*self.encode(pair), margin_row(pair.margin))

    def encode(self, pair: Pair) -> tuple[Encoded, Encoded, Encoded]:
        """The prompt's tokens (no targets) and each completion's with their target flags
        (`encoded_pair`); a BadRow when the pair cannot be rendered."""
        return encoded_pair(self.tokenizer, pair)


def encoded_pair(tokenizer, pair: Pair) -> tuple[Encoded, Encoded, Encoded]:
    """A pair's prompt tokens (no targets) and each completion's with their target flags
    (module docstring: rendered with the tokenizer's chat template where it has one); a
    BadRow when the pair cannot be rendered. A reward model reads a prompt and a
    completion as the prompt's tokens then the completion's (`freetx.objectives.RewardModel`)."""
    if getattr(tokenizer, "chat_template", None) is not None:
        if pair.conversational:
            prompt, chosen, rejected = pair.prompt, pair.chosen, pair.rejected
        else:
            prompt = [_turn("user", pair.prompt)]
            chosen = [_turn("assistant", pair.chosen)]
            rejected = [_turn("assistant", pair.rejected)]
        # the same prompt tokens for both: the text before each reply is the prompt
        # rendered with its generation prompt (`rendered_replies` checks it is)
        (prompt_ids, chosen), (_, rejected) = (
            _reply(tokenizer, prompt, completion) for completion in (chosen, rejected)
        )
        return (prompt_ids, [False] * len(prompt_ids)), chosen, rejected
    prompt, chosen, rejected = _as_strings(pair, type(tokenizer).__name__)
    encoded = [prompt_response_tokens(tokenizer, prompt, c) for c in (chosen, rejected)]
    start = encoded[0][1].index(True)  # the prompt's tokens are those before it
    prompt_ids = encoded[0][0][:start]
    return (prompt_ids, [False] * start), *((ids[start:], t[start:]) for ids, t in encoded)


def _reply(tok, prompt: Messages, completion: Messages) -> tuple[list[int], Encoded]:
    """The prompt rendered with its generation prompt, tokenized; and the completion's
    tokens up to the end of its last reply, with target flags (its replies)."""
    text, spans = rendered_replies(tok, [*prompt, *completion], first=len(prompt))
    start, end = spans[0][0], spans[-1][1]
    ids, offsets = tok.encode_with_offsets(text[start:end])
    return tok.encode(text[:start]), (
        ids,
        in_spans(offsets, [(s - start, e - start) for s, e in spans]),
    )


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _as_strings(pair: Pair, tokenizer: str) -> tuple[str, str, str]:
    """A pair as strings for a tokenizer without a chat template: a conversational pair
    only when it is one user turn and one assistant reply each (else a BadRow)."""
    if not pair.conversational:
        return pair.prompt, pair.chosen, pair.rejected
    roles = [[m["role"] for m in part] for part in (pair.prompt, pair.chosen, pair.rejected)]
    if roles != [["user"], ["assistant"], ["assistant"]]:
        raise BadRow(
            f"is a conversation (roles {roles[0]} then {roles[1]} / {roles[2]}), and "
            f"{tokenizer} has no chat template to render it; use freetx.data.HFTokenizer with "
            "a model folder that has one, or give the pair as prompt/chosen/rejected strings."
        )
    return pair.prompt[0]["content"], pair.chosen[0]["content"], pair.rejected[0]["content"]


def builtin_unpaired(count: int, seed: int, tasks: list[str] | None = None) -> list[Record]:
    """`count` unpaired records of the built-in tasks: `builtin_pairs`' prompts, the even
    ones with their right answer (desirable), the odd ones with the plausible wrong one."""
    return [
        Record(
            record.where.replace("pair", "example"),
            {
                "prompt": record.fields["prompt"],
                "completion": record.fields["chosen" if i % 2 == 0 else "rejected"],
                "label": i % 2 == 0,
            },
        )
        for i, record in enumerate(builtin_pairs(count, seed, tasks))
    ]


def with_kl_completions(
    examples: list[tuple[str, Unpaired]],
) -> list[tuple[str, tuple[Pair, bool]]]:
    """Each example as a pair for the KTO loss: its prompt, its completion, and the
    completion of the nearest example before it (cyclically, in the split's order) whose
    prompt differs, which makes the mismatched (prompt, completion) row that estimates
    KTO's KL baseline; and its label. A DataError when every prompt is the same."""
    pairs = []
    for i, (where, example) in enumerate(examples):
        other = next(
            (
                examples[(i - k) % len(examples)][1]
                for k in range(1, len(examples))
                if examples[(i - k) % len(examples)][1].prompt != example.prompt
                and isinstance(examples[(i - k) % len(examples)][1].completion, list)
                == isinstance(example.completion, list)
            ),
            None,
        )
        if other is None:
            raise DataError(
                f"{where}: no other example of the split has another prompt (and a completion "
                "of the same kind), so KTO has no mismatched (prompt, completion) to estimate "
                "its KL baseline from; give examples of 2 or more prompts."
            )
        pairs.append(
            (where, (Pair(example.prompt, example.completion, other.completion), example.desirable))
        )
    return pairs


@dataclass(eq=False, repr=False)
class UnpairedPreferenceDataset(PreferenceDataset):
    """Unpaired preference examples (KTO's: TRL's `{prompt, completion, label}`, strings or
    conversations; format unpaired), each served as two samples like a preference pair:
    its prompt and completion, labelled desirable or not (`desirable`, on both samples),
    and its prompt with another example's completion (`with_kl_completions`), from which
    the KTO loss estimates its KL baseline. `builtin`: the built-in tasks' prompts, half
    with their right answer (desirable), half with a plausible wrong one. No packing."""

    ROWS: ClassVar[int] = 4  # the prompt, the completion, the KL row's completion, the label
    UNIT: ClassVar[str] = "examples"
    # the prompt is cut for the example's own completion; the KL row's borrowed one is cut
    # at its end where the two do not fit (as TRL truncates it)
    FITTED: ClassVar[slice] = slice(1, 2)

    def __post_init__(self) -> None:
        check_split(self.split, self.val_fraction, self.seq_len)
        if self.packed:
            raise DataError(
                "dataset.packed=true: UnpairedPreferenceDataset serves each example with its "
                "mismatched KL row, one sequence each; set dataset.packed=false."
            )
        fmt = prompts_format(
            self, self.split_source, "UnpairedPreferenceDataset", ("unpaired",), "unpaired",
            "unpaired examples",
        )  # fmt: skip
        source, rule = self.split_rows()

        def encode() -> Iterable[Encoded]:
            """Every example of the split encoded (on a cache miss): its prompt, its
            completion, the KL row's completion, its label (one id: 1 desirable, 0 not)."""
            records = (
                builtin_unpaired(self.num_builtin_examples, self.seed, self.tasks)
                if source == "builtin"
                else read_records(source, fmt.record_columns)
            )
            examples = read_split(records, fmt, fmt.unpaired, rule, self.bad_rows)
            encoded = encode_rows(with_kl_completions(examples), self.encode_example, self.bad_rows)
            return [row for rows in encoded[0] for row in rows]

        rows = self.cached("UnpairedPreferenceDataset", source, encode, served=("max_prompt_len",))
        check_not_empty(len(rows) // self.ROWS, rule, source, self.bad_rows)
        self.rows, self.pad_id = rows, self.tokenizer.pad_id
        self.prompt_kept, self.fit = self._fit(self.max_prompt_len, self.split, source)
        self.packs = None

    def encode_example(self, example: tuple[Pair, bool]) -> tuple[Encoded, ...]:
        """An example's token rows: `encode`'s three (the prompt, its completion, the KL
        row's), then its label as a row of one id."""
        pair, desirable = example
        return (*self.encode(pair), ([int(desirable)], [False]))

    def desirable(self, index: int) -> bool:
        """Whether example `index`'s completion is desirable."""
        return bool(self.rows[self.ROWS * index + 3][0][0])

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the example's sample, its KL row's sample), both with its label."""
        samples = self.pair_samples(index)
        label = torch.tensor(self.desirable(index))
        return tuple(with_label(sample, label) for sample in samples)
