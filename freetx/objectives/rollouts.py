"""The rollout of online RL: prompts -> the policy's completions, decoded, scored by the
rewards, weighted by their advantages, with the log-probs the loss reads, as each optimizer
step's micro-batches; and the metrics of all that. A policy-gradient recipe calls it and
keeps only its loop:

    scorer = CompletionScorer(tokenizer, rewards, end_ids, max_completion_length, timeout_s)
    rollouts = Rollouts(plan, scorer, cfg.generation, advantage, scale, cfg.seed, micro_batches,
                        stop=run)  # a stop signal while a reward runs: Interrupted
    steps, prompt_groups, metrics = rollouts(prompts, step, reference, num_chunks)
    for batches in steps: ...the loss on each micro-batch (a `RolloutBatch`), a step...

    scorer.validation(model, batches, sampling, "seed 0 validation", groups)  # mean rewards

`CompletionScorer` is generate -> decode -> score, once: GRPO's rollouts and validation and
the eval recipe's rewards use it. Each completion's draws are keyed by the run's seed, the
step, the prompt's id and its index (`Draws.keyed`), so the rollouts are the same at any
world size and after a resume. What plugs in: the advantage estimate (`advantages.py`), the
rewards (`rewards.py`), the generation (`freetx.models.generation.generate`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from freetx.data import PromptBatch, RolloutBatch
from freetx.distributed import ParallelGroups, ParallelPlan
from freetx.fields import at_least
from freetx.models.engine import EngineConfig
from freetx.models.generation import Draws, Sampling, generate, sampling_problems
from freetx.objectives.advantages import (
    Baseline,
    TokenAdvantages,
    group_advantages,
    token_advantages,
)
from freetx.objectives.deadline import Interrupted
from freetx.objectives.logprobs import token_logps
from freetx.objectives.rewards import (
    REWARD_TIMEOUT_S,
    Reward,
    models_gathered,
    score_completions,
    weighted,
)
from freetx.training.signals import StopAgreement


@dataclass
class GenerationConfig:
    """How the policy samples its completions (the rollouts): a config's `generation:`."""

    num_generations: int = at_least(2, default=8)  # completions per prompt: a group
    max_completion_length: int = at_least(1, default=64)  # tokens, the end token included
    temperature: float = at_least(0, default=1.0)
    top_k: Optional[int] = at_least(1, default=None)
    top_p: Optional[float] = None  # (0, 1]; None: every token
    # optimizer steps per generation: the generated completions are split among them
    # (TRL's steps_per_generation); after the first, the policy has moved, and the ratio
    # to the log-probs kept from generation time is clipped
    steps_per_generation: int = at_least(1, default=1)
    # DAPO's dynamic sampling: a group whose rewards are all equal is replaced by a new
    # prompt's group, up to this many extra rounds of generation per step (0: kept as is)
    dynamic_sampling: int = at_least(0, default=0)
    # the generation engine: slots, the paged KV cache's blocks, compile (docs/generation.md)
    engine: EngineConfig = field(default_factory=EngineConfig)

    meaningless = staticmethod(sampling_problems)  # a top_p outside (0, 1]

    def per_rank_forwards(self) -> str | None:
        """Each rank generates its own prompts' completions until they end, which expert
        parallelism cannot run (`freetx.training.config.ForwardsPerRank`)."""
        return "the rollouts' generation"


class Completions(NamedTuple):
    """Completions of a batch of prompts, each prompt's `n` adjacent, and their scores; a
    multi-turn episode's (`freetx.objectives.episodes`) with its own prompt tokens, which
    of its tokens were sampled, and its record."""

    tokens: list[list[int]]  # each one's tokens, its end token included
    texts: list[str]  # as the rewards read them (the end token left out)
    raw: torch.Tensor  # [R, rewards]: each reward function's value
    ended: torch.Tensor  # [R] bool: reached an end token
    lengths: torch.Tensor  # [R]: tokens generated
    entropy: torch.Tensor  # [R]: the mean entropy of its tokens' distributions
    clipped: torch.Tensor  # [R] bool: cut by a limit (max_completion_length, max_turns)
    prompt_ids: list[list[int]] | None = None  # each one's prompt (None: the batch's)
    trained: list[list[bool]] | None = None  # per token: sampled (None: all of them)
    episodes: list[Any] | None = None  # each one's `Episode`
    environment_s: float = 0.0  # time in the environment's and the tools' calls


class CompletionScorer:
    """generate -> decode -> score: `n` completions of each prompt of a `PromptBatch`, each
    scored by every reward (`score_completions`; a reward reads the prompt, the completion
    and the row's fields, with `completion_tokens`), each call within `timeout_s`; the
    generation by `engine` (None: the engine's defaults)."""

    def __init__(
        self,
        tokenizer,
        rewards: Sequence[Reward],
        end_ids: list[int],
        max_new_tokens: int,
        timeout_s: float = REWARD_TIMEOUT_S,
        engine: EngineConfig | None = None,
    ) -> None:
        self.tokenizer, self.rewards, self.end_ids = tokenizer, list(rewards), end_ids
        self.max_new_tokens, self.timeout_s, self.engine = max_new_tokens, timeout_s, engine
        self.weights = torch.tensor([r.weight for r in self.rewards])

    def generate(self, model, prompts: PromptBatch, n: int, sampling: Sampling, keys: list[str]):
        """The model's completions (`generate`'s output; None for no prompt), each row's
        draws keyed by `keys` (one per completion)."""
        rows = [ids for ids in prompts.prompt_ids for _ in range(n)]
        if not rows:
            return None
        draws = Draws.keyed(keys, self.max_new_tokens)
        return generate(
            model, rows, self.max_new_tokens, sampling, self.end_ids, draws, engine=self.engine
        )

    def score(self, out, prompts: PromptBatch, n: int, stop=None) -> Completions:
        """`generate`'s completions decoded and scored; `stop()` true (a stop signal) while
        a reward runs: Interrupted."""
        tokens, ended = out.replies(), out.ended.cpu()
        texts = [self.tokenizer.decode(t[:-1] if e else t) for t, e in zip(tokens, ended.tolist())]
        fields = [
            {**prompts.fields[i // n], "completion_tokens": len(t)} for i, t in enumerate(tokens)
        ]
        raw = score_completions(
            self.rewards,
            [p for p in prompts.prompts for _ in range(n)],
            texts,
            fields,
            [i for i in prompts.ids for _ in range(n)],
            completion_ids=tokens,
            conversations=[c for c in prompts.conversations for _ in range(n)],
            timeout_s=self.timeout_s,
            stop=stop,
        )
        entropy = (out.entropy.sum(dim=1) / out.lengths.clamp(min=1)).cpu()
        lengths = out.lengths.cpu().float()
        clipped = (lengths >= self.max_new_tokens) & ~ended
        return Completions(tokens, texts, raw, ended, lengths, entropy, clipped)

    @torch.no_grad()
    def validation(
        self, model, batches, sampling: Sampling, key: str, groups: ParallelGroups
    ) -> dict[str, float]:
        """One completion per prompt of every batch (an evaluation loader's: its shard's
        repeats left out), each row's draws keyed by `key` and its id: over every rank, the
        mean weighted reward ("reward"), each reward's ("rewards/<name>/mean") and the mean
        completion length ("completions/mean_length")."""
        sums: dict[str, Any] = {}
        for batch in batches:
            out = self.generate(model, batch, 1, sampling, [f"{key} {i}" for i in batch.ids])
            with models_gathered(self.rewards):  # every rank has as many batches
                done = self.score(out, batch, 1)
            keep = batch.real_rows()
            parts = {
                "reward": weighted(done.raw, self.weights)[keep].sum(),
                "prompts": keep.sum().float(),
                "completions/mean_length": done.lengths[keep].sum(),
                **reward_sums(done.raw[keep], self.rewards),
            }
            for name, value in parts.items():
                sums[name] = sums.get(name, 0) + value
        totals = groups.sum(sums, over="dp")
        prompts = max(float(totals.pop("prompts")), 1.0)
        means = reward_means(totals, self.rewards)
        return {**{name: float(value) / prompts for name, value in totals.items()}, **means}


def reward_sums(raw: torch.Tensor, rewards: Sequence[Reward]) -> dict[str, torch.Tensor]:
    """Each reward's sum, sum of squares and count over the completions it applies to
    (`raw` [R, rewards], NaN: not applicable), for `reward_means` once summed over ranks."""
    sums = {}
    for i, reward in enumerate(rewards):
        applies = ~raw[:, i].isnan()
        values = raw[applies, i].double()
        sums[f"rewards/{reward.name}/mean"] = values.sum()
        sums[f"rewards/{reward.name}/sq"] = (values**2).sum()
        sums[f"rewards/{reward.name}/count"] = applies.sum().double()
    return sums


def reward_means(totals: dict[str, Any], rewards: Sequence[Reward]) -> dict[str, float]:
    """Each reward's mean and std over the completions it applies to, from `reward_sums`
    summed over ranks (popped from `totals`)."""
    out = {}
    for reward in rewards:
        name = f"rewards/{reward.name}"
        count = max(float(totals.pop(f"{name}/count")), 1.0)
        mean = float(totals.pop(f"{name}/mean")) / count
        square = float(totals.pop(f"{name}/sq")) / count
        out[f"{name}/mean"], out[f"{name}/std"] = mean, max(square - mean**2, 0.0) ** 0.5
    return out


@dataclass
class PromptGroup:
    """One prompt's completions (num_generations of them), as generated and scored."""

    prompt_ids: list[int]
    prompt: str  # the prompt's text, as the rewards see it
    id: str  # its row's id
    completions: list[list[int]]  # each one's tokens, its end token included
    texts: list[str]  # as the rewards read them
    raw: torch.Tensor  # [n, rewards]: each reward function's value
    total: torch.Tensor  # [n]: their weighted sum
    ended: torch.Tensor  # [n]: reached an end token
    entropy: torch.Tensor  # [n]: the mean entropy of its tokens' distributions
    lengths: torch.Tensor  # [n]: tokens generated
    clipped: torch.Tensor  # [n]: cut by a limit
    trained: list[list[bool]] | None = None  # an episode's: which tokens were sampled
    episodes: list[Any] | None = None  # each completion's `Episode` (multi-turn)
    advantages: torch.Tensor | None = None  # [n], once every group is in

    @property
    def zero_variance(self) -> bool:
        """Every completion got the same reward: the group carries no signal."""
        return bool((self.total == self.total[0]).all())


class Rollouts:
    """One generation of a policy-gradient run (`__call__`): this rank's prompts of
    `steps_per_generation` optimizer steps, `num_generations` completions of each (DAPO's
    dynamic sampling replacing groups without signal), scored, their advantages (the
    `advantage` baseline, `scale`d: group, batch or none), the log-probs the loss reads
    beside the policy's own, each step's micro-batches, and the generation's metrics.
    `stop` (the run): a stop signal while a reward runs abandons the rollout on every rank
    (Interrupted, after the ranks agree), so that the run saves the step it is at."""

    def __init__(
        self,
        plan: ParallelPlan,
        scorer: CompletionScorer,
        generation: GenerationConfig,
        advantage: Baseline,
        scale: str,
        seed: int,
        micro_batches: int,
        stop: StopAgreement | None = None,
    ) -> None:
        self.plan, self.ranks, self.scorer, self.gen = plan, plan.groups, scorer, generation
        self.advantage, self.scale, self.seed = advantage, scale, seed
        self.micro_batches, self.stop = micro_batches, stop
        self.sampling = Sampling(generation.temperature, generation.top_k, generation.top_p)

    def __call__(
        self, prompts: Iterator[PromptBatch], step: int, reference=None, num_chunks=None
    ) -> tuple[list[list[RolloutBatch]], list[PromptGroup], dict[str, float]]:
        """Each optimizer step's micro-batches, the prompt groups they were made of, the metrics.
        `reference`: the KL term's reference model (`reference_model`), or None. Interrupted
        on every rank when a rank got a stop signal while its rewards scored."""
        gen, started = self.gen, time.perf_counter()
        batch = PromptBatch.join([next(prompts) for _ in range(gen.steps_per_generation)])
        prompt_groups, made = self.sample(batch, f"step {step}")
        for round_ in range(1, gen.dynamic_sampling + 1):  # DAPO: replace groups of no signal
            flat = [i for i, g in enumerate(prompt_groups) if g.zero_variance]
            # every rank takes part in each round (its parameters are gathered together)
            if not self.ranks.sum({"flat": torch.tensor(len(flat))}, over="dp")["flat"]:
                break
            more, extra = self.sample(next(prompts).take(len(flat)), f"step {step} round {round_}")
            for index, group in zip(flat, more):
                prompt_groups[index] = group
            made = {k: made[k] + extra[k] for k in made}
        self.set_advantages(prompt_groups)
        per_step = len(prompt_groups) // gen.steps_per_generation
        steps = [
            self.batches(prompt_groups[k * per_step : (k + 1) * per_step])
            for k in range(gen.steps_per_generation)
        ]
        every = [b for batches in steps for b in batches]
        policy_logps = self.with_logps(every, reference, num_chunks)
        if isinstance(self.advantage, TokenAdvantages):  # per token, over every rank's
            token_advantages(self.advantage, every, policy_logps, self.ranks)
        metrics = self.metrics(prompt_groups, made)
        metrics["time/generation"], metrics["time/scoring"] = (
            made["generation_s"],
            made["scoring_s"],
        )
        if prompt_groups and prompt_groups[0].episodes is not None:
            metrics["time/environment"] = made["environment_s"]
        metrics["time/rollout"] = time.perf_counter() - started
        return steps, prompt_groups, metrics

    def sample(self, prompts: PromptBatch, when: str) -> tuple[list[PromptGroup], dict]:
        """num_generations completions of each prompt, scored: a PromptGroup per prompt; and the
        time and tokens it took. Each completion's draws are keyed by the run's seed, `when`,
        the prompt's id and its index in the group."""
        n = self.gen.num_generations
        keys = [
            f"seed {self.seed} {when} prompt {pid} sample {j}"
            for pid in prompts.ids
            for j in range(n)
        ]
        started = time.perf_counter()
        with self.plan.gathered() as model, self.plan.autocast():  # one all-gather
            model.eval()
            out = self.scorer.generate(model, prompts, n, self.sampling, keys)
            model.train()
        generated = time.perf_counter() - started
        scoring = time.perf_counter()
        done = self.scored(out, prompts)  # on every rank, with completions or none
        scored = time.perf_counter() - scoring
        if done is None:
            empty = {"generation_s": generated, "scoring_s": 0.0, "tokens": 0.0}
            return [], {**empty, "environment_s": 0.0}
        prompt_groups = []
        for i, prompt_ids in enumerate(prompts.prompt_ids):
            part = slice(i * n, (i + 1) * n)
            group = PromptGroup(
                prompt_ids if done.prompt_ids is None else done.prompt_ids[i * n],
                prompts.prompts[i],
                prompts.ids[i],
                done.tokens[part],
                done.texts[part],
                done.raw[part],
                weighted(done.raw[part], self.scorer.weights),
                done.ended[part],
                done.entropy[part],
                done.lengths[part],
                done.clipped[part],
                None if done.trained is None else done.trained[part],
                None if done.episodes is None else done.episodes[part],
            )
            prompt_groups.append(group)
        made = {"generation_s": generated - done.environment_s, "scoring_s": scored}
        made.update({"tokens": float(done.lengths.sum()), "environment_s": done.environment_s})
        return prompt_groups, made

    def scored(self, out, prompts: PromptBatch) -> Completions | None:
        """`generate`'s completions (None: none) scored (`CompletionScorer.score`), each
        reward's wait woken by a stop signal; then every rank agrees whether one got a
        signal (a rank can wait on a reward while the others do not) and, if so, all raise
        Interrupted."""
        stop, done = self.stop, None
        try:
            with models_gathered(self.scorer.rewards):  # a judge, whole: every rank at once
                if out is not None:
                    watch = None if stop is None else stop.stop_requested
                    done = self.scorer.score(out, prompts, self.gen.num_generations, watch)
        except Interrupted:  # this rank's signal: the agreement says it to every rank
            pass
        if stop is not None and stop.agree_to_stop():
            raise Interrupted
        return done

    def set_advantages(self, prompt_groups: list[PromptGroup]) -> None:
        """Each completion's advantage (`group_advantages` with the `advantage` baseline);
        `scale` batch divides by the std of every rank's rewards, as TRL's. A per-token
        estimate's: its centered reward, made per token by `token_advantages`."""
        n, scale = self.gen.num_generations, self.scale
        total = torch.cat([g.total for g in prompt_groups])
        if isinstance(self.advantage, TokenAdvantages):
            centered = self.advantage.centered(total, n)
            for i, group in enumerate(prompt_groups):
                group.advantages = centered[i * n : (i + 1) * n]
            return
        batch_std = None
        if scale == "batch":
            moments = {
                "n": torch.tensor(float(len(total))),
                "sum": total.sum(),
                "sq": (total.double() ** 2).sum(),
            }
            sums = self.ranks.sum(moments, over="dp")
            mean = sums["sum"] / sums["n"]
            variance = (sums["sq"] - sums["n"] * mean**2) / max(sums["n"] - 1, 1)
            batch_std = max(variance, 0.0) ** 0.5
        found = group_advantages(total, n, scale, self.advantage, batch_std)
        for i, group in enumerate(prompt_groups):
            group.advantages = found.advantages[i * n : (i + 1) * n]

    def batches(self, prompt_groups: list[PromptGroup]) -> list[RolloutBatch]:
        """One optimizer step's prompt groups in `micro_batches` micro-batches, each its groups'
        completions as rows (a group never split)."""
        size = len(prompt_groups) // self.micro_batches
        parts = (prompt_groups[i * size : (i + 1) * size] for i in range(self.micro_batches))
        return [
            RolloutBatch.of_rollouts(
                [g.prompt_ids for g in part for _ in g.completions],
                [c for g in part for c in g.completions],
                torch.cat([g.advantages for g in part]),
                trained=_trained_of(part),
            )
            for part in parts
        ]

    @torch.no_grad()
    def with_logps(self, batches: list[RolloutBatch], reference, num_chunks) -> list | None:
        """The log-probs the loss reads besides the policy's own: the policy's at generation
        time (more than one step per generation: the ratio's denominator) and the
        reference's (a KL term), a micro-batch at a time (every rank runs as many). Returns
        the policy's at generation time per batch when a per-token estimate folds a KL into
        the reward (else None)."""
        several = self.gen.steps_per_generation > 1
        kl = isinstance(self.advantage, TokenAdvantages) and self.advantage.needs_reference
        if not (several or kl) and reference is None:
            return None
        policy = []
        for batch in batches:
            placed = batch.to(self.plan.runtime.device)
            if several or kl:
                with self.plan.autocast():
                    logps = token_logps(
                        self.plan.model, placed.input_ids, placed.labels, num_chunks
                    )[0]
                policy.append(logps)
                if several:
                    batch.old_logps = logps
            if reference is not None:
                batch.ref_logps = reference.tokens(placed)
        return policy if kl else None

    def metrics(self, prompt_groups: list[PromptGroup], made: dict[str, float]) -> dict[str, float]:
        """TRL's names, over every rank's completions: reward (mean, and the mean of the
        groups' std), each reward's mean and std, the groups without signal, completion
        lengths, how many hit max_completion_length, entropy, generation tokens/s."""
        rewards = self.scorer.rewards
        raw = torch.cat([g.raw for g in prompt_groups])
        total = torch.cat([g.total for g in prompt_groups])
        lengths = torch.cat([g.lengths for g in prompt_groups])
        sums = {
            "completions": len(total),
            "groups": len(prompt_groups),
            "reward": float(total.sum()),
            "reward_sq": float((total**2).sum()),
            "reward_std": sum(float(g.total.std()) for g in prompt_groups),
            "frac_reward_zero_std": sum(g.zero_variance for g in prompt_groups),
            "completions/mean_length": float(lengths.sum()),
            "completions/clipped_ratio": float(torch.cat([g.clipped for g in prompt_groups]).sum()),
            "entropy": float(torch.cat([g.entropy for g in prompt_groups]).sum()),
            "generation_tokens": made["tokens"],
            "generation_s": made["generation_s"],
        }
        sums.update({name: float(value) for name, value in reward_sums(raw, rewards).items()})
        episodes = [e for g in prompt_groups for e in g.episodes or []]
        if episodes:
            sums.update(episode_sums(episodes))
        totals, maxima = self.ranks.sum_and_max(
            sums, {"completions/max_length": float(lengths.max())}, over="dp"
        )
        n, g = totals.pop("completions"), totals.pop("groups")
        out = {**maxima, **reward_means(totals, rewards), "reward": totals["reward"] / n}
        for name in ("reward_std", "frac_reward_zero_std"):  # per group
            out[name] = totals[name] / g
        for name in ("completions/mean_length", "completions/clipped_ratio", "entropy"):
            out[name] = totals[name] / n
        out["generation/tokens_per_s"] = totals["generation_tokens"] / max(
            totals["generation_s"], 1e-9
        )
        if episodes:
            out.update(episode_means(totals, n))
        return out


def episode_sums(episodes: list[Any]) -> dict[str, float]:
    """A rank's sums of the multi-turn metrics over its episodes, for `episode_means`."""
    return {
        "episodes/turns": float(sum(e.turns for e in episodes)),
        "tools/calls": float(sum(e.tool_calls for e in episodes)),
        "tools/errors": float(sum(e.tool_errors for e in episodes)),
        "episodes/cut_max_turns": float(sum(e.cut == "max_turns" for e in episodes)),
        "episodes/cut_max_tokens": float(sum(e.cut == "max_tokens" for e in episodes)),
    }


def episode_means(totals: dict[str, float], episodes: float) -> dict[str, float]:
    """TRL's tool metrics (`tools/call_frequency`: calls per episode,
    `tools/failure_frequency`: the share of calls that failed), the mean turns per episode
    and the share of episodes cut at max_turns and at max_tokens, from the sums over ranks."""
    calls = totals["tools/calls"]
    return {
        "episodes/mean_turns": totals["episodes/turns"] / episodes,
        "tools/call_frequency": calls / episodes,
        "tools/failure_frequency": totals["tools/errors"] / max(calls, 1.0),
        "episodes/cut_max_turns": totals["episodes/cut_max_turns"] / episodes,
        "episodes/cut_max_tokens": totals["episodes/cut_max_tokens"] / episodes,
    }


def _trained_of(groups: list[PromptGroup]) -> list[list[bool]] | None:
    """Which completion tokens of these groups were sampled (None: all of them)."""
    if all(g.trained is None for g in groups):
        return None
    return [
        g.trained[j] if g.trained is not None else [True] * len(c)
        for g in groups
        for j, c in enumerate(g.completions)
    ]


def write_samples(
    path: Path, step: int, prompt_groups: list[PromptGroup], rewards: Sequence[Reward], count: int
) -> list[dict[str, Any]]:
    """The first `count` completions appended to the JSONL file `path` (prompt,
    completion, each reward, total; an episode's messages and turns); returns the records
    written."""
    records = []
    for group in prompt_groups:
        for j, text in enumerate(group.texts):
            values = {r.name: float(group.raw[j, i]) for i, r in enumerate(rewards)}
            records.append(
                {
                    "step": step,
                    "id": group.id,
                    "prompt": group.prompt,
                    "completion": text,
                    "rewards": values,
                    "reward": float(group.total[j]),
                }
            )
            if group.episodes is not None:  # the episode after its prompt, and its turns
                episode = group.episodes[j]
                records[-1]["messages"] = episode.messages[episode.start :]
                records[-1]["turns"] = episode.turns
    records = records[:count]
    with open(path, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return records
