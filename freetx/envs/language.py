"""Language environments: what a multi-turn episode of online RL talks to (a GRPO config's
`env:`, docs/environments.md).

An episode starts from a dataset row: its prompt as messages and its other fields (an
answer, a secret, a goal). The environment gives the first messages (`reset`); the model
replies; a reply that calls tools gets their results (`freetx.envs.tools`); a reply that
calls none goes to the environment (`step`), which answers with its next messages (a
user turn, an observation), a reward for the turn, and whether the episode is over.

Both methods are functions of the row and the conversation so far, never of hidden state
or a clock: an environment must be deterministic given the row and the model's actions,
so that an episode replays exactly at any world size and after a resume (the model's
draws are keyed by the run's seed, the step, the prompt, the completion and the turn).
Either may be a plain or an `async` method; each call has the run's deadline.

A message is a dict: `role` (system, user, assistant, tool), `content`, and for an
assistant reply that called tools, `tool_calls` ([{"type": "function", "function":
{"name", "arguments"}}], as transformers' chat templates read them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]


@dataclass
class Turn:
    """What the environment answers to a reply: its next messages (none when the episode
    is over), the turn's reward (added to the episode's) and whether the episode ends."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class LanguageEnvironment(Protocol):
    """A multi-turn environment (module docstring): deterministic given the row and the
    conversation; `reset` and `step` may be `async`."""

    def reset(
        self, messages: list[Message], row: Mapping[str, Any]
    ) -> list[Message] | Awaitable[list[Message]]:
        """The episode's first messages, from the row's prompt (`messages`) and fields."""
        ...

    def step(self, messages: list[Message], row: Mapping[str, Any]) -> Turn | Awaitable[Turn]:
        """The next turn, given the whole conversation, whose last message is the model's
        reply (`content`: its text)."""
        ...


@runtime_checkable
class ProvidesTools(Protocol):
    """An environment whose tools the model may call (the calculator's `calculate`): plain
    functions or bound methods, each described to the model by its signature and
    docstring (`freetx.envs.tools.tool_schema`)."""

    def tools(self) -> list[Callable[..., Any]]: ...


@runtime_checkable
class BuiltinTask(Protocol):
    """A built-in environment's own data (`dataset.source: builtin`, `tasks: [NAME]`):
    prompt rows for RL (`rows`: a `prompt` and the fields the environment reads) and
    demonstrations for the SFT before it (`demonstrations`: whole conversations)."""

    name: str

    def rows(self, count: int, seed: int) -> list[dict[str, Any]]: ...

    def demonstrations(self, count: int, seed: int) -> list[list[Message]]: ...


def last_reply(messages: list[Message]) -> str:
    """The content of a conversation's last assistant message ("" when there is none)."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


class SingleReply:
    """The environment of a run with tools and no `env:`: a reply that calls no tool ends
    the episode (TRL's tool loop); the rewards score the conversation."""

    def reset(self, messages: list[Message], row: Mapping[str, Any]) -> list[Message]:
        return messages

    def step(self, messages: list[Message], row: Mapping[str, Any]) -> Turn:
        return Turn(done=True)
