"""Rewards: what an online RL run (GRPO) scores each completion with.

A reward is a function of (prompt, completion, row) -> a finite number (`RewardFunction`):
the prompt's text, the completion's text, and the dataset row's other fields (an
`answer` column, a task name, ...) with `completion_tokens`, the completion's length in
tokens, put there by the recipe. The config lists them, each with a weight:

    rewards:
      - {_component_: freetx.objectives.ExactMatch, extract: hash, weight: 1.0}
      - {_component_: freetx.objectives.RegexFormat, pattern: '(?s).*#### .+', weight: 0.2}
      - {_component_: my_rewards.count_words, weight: 0.1, name: words}

A class is built with the node's keys (`freetx.config.instantiate`); a plain function,
a user's own found on PYTHONPATH as every `_component_` is, is the reward itself. A reward
may also be TRL's batched form, taken unchanged (`BatchedReward`: a signature naming
`completions`): f(prompts, completions, completion_ids, **columns) -> a list of floats,
None where it does not apply. `build_rewards` checks each can be called in its form
before anything runs; `score_completions` calls them, each call with a deadline
(`reward_timeout_s`, `freetx.objectives.deadline`), and a reward that raises, returns no
finite number or passes its deadline stops the run with a `RewardError` naming the reward
and the row: never a silent 0 (docs/rewards.md).

Built in: `ExactMatch` (the answer extracted from the completion equals the row's; GSM8K's
`#### 72`, `\\boxed{72}`), `RegexFormat` (the completion fits a pattern) and `LengthPenalty`
(DAPO's overlong shaping).
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch
from omegaconf import ListConfig, OmegaConf

from freetx.config.instantiate import (
    COMPONENT,
    import_component,
    instantiate_except,
    is_component,
    node_path,
)
from freetx.errors import ConfigError, TrainingError
from freetx.objectives.deadline import call_named

if TYPE_CHECKING:
    from freetx.distributed import ParallelPlan

HELD = ("weight", "name")  # a reward node's keys the recipe reads (the rest are the target's)
SIGNATURE = "def reward(prompt: str, completion: str, row: dict) -> float"
TRL_SIGNATURE = "def reward(prompts, completions, completion_ids, **kwargs) -> list[float]"
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")  # passed by keyword, as TRL does
REWARD_TIMEOUT_S = 60.0  # a reward call's deadline unless the config sets reward_timeout_s
EXTRACTORS = ("none", "hash", "boxed")
_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+|\d+)(\.\d*)?|[+-]?\.\d+")


class RewardError(TrainingError):
    """A reward that cannot score a completion: it raised, returned no finite number, or
    the row lacks a field it reads."""


class RewardFunction(Protocol):
    """freetx's form of a reward: one completion's score (a finite number)."""

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float: ...


class BatchedReward(Protocol):
    """TRL's form, taken unchanged: every completion of a batch scored in one call, each
    argument by keyword, the rows' columns as lists in `kwargs`; a conversation's prompt
    is its messages and its completion [{"role": "assistant", "content": text}]. None for
    a completion: the reward does not apply to it (TRL's meaning)."""

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        **kwargs: Any,
    ) -> list[float | None]: ...


@runtime_checkable
class HoldsModel(Protocol):
    """A reward that runs a model of its own (`freetx.objectives.Judge`): the recipe places
    it on the run's device once, at setup, before any reward is called (with the
    policy's `plan`: sharded like it), and the rollout gathers it whole around each
    scoring, on every rank at once (`gathered`)."""

    def place(self, device: torch.device, plan: ParallelPlan | None = None) -> None: ...

    def gathered(self) -> AbstractContextManager[None]: ...


def place_rewards(
    rewards: Sequence[Reward], device: torch.device, plan: ParallelPlan | None = None
) -> None:
    """Each reward that holds a model (`HoldsModel`) placed on `device` (sharded like the
    policy of `plan`, when given)."""
    for reward in rewards:
        if isinstance(reward.function, HoldsModel):
            reward.function.place(device, plan)


@contextmanager
def models_gathered(rewards: Sequence[Reward]):
    """The models of the rewards that hold one gathered whole inside (every rank enters
    together, whether it has completions to score or not)."""
    with ExitStack() as stack:
        for reward in rewards:
            if isinstance(reward.function, HoldsModel):
                stack.enter_context(reward.function.gathered())
        yield


class Reward(NamedTuple):
    """A built reward: its name (metrics `rewards/<name>/mean`), function and weight;
    `batched`: TRL's form (`BatchedReward`)."""

    name: str
    function: RewardFunction | BatchedReward
    weight: float
    batched: bool = False


def is_batched(function: Any) -> bool:
    """Whether a reward is TRL's batched form: its signature names `completions` (freetx's
    form takes one `completion`)."""
    try:
        return "completions" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature: freetx's form, the first call says
        return False


def _field(row: Mapping[str, Any], field: str, reward: str) -> Any:
    """The row's `field`, or a RewardError naming it and the fields the row has."""
    if field not in row:
        raise RewardError(
            f"{reward} reads the row's field '{field}', and the row has "
            + (f"only {', '.join(sorted(map(str, row)))}" if row else "no fields")
            + "; add the column to the data, or point the reward at another one."
        )
    return row[field]


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces included), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None  # never closed


def extracted(text: str, extract: str) -> str | None:
    """The answer in `text` by `extract` (`ExactMatch`), stripped; None when there is none."""
    if extract == "hash":
        found = text.rpartition("####")
        return found[2].strip() if found[1] else None
    if extract == "boxed":
        found = _boxed(text)
        return None if found is None else found.strip()
    return text.strip()


def _number(text: str) -> Decimal | None:
    """`text` as a number (commas between thousands allowed), else None."""
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def same_answer(a: str, b: str) -> bool:
    """Equal after stripping; as numbers when both are ("3.0" == "3", "1,000" == "1000")."""
    a, b = a.strip(), b.strip()
    x, y = _number(a), _number(b)
    return x == y if x is not None and y is not None else a == b


class ExactMatch:
    """1.0 when the answer extracted from the completion equals the row's, else 0.0.

    `extract`: none (the whole completion), hash (GSM8K: the text after the last
    "####"), boxed (the content of the last \\boxed{...}); a completion without one
    scores 0.0. When the row's answer holds the marker too (GSM8K's `answer` column: the
    worked solution ending in "#### 72"), its answer is extracted the same way.
    """

    def __init__(self, answer_field: str = "answer", extract: str = "none") -> None:
        if extract not in EXTRACTORS:
            raise ValueError(
                f"extract={extract!r} is no extractor; use none (the whole completion), hash "
                "(the text after the last ####) or boxed (the last \\boxed{...})."
            )
        self.answer_field, self.extract = answer_field, extract

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        answer = str(_field(row, self.answer_field, "ExactMatch"))
        given = extracted(completion, self.extract)
        if given is None:
            return 0.0
        answer = extracted(answer, self.extract) or answer  # the row's own marker, if any
        return 1.0 if same_answer(given, answer) else 0.0


class RegexFormat:
    """1.0 when the completion fits `pattern` (all of it: `full_match`; else anywhere)."""

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """A pattern that is no regular expression (`freetx validate` says so too)."""
        pattern = values.get("pattern")
        if isinstance(pattern, str):
            try:
                re.compile(pattern)
            except re.error as e:
                return {"pattern": f"{pattern!r} is no regular expression ({e}); fix it."}
        return {}

    def __init__(self, pattern: str, full_match: bool = True) -> None:
        problems = self.meaningless({"pattern": pattern})
        if problems:
            raise ValueError(problems["pattern"])
        self.pattern, self.full_match = re.compile(pattern), full_match

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        match = self.pattern.fullmatch if self.full_match else self.pattern.search
        return 1.0 if match(completion) else 0.0


class LengthPenalty:
    """DAPO's overlong shaping of a completion of L = row["completion_tokens"] tokens: 0
    up to max_tokens - soft_tokens, falling linearly to -1 at max_tokens, -1 beyond."""

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """A soft zone that is empty or wider than the limit (`freetx validate` too)."""
        most, soft = values.get("max_tokens"), values.get("soft_tokens")
        if isinstance(most, int) and most < 1:
            return {"max_tokens": "it is the completion's length limit; set 1 or more."}
        if isinstance(soft, int) and (soft < 1 or (isinstance(most, int) and soft > most)):
            return {
                "soft_tokens": f"it is the tokens before max_tokens where the penalty ramps "
                f"from 0 to -1; set 1 to max_tokens ({most}), e.g. max_tokens // 4."
            }
        return {}

    def __init__(self, max_tokens: int, soft_tokens: int) -> None:
        values = {"max_tokens": max_tokens, "soft_tokens": soft_tokens}
        for key, why in self.meaningless(values).items():
            raise ValueError(f"{key}={values[key]!r}: {why}")
        self.max_tokens, self.soft_tokens = max_tokens, soft_tokens

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        length = _field(row, "completion_tokens", "LengthPenalty")
        free = self.max_tokens - self.soft_tokens
        if length <= free:
            return 0.0
        if length > self.max_tokens:
            return -1.0
        return (free - length) / self.soft_tokens


def snake_case(name: str) -> str:
    """ExactMatch -> exact_match; count_words stays."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def build_rewards(nodes: Any, required: bool = True) -> list[Reward]:
    """The config's `rewards:` list built (module docstring): each node's weight (default
    1.0) and name (default: its class's or function's, in snake_case; a repeat gets _2,
    _3, ...), each function checked to take (prompt, completion, row). ConfigError, naming
    the node's path, for anything wrong, before any reward runs; for an empty list when
    the rewards are `required` (an environment's own rewards may do without)."""
    if isinstance(nodes, (list, tuple)):
        nodes = OmegaConf.create({"rewards": list(nodes)}).rewards  # paths: rewards[i]
    if isinstance(nodes, ListConfig) and not len(nodes) and not required:
        return []
    if not isinstance(nodes, ListConfig) or not len(nodes):
        raise ConfigError(
            f"rewards is {nodes!r}, and a run scores its completions with at least one "
            "reward; list them, e.g. rewards: [{_component_: freetx.objectives.ExactMatch, "
            "weight: 1.0}] (docs/rewards.md)."
        )
    built, names = [], set()
    for i, node in enumerate(nodes):
        where = node_path(node, f"rewards[{i}]")
        name, function, weight = _built(node, where)
        unique, n = name, 1
        while unique in names:
            n += 1
            unique = f"{name}_{n}"
        names.add(unique)
        built.append(Reward(unique, function, weight, is_batched(function)))
    return built


def _built(node: Any, where: str) -> tuple[str, RewardFunction, float]:
    """One reward node's name, function (checked) and weight."""
    if not is_component(node):
        raise ConfigError(
            f"{where} is {node!r}; a reward is a node with a _component_ naming a reward "
            "class or function, e.g. {_component_: freetx.objectives.ExactMatch, weight: 1.0}."
        )
    weight = node.get("weight", 1.0)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, numbers.Real)
        or not math.isfinite(weight)
    ):
        raise ConfigError(
            f"{where}.weight is {weight!r}; a weight is a finite number (the reward's share "
            "of the total: 1.0, 0.5, or 0 to log it only)."
        )
    name = node.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"{where}.name is {name!r}; name it with a word, e.g. name: format.")
    dotted = node[COMPONENT]
    default, function = function_of(node, where, HELD, "reward")
    _check_callable(function, dotted, where)
    return name or snake_case(default), function, float(weight)


def function_of(node: Any, where: str, held: tuple[str, ...], what: str) -> tuple[str, Any]:
    """A node naming user code (a reward, a tool): a class is built with the node's keys
    but `held` (its instance is the function), a function is the function itself and
    takes no keys; and its default name (the class's or function's)."""
    dotted = node[COMPONENT]
    target = import_component(dotted, f"{where}.{COMPONENT}")
    if inspect.isclass(target):
        return target.__name__, instantiate_except(node, held)
    extra = [k for k in node if k not in (COMPONENT, *held)]
    if extra:
        raise ConfigError(
            f"{where}: {dotted} is a function, so it is the {what} itself and takes no "
            f"settings from the config, but the node sets {', '.join(map(str, extra))}; "
            "remove them, or write a class whose __init__ takes them and whose __call__ "
            f"is the {what}."
        )
    return getattr(target, "__name__", what), target


def _check_callable(function: Any, dotted: str, where: str) -> None:
    """Refuse a reward that cannot be called in its form: function(prompt, completion,
    row), or TRL's function(prompts=, completions=, completion_ids=, **columns)."""
    if not callable(function):
        raise ConfigError(
            f"{where}: {dotted} builds a {type(function).__name__}, which cannot be called; "
            f"a reward is a function {SIGNATURE}, or a class whose __call__ is one."
        )
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have none: the first call says
        return
    if is_batched(function):
        keywords = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        try:
            signature.bind_partial(**dict.fromkeys(TRL_ARGUMENTS, []))  # columns: at run
        except TypeError as e:
            keywords, why = False, f" ({e})"
        else:
            why = "" if keywords else " (it has no **kwargs)"
        if not keywords:
            raise ConfigError(
                f"{where}: {dotted}{signature} names `completions`, so it is read as TRL's "
                f"batched form, and it cannot be called as one{why}; write it as "
                f"{TRL_SIGNATURE}: the rows' columns come as keyword lists in kwargs "
                "(docs/rewards.md)."
            )
        return
    try:
        signature.bind("prompt", "completion", {})
    except TypeError as e:
        raise ConfigError(
            f"{where}: {dotted}{signature} cannot be called with a reward's three arguments "
            f"({e}); write it as {SIGNATURE}: the prompt's text, the completion's text and "
            f"the row's other fields with completion_tokens; or as TRL's {TRL_SIGNATURE} "
            "(docs/rewards.md)."
        ) from None


def _short(text: str, most: int = 80) -> str:
    """`text` as a repr of at most about `most` characters."""
    return repr(text if len(text) <= most else text[: most - 3] + "...")


def score_completions(
    rewards: Sequence[Reward],
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    row_ids: Sequence[str],
    *,
    completion_ids: Sequence[list[int]] | None = None,
    conversations: Sequence[list[dict[str, str]] | None] | None = None,
    timeout_s: float = REWARD_TIMEOUT_S,
    stop: Callable[[], bool] | None = None,
    completion_messages: Sequence[list[dict[str, Any]]] | None = None,
) -> torch.Tensor:
    """[R, len(rewards)] float32: each reward's own value for each completion (unweighted;
    the recipe weights them: `weighted`); NaN where a TRL-style reward returned None (it
    does not apply). Each call has `timeout_s` seconds, and `stop` (a stop signal came)
    abandons the wait (`call_with_deadline`: Interrupted). A reward that raises, returns
    no finite number or passes its deadline, or a completion no reward applies to, raises
    RewardError naming the reward, the row and a shortened prompt and completion.
    `completion_ids` (each completion's tokens) and `conversations` (each prompt's
    messages, None for a string) are what TRL's form reads besides the texts;
    `completion_messages`: each completion as messages (a multi-turn episode's, after its
    prompt), TRL's completions of a conversation."""
    scenes = [
        f"on {row_id} (prompt {_short(prompt)}, completion {_short(completion)})"
        for prompt, completion, row_id in zip(prompts, completions, row_ids, strict=True)
    ]
    scores = torch.empty(len(completions), len(rewards), dtype=torch.float32)
    for j, reward in enumerate(rewards):
        if reward.batched:
            where = (
                f"reward {reward.name} on the {len(rows)} completions of {row_ids[0]} .. "
                f"{row_ids[-1]} (first prompt {_short(prompts[0])})"
            )
            arguments = _trl_arguments(
                prompts, completions, rows, completion_ids, conversations, completion_messages
            )
            values = _called(reward.function, where, timeout_s, stop, **arguments)
            scores[:, j] = _trl_values(values, reward.name, scenes, where)
            continue
        for i, arguments in enumerate(zip(prompts, completions, rows, strict=True)):
            scene = f"reward {reward.name} {scenes[i]}"
            scores[i, j] = _finite(
                _called(reward.function, scene, timeout_s, stop, *arguments), scene
            )
    for i in scores.isnan().all(dim=1).nonzero().flatten().tolist():
        raise RewardError(
            f"no reward applies to the completion {scenes[i]}: each of "
            f"{', '.join(r.name for r in rewards)} returned None. Score every completion "
            "with at least one reward (a reward of its task, or one that applies to all)."
        )
    return scores


def _called(
    function: Callable[..., Any],
    scene: str,
    timeout_s: float,
    stop: Callable[[], bool] | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A reward's call, with its deadline (`call_named`; Interrupted passes through); a
    RewardError naming `scene` when it raises or passes the deadline."""
    fix = "Fix the reward (or the data it reads); a failing reward is never counted as 0."
    return call_named(
        function,
        *args,
        scene=scene,
        key="reward_timeout_s",
        timeout_s=timeout_s,
        error=RewardError,
        fix=fix,
        stop=stop,
        **kwargs,
    )


def _finite(value: Any, scene: str) -> float:
    """`value` as a float, or a RewardError: it is no finite number."""
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(
            f"{scene} returned {value!r}, not a finite number; a reward returns a "
            "float (e.g. 1.0 right, 0.0 wrong) for every completion."
        )
    return float(value)


def _trl_arguments(
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    completion_ids: Sequence[list[int]] | None,
    conversations: Sequence[list[dict[str, str]] | None] | None,
    completion_messages: Sequence[list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """TRL's arguments for a batch (`BatchedReward`): every one by keyword, a conversation's
    prompt as its messages and its completion as one assistant message (an episode's: its
    messages), each column of the rows as a list (None where a row lacks it)."""
    talks = list(conversations) if conversations else [None] * len(prompts)
    columns = dict.fromkeys(k for row in rows for k in row if k not in TRL_ARGUMENTS)
    if completion_messages is not None:
        said = list(completion_messages)
    else:
        said = [
            c if talk is None else [{"role": "assistant", "content": c}]
            for c, talk in zip(completions, talks)
        ]
    return {
        "prompts": [p if talk is None else talk for p, talk in zip(prompts, talks)],
        "completions": said,
        "completion_ids": [list(ids) for ids in completion_ids or [[] for _ in prompts]],
        **{key: [row.get(key) for row in rows] for key in columns},
    }


def _trl_values(values: Any, name: str, scenes: Sequence[str], where: str) -> torch.Tensor:
    """A TRL-style reward's list: one finite number or None (NaN: not applicable) per
    completion; else a RewardError naming the completion."""
    listed = isinstance(values, (list, tuple))
    if not listed or len(values) != len(scenes):
        got = f"a list of {len(values)}" if listed else repr(values)[:40]
        raise RewardError(
            f"{where} returned {got}, not a list of {len(scenes)} values; a TRL-style "
            "reward returns one float per completion (None where it does not apply)."
        )
    return torch.tensor(
        [
            math.nan if v is None else _finite(v, f"reward {name} {scene}")
            for v, scene in zip(values, scenes)
        ]
    )


def weighted(raw: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: the weighted sum of its rewards' values, those that do
    not apply to it (NaN: a TRL-style reward's None) left out, as TRL's."""
    return raw.nan_to_num(0.0) @ weights.to(raw.dtype)
