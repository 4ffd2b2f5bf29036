"""The built-in language environments' own data (`freetx.envs.BUILTIN_ENVS`), as the
`builtin` source of a dataset whose `tasks` names them: prompt rows for RL
(PromptDataset: a `prompt` and the fields the environment reads: an answer, a secret, a
goal) and demonstrations for the SFT before it (ChatDataset: whole conversations, tool
calls and results included). Several environments share the count and alternate, row by
row, deterministic from the seed; each environment is built with its defaults, the ones
its GRPO config's `env:` keeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetx.data.sources import Record
from freetx.envs import BUILTIN_ENVS, ProvidesTools
from freetx.envs.tools import tool_schema


def environment_tasks(tasks: Any) -> list[str]:
    """The names in a dataset's `tasks` that are built-in environments."""
    listed = isinstance(tasks, Sequence) and not isinstance(tasks, str)
    return [t for t in tasks if t in BUILTIN_ENVS] if listed else []


def environment_problem(tasks: Any) -> str | None:
    """Why `tasks` cannot mix environments with string tasks, or None."""
    named = environment_tasks(tasks)
    if named and len(named) != len(tasks):
        others = [t for t in tasks if t not in BUILTIN_ENVS]
        return (
            f"it names built-in environments ({', '.join(named)}) and string tasks "
            f"({', '.join(map(str, others))}), whose data differ (conversations with fields "
            "for an environment, or one answer); list one kind."
        )
    return None


def _interleaved(parts: list[list[Any]]) -> list[Any]:
    return [part[i] for i in range(max(map(len, parts))) for part in parts if i < len(part)]


def environment_rows(tasks: list[str], count: int, seed: int) -> list[Record]:
    """`count` prompt records of the environments `tasks` (a prompt and its fields)."""
    share = -(-count // len(tasks))
    parts = [BUILTIN_ENVS[t]().rows(share, seed) for t in tasks]
    rows = _interleaved(parts)[:count]
    return [Record(f"builtin prompt {i}", row) for i, row in enumerate(rows)]


def environment_demonstrations(tasks: list[str], count: int, seed: int) -> list[Record]:
    """`count` conversations of the environments `tasks` (format messages), each with the
    schemas of its environment's tools (column `tools`)."""
    share = -(-count // len(tasks))
    parts = []
    for task in tasks:
        env = BUILTIN_ENVS[task]()
        tools = [tool_schema(f) for f in env.tools()] if isinstance(env, ProvidesTools) else None
        parts.append(
            [{"messages": talk, "tools": tools} for talk in env.demonstrations(share, seed)]
        )
    talks = _interleaved(parts)[:count]
    return [Record(f"builtin example {i}", fields) for i, fields in enumerate(talks)]
