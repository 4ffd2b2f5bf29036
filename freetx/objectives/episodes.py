"""Multi-turn episodes: the rollout of a GRPO run with `env:` or `tools:` (docs/environments.md).

Each prompt's `num_generations` episodes run side by side in the generation engine's
slots. An episode's turn: it generates its reply (its draws keyed by the run's seed, the
step, the prompt, the completion and the turn, so episodes replay at any world size and
after a resume); as soon as the reply ends, in a thread pool, its tool calls get their
results, or, calling none, it goes to the environment
(`freetx.envs.LanguageEnvironment.step`), which answers with messages, a reward and
whether the episode is over; as soon as that answer comes, the episode's next turn joins
the engine's slots, while the other episodes decode (a model the engine does not serve:
the static batch, a turn of every episode at a time). Every call of the user's code (the environment,
a tool) has `timeout_s`; one that raises or passes it stops the run naming the row, the
turn and the call; a tool's own failure (bad arguments, an exception) is the model's to
read, as an error message.

Token in, token out: an episode's sequence is its prompt's tokens, then each reply's
tokens exactly as sampled, each followed by the tokens of the environment's messages as
the chat template renders them after an assistant turn (`continuation_ids`: the suffix,
never a re-render of the history, which a template may rewrite). Only the sampled tokens
carry the loss; the environment's and the template's are masked (`trained`).

An episode ends when the environment says so, when a reply calls no tool in a run
without `env:`, at `max_turns` replies (the last reply's calls are not run), or when the
environment's messages and another reply could pass `max_tokens` (no sequence is longer,
prompt included); those cut are counted. Each tool call has an id of 9 letters and
digits from the episode's key, the turn and its place (Mistral's templates ask one). Its reward: the
environment's turn rewards summed (column `env` of the rewards), plus the weighted
rewards, which read the last reply as the completion and the whole conversation as the
row's `messages` (TRL's batched form: the episode's messages as the completion).
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from freetx.config.instantiate import instantiate_except, is_component, node_path
from freetx.data import PromptBatch
from freetx.data.chat import chat_prompt_ids, continuation_ids
from freetx.envs import LanguageEnvironment, Message, ProvidesTools, SingleReply, Turn, last_reply
from freetx.envs.tools import parse_tool_calls, tool_format, tool_name, tool_result, tool_schema
from freetx.errors import ConfigError, TrainingError
from freetx.models.engine import EngineConfig
from freetx.models.generation import Draws, Sampling, decoder
from freetx.objectives.deadline import call_named
from freetx.objectives.rewards import REWARD_TIMEOUT_S, Reward, function_of, score_completions
from freetx.objectives.rollouts import Completions, CompletionScorer

ENV_KEYS = (
    "max_turns",
    "max_tokens",
    "tool_format",
    "timeout_s",
)  # the env node's, not its class's
ENV_REWARD = "env"  # the environment's rewards, a column beside the reward functions'
WORKERS = 16  # environment steps run at once


def no_chat_template(tokenizer: str) -> ConfigError:
    """The refusal of episodes with a tokenizer that has no chat template (the run's, and
    `freetx validate`'s for a ByteTokenizer node without one)."""
    return ConfigError(
        f"env/tools: {tokenizer} has no chat template, and an episode's messages are "
        "rendered by one; use freetx.data.ByteTokenizer with chat_template: turns (a byte "
        "model), or an HF folder whose tokenizer has one."
    )


def check_episode_pool(engine: EngineConfig, max_tokens: int) -> None:
    """Refuse a KV pool (`generation.engine.kv_blocks`) smaller than one episode of
    `max_tokens` (the engine holds an episode's turns at that length at most)."""
    blocks, size = engine.kv_blocks, engine.block_size
    if blocks is not None and blocks * size < max_tokens:
        raise ConfigError(
            f"generation.engine.kv_blocks={blocks} blocks of {size} tokens hold "
            f"{blocks * size} tokens, and one episode may hold env.max_tokens={max_tokens}. "
            f"Raise generation.engine.kv_blocks to {math.ceil(max_tokens / size)} or more, "
            "or null: enough for every slot."
        )


class EpisodeError(TrainingError):
    """An environment or a tool that failed or hung (named with the row and the turn)."""


@dataclass(frozen=True)
class EpisodeLimits:
    """The `env:` node's own keys (the rest build the environment)."""

    max_turns: int = 4  # replies per episode at most
    max_tokens: int = 1024  # an episode's tokens at most, its prompt's included
    tool_format: str | None = None  # hermes, llama3, mistral; None: the template's family
    timeout_s: float = REWARD_TIMEOUT_S  # each call of the environment or a tool

    @classmethod
    def of(cls, node: Any) -> EpisodeLimits:
        """The held keys of an `env:` node (None: the defaults), checked."""
        values = {k: node[k] for k in ENV_KEYS if node is not None and k in node}
        limits = cls(**values)
        for key, low in (("max_turns", 1), ("max_tokens", 2), ("timeout_s", 0.001)):
            value = getattr(limits, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
                raise ConfigError(f"env.{key}={value!r}: it must be a number of at least {low}.")
        return limits


def build_environment(
    node: Any, tool_nodes: Sequence[Any]
) -> tuple[LanguageEnvironment, dict[str, Callable[..., Any]], EpisodeLimits]:
    """The config's `env:` (None: `SingleReply`, for a run with tools only) built and
    checked to be a `LanguageEnvironment`, the tools it provides and the config's
    `tools:` (each a function, or a class whose instance is one; their names unique,
    their schemas built), and its limits. ConfigError before anything runs."""
    limits = EpisodeLimits.of(node)
    env = SingleReply() if node is None else instantiate_except(node, ENV_KEYS)
    if not isinstance(env, LanguageEnvironment):
        raise ConfigError(
            f"env._component_ builds {type(env).__name__}, which is no language environment: "
            "it needs reset(messages, row) -> messages and step(messages, row) -> Turn "
            "(freetx.envs.LanguageEnvironment, docs/environments.md)."
        )
    functions = list(env.tools()) if isinstance(env, ProvidesTools) else []
    for i, tool in enumerate(tool_nodes):
        where = node_path(tool, f"tools[{i}]")
        if not is_component(tool):
            raise ConfigError(f"{where} is {tool!r}; a tool is {{_component_: module.function}}.")
        functions.append(function_of(tool, where, (), "tool")[1])
    tools: dict[str, Callable[..., Any]] = {}
    for function in functions:
        name = tool_name(function)
        if name in tools:
            raise ConfigError(f"two tools are named {name}; a model calls a tool by its name.")
        tool_schema(function)  # a docstring and annotations, or a ConfigError
        tools[name] = function
    return env, tools, limits


@dataclass
class Episode:
    """One episode as it runs: the row it came from, its conversation, its prompt's tokens
    and every token after them (`trained`: which are sampled), and what happened."""

    row: dict[str, Any]
    row_id: str
    key: str  # its draws' key (turn 0's; later turns add " turn t")
    messages: list[Message]
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    start: int = 0  # where its conversation's first reply is (messages before: the prompt)
    reward: float = 0.0  # the environment's, summed over the turns
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    generated: int = 0  # sampled tokens
    entropy: float = 0.0  # summed over them
    done: bool = False
    cut: str | None = None  # max_turns or max_tokens: ended by a limit
    ended: bool = True  # its last reply reached an end token
    clipped: bool = False  # a reply cut at max_completion_length, or the episode by a limit

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)


class EpisodeBatch(list):
    """The episodes of a batch of prompts (each prompt's `n` adjacent): what the runner's
    `generate` returns, for its `score`; `lengths` [R]: sampled tokens, `environment_s`:
    the time the rollout waited on the environment's and the tools' calls (the resets,
    and the calls with nothing to decode meanwhile)."""

    lengths: torch.Tensor
    environment_s: float = 0.0


class EpisodeRunner(CompletionScorer):
    """The rollout of multi-turn episodes (module docstring), a `CompletionScorer`:
    `generate(model, prompts, n, sampling, keys)` runs the episodes, `score(out, prompts,
    n, stop)` scores them; GRPO's `Rollouts` and `validation` call it as they call one."""

    def __init__(
        self,
        tokenizer,
        env: LanguageEnvironment,
        tools: dict[str, Callable[..., Any]],
        limits: EpisodeLimits,
        rewards: Sequence[Reward],
        end_ids: list[int],
        max_new_tokens: int,
        reward_timeout_s: float = REWARD_TIMEOUT_S,
        engine: EngineConfig | None = None,
    ) -> None:
        super().__init__(tokenizer, rewards, end_ids, max_new_tokens, reward_timeout_s, engine)
        self.env, self.tools, self.limits = env, tools, limits
        # the environment's summed turn rewards are one more column, weighted 1
        self.functions = list(rewards)
        self.rewards = [*rewards, Reward(ENV_REWARD, None, 1.0)]
        self.weights = torch.tensor([r.weight for r in self.rewards])
        self.schemas = [tool_schema(f) for f in tools.values()] or None
        template = getattr(tokenizer, "chat_template", None)
        if template is None:
            raise no_chat_template(type(tokenizer).__name__)
        if engine is not None:
            check_episode_pool(engine, limits.max_tokens)
        self.format = tool_format(template, limits.tool_format) if tools else None

    # -- the user's code, with its deadline ---------------------------------------------

    def call(
        self,
        function: Callable[..., Any],
        *args: Any,
        scene: str,
        tool: bool = False,
        **kwargs: Any,
    ) -> Any:
        """`function(*args, **kwargs)` (awaited when it is async) within env.timeout_s
        (`call_named`); an EpisodeError naming `scene` when it passes the deadline, or when
        it raises and is the environment (a `tool`'s exception is raised as it is: the
        model reads it)."""
        fix = "Fix the environment; a failing environment is never a silent end of the episode."
        return call_named(
            function,
            *args,
            scene=scene,
            key="env.timeout_s",
            timeout_s=self.limits.timeout_s,
            error=EpisodeError,
            fix=fix,
            raw=tool,
            **kwargs,
        )

    # -- generate: the turns ------------------------------------------------------------

    def generate(self, model, prompts: PromptBatch, n: int, sampling: Sampling, keys: list[str]):
        """The episodes of each prompt (`n` each, their draws keyed by `keys`), run to
        their ends; None for no prompt. A reply goes to the thread pool as soon as it
        ends; the episode's next turn joins the engine's slots as soon as its environment
        answers, while the others decode (the static batch, for a model the engine does
        not serve: a turn of every episode at a time)."""
        if not prompts.ids:
            return None
        started = time.perf_counter()
        episodes = self.start_episodes(prompts, n, keys)
        environment_s = time.perf_counter() - started  # the resets
        longest = self.limits.max_tokens - self.max_new_tokens
        decoding = decoder(
            model, self.max_new_tokens, sampling, self.end_ids, self.engine, len(episodes), longest
        )
        asked: dict[int, Episode] = {}  # by request

        def ask(e: Episode) -> None:
            """The episode's next reply requested, unless it has no room for one."""
            if e.length + self.max_new_tokens > self.limits.max_tokens:
                e.done, e.cut, e.clipped = True, "max_tokens", True
                return
            key = e.key if e.turns == 0 else f"{e.key} turn {e.turns}"
            uniforms = Draws.keyed([key], self.max_new_tokens).uniforms[0]
            asked[decoding.add(e.prompt_ids + e.tokens, uniforms)] = e

        for e in episodes:
            ask(e)
        order = {id(e): i for i, e in enumerate(episodes)}
        pool = ThreadPoolExecutor(max_workers=min(WORKERS, len(episodes)))
        stepping: dict[Future, Episode] = {}  # replies with the environment
        try:
            while decoding.busy or stepping:
                if decoding.busy and (decoding.joins_running or not stepping):
                    for request in decoding.step():
                        e = asked.pop(request)
                        last = e.turns + 1 == self.limits.max_turns
                        reply = decoding.reply(request)
                        stepping[pool.submit(self.advance, e, *reply, e.turns, last)] = e
                    answered = [f for f in stepping if f.done()]
                else:  # nothing to decode until the environment answers
                    waited = time.perf_counter()
                    how = FIRST_COMPLETED if decoding.joins_running else ALL_COMPLETED
                    answered = list(wait(stepping, return_when=how).done)
                    environment_s += time.perf_counter() - waited
                for future in sorted(answered, key=lambda f: order[id(stepping[f])]):
                    e = stepping.pop(future)
                    future.result()  # the environment's or a tool's failure, raised
                    if not e.done:
                        ask(e)
        finally:  # after a failure, the calls not yet started are not made
            pool.shutdown(wait=True, cancel_futures=True)
        assert all(e.done for e in episodes), "an episode was left unfinished"
        episodes.lengths = torch.tensor([float(e.generated) for e in episodes])
        episodes.environment_s = environment_s
        return episodes

    def start_episodes(self, prompts: PromptBatch, n: int, keys: list[str]) -> EpisodeBatch:
        """Each prompt's `n` episodes from the environment's first messages (`reset`)."""
        episodes = EpisodeBatch()
        for i, row_id in enumerate(prompts.ids):
            said = prompts.conversations[i] if prompts.conversations else None
            messages = said or [{"role": "user", "content": prompts.prompts[i]}]
            row = dict(prompts.fields[i])
            scene = f"env.reset on {row_id}"
            first = self.call(self.env.reset, [dict(m) for m in messages], row, scene=scene)
            if not isinstance(first, list) or not all(isinstance(m, dict) for m in first):
                raise EpisodeError(
                    f"{scene} returned {first!r:.120}, not a list of messages "
                    '([{"role": ..., "content": ...}, ...]): the episode\'s first messages.'
                )
            ids = chat_prompt_ids(self.tokenizer, first, self.schemas)
            if len(ids) + self.max_new_tokens > self.limits.max_tokens:
                raise EpisodeError(
                    f"the episode prompt of {row_id} is {len(ids)} tokens, and with a reply of "
                    f"max_completion_length={self.max_new_tokens} it passes env.max_tokens="
                    f"{self.limits.max_tokens}; raise env.max_tokens (and the model's "
                    "max_seq_len), or shorten the prompts (dataset.max_prompt_len)."
                )
            for j in range(n):
                episodes.append(
                    Episode(
                        dict(row),  # each its own: the steps of a group run side by side
                        row_id,
                        keys[i * n + j],
                        [dict(m) for m in first],
                        ids,
                        start=len(first),
                    )
                )
        return episodes

    def advance(
        self, e: Episode, reply: list[int], ended: bool, entropy: float, turn: int, last: bool
    ) -> None:
        """One episode's turn after its reply was sampled: the reply appended (trained),
        its tool calls answered or the environment stepped, and, unless the episode ends,
        the tokens of the new messages appended (masked)."""
        e.tokens += reply
        e.trained += [True] * len(reply)
        e.generated += len(reply)
        e.entropy += entropy
        e.turns, e.ended = e.turns + 1, ended
        e.clipped = e.clipped or not ended
        said = reply[:-1] if ended else reply
        message: Message = {"role": "assistant", "content": self.tokenizer.decode(said)}
        calls = []
        if self.format:
            calls = parse_tool_calls(self.tokenizer.decode(said, keep_special=True), self.format)
        # each call's id: deterministic (the episode's key, the turn, its place)
        ids = [_call_id(f"{e.key} turn {turn} call {i}") for i in range(len(calls))]
        parsed = [c.as_message_call(i) for c, i in zip(calls, ids) if c.error is None]
        if parsed:
            message["tool_calls"] = parsed
        e.messages.append(message)
        e.tool_calls += len(calls)

        def scene(what: str) -> str:
            return f"{what} on {e.row_id} (turn {turn})"

        if calls and last:  # its results would not be read: the episode ends here
            e.done, e.cut, e.clipped = True, "max_turns", True
            return
        if calls:
            new = []
            for call, call_id in zip(calls, ids):
                where = scene(f"tool {call.name}")
                result, failed = tool_result(
                    call,
                    self.tools,
                    functools.partial(self.call, scene=where, tool=True),
                    passing=(EpisodeError,),
                )
                new.append(
                    {
                        "role": "tool",
                        "name": call.name or "",
                        "tool_call_id": call_id,
                        "content": result,
                    }
                )
                e.tool_errors += failed
            step = Turn(new)
        else:
            step = self.call(self.env.step, list(e.messages), e.row, scene=scene("env.step"))
            if not isinstance(step, Turn) or not math.isfinite(float(step.reward)):
                raise EpisodeError(
                    f"{scene('env.step')} returned {step!r:.120}, not a freetx.envs.Turn("
                    "messages, reward, done) with a finite reward."
                )
            e.reward += float(step.reward)
        if step.done:
            e.messages.extend(step.messages)
            e.done = True
            return
        if last:
            e.done, e.cut, e.clipped = True, "max_turns", True
            return
        more = continuation_ids(self.tokenizer, message, step.messages, reply, ended, self.schemas)
        if e.length + len(more) + self.max_new_tokens > self.limits.max_tokens:
            e.done, e.cut, e.clipped = True, "max_tokens", True  # no room for another reply
            return
        e.messages.extend(step.messages)
        e.tokens += more
        e.trained += [False] * len(more)

    # -- score: the rewards over the episodes -------------------------------------------

    def score(self, out: EpisodeBatch, prompts: PromptBatch, n: int, stop=None):
        """The episodes scored: each reward function over the last reply (the completion)
        and the whole conversation (the row's `messages`, its `turns` and `env_reward`),
        and the environment's summed rewards (column `env`), as `Completions` with each
        episode's prompt tokens, mask and record."""
        texts = [last_reply(e.messages) for e in out]
        fields = [
            {
                **e.row,
                "completion_tokens": e.generated,
                "messages": e.messages,
                "turns": e.turns,
                "env_reward": e.reward,
            }
            for e in out
        ]
        env = torch.tensor([[e.reward] for e in out], dtype=torch.float32)
        if self.functions:
            raw = score_completions(
                self.functions,
                [p for p in prompts.prompts for _ in range(n)],
                texts,
                fields,
                [e.row_id for e in out],
                completion_ids=[[t for t, k in zip(e.tokens, e.trained) if k] for e in out],
                conversations=[e.messages[: e.start] for e in out],
                timeout_s=self.timeout_s,
                stop=stop,
                completion_messages=[e.messages[e.start :] for e in out],
            )
            raw = torch.cat([raw, env], dim=1)
        else:
            raw = env
        ended = torch.tensor([e.cut is None and e.ended for e in out])
        lengths = out.lengths
        entropy = torch.tensor([e.entropy / max(e.generated, 1) for e in out])
        return Completions(
            [list(e.tokens) for e in out],
            texts,
            raw,
            ended,
            lengths,
            entropy,
            clipped=torch.tensor([e.clipped for e in out]),
            prompt_ids=[e.prompt_ids for e in out],
            trained=[list(e.trained) for e in out],
            episodes=list(out),
            environment_s=out.environment_s,
        )


def _call_id(key: str) -> str:
    """A tool call's id: 9 letters and digits (what Mistral's templates ask), from `key`."""
    return hashlib.sha256(key.encode()).hexdigest()[:9]
