"""Online RL with verifiable rewards: GRPO and its kin (Dr. GRPO, DAPO, GSPO), the policy
generating its own completions inside the training job; all of the model's weights, or
LoRA / QLoRA / DoRA adapters (`peft:`), on FSDP2 / ZeRO / DDP strategies with tp.

    freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/instruct_tiny  # the SFT
    freetx run --nproc-per-node 2 grpo_fsdp2 --config llm/grpo_tiny
    freetx run --nproc-per-node 2 grpo_fsdp2 --config llm/hf_tiny_grpo model_dir=DIR \\
        dataset.source=prompts.jsonl

One generation, then `generation.steps_per_generation` optimizer steps, top to bottom
in `train()`:
1. every data-parallel rank takes its prompts (`freetx.data.PromptDataset`: a prompt and
   the fields the rewards read, e.g. the answer) and samples `num_generations`
   completions of each with the current policy (`freetx.models.generation.generate`: a
   KV cache, stops at the end token), its sharded parameters gathered once for the
   whole phase (`ParallelPlan.gathered`); each completion's draws come from its own
   seed (the run's seed, the step, the prompt's id, its index), so the rollouts are the
   same at any world size and after a resume;
2. the reward functions score each completion (`rewards:`, weighted and summed;
   `freetx.objectives.rewards`);
3. each group's advantages (`freetx.objectives.group_advantages`): its rewards minus
   their mean, divided by their std or not (`loss.scale_rewards`); a group whose rewards
   are all equal carries no signal (counted; `generation.dynamic_sampling` replaces it);
4. the policy's log-probs at generation time (the ratio's denominator, when more than
   one optimizer step uses the generation) and the reference's (`loss.beta` > 0: the
   base with adapters off for LoRA, a frozen copy for full fine-tuning);
5. each optimizer step on its share of the completions: the clipped ratio objective
   (`freetx.objectives.GRPOLoss`), summed over the micro-batches and divided by the
   global batch's units (tokens, or completions).
Copy this file (`freetx cp grpo_fsdp2 ./my_grpo.py`) to change the loop itself.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
from omegaconf import MISSING

from freetx.checkpoint import files_read_by
from freetx.config import instantiate
from freetx.data import (
    PromptBatch,
    PromptDataset,
    RolloutBatch,
    build_eval_loader,
    build_train_loader,
    checked_tokenizer,
    collate_prompts,
    micro_batch_size,
)
from freetx.distributed import build_groups, init_distributed, parallelize
from freetx.distributed.expert_parallel import check_same_forwards
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.fields import at_least, component_list, read_path
from freetx.models import DecodesIncrementally
from freetx.models.generation import Draws, Sampling, generate, sampling_problems
from freetx.models.hf import end_token_ids, model_dir_problems
from freetx.models.peft import PEFTConfig, apply_peft
from freetx.objectives import (
    GRPOLoss,
    build_rewards,
    group_advantages,
    reward_sums,
    score_completions,
)
from freetx.objectives.cross_entropy import with_router_loss
from freetx.objectives.logprobs import token_logps
from freetx.objectives.reference import AdaptersOff, FrozenCopy
from freetx.training import (
    PlannedRun,
    TrainingConfig,
    TrainingRun,
    accumulate_gradients,
    build_lr_scheduler,
    check_model_and_data,
    optimizer_step,
    seed_everything,
)
from freetx.training.export import built_class


@dataclass
class GenerationConfig:
    """How the policy samples its completions (the rollouts)."""

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

    meaningless = staticmethod(sampling_problems)  # a top_p outside (0, 1]


@dataclass
class RolloutEvalConfig:
    """The `eval:` section: completions to the validation prompts, one per prompt, scored
    by the same rewards (`val/reward`, `val/rewards/<name>/mean`: with an exact-match
    reward and temperature 0, the greedy success rate)."""

    every_n_steps: int = at_least(0, default=0)  # 0: only at the end of training
    batch_size: int = at_least(1, default=32)  # validation prompts per batch, over all ranks
    max_batches: Optional[int] = at_least(1, default=None)  # of those; None: all
    temperature: float = at_least(0, default=0.0)  # 0: greedy
    before_training: bool = True  # also at step 0 (every_n_steps > 0): where it starts


@dataclass
class SamplesConfig:
    """Completions written to output_dir/samples.jsonl (rank 0's) and shown."""

    every_n_steps: int = at_least(0, default=10)  # 0: never
    count: int = at_least(1, default=8)  # completions written each time
    show: int = at_least(0, default=2)  # of those, shown on the console


@dataclass
class GRPOConfig(TrainingConfig):
    """The schema of this recipe's configs: TrainingConfig's keys, then these. batch_size
    counts prompts per optimizer step (each num_generations completions)."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *TrainingConfig.fixed_on_resume, "model", "tokenizer", "dataset", "peft", "loss",
        "generation", "rewards",
    )  # fmt: skip

    model_dir: Optional[str] = read_path(None)  # an HF model folder, for ${model_dir} below
    model: Any = MISSING
    tokenizer: Any = MISSING
    dataset: Any = MISSING  # a PromptDataset, built twice: split=train and validation
    # [{_component_: ..., weight: 1.0, name: ...}]: freetx.objectives.rewards, docs/rewards.md
    rewards: list[Any] = component_list("weight", "name")
    loss: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.GRPOLoss"})
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    eval: RolloutEvalConfig = field(default_factory=RolloutEvalConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    peft: PEFTConfig = field(default_factory=PEFTConfig)  # LoRA / QLoRA / DoRA

    meaningless = staticmethod(model_dir_problems)

    def refuse_combinations(self) -> None:
        """A dataset that gives no prompts; steps a generation cannot split; context and
        pipeline parallelism; the rewards (built, their signatures checked)."""
        dataset = built_class(self.dataset, "dataset")
        if dataset is not None and not issubclass(dataset, PromptDataset):
            raise ConfigError(
                f"dataset._component_ builds {dataset.__name__}; grpo_fsdp2 generates from "
                "prompts and scores the completions.",
                fix="Use freetx.data.PromptDataset (a prompt or messages column, and the "
                "columns the rewards read).",
            )
        spg = self.generation.steps_per_generation
        for key, value in (("max_steps", self.max_steps),
                           ("checkpoint.every_n_steps", self.checkpoint.every_n_steps)):  # fmt: skip
            if value and value % spg:
                raise ConfigError(
                    f"{key}={value} is not a multiple of generation.steps_per_generation="
                    f"{spg}: a generation's steps run together (a checkpoint between them "
                    "could not resume them).",
                    fix=f"Set {key} to a multiple of {spg}.",
                )
        for axis in ("cp", "pp"):
            if getattr(self.distributed, axis) > 1:
                raise ConfigError(
                    f"distributed.{axis}={getattr(self.distributed, axis)}: grpo_fsdp2 "
                    "generates whole sequences on each rank; "
                    + ("the KV cache holds no context shard (generation would need the "
                       "keys and values of every cp rank at each token)" if axis == "cp" else
                       "a pipeline would generate one token per pass through every stage")
                    + ".",
                    fix=f"Use distributed.tp or a sharded strategy instead, with {axis}=1.",
                )  # fmt: skip
        check_same_forwards(self.distributed.ep, "grpo_fsdp2's generation")
        build_rewards(self.rewards)  # each reward's signature, before any launch

    def planned(self) -> PlannedRun:  # a prompt's completions, the generation phase
        gen = self.generation
        prompt = self.dataset.get("max_prompt_len")  # None: the model's whole context
        seq_len = prompt + gen.max_completion_length if prompt else None
        return PlannedRun(
            self.model, seq_len, self.peft, self.loss, rows_per_sample=gen.num_generations,
            reference=reference_kind(self),
            generations_per_prompt=gen.num_generations * gen.steps_per_generation,
            tokenizer=self.tokenizer, dataset=self.dataset,
        )  # fmt: skip


def reference_kind(cfg: GRPOConfig) -> str:
    """none (beta 0), adapters_off (LoRA), or frozen_copy."""
    if not float(cfg.loss.get("beta", 0.0)) > 0:
        return "none"
    return "adapters_off" if cfg.peft.method != "none" else "frozen_copy"


@dataclass
class Group:
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
    advantages: torch.Tensor | None = None  # [n], once every group is in (`set_advantages`)

    @property
    def zero_variance(self) -> bool:
        """Every completion got the same reward: the group carries no signal."""
        return bool((self.total == self.total[0]).all())


class GRPORecipeFSDP2:
    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device, cfg.distributed.collective_timeout_s)
        self.device = self.runtime.device
        self.accumulation = cfg.gradient_accumulation_steps
        seed_everything(cfg.seed, self.runtime.rank, cfg.deterministic)

    def setup(self) -> None:
        cfg, gen = self.cfg, self.cfg.generation
        cfg.refuse_combinations()
        self.groups = build_groups(self.runtime, cfg.distributed)
        rank, world_size = self.groups.dp_rank, self.groups.dp_size
        self.run = TrainingRun(cfg, self.groups, "grpo_fsdp2")
        micro_batch_size(cfg.batch_size, world_size, self.accumulation)  # prompts per rank
        self.tokenizer = checked_tokenizer(instantiate(cfg.tokenizer))
        self.loss_fn: GRPOLoss = instantiate(cfg.loss)
        self.rewards = build_rewards(cfg.rewards)
        self.weights = torch.tensor([r.weight for r in self.rewards])
        train_set = instantiate(cfg.dataset, tokenizer=self.tokenizer, split="train")
        val_set = instantiate(cfg.dataset, tokenizer=self.tokenizer, split="validation")
        self.run.report_cuts(train_set, val_set)
        longest = max(train_set.fit.seq_len, val_set.fit.seq_len)  # prompt tokens at most
        self.seq_len = longest + gen.max_completion_length

        with torch.device("meta"):
            model = instantiate(cfg.model)
        check_model_and_data(model.config, self.tokenizer, self.seq_len)
        if not isinstance(model, DecodesIncrementally):  # rollouts of many prompt lengths
            raise ConfigError(
                f"model: {type(model).__name__} has no KV cache (DecodesIncrementally), and "
                "grpo_fsdp2 generates each rank's prompts of different lengths in one "
                "left-padded batch, which only a KV cache masks.",
                fix="Train a decoder LM (freetx.models.transformer.decoder or an HF folder "
                "through freetx.models.hf_model).",
            )
        trains = apply_peft(model, cfg.peft, world_size)
        self.plan = parallelize(
            model, self.groups, cfg.distributed, seed=cfg.seed,
            init_weights=not self.run.loads_weights,
            frozen=self.run.decide_frozen_base(model),
        )  # fmt: skip
        self.model = self.plan.model
        self.optimizer = self.plan.build_optimizer(cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)

        kind = reference_kind(cfg)
        self.reference = None  # the KL term's: the base with adapters off, or a frozen copy
        if kind == "adapters_off":
            self.reference = AdaptersOff(self.plan, self.loss_fn.num_chunks)
        elif kind == "frozen_copy":
            self.reference = FrozenCopy.build(
                cfg.model, self.plan, cfg.seed, cfg.checkpoint.initial_weights,
                self.loss_fn.num_chunks,
            )  # fmt: skip
        self.sampling = Sampling(gen.temperature, gen.top_k, gen.top_p)
        folder = [] if cfg.model_dir is None else end_token_ids(cfg.model_dir)
        self.end_ids = [self.tokenizer.eos_id, *(i for i in folder if i != self.tokenizer.eos_id)]
        # this rank's share of each optimizer step's prompts (a generation takes
        # steps_per_generation of them: the same prompts per step at any world size)
        self.prompt_loader = build_train_loader(
            train_set, cfg.batch_size, 1, rank, world_size, cfg.seed,
            num_workers=cfg.num_workers, collate=collate_prompts,
        )  # fmt: skip
        self.val_loader = build_eval_loader(
            val_set, cfg.eval.batch_size, rank, world_size, collate_prompts
        )
        weights = cfg.checkpoint.initial_weights
        reference_inputs = {"reference": weights} if kind != "none" and weights else {}
        self.run.start(
            self.plan, self.optimizer, self.lr_scheduler, self.prompt_loader,
            tokens_per_sample=gen.num_generations * self.seq_len,
            inputs={**reference_inputs, **files_read_by(tokenizer=self.tokenizer, dataset=train_set)},
            prompts=len(train_set), completions_per_prompt=gen.num_generations,
            rewards=", ".join(f"{r.name} x {r.weight:g}" for r in self.rewards),
            reference=kind.replace("_", " "), trains=trains,
        )  # fmt: skip
        self.prompts = iter(self.prompt_loader)

    # -- the loop ---------------------------------------------------------------
    def train(self) -> None:
        cfg, run = self.cfg, self.run
        if run.step == 0 and cfg.eval.every_n_steps and cfg.eval.before_training:
            run.evaluate(self.evaluate)  # the success rate it starts from
        self.model.train()
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            steps, metrics = self.rollout()
            for batches in steps:  # each optimizer step's micro-batches
                started = time.perf_counter()
                self.optimizer.zero_grad(set_to_none=True)
                sums, units = accumulate_gradients(
                    self.plan, batches, self.compute_loss,
                    count=lambda b: self.loss_fn.units(b.completion_mask()),
                )  # fmt: skip
                grad_norm = optimizer_step(
                    self.plan, self.optimizer, self.lr_scheduler, cfg.max_grad_norm
                )
                run.advance(grad_norm, sum(b.real_positions() for b in batches))
                if run.log_due():
                    metrics["time/training"] = time.perf_counter() - started
                    run.log_train(sums, units, grad_norm, metrics)
                if run.due(cfg.eval.every_n_steps):
                    run.evaluate(self.evaluate)
                if run.due(cfg.checkpoint.every_n_steps):
                    run.save()
        run.finish(self.evaluate)

    def rollout(self) -> tuple[list[list[RolloutBatch]], dict[str, float]]:
        """One generation: this rank's prompts, their completions, rewards, advantages
        and the log-probs the loss reads, as each optimizer step's micro-batches; and the
        generation's metrics (over all ranks)."""
        gen = self.cfg.generation
        step, started = self.run.step, time.perf_counter()
        prompts = PromptBatch.join([next(self.prompts) for _ in range(gen.steps_per_generation)])
        groups, made = self.sample_groups(prompts, f"step {step}")
        for round_ in range(1, gen.dynamic_sampling + 1):  # DAPO: replace groups of no signal
            flat = [i for i, g in enumerate(groups) if g.zero_variance]
            # every rank takes part in each round (its parameters are gathered together)
            if not self.groups.sum({"flat": torch.tensor(len(flat))}, over="dp")["flat"]:
                break
            extra = next(self.prompts).take(len(flat))
            more, extra_made = self.sample_groups(extra, f"step {step} round {round_}")
            for index, group in zip(flat, more):
                groups[index] = group
            made = {k: made[k] + extra_made[k] for k in made}
        self.set_advantages(groups)
        per_step = len(groups) // gen.steps_per_generation
        steps = [self.micro_batches(groups[k * per_step : (k + 1) * per_step])
                 for k in range(gen.steps_per_generation)]  # fmt: skip
        self.with_logps([batch for batches in steps for batch in batches])
        self.write_samples(step, groups)
        metrics = self.rollout_metrics(groups, made)
        metrics["time/generation"], metrics["time/scoring"] = (
            made["generation_s"],
            made["scoring_s"],
        )
        metrics["time/rollout"] = time.perf_counter() - started
        return steps, metrics

    def sample_groups(self, prompts: PromptBatch, when: str) -> tuple[list[Group], dict]:
        """num_generations completions of each prompt, scored: a Group per prompt; and
        the time and tokens it took. Each completion's draws are keyed by the run's seed,
        `when`, the prompt's id and its index in the group."""
        cfg, gen = self.cfg, self.cfg.generation
        n = gen.num_generations
        rows = [ids for ids in prompts.prompt_ids for _ in range(n)]
        keys = [f"seed {cfg.seed} {when} prompt {pid} sample {j}"
                for pid in prompts.ids for j in range(n)]  # fmt: skip
        started = time.perf_counter()
        with self.plan.gathered() as model, self.plan.autocast():  # one all-gather
            model.eval()
            out = None
            if rows:
                out = generate(
                    model, rows, gen.max_completion_length, self.sampling, self.end_ids,
                    Draws.keyed(keys, gen.max_completion_length),
                )  # fmt: skip
            model.train()
        generated = time.perf_counter() - started
        if out is None:
            return [], {"generation_s": generated, "scoring_s": 0.0, "tokens": 0.0}
        replies, ended = out.replies(), out.ended.cpu()
        texts = [self.tokenizer.decode(r[:-1] if e else r) for r, e in zip(replies, ended.tolist())]
        fields = [{**prompts.fields[i // n], "completion_tokens": len(r)}
                  for i, r in enumerate(replies)]  # fmt: skip
        scoring = time.perf_counter()
        raw = score_completions(
            self.rewards, [p for p in prompts.prompts for _ in range(n)], texts, fields,
            [i for i in prompts.ids for _ in range(n)],
        )  # fmt: skip
        scored = time.perf_counter() - scoring
        entropy = (out.entropy.sum(dim=1) / out.lengths.clamp(min=1)).cpu()
        groups = []
        for i, prompt_ids in enumerate(prompts.prompt_ids):
            part = slice(i * n, (i + 1) * n)
            groups.append(Group(
                prompt_ids, prompts.prompts[i], prompts.ids[i], replies[part], texts[part],
                raw[part], raw[part] @ self.weights, ended[part], entropy[part],
            ))  # fmt: skip
        tokens = float(out.lengths.sum())
        return groups, {"generation_s": generated, "scoring_s": scored, "tokens": tokens}

    def set_advantages(self, groups: list[Group]) -> None:
        """Each completion's advantage: its reward minus its group's mean, divided by the
        group's std (`scale_rewards: group`), by the std of every rank's rewards (`batch`),
        or not at all (`none`, Dr. GRPO)."""
        n, scale = self.cfg.generation.num_generations, self.loss_fn.scale_rewards
        total = torch.cat([g.total for g in groups])
        found = group_advantages(total, n, "none" if scale == "batch" else scale)
        advantages = found.advantages
        if scale == "batch":  # the std over every rank's rewards, as TRL's
            sums = self.groups.sum({"n": torch.tensor(float(len(total))), "sum": total.sum(),
                                    "sq": (total.double() ** 2).sum()}, over="dp")  # fmt: skip
            mean = sums["sum"] / sums["n"]
            variance = (sums["sq"] - sums["n"] * mean**2) / max(sums["n"] - 1, 1)
            advantages = advantages / (max(variance, 0.0) ** 0.5 + 1e-4)
        for i, group in enumerate(groups):
            group.advantages = advantages[i * n : (i + 1) * n]

    def micro_batches(self, groups: list[Group]) -> list[RolloutBatch]:
        """One optimizer step's groups in gradient_accumulation_steps micro-batches, each
        its groups' completions as rows (a group never split)."""
        size = len(groups) // self.accumulation
        batches = []
        for part in (groups[i * size : (i + 1) * size] for i in range(self.accumulation)):
            batches.append(RolloutBatch.of_rollouts(
                [g.prompt_ids for g in part for _ in g.completions],
                [c for g in part for c in g.completions],
                torch.cat([g.advantages for g in part]),
            ))  # fmt: skip
        return batches

    @torch.no_grad()
    def with_logps(self, batches: list[RolloutBatch]) -> None:
        """Each group's log-probs the loss reads besides the policy's own: the policy's at
        generation time (more than one step per generation) and the reference's (a KL
        term), a micro-batch at a time (every rank runs as many forwards)."""
        steps = self.cfg.generation.steps_per_generation
        if steps == 1 and self.reference is None:
            return
        num_chunks = self.loss_fn.num_chunks
        for batch in batches:
            placed = batch.to(self.device)
            if steps > 1:
                with self.plan.autocast():
                    batch.old_logps = token_logps(
                        self.model, placed.input_ids, placed.labels, num_chunks
                    )[0]
            if self.reference is not None:
                batch.ref_logps = self.reference.tokens(placed)

    def compute_loss(self, batch: RolloutBatch):
        """One micro-batch of completions: the policy's log-probs (with a gradient) and
        the GRPO loss summed over its units (+ the metrics' sums)."""
        logps, output = token_logps(
            self.model, batch.input_ids, batch.labels, self.loss_fn.num_chunks
        )
        mask = batch.completion_mask()
        loss, metrics = self.loss_fn(
            logps, batch.old_logps, batch.ref_logps, batch.advantages.to(logps.device), mask,
            max_completion_length=self.cfg.generation.max_completion_length,
        )  # fmt: skip
        return with_router_loss(output, loss, metrics, self.loss_fn.units(mask))

    # -- what it logs -----------------------------------------------------------
    def rollout_metrics(self, groups: list[Group], made: dict[str, float]) -> dict[str, float]:
        """TRL's names, over every rank's completions: reward (mean, and the mean of the
        groups' std), each reward's mean and std, the groups without signal, completion
        lengths, how many hit max_completion_length, entropy, generation tokens/s."""
        limit = self.cfg.generation.max_completion_length
        raw = torch.cat([g.raw for g in groups])
        total = torch.cat([g.total for g in groups])
        lengths = torch.tensor([len(c) for g in groups for c in g.completions], dtype=torch.float)
        ended = torch.cat([g.ended for g in groups])
        sums = {
            "completions": len(total), "groups": len(groups),
            "reward": float(total.sum()), "reward_sq": float((total**2).sum()),
            "reward_std": sum(float(g.total.std()) for g in groups),
            "frac_reward_zero_std": sum(g.zero_variance for g in groups),
            "completions/mean_length": float(lengths.sum()),
            "completions/clipped_ratio": float(((lengths >= limit) & ~ended).sum()),
            "entropy": float(torch.cat([g.entropy for g in groups]).sum()),
            "generation_tokens": made["tokens"], "generation_s": made["generation_s"],
        }  # fmt: skip
        for i, reward in enumerate(self.rewards):
            sums[f"rewards/{reward.name}/mean"] = float(raw[:, i].sum())
            sums[f"rewards/{reward.name}/sq"] = float((raw[:, i] ** 2).sum())
        totals, maxima = self.groups.sum_and_max(
            sums, {"completions/max_length": float(lengths.max())}, over="dp"
        )
        n, g = totals.pop("completions"), totals.pop("groups")
        out = dict(maxima)
        for name in ("reward", *(f"rewards/{r.name}/mean" for r in self.rewards)):
            out[name] = totals[name] / n
            if name != "reward":  # a reward's std over every completion
                square = totals[name.replace("/mean", "/sq")] / n
                out[name.replace("/mean", "/std")] = max(square - out[name] ** 2, 0.0) ** 0.5
        for name in ("reward_std", "frac_reward_zero_std"):  # per group
            out[name] = totals[name] / g
        for name in ("completions/mean_length", "completions/clipped_ratio", "entropy"):
            out[name] = totals[name] / n
        out["generation/tokens_per_s"] = totals["generation_tokens"] / max(
            totals["generation_s"], 1e-9
        )
        return out

    def write_samples(self, step: int, groups: list[Group]) -> None:
        """samples.every_n_steps: rank 0's first `count` completions to samples.jsonl
        (prompt, completion, each reward, total), `show` of them on the console."""
        cfg = self.cfg.samples
        if not (cfg.every_n_steps and step % cfg.every_n_steps == 0) or self.runtime.rank:
            return
        records = []
        for group in groups:
            for j, text in enumerate(group.texts):
                rewards = {r.name: float(group.raw[j, i]) for i, r in enumerate(self.rewards)}
                records.append({"step": step, "id": group.id, "prompt": group.prompt,
                                "completion": text, "rewards": rewards,
                                "reward": float(group.total[j])})  # fmt: skip
        records = records[: cfg.count]
        with open(Path(self.cfg.output_dir) / "samples.jsonl", "a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        for record in records[: cfg.show]:
            self.run.write(
                f"sample at step {step}: {record['prompt']!r} -> {record['completion']!r} "
                f"(reward {record['reward']:g})"
            )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """One completion per validation prompt (eval.temperature; 0: greedy), scored:
        the mean reward and each reward's, the mean length; every rank taking part."""
        cfg = self.cfg
        sampling = Sampling(cfg.eval.temperature, cfg.generation.top_k, cfg.generation.top_p)
        sums: dict[str, Any] = {}
        with self.plan.gathered() as model, self.plan.autocast():
            model.eval()
            for batch in itertools.islice(self.val_loader, cfg.eval.max_batches):
                keys = [f"seed {cfg.seed} validation {i}" for i in batch.ids]
                totals = reward_sums(
                    model,
                    batch,
                    self.rewards,
                    self.tokenizer,
                    self.end_ids,
                    cfg.generation.max_completion_length,
                    sampling,
                    keys,
                )
                totals = {(k if k == "prompts" else f"val/{k}"): v for k, v in totals.items()}
                for name, value in totals.items():
                    sums[name] = sums.get(name, 0) + value
            model.train()
        totals = self.groups.sum(sums, over="dp")
        prompts = max(float(totals.pop("prompts")), 1.0)
        return {name: float(value) / prompts for name, value in totals.items()}

    def cleanup(self) -> None:
        self.run.close()


@parse(GRPOConfig)
def recipe_main(cfg: GRPOConfig) -> None:
    recipe = GRPORecipeFSDP2(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
