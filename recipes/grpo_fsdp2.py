"""Online RL with verifiable rewards: GRPO and its kin (Dr. GRPO, DAPO, GSPO), the policy
generating its own completions inside the training job; all of the model's weights, or
LoRA / QLoRA / DoRA adapters (`peft:`), on FSDP2 / ZeRO / DDP strategies with tp.

    freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/instruct_tiny  # the SFT
    freetx run --nproc-per-node 2 grpo_fsdp2 --config llm/grpo_tiny
    freetx run --nproc-per-node 2 grpo_fsdp2 --config llm/hf_tiny_grpo model_dir=DIR \\
        dataset.source=prompts.jsonl
    freetx run --nproc-per-node 2 grpo_fsdp2 --config llm/calculator_grpo_tiny  # a tool

One generation, then `generation.steps_per_generation` optimizer steps, top to bottom
in `train()`:
1. every data-parallel rank takes its prompts (`freetx.data.PromptDataset`: a prompt and
   the fields the rewards read, e.g. the answer) and samples `num_generations`
   completions of each with the current policy (`freetx.models.generation.generate`: a
   KV cache, stops at the end token), its sharded parameters gathered once for the
   whole phase (`ParallelPlan.gathered`); each completion's draws come from its own
   seed (the run's seed, the step, the prompt's id, its index), so the rollouts are the
   same at any world size and after a resume;
   with `env:` or `tools:`, each completion is a multi-turn episode instead: the model
   replies, a tool or the environment answers (while the other episodes decode), and so
   on until the episode ends (`freetx.objectives.episodes.EpisodeRunner`,
   docs/environments.md), trained on the
   sampled tokens exactly (token in, token out);
2. the reward functions score each completion (`rewards:`, weighted and summed;
   `freetx.objectives.rewards`; an episode's: its last reply and whole conversation,
   plus the environment's rewards);
3. each group's advantages (`freetx.objectives.group_advantages`): its rewards minus
   their mean (`advantage:`; RLOO's: the others' mean), divided by their std or not
   (`loss.scale_rewards`); a group whose rewards are all equal carries no signal
   (counted; `generation.dynamic_sampling` replaces it);
4. the policy's log-probs at generation time (the ratio's denominator, when more than
   one optimizer step uses the generation) and the reference's (`loss.beta` > 0, or a
   KL folded into the reward: the base with adapters off for LoRA, a frozen copy for
   full fine-tuning); a per-token estimate (REINFORCE++) makes its advantages here;
5. each optimizer step on its share of the completions: the clipped ratio objective
   (`freetx.objectives.GRPOLoss`), summed over the micro-batches and divided by the
   global batch's units (tokens, or completions).
A new RL algorithm is an advantage estimate (`freetx/objectives/advantages.py`) or a
loss in freetx/objectives/ and a config; copy this file (`freetx cp grpo_fsdp2
./my_grpo.py`) to change the loop itself.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from freetx.config import instantiate
from freetx.data import ByteTokenizer, PromptDataset, RolloutBatch, collate_prompts
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.fields import at_least, component_list, component_node
from freetx.models.engine import check_pool
from freetx.models.generation import Sampling, check_generates
from freetx.models.hf import ending_ids
from freetx.objectives import GRPOLoss, build_rewards, token_logps, with_router_loss
from freetx.objectives.advantages import TokenAdvantages
from freetx.objectives.deadline import Interrupted
from freetx.objectives.episodes import (
    ENV_KEYS,
    EpisodeRunner,
    build_environment,
    check_episode_pool,
    no_chat_template,
)
from freetx.objectives.reference import reference_kind, reference_model
from freetx.objectives.rewards import REWARD_TIMEOUT_S, HoldsModel, place_rewards
from freetx.objectives.rollouts import CompletionScorer, GenerationConfig, Rollouts, write_samples
from freetx.training import FinalTasksConfig, PlannedRun, accumulate_gradients, optimizer_step
from freetx.training.decoder import DecoderConfig, DecoderSetup
from freetx.training.export import built_class


@dataclass
class RolloutEvalConfig(FinalTasksConfig):
    """The `eval:` section: completions to the validation prompts, one per prompt, scored
    by the same rewards (`val/reward`, `val/rewards/<name>/mean`: with an exact-match
    reward and temperature 0, the greedy success rate); and `eval.after_training`'s
    lm-eval tasks."""

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
class GRPOConfig(DecoderConfig):
    """The schema of this recipe's configs: DecoderConfig's keys, then these. batch_size
    counts prompts per optimizer step (each num_generations completions); the dataset is a
    PromptDataset."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *DecoderConfig.fixed_on_resume,
        "loss",
        "generation",
        "rewards",
        "advantage",
        "env",
        "tools",
    )

    # [{_component_: ..., weight: 1.0, name: ...}]: freetx.objectives.rewards, docs/rewards.md
    # ([] with an env: its own rewards)
    rewards: list[Any] = component_list("weight", "name")
    # multi-turn episodes (docs/environments.md): {_component_: an environment, max_turns,
    # max_tokens, tool_format, timeout_s}; None: one completion per prompt
    env: Any = component_node(*ENV_KEYS, optional=True)
    # functions the model may call ([{_component_: my_tools.search}]), besides the env's
    tools: list[Any] = component_list(default_factory=list)
    # seconds a reward's call may take (a TRL-style reward's: its call on a rank's batch);
    # past it the run stops naming the reward and the row (freetx.objectives.deadline)
    reward_timeout_s: float = at_least(1, default=REWARD_TIMEOUT_S)
    loss: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.GRPOLoss"})
    # a completion's reward minus this baseline: GroupMean (GRPO) or LeaveOneOut (RLOO); or
    # advantages per token: ReinforcePlusPlus (a KL folded into the reward, batch-normalized)
    advantage: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.GroupMean"})
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    eval: RolloutEvalConfig = field(default_factory=RolloutEvalConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)

    def refuse_combinations(self) -> None:
        """A dataset that gives no prompts; a KV cache pool too small for a completion;
        steps a generation cannot split; context and
        pipeline parallelism; the rewards (built, their signatures checked). And
        DecoderConfig's (QAT with tp, an evaluation without validation rows)."""
        super().refuse_combinations()
        dataset = built_class(self.dataset, "dataset")
        if dataset is not None and not issubclass(dataset, PromptDataset):
            raise ConfigError(
                f"dataset._component_ builds {dataset.__name__}; grpo_fsdp2 generates from "
                "prompts and scores the completions.",
                fix="Use freetx.data.PromptDataset (a prompt or messages column, and the "
                "columns the rewards read).",
            )
        check_pool(
            self.generation.engine, self.generation.max_completion_length, "generation.engine."
        )
        spg = self.generation.steps_per_generation
        for key, value in (
            ("max_steps", self.max_steps),
            ("checkpoint.every_n_steps", self.checkpoint.every_n_steps),
        ):
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
                    + (
                        "the KV cache holds no context shard (generation would need the "
                        "keys and values of every cp rank at each token)"
                        if axis == "cp"
                        else "a pipeline would generate one token per pass through every stage"
                    )
                    + ".",
                    fix=f"Use distributed.tp or a sharded strategy instead, with {axis}=1.",
                )
        instantiate(self.advantage)  # an advantage estimate that builds
        build_rewards(self.rewards, required=not self.episodes)  # each one's signature
        if self.episodes:
            limits = build_environment(self.env, self.tools)[2]  # the env, its tools' schemas
            check_episode_pool(self.generation.engine, limits.max_tokens)
            tokenizer = built_class(self.tokenizer, "tokenizer")
            if tokenizer is ByteTokenizer and not self.tokenizer.get("chat_template"):
                raise no_chat_template("ByteTokenizer")  # an HF folder's: when it is read

    @property
    def episodes(self) -> bool:
        """Whether the rollouts are multi-turn episodes (an env, or tools)."""
        return self.env is not None or bool(self.tools)

    def cautions(self) -> list[str]:
        """Greedy sampling (temperature 0, or top_k 1): a group's completions are all the
        same, so GRPO cannot learn; a `loss.scale_rewards` that a per-token estimate does
        not read. Legal, so said and not refused."""
        gen, found = self.generation, super().cautions()
        scale = self.loss.get("scale_rewards", "group")
        if scale != "group" and isinstance(instantiate(self.advantage), TokenAdvantages):
            found.append(
                f"loss.scale_rewards={scale} is not read: advantage "
                f"{self.advantage['_component_']} normalizes every token's return over the "
                "whole rollout itself. Leave loss.scale_rewards at group (or use a Baseline: "
                "freetx.objectives.GroupMean, LeaveOneOut)."
            )
        greedy = "temperature=0" if gen.temperature == 0 else "top_k=1" if gen.top_k == 1 else ""
        if not greedy:
            return found
        return [
            *found,
            f"generation.{greedy} samples greedily: the {gen.num_generations} completions of "
            "each prompt are the same, so each group's rewards are equal, every advantage is "
            "0 and the run learns nothing (frac_reward_zero_std stays 1). Sample instead, e.g. "
            "generation.temperature=1.0 (eval.temperature=0 keeps validation greedy).",
        ]

    def planned(self) -> PlannedRun:  # a prompt's completions, the generation phase
        gen = self.generation
        prompt = self.dataset.get("max_prompt_len")  # None: the model's whole context
        seq_len = prompt + gen.max_completion_length if prompt else None
        if self.episodes:  # an episode's tokens
            seq_len = build_environment(self.env, self.tools)[2].max_tokens
        return PlannedRun(
            self.model,
            seq_len,
            self.peft,
            self.loss,
            rows_per_sample=gen.num_generations,
            reference=reference_kind(
                [instantiate(self.loss), instantiate(self.advantage)], self.peft.method != "none"
            ),
            generations_per_prompt=gen.num_generations * gen.steps_per_generation,
            engine=gen.engine,
            judges=tuple(  # a judge's model, a reward model's path
                str(node.get("model") or node.get("path"))
                for node in self.rewards
                if (target := built_class(node, "rewards")) and issubclass(target, HoldsModel)
            ),
            tokenizer=self.tokenizer,
            dataset=self.dataset,
        )


class GRPORecipeFSDP2:
    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.accumulation = cfg.gradient_accumulation_steps

    def setup(self) -> None:
        cfg, gen = self.cfg, self.cfg.generation
        self.decoder = setup = DecoderSetup(cfg, "grpo_fsdp2")  # the run, ranks, tokenizer
        self.run, self.groups = setup.run, setup.groups
        self.loss_fn: GRPOLoss = instantiate(cfg.loss)
        self.rewards = build_rewards(cfg.rewards, required=not cfg.episodes)
        train_set, val_set = setup.datasets()
        # prompt tokens at most
        longest = max(d.fit.seq_len for d in (train_set, val_set) if d is not None)
        self.seq_len = longest + gen.max_completion_length
        # the loss's constant normalizer (Dr. GRPO): a completion's sampled tokens at most
        self.completion_budget = gen.max_completion_length
        end_ids = ending_ids(setup.tokenizer.eos_id, [cfg.model_dir])
        scoring = (self.rewards, end_ids, gen.max_completion_length, cfg.reward_timeout_s)
        if cfg.episodes:  # multi-turn: an episode's tokens, every reply's
            env, tools, limits = build_environment(cfg.env, cfg.tools)
            self.seq_len = limits.max_tokens
            self.completion_budget = gen.max_completion_length * limits.max_turns
            # its chat template and tool format checked here, before the model
            self.scorer = EpisodeRunner(setup.tokenizer, env, tools, limits, *scoring, gen.engine)
        else:
            self.scorer = CompletionScorer(setup.tokenizer, *scoring, gen.engine)
        seq_key = (
            "env.max_tokens"
            if cfg.episodes
            else "dataset.max_prompt_len + generation.max_completion_length"
        )
        model = setup.meta_model(cfg.model, self.seq_len, seq_key=seq_key)
        check_generates(model, "grpo_fsdp2")  # rollouts of many prompt lengths
        self.plan = setup.build(model)  # PEFT, QAT, parallelize, optimizer, schedule
        self.model, self.optimizer = self.plan.model, setup.optimizer
        place_rewards(self.rewards, setup.runtime.device, self.plan)  # a judge, sharded like it

        # the KL's reference (loss.beta > 0, or a KL folded into the reward): the base with
        # adapters off, or a frozen copy
        self.advantage = instantiate(cfg.advantage)
        kind = reference_kind([self.loss_fn, self.advantage], cfg.peft.method != "none")
        self.reference = reference_model(
            kind,
            self.plan,
            cfg.model,
            cfg.seed,
            cfg.checkpoint.initial_weights,
            self.loss_fn.num_chunks,
        )
        self.rollouts = Rollouts(
            self.plan,
            self.scorer,
            gen,
            self.advantage,
            self.loss_fn.scale_rewards,
            cfg.seed,
            micro_batches=self.accumulation,
            stop=self.run,  # a stop signal while a reward runs: Interrupted
        )
        # this rank's share of each optimizer step's prompts (a generation takes
        # steps_per_generation of them: the same prompts per step at any world size)
        self.prompt_loader, self.val_loader = setup.loaders(
            train_set, val_set, collate_prompts, micro_batches=1
        )
        setup.start(
            self.prompt_loader,
            train_set,
            tokens_per_sample=gen.num_generations * self.seq_len,
            flops_seq_len=self.seq_len,
            models={"reference": None if kind == "none" else cfg.checkpoint.initial_weights},
            prompts=len(train_set),
            completions_per_prompt=gen.num_generations,
            rewards=", ".join(f"{r.name} x {r.weight:g}" for r in self.scorer.rewards),
            reference=kind.replace("_", " "),
        )
        self.prompts = iter(self.prompt_loader)

    def train(self) -> None:
        cfg, run = self.cfg, self.run
        if run.step == 0 and cfg.eval.every_n_steps and cfg.eval.before_training:
            run.evaluate(self.evaluate)  # the success rate it starts from
        self.model.train()
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            # one generation: completions, rewards, advantages, log-probs; its steps' batches
            where = self.prompt_loader.state_dict()  # its prompts' place in the data
            try:
                steps, prompt_groups, metrics = self.rollouts(
                    self.prompts, run.step, self.reference, self.loss_fn.num_chunks
                )
            except Interrupted:  # a stop signal while a reward ran: every rank stops here,
                self.prompt_loader.load_state_dict(where)  # saving this step, which resumes
                break  # with this generation's prompts

            self.write_samples(run.step, prompt_groups)
            for batches in steps:  # each optimizer step's micro-batches
                started = time.perf_counter()
                self.optimizer.zero_grad(set_to_none=True)
                sums, units = accumulate_gradients(
                    self.plan,
                    batches,
                    self.compute_loss,
                    count=lambda b: self.loss_fn.units(b.completion_mask()),
                )
                grad_norm = optimizer_step(
                    self.plan, self.optimizer, self.decoder.lr_scheduler, cfg.max_grad_norm
                )
                run.advance(grad_norm, sum(b.real_positions() for b in batches))
                if run.log_due():
                    metrics["time/training"] = time.perf_counter() - started
                    run.log_train(sums, units, grad_norm, metrics)
                if run.due(cfg.eval.every_n_steps):
                    run.evaluate(self.evaluate)
                if run.due(cfg.checkpoint.every_n_steps):
                    run.save()
        self.decoder.finish(self.evaluate)  # the last step's; QAT's export; lm-eval tasks

    def compute_loss(self, batch: RolloutBatch):
        """One micro-batch of completions: the policy's log-probs (with a gradient) and
        the GRPO loss summed over its units (+ the metrics' sums)."""
        logps, output = token_logps(
            self.model, batch.input_ids, batch.labels, self.loss_fn.num_chunks
        )
        mask = batch.completion_mask()
        loss, metrics = self.loss_fn(
            logps,
            batch.old_logps,
            batch.ref_logps,
            batch.advantages.to(logps.device),
            mask,
            max_completion_length=self.completion_budget,
        )
        return with_router_loss(output, loss, metrics, self.loss_fn.units(mask))

    def write_samples(self, step: int, prompt_groups) -> None:
        """samples.every_n_steps: rank 0's first `count` completions to samples.jsonl
        (prompt, completion, each reward, total), `show` of them on the console."""
        cfg = self.cfg.samples
        if not (cfg.every_n_steps and step % cfg.every_n_steps == 0) or self.decoder.runtime.rank:
            return
        path = Path(self.cfg.output_dir) / "samples.jsonl"
        records = write_samples(path, step, prompt_groups, self.scorer.rewards, cfg.count)
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
        batches = itertools.islice(self.val_loader, cfg.eval.max_batches)
        with self.plan.gathered() as model, self.plan.autocast():
            model.eval()
            means = self.scorer.validation(
                model, batches, sampling, f"seed {cfg.seed} validation", self.groups
            )
            model.train()
        return {f"val/{name}": value for name, value in means.items()}

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
