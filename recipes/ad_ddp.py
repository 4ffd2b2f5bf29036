"""Algorithm Distillation on Dark Room, trained with DDP, evaluated in context.

    freetx run --nproc-per-node 2 ad_ddp --config ad/darkroom_tiny
    freetx run --nproc-per-node 2 ad_ddp --config ad/darkroom_ed      # the ED control
    freetx run --nproc-per-node 2 ad_ddp --config ad/darkroom_compressed

Setup makes (or reuses) the learning histories: Q-learning on every training
goal, generation split across ranks, one safetensors shard per rank. The loop
is the LM recipe's: windows of `n_transit` transitions, the source's action
predicted at every position, accumulation with gradient sync on the last
micro-batch, clip, step, schedule, log, checkpoint. Evaluation runs the frozen
model on held-out goals for `eval.episodes` episodes, its own transitions
filling a sliding context, the goals split across ranks and the returns
summed over all of them. With a `compress:` section (compressed AD, the seed's
`ad_dr_compressed`), the context is the last `compress.regions` regions of
`compress.region_episodes` episodes each, bracketed by learned <compress> / </compress>
tokens, in training windows and in the evaluation alike: the oldest region is dropped
whole when a new one opens.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import MISSING

from freetx.config import at_least, instantiate
from freetx.data import build_train_loader, micro_batch_size
from freetx.data.darkroom import (
    ADWindows,
    CompressedADWindows,
    compressed_length,
    compressed_run_inputs,
    histories_cache,
    load_histories,
    next_transition,
    run_inputs,
    subsample_episodes,
)
from freetx.distributed import build_groups, init_distributed, parallelize
from freetx.entry import parse
from freetx.envs import (
    NUM_ACTIONS,
    DarkRoom,
    DarkRoomConfig,
    HistoryConfig,
    goal_split,
    history_shard,
    optimal_return,
    random_return,
    state_index,
)
from freetx.errors import ConfigError
from freetx.fields import written_folder
from freetx.training import (
    PlannedRun,
    TrainingConfig,
    TrainingRun,
    accumulate_gradients,
    build_lr_scheduler,
    optimizer_step,
    seed_everything,
)

MIN_EPISODES_IN_CONTEXT = 4


@dataclass
class InContextEvalConfig:
    every_n_steps: int = at_least(0, default=0)  # 0: only at the end of training
    episodes: int = at_least(1, default=30)  # in-context episodes per goal
    seeds: int = at_least(1, default=2)  # evaluation seeds per goal (averaged over goals x seeds)
    # sampling temperatures tried on the validation goals (0: greedy); the test goals are
    # evaluated once, at the end, at the one whose last 5 episodes returned most
    temperatures: list[float] = field(default_factory=lambda: [0.5, 1.0])


@dataclass
class CompressConfig:
    """`compress:` compressed AD: the context keeps the last `regions` regions (rollout
    batches) of `region_episodes` episodes, each between <compress> and </compress>."""

    region_episodes: int = at_least(1, default=2)
    regions: int = at_least(2, default=2)  # the one being filled and the ones before it


def first2(curve: np.ndarray) -> float:
    return float(np.mean(curve[:2]))


def last5(curve: np.ndarray) -> float:
    return float(np.mean(curve[-5:]))


@dataclass
class ADRecipeConfig(TrainingConfig):
    """The schema of ad_ddp's configs: TrainingConfig's keys, then these (its configs pick
    DDP: `distributed.strategy: ddp`); a key not listed is an error. batch_size: global windows per step (seed:
    train_batch_size x GPUs x accumulation)."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *TrainingConfig.fixed_on_resume, "model", "env", "histories", "compress",
    )  # fmt: skip

    data_dir: Optional[str] = written_folder(None)  # histories; null: <output_dir>/data
    env: DarkRoomConfig = field(default_factory=DarkRoomConfig)
    histories: HistoryConfig = field(default_factory=HistoryConfig)
    model: Any = MISSING
    eval: InContextEvalConfig = field(default_factory=InContextEvalConfig)
    compress: Optional[CompressConfig] = None  # null: plain AD, a sliding window

    def planned(self) -> PlannedRun:  # windows of the model's context (n_transit)
        return PlannedRun(self.model)

    def refuse_combinations(self) -> None:
        """The model against the environment (`check_model_fits`): `freetx validate`,
        `run` and `launch` refuse alike, before any history is generated."""
        super().refuse_combinations()
        with torch.device("meta"):
            model = instantiate(self.model)
        check_model_fits(self, model.config)


def check_model_fits(cfg: ADRecipeConfig, model_config) -> None:
    """The model against the environment: a context across episodes, every cell a state,
    Dark Room's actions; the evaluation's temperatures and the goals that choose one."""
    env, horizon, compress = cfg.env, cfg.env.horizon, cfg.compress
    if (
        compress is not None
        and compress.regions * compress.region_episodes < MIN_EPISODES_IN_CONTEXT
    ):
        raise ConfigError(
            f"compress: {compress.regions} regions of {compress.region_episodes} episodes "
            f"span fewer than {MIN_EPISODES_IN_CONTEXT} episodes; in-context learning needs a "
            "context across episodes. Raise compress.region_episodes or compress.regions."
        )
    if compress is None and model_config.max_seq_len < MIN_EPISODES_IN_CONTEXT * horizon:
        raise ConfigError(
            f"model.n_transit={model_config.max_seq_len} spans fewer than "
            f"{MIN_EPISODES_IN_CONTEXT} episodes of {horizon} steps; in-context learning needs "
            f"a context across episodes. Use n_transit >= {MIN_EPISODES_IN_CONTEXT * horizon}."
        )
    if model_config.num_states < env.grid_size**2:
        raise ConfigError(
            f"model.num_states={model_config.num_states} is fewer than the "
            f"{env.grid_size**2} cells of a {env.grid_size}x{env.grid_size} Dark Room "
            f"(env.grid_size={env.grid_size}). Set model.num_states={env.grid_size**2}."
        )
    temps = cfg.eval.temperatures
    if not temps or min(temps) < 0:
        raise ConfigError(
            f"eval.temperatures={list(temps)}: list one or more sampling temperatures, "
            "each 0 (greedy) or more, e.g. eval.temperatures=[0.5,1.0]."
        )
    if len(temps) > 1 and not len(goal_split(env).val):
        raise ConfigError(
            f"eval.temperatures lists {len(temps)} temperatures but env.val_goals=0: there "
            "are no validation goals to choose one on (the test goals never choose). Set "
            "env.val_goals > 0, or list one temperature."
        )
    if model_config.state_encoding == "xy" and model_config.grid_size != env.grid_size:
        raise ConfigError(
            f"model.grid_size={model_config.grid_size} but env.grid_size={env.grid_size}; "
            f"the xy state encoding reads cells of the environment's grid. Set "
            f"model.grid_size={env.grid_size}."
        )
    if compress is not None and not model_config.boundary_tokens:
        raise ConfigError(
            "compress: lays the context out in regions between <compress> / </compress> "
            "tokens, which the model embeds only with model.boundary_tokens=true; set it, "
            "or compress=null for plain AD."
        )
    if compress is None and model_config.boundary_tokens:
        raise ConfigError(
            "model.boundary_tokens=true embeds compressed AD's <compress> / </compress> "
            "tokens, but there is no compress: section to lay them out; add one (e.g. "
            "compress={region_episodes: 2, regions: 2}) or set model.boundary_tokens=false."
        )
    need = compressed_length(compress.region_episodes, compress.regions, horizon) if compress else 0
    if need > model_config.max_seq_len:
        raise ConfigError(
            f"compress: {compress.regions} regions of {compress.region_episodes} episodes of "
            f"{horizon} steps are {need} tokens with their markers, more than "
            f"model.n_transit={model_config.max_seq_len} holds. Set model.n_transit={need}, "
            "or keep fewer or shorter regions."
        )
    history = cfg.histories.episodes // cfg.histories.subsample  # episodes per history
    window = compress.regions * compress.region_episodes if compress else 0
    if window > history:
        raise ConfigError(
            f"compress: {compress.regions} regions of {compress.region_episodes} episodes are "
            f"longer than a history ({history} episodes: histories.episodes / subsample); "
            "lower compress.regions or compress.region_episodes, or raise histories.episodes."
        )
    if model_config.num_actions != NUM_ACTIONS:
        raise ConfigError(
            f"model.num_actions={model_config.num_actions}, but Dark Room has "
            f"{NUM_ACTIONS} actions (4 moves and stay). Set model.num_actions={NUM_ACTIONS}."
        )


class ADRecipeDDP:
    def __init__(self, cfg: ADRecipeConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device, cfg.distributed.collective_timeout_s)
        self.device = self.runtime.device
        self.accumulation = cfg.gradient_accumulation_steps
        seed_everything(cfg.seed, self.runtime.rank, cfg.deterministic)

    def setup(self) -> None:
        cfg = self.cfg
        self.groups = build_groups(self.runtime, cfg.distributed)  # the ranks: dp, world
        self.run = TrainingRun(cfg, self.groups, "ad_ddp")  # claims output_dir, plans the resume
        rank, world_size = self.groups.dp_rank, self.groups.dp_size  # this rank's share of data
        micro_batch_size(cfg.batch_size, world_size, self.accumulation)  # fails early
        # Cheap checks first: a model that does not fit the environment fails before any
        # history is generated.
        with torch.device("meta"):
            model = instantiate(cfg.model)
        self.n_transit = model.config.max_seq_len
        check_model_fits(cfg, model.config)  # as `freetx run` did before launching
        histories = self.make_histories()
        if cfg.compress is None:
            windows = ADWindows(
                histories, self.n_transit, cfg.env.horizon, model.no_action, model.no_reward
            )
        else:
            c = cfg.compress
            windows = CompressedADWindows(
                histories, c.region_episodes, c.regions, cfg.env.horizon,
                model.no_action, model.no_reward,
            )  # fmt: skip
        tokens = len(windows[0]["labels"])
        self.plan = parallelize(
            model, self.groups, cfg.distributed, seed=cfg.seed,
            init_weights=not self.run.loads_weights,  # random init unless weights are loaded
        )  # fmt: skip
        self.model = self.plan.model
        self.optimizer = self.plan.build_optimizer(cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)
        self.train_loader = build_train_loader(
            windows, cfg.batch_size, self.accumulation, rank, world_size, cfg.seed,
            num_workers=cfg.num_workers,
        )  # fmt: skip
        self.run.start(
            self.plan, self.optimizer, self.lr_scheduler, self.train_loader,
            tokens_per_sample=tokens, n_transit=self.n_transit, windows=len(windows),
            histories="expert (ED)" if cfg.histories.expert else "Q-learning (AD)",
            context="sliding" if cfg.compress is None else
            f"compressed: {cfg.compress.regions} regions x {cfg.compress.region_episodes} episodes",
        )  # fmt: skip

    def make_histories(self) -> dict[str, np.ndarray]:
        """Generate the learning histories once (split across ranks), or reuse them."""
        cfg, rank, world_size = self.cfg, self.groups.dp_rank, self.groups.dp_size
        data_dir = cfg.data_dir or str(Path(cfg.output_dir) / "data")
        cache = histories_cache(data_dir, cfg.env, cfg.histories)
        if not cache.complete():
            kind = "expert (ED)" if cfg.histories.expert else "Q-learning"
            self.run.write(f"generating {kind} histories into {cache.folder}")
            goals = goal_split(cfg.env)
            metadata = {
                "env": asdict(cfg.env), "histories": asdict(cfg.histories),
                "train_goals": goals.train.tolist(), "val_goals": goals.val.tolist(),
                "test_goals": goals.test.tolist(),
            }  # fmt: skip
            cache.build(
                rank, world_size, lambda: history_shard(rank, world_size, cfg.env, cfg.histories),
                metadata, barrier=self.groups.barrier,
            )  # fmt: skip
        histories = load_histories(cache)
        return subsample_episodes(histories, cfg.histories.subsample, cfg.env.horizon)

    def train(self) -> None:
        cfg, run = self.cfg, self.run
        data = iter(self.train_loader)
        self.model.train()
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            batches = [next(data) for _ in range(self.accumulation)]
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_predictions = accumulate_gradients(
                self.plan, batches, self.compute_loss, count=lambda b: (b["labels"] >= 0).sum()
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.lr_scheduler, cfg.max_grad_norm
            )
            run.advance(grad_norm)  # the NaN guard: a non-finite norm skipped the update
            if run.log_due():
                run.log_train(sums, num_predictions, grad_norm)
            if run.due(cfg.eval.every_n_steps):
                run.evaluate(self.evaluate)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        run.finish(self.evaluate)

    def compute_loss(self, batch: dict[str, torch.Tensor]):
        """One micro-batch: the source's action predicted at every transition (summed
        cross-entropy; compressed AD's markers are labelled -100, no prediction), and how
        many of those predictions are right."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = self.model(**batch)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
        correct = (logits.argmax(-1) == labels).sum()  # never equal at a marker (-100)
        return loss, {"action_accuracy": correct}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """In-context RL, returns per episode averaged over goals x seeds.

        On the validation goals (training-split goals kept out of the histories) at
        every temperature of `eval.temperatures`; the one whose last 5 episodes return
        most is chosen. At the end of training, and only then, the test goals are
        evaluated once, at the chosen temperature.
        """
        cfg, ecfg = self.cfg, self.cfg.eval
        goals = goal_split(cfg.env)
        metrics: dict[str, float] = {}
        report: dict[str, Any] = {"step": self.run.step, "seeds": ecfg.seeds}
        chosen = ecfg.temperatures[0]
        if len(goals.val):
            temps = list(ecfg.temperatures)
            returns = self.in_context_returns(goals.val, temps)  # [temps, goals, seeds, episodes]
            curves = {t: returns[i].mean((0, 1)) for i, t in enumerate(temps)}
            chosen = max(temps, key=lambda t: last5(curves[t]))  # ties: the first listed
            for t in temps:
                metrics[f"eval/val_return_last5_T{t:g}"] = last5(curves[t])
            metrics["eval/val_return_first2"] = first2(curves[chosen])
            metrics["eval/val_return_last5"] = last5(curves[chosen])
            report["validation"] = {
                "goals": goals.val.tolist(),
                "returns_per_episode": {f"{t:g}": curves[t].tolist() for t in temps},
                "optimal_return": float(optimal_return(goals.val, cfg.env).mean()),
            }
            self.run.write(
                f"validation: {len(goals.val)} goals x {ecfg.seeds} seeds, return of the last 5 "
                "episodes " + ", ".join(f"T={t:g} {last5(curves[t]):.2f}" for t in temps)
                + f" -> temperature {chosen:g}"
            )  # fmt: skip
        metrics["eval/temperature"] = chosen
        report["temperature"] = chosen
        if self.run.step >= cfg.max_steps:
            metrics.update(self.evaluate_test(goals.test, chosen, report))
        if self.runtime.is_rank_zero:
            out = Path(cfg.output_dir) / "eval"
            out.mkdir(parents=True, exist_ok=True)
            (out / "in_context_returns.json").write_text(json.dumps(report, indent=2))
        return metrics

    def evaluate_test(
        self, goals: np.ndarray, temperature: float, report: dict[str, Any]
    ) -> dict[str, float]:
        """The held-out test goals, once, at the temperature chosen on validation."""
        cfg = self.cfg
        returns = self.in_context_returns(goals, [temperature])[0]  # [goals, seeds, episodes]
        curve = returns.mean((0, 1))
        optimal = float(optimal_return(goals, cfg.env).mean())
        random = float(random_return(goals, cfg.env, seed=cfg.seed).mean())
        report["test"] = {
            "goals": goals.tolist(),
            "returns_per_episode": curve.tolist(),
            "last5_per_goal": returns[:, :, -5:].mean((1, 2)).tolist(),
            "returns": returns.tolist(),  # [goal][seed][episode]: each run's curve
            "last5_per_seed": returns[:, :, -5:].mean((0, 2)).tolist(),
            "optimal_return": optimal,
            "random_return": random,
        }
        self.run.write(
            f"test: {len(goals)} held-out goals x {cfg.eval.seeds} seeds at T={temperature:g}: "
            f"first 2 episodes {first2(curve):.2f}, last 5 {last5(curve):.2f} "
            f"(optimal {optimal:.2f}, random {random:.2f})"
        )
        metrics = {
            "eval/test_return_first2": first2(curve),
            "eval/test_return_last5": last5(curve),
            "eval/optimal_return": optimal,
            "eval/random_return": random,
        }
        metrics.update({f"eval/test_return_episode_{k + 1:02d}": v for k, v in enumerate(curve)})
        return metrics

    @torch.no_grad()
    def in_context_returns(self, goals: np.ndarray, temperatures: list[float]) -> np.ndarray:
        """Returns [temperatures, goals, seeds, episodes] of in-context runs.

        The runs are split across ranks; every rank runs as many (padding repeats
        the last run), so every rank makes the same number of forward passes, and
        the returns are summed over ranks into the full array on every rank.
        """
        ecfg, world_size, rank = self.cfg.eval, self.plan.dp_size, self.plan.dp_rank
        shape = (len(temperatures), len(goals), ecfg.seeds)
        runs = list(np.ndindex(*shape))
        per_rank = -(-len(runs) // world_size)
        first = rank * per_rank
        mine = [runs[min(i, len(runs) - 1)] for i in range(first, first + per_rank)]
        model = self.plan.inference_model
        model.eval()
        returns = self.rollout(
            model,
            goals[[g for _, g, _ in mine]],
            np.array([temperatures[t] for t, _, _ in mine]),
            [(int(state_index(goals[g], self.cfg.env.grid_size)), s) for _, g, s in mine],
        )
        model.train()
        full = torch.zeros((len(runs), ecfg.episodes), dtype=torch.float64, device=self.device)
        real = [i for i in range(per_rank) if first + i < len(runs)]
        full[first : first + len(real)] = torch.from_numpy(returns[real]).to(self.device)
        self.plan.groups.all_reduce(full, over="dp")
        return full.cpu().numpy().reshape(*shape, ecfg.episodes)

    def rollout(
        self,
        model,
        goals: np.ndarray,
        temperatures: np.ndarray,
        noise_keys: list[tuple[int, int]],
    ) -> np.ndarray:
        """Act for `eval.episodes` episodes in each run (a goal, a temperature, a noise
        key) with a sliding, episode-aligned context. Returns [runs, episodes].

        The context holds the last n_transit // horizon - 1 whole episodes and the
        current one so far, the layout of the training windows; compressed AD's, the
        region being filled and the `compress.regions - 1` whole regions before it
        (`compressed_run_inputs`). An episode's context is computed at its first step and
        kept in a KV cache; each later step computes its one new transition. Each run
        samples its actions from its own random stream, keyed by (seed, goal cell, eval
        seed), so results do not depend on how the runs are split across ranks, and runs
        that differ only in temperature share their noise.
        """
        horizon, episodes = self.cfg.env.horizon, self.cfg.eval.episodes
        keep = max(1, self.n_transit // horizon - 1)  # whole past episodes in context
        compress = self.cfg.compress
        env = DarkRoom(goals, self.cfg.env)
        n = len(goals)
        steps = episodes * horizon
        uniform = torch.tensor(
            np.stack([np.random.default_rng([self.cfg.seed, *key]).random(steps) for key in noise_keys]),
            device=self.device,
        )  # fmt: skip
        temperature = torch.tensor(temperatures, dtype=torch.float32, device=self.device)[:, None]
        greedy = temperature == 0
        states = torch.zeros(n, steps, dtype=torch.long, device=self.device)
        actions = torch.zeros_like(states)
        rewards = torch.zeros_like(states)
        returns = np.zeros((n, episodes))
        cache = model.run_cache(n, self.device)  # an episode's context, computed once
        t = 0
        for episode in range(episodes):
            state = torch.from_numpy(env.reset()).to(self.device)
            cache.rewind()  # its buffers kept: the new context is written over the last
            done = False
            while not done:
                states[:, t] = state
                if cache.length:  # the transition after the cached ones
                    inputs = next_transition(states, actions, rewards, t, compress is not None)
                elif compress is None:  # the episode's first step: its whole context
                    inputs = run_inputs(
                        states, actions, rewards, t, horizon, keep, model.no_action,
                        model.no_reward,
                    )  # fmt: skip
                else:
                    inputs = compressed_run_inputs(
                        states, actions, rewards, t, horizon, compress.region_episodes,
                        compress.regions, model.no_action, model.no_reward,
                    )  # fmt: skip
                with self.plan.autocast():
                    logits = model(**inputs, cache=cache)[:, -1]
                logits = logits.float()
                # inverse-CDF sampling with this run's own noise; greedy where T = 0
                cdf = torch.softmax(logits / temperature.masked_fill(greedy, 1.0), -1).cumsum(-1)
                sampled = (cdf < uniform[:, t : t + 1]).sum(-1).clamp(max=logits.shape[-1] - 1)
                action = torch.where(greedy[:, 0], logits.argmax(-1), sampled)
                next_state, reward, done = env.step(action.cpu().numpy())
                actions[:, t] = action
                rewards[:, t] = torch.from_numpy(reward.astype(np.int64)).to(self.device)
                returns[:, episode] += reward
                state = torch.from_numpy(next_state).to(self.device)
                t += 1
        return returns

    def cleanup(self) -> None:
        self.run.close()


@parse(ADRecipeConfig)
def recipe_main(cfg: ADRecipeConfig) -> None:
    recipe = ADRecipeDDP(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
