"""Chat data: conversations rendered with the model's chat template, loss on assistant turns.

Source: records in any format of `freetx.data.formats` (messages, the default:
`{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`;
sharegpt; alpaca and prompt_response as one user turn and one assistant turn), from
any source of `freetx.data.sources`, or `builtin`: InstructDataset's built-in string
tasks as user/assistant turns.
Each conversation is rendered with the tokenizer's chat template (an
`HFTokenizer` read from a model folder) and tokenized as transformers'
`apply_chat_template(messages, tokenize=True)` does: no special tokens beyond
those the template writes (it writes BOS where the model wants one).

Labels are IGNORE_INDEX everywhere but on the assistant's tokens: its content and
the end-of-turn token(s) the template closes it with, not the role header before
it (the model is given that). Assistant message i is located in the rendered
conversation by three renderings: up to it with the generation prompt (what the
model sees before it replies: the reply starts where that ends); the whole
conversation with a mark after the message's content (where the two differ, the
content ends, however the template rewrote it: Qwen3 drops the reasoning of
earlier replies); and the conversation up to and including it, with and without
a generation prompt after it: the tokens these two and the whole conversation
share after the content are the end of the turn (Llama 3's <|eot_id|>, ChatML's
<|im_end|>, Phi-3's <|end|>, Gemma's <end_of_turn>), without the whitespace after
it and without what a template writes only at the end of a conversation (Phi-3's
<|endoftext|>). A token is the reply's if it starts in those characters. A
template that renders no generation prompt leaves the header in the reply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from freetx.data.formats import BadRow, Messages, check_not_empty, encode_rows, read_split
from freetx.data.instruct import builtin_tasks_problem, check_builtin_tasks, dataset_records
from freetx.data.row_datasets import TokenRowsDataset
from freetx.data.sampling import check_split, split_problems
from freetx.data.token_rows import Encoded
from freetx.data.token_samples import TokenSamples
from freetx.errors import DataError


def chat_problems(values: dict) -> dict[str, str]:
    """A chat dataset node's settings no run can have: the split's, and `tasks` that are no
    built-in string tasks or environments."""
    found = split_problems(values)
    problem = builtin_tasks_problem(values.get("tasks"), environments=True)
    if problem:
        found["tasks"] = problem
    return found


@dataclass(eq=False, repr=False)
class ChatDataset(TokenRowsDataset, TokenSamples):
    """Chat conversations as fixed-length samples with loss on the assistant's tokens.

    A sample is {"input_ids", "labels"}, each [seq_len]: the conversation's tokens
    cut to `seq_len + 1` and padded with PAD, labels the next token where it is
    the assistant's and IGNORE_INDEX elsewhere (padding included). Its keys:
    `TokenRowsDataset`'s, `source` and `seq_len` required (format: messages, the default,
    sharegpt, alpaca, prompt_response).
    """

    source: str = field()  # no default
    seq_len: int = field()
    # builtin only: which string tasks, or which built-in environments' demonstrations
    # (freetx.data.env_tasks); None: every string task
    tasks: list[str] | None = None
    meaningless = staticmethod(chat_problems)  # checked before it is built

    def __post_init__(self) -> None:
        check_split(self.split, self.val_fraction, self.seq_len)
        for key, why in chat_problems({"tasks": self.tasks}).items():
            raise DataError(f"dataset.{key}={self.tasks!r}: {why}")
        check_builtin_tasks(self.source, self.tasks)
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                f"ChatDataset needs a tokenizer with a chat template, and {type(tokenizer).__name__}"
                " has none; use freetx.data.HFTokenizer with a model folder that has one "
                "(chat_template.jinja, or chat_template in tokenizer_config.json), or train on "
                "prompt/response data with freetx.data.InstructDataset."
            )
        source, rule = self.split_rows()

        def encode() -> list[Encoded]:
            """Every conversation of the split rendered (on a cache miss): a template that
            does not fit the data fails at startup (or skips the row)."""
            records, fmt = dataset_records(
                source,
                self.format,
                self.columns,
                "ChatDataset",
                "messages",
                self.num_builtin_examples,
                self.seed,
                self.tasks,
            )
            talks = read_split(records, fmt, fmt.conversation_and_tools, rule, self.bad_rows)
            return encode_rows(talks, self.encode, self.bad_rows)[0]

        rows = self.cached("ChatDataset", source, encode)
        check_not_empty(len(rows), rule, source, self.bad_rows)
        # conversations whose replies lie past seq_len are counted and dropped
        TokenSamples.__init__(
            self, rows, self.seq_len, tokenizer.pad_id, self.split, source, self.packed, self.seed
        )

    def encode(self, talk: tuple[Messages, list[dict] | None]) -> Encoded:
        """A conversation's token ids (rendered with the schemas of the tools it may call),
        and for each whether it is the assistant's; a BadRow when the chat template cannot
        render it or its replies cannot be found."""
        messages, tools = talk
        text, spans = rendered_replies(self.tokenizer, messages, tools=tools)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        return ids, in_spans(offsets, spans)


def rendered_replies(
    tok, messages: Messages, first: int = 0, tools: list[dict] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """A conversation rendered with the chat template (and the schemas of the `tools` it
    may call), and the characters of each assistant reply from message `first` on (see the
    module docstring); a BadRow when the template cannot render it or its replies cannot
    be found."""

    def render(talk: Messages, add_generation_prompt: bool = False) -> str:
        return tok.apply_chat_template(talk, add_generation_prompt, tools=tools)

    try:
        text = render(messages)
        spans = [
            _reply_span(render, tok, messages, i, text)
            for i, message in enumerate(messages)
            if i >= first and message["role"] == "assistant"
        ]
    except DataError as e:
        raise BadRow(f"cannot be rendered: {e}") from None
    return text, spans


def in_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """For each token (its character offsets), whether it starts in one of the spans."""
    return [any(start <= s < end for start, end in spans) for s, _ in offsets]


# appended to a reply's content to find where the template writes it (never in a text)
_MARK = "\x00"


def _reply_span(render, tok, messages: Messages, i: int, text: str) -> tuple[int, int]:
    """The characters of `text` (the whole rendered conversation) that are message i's;
    `render(messages, add_generation_prompt)`: the chat template's text."""
    prompt = render(messages[:i], True)
    marked = [*messages[:i], {**messages[i], "content": messages[i]["content"] + _MARK}]
    end = _content_end(text, render(marked + messages[i + 1 :]))
    turn = render(messages[: i + 1])
    turn_end = _content_end(turn, render(marked))
    if not text.startswith(prompt) or end is None or turn_end is None or end < len(prompt):
        raise DataError(
            f"the chat template renders the conversation up to message {i} (an "
            "assistant reply) differently from the way it renders it inside the longer "
            "conversation, so the reply's tokens cannot be located. Use a template that renders "
            "earlier turns the same whatever follows them, or put each assistant turn of such "
            "conversations in a record of its own."
        )
    opened = render(messages[: i + 1], True)
    tails = [turn[turn_end:], opened[turn_end:], text[end : end + len(turn) - turn_end]]
    encoded = [tok.encode_with_offsets(tail) for tail in tails]
    shared = len(os.path.commonprefix([ids for ids, _ in encoded]))
    end_of_turn = tails[0][: encoded[0][1][shared - 1][1]] if shared else ""
    return len(prompt), end + len(end_of_turn.rstrip())


def _content_end(text: str, marked: str) -> int | None:
    """Where a message's content ends in `text`, given `marked`, the same rendering with
    _MARK after that content: the two differ up to there (None: the mark is not once in it)."""
    if marked.count(_MARK) != 1:
        return None
    return len(text) - len(os.path.commonprefix([text[::-1], marked[::-1]]))


# -- multi-turn episodes: the tokens around a generated reply -----------------------------

# the stand-in user turn a continuation is rendered after (nothing a template rewrites)
_STAND_IN = {"role": "user", "content": "x"}


def chat_prompt_ids(tok, messages: Messages, tools: list[dict] | None = None) -> list[int]:
    """A prompt's tokens: `messages` rendered with the chat template (with the schemas of
    `tools`) and its generation prompt, tokenized as rendered (PromptDataset's prompts, an
    episode's first tokens, a judge's input)."""
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools))


def continuation_ids(
    tok,
    reply: dict,
    new: Messages,
    reply_ids: list[int],
    ended: bool,
    tools: list[dict] | None,
) -> list[int]:
    """The tokens that follow a generated reply in an episode's trained sequence, without
    re-rendering the conversation (whose template may rewrite history: Qwen3 drops the
    reasoning of earlier replies), so the generated tokens stay exactly as sampled:

    1. the rest of the template's close of an assistant turn after the end token the
       model generated (ChatML's newline after <|im_end|>); all of it for a reply cut
       before its end token (or ended by another one);
    2. the `new` messages as the template renders them after an assistant turn, then its
       generation prompt: what a stand-in conversation ending in `reply` (the reply's
       message, its tool calls with it) gains after the reply's content when `new` follow
       it.

    A DataError when the template ends the turn differently once messages follow it (no
    suffix to append)."""
    marked = [_STAND_IN, {"role": "assistant", "content": _MARK}]
    close = tok.apply_chat_template(marked).split(_MARK, 1)[1]
    close_ids = tok.encode(close)
    if ended and close_ids and reply_ids and reply_ids[-1] == close_ids[0]:
        close_ids = close_ids[1:]
    # after the reply's (marked) content: what the turn alone ends with, and what the
    # conversation goes on with (a template may write the reply itself differently when
    # it is the last message, as Qwen3 writes an empty <think> block before it)
    before = [_STAND_IN, {**reply, "content": _MARK}]
    base = tok.apply_chat_template(before, tools=tools).split(_MARK, 1)[1]
    full = tok.apply_chat_template([*before, *new], add_generation_prompt=True, tools=tools)
    full = full.split(_MARK, 1)[1]
    if not full.startswith(base):
        raise DataError(
            "the chat template renders an assistant turn differently once more messages "
            "follow it, so the environment's messages cannot be appended to the generated "
            "tokens as a suffix; use a template that renders a turn's end the same whatever "
            "follows."
        )
    return close_ids + tok.encode(full[len(base) :])
