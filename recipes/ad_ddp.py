"""Algorithm Distillation on Dark Room, trained with DDP, evaluated in context.

    freetx run --nproc-per-node 2 ad_ddp --config ad/darkroom_tiny
    freetx run --nproc-per-node 2 ad_ddp --config ad/darkroom_ed      # the ED control

Setup makes (or reuses) the learning histories: Q-learning on every training
goal, generation split across ranks, one safetensors shard per rank. The loop
is the LM recipe's: windows of `n_transit` transitions, the source's action
predicted at every position, accumulation with gradient sync on the last
micro-batch, clip, step, schedule, log, checkpoint. Evaluation runs the frozen
model on held-out goals for `eval.episodes` episodes, its own transitions
filling a sliding context, the goals split across ranks and the returns
summed over all of them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import MISSING

from freetx.config import at_least, instantiate, parse
from freetx.data import build_train_loader, micro_batch_size
from freetx.data.darkroom import ADWindows, histories_cache, load_histories, subsample_episodes
from freetx.distributed import init_distributed, parallelize
from freetx.envs import (
    NUM_ACTIONS,
    DarkRoom,
    DarkRoomConfig,
    HistoryConfig,
    goal_split,
    history_shard,
    optimal_return,
    random_return,
)
from freetx.errors import ConfigError
from freetx.training import (
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
    episodes: int = at_least(1, default=30)  # in-context episodes per held-out goal
    seeds: int = at_least(1, default=2)  # evaluation seeds per goal (averaged over goals x seeds)
    temperature: float = 1.0  # sampling the model's actions; 0: greedy


@dataclass
class ADRecipeConfig(TrainingConfig):
    """The schema of ad_ddp's configs: TrainingConfig's keys, then these (its configs pick
    DDP: `distributed.strategy: ddp`); a key not listed is an error. batch_size: global windows per step (seed:
    train_batch_size x GPUs x accumulation)."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *TrainingConfig.fixed_on_resume, "model", "env", "histories",
    )  # fmt: skip

    data_dir: Optional[str] = None  # histories; null: <output_dir>/data
    env: DarkRoomConfig = field(default_factory=DarkRoomConfig)
    histories: HistoryConfig = field(default_factory=HistoryConfig)
    model: Any = MISSING
    eval: InContextEvalConfig = field(default_factory=InContextEvalConfig)


class ADRecipeDDP:
    def __init__(self, cfg: ADRecipeConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device)
        self.device = self.runtime.device
        self.accumulation = cfg.gradient_accumulation_steps
        seed_everything(cfg.seed, self.runtime.rank)

    def setup(self) -> None:
        cfg, rank, world_size = self.cfg, self.runtime.rank, self.runtime.world_size
        self.run = TrainingRun(cfg, self.runtime, "ad_ddp")  # claims output_dir, plans the resume
        micro_batch_size(cfg.batch_size, world_size, self.accumulation)  # fails early
        # Cheap checks first: a model that does not fit the environment fails before any
        # history is generated.
        with torch.device("meta"):
            model = instantiate(cfg.model)
        self.n_transit = model.config.max_seq_len
        self.check_settings(model.config)
        histories = self.make_histories()
        windows = ADWindows(
            histories, self.n_transit, cfg.env.horizon, model.no_action, model.no_reward
        )
        self.plan = parallelize(model, self.runtime, cfg.distributed, seed=cfg.seed)
        self.model = self.plan.model
        self.optimizer = self.plan.build_optimizer(cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)
        self.train_loader = build_train_loader(
            windows, cfg.batch_size, self.accumulation, rank, world_size, cfg.seed,
            num_workers=cfg.num_workers,
        )  # fmt: skip
        self.run.start(
            self.plan, self.optimizer, self.lr_scheduler, self.train_loader,
            tokens_per_sample=self.n_transit, n_transit=self.n_transit, windows=len(windows),
            histories="expert (ED)" if cfg.histories.expert else "Q-learning (AD)",
        )  # fmt: skip

    def check_settings(self, model_config) -> None:
        """The model against the environment: a context across episodes, every cell a state."""
        env, horizon = self.cfg.env, self.cfg.env.horizon
        if self.n_transit < MIN_EPISODES_IN_CONTEXT * horizon:
            raise ConfigError(
                f"model.n_transit={self.n_transit} spans fewer than {MIN_EPISODES_IN_CONTEXT} "
                f"episodes of {horizon} steps; in-context learning needs a context across "
                f"episodes. Use n_transit >= {MIN_EPISODES_IN_CONTEXT * horizon}."
            )
        if model_config.num_states < env.grid_size**2:
            raise ConfigError(
                f"model.num_states={model_config.num_states} is fewer than the "
                f"{env.grid_size**2} cells of a {env.grid_size}x{env.grid_size} Dark Room "
                f"(env.grid_size={env.grid_size}). Set model.num_states={env.grid_size**2}."
            )
        if model_config.num_actions != NUM_ACTIONS:
            raise ConfigError(
                f"model.num_actions={model_config.num_actions}, but Dark Room has "
                f"{NUM_ACTIONS} actions (4 moves and stay). Set model.num_actions={NUM_ACTIONS}."
            )

    def make_histories(self) -> dict[str, np.ndarray]:
        """Generate the learning histories once (split across ranks), or reuse them."""
        cfg, rank, world_size = self.cfg, self.runtime.rank, self.runtime.world_size
        data_dir = cfg.data_dir or str(Path(cfg.output_dir) / "data")
        cache = histories_cache(data_dir, cfg.env, cfg.histories)
        if not cache.complete():
            kind = "expert (ED)" if cfg.histories.expert else "Q-learning"
            self.run.write(f"generating {kind} histories into {cache.folder}")
            train_goals, test_goals = goal_split(cfg.env)
            metadata = {
                "env": asdict(cfg.env), "histories": asdict(cfg.histories),
                "train_goals": train_goals.tolist(), "test_goals": test_goals.tolist(),
            }  # fmt: skip
            cache.build(
                rank, world_size, lambda: history_shard(rank, world_size, cfg.env, cfg.histories),
                metadata, barrier=dist.barrier,
            )  # fmt: skip
        histories = load_histories(cache)
        return subsample_episodes(histories, cfg.histories.subsample, cfg.env.horizon)

    def train(self) -> None:
        cfg, run = self.cfg, self.run
        data = iter(self.train_loader)
        self.model.train()
        while run.step < cfg.max_steps:
            batches = [next(data) for _ in range(self.accumulation)]
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_predictions = accumulate_gradients(
                self.plan, batches, self.compute_loss, count=lambda b: b["labels"].numel()
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.lr_scheduler, cfg.max_grad_norm
            )
            run.advance()
            if run.log_due():
                run.log_train(sums, num_predictions, grad_norm)
            if run.due(cfg.eval.every_n_steps):
                run.evaluate(self.evaluate)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        run.finish(self.evaluate)

    def compute_loss(self, batch: dict[str, torch.Tensor]):
        """One micro-batch: the source's action predicted at every position (summed
        cross-entropy), and how many of those predictions are right."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        logits = self.model(batch["states"], batch["prev_actions"], batch["prev_rewards"])
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="sum"
        )
        correct = (logits.argmax(-1) == batch["labels"]).sum()
        return loss, {"action_accuracy": correct}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """In-context RL on held-out goals: returns per episode, averaged over goals x seeds."""
        cfg, ecfg = self.cfg, self.cfg.eval
        world_size, rank = self.runtime.world_size, self.runtime.rank
        _, test_goals = goal_split(cfg.env)
        runs = [(g, s) for s in range(ecfg.seeds) for g in range(len(test_goals))]
        # every rank runs the same number of environments (padding repeats the last run,
        # weight 0), so every rank makes the same number of forward passes
        per_rank = -(-len(runs) // world_size)
        first = rank * per_rank
        mine = [runs[min(i, len(runs) - 1)] for i in range(first, first + per_rank)]
        weights = np.array([1.0 if first + i < len(runs) else 0.0 for i in range(per_rank)])
        model = self.plan.inference_model
        model.eval()
        returns = self.rollout(model, test_goals, mine, ecfg)
        model.train()
        summed = torch.tensor(returns.T @ weights, dtype=torch.float64, device=self.device)
        count = torch.tensor(weights.sum(), dtype=torch.float64, device=self.device)
        if dist.is_initialized() and world_size > 1:
            dist.all_reduce(summed)
            dist.all_reduce(count)
        curve = (summed / count).tolist()
        optimal = float(optimal_return(test_goals, cfg.env).mean())
        random = float(random_return(test_goals, cfg.env, seed=cfg.seed).mean())
        metrics = {
            "eval/return_first2": float(np.mean(curve[:2])),
            "eval/return_last5": float(np.mean(curve[-5:])),
            "eval/optimal_return": optimal,
            "eval/random_return": random,
        }
        metrics.update({f"eval/return_episode_{k + 1:02d}": v for k, v in enumerate(curve)})
        self.run.write(
            f"in-context returns on {len(test_goals)} held-out goals x {ecfg.seeds} seeds: "
            f"first 2 episodes {metrics['eval/return_first2']:.2f}, last 5 "
            f"{metrics['eval/return_last5']:.2f} (optimal {optimal:.2f}, random {random:.2f})"
        )
        if self.runtime.is_rank_zero:
            out = Path(cfg.output_dir) / "eval"
            out.mkdir(parents=True, exist_ok=True)
            (out / "in_context_returns.json").write_text(json.dumps({
                "step": self.run.step, "returns_per_episode": curve,
                "optimal_return": optimal, "random_return": random,
                "test_goals": test_goals.tolist(), "seeds": ecfg.seeds,
            }, indent=2))  # fmt: skip
        return metrics

    def rollout(self, model, goals: np.ndarray, runs: list[tuple[int, int]], ecfg) -> np.ndarray:
        """Act for `episodes` episodes in each (goal index, eval seed) run, with a
        sliding, episode-aligned context. Returns [runs, episodes].

        The context holds the last n_transit // horizon - 1 whole episodes and the
        current one so far, the layout of the training windows. Each run samples its
        actions from its own random stream, so results do not depend on how the runs
        are split across ranks.
        """
        horizon = self.cfg.env.horizon
        keep = max(1, self.n_transit // horizon - 1)  # whole past episodes in context
        env = DarkRoom(goals[[g for g, _ in runs]], self.cfg.env)
        n = len(runs)
        steps = ecfg.episodes * horizon
        uniform = torch.tensor(
            np.stack([np.random.default_rng([self.cfg.seed, g, s]).random(steps) for g, s in runs]),
            device=self.device,
        )
        states = torch.zeros(n, ecfg.episodes * horizon, dtype=torch.long, device=self.device)
        actions = torch.zeros_like(states)
        rewards = torch.zeros_like(states)
        returns = np.zeros((n, ecfg.episodes))
        t = 0
        for episode in range(ecfg.episodes):
            state = torch.from_numpy(env.reset()).to(self.device)
            done = False
            while not done:
                states[:, t] = state
                start = max(0, episode - keep) * horizon
                ctx = slice(start, t + 1)
                no_action = torch.full((n, 1), model.no_action, device=self.device)
                no_reward = torch.full((n, 1), model.no_reward, device=self.device)
                prev_actions = torch.cat([no_action, actions[:, start:t]], 1)
                prev_rewards = torch.cat([no_reward, rewards[:, start:t]], 1)
                with self.plan.autocast():
                    logits = model(states[:, ctx], prev_actions, prev_rewards)[:, -1].float()
                if ecfg.temperature > 0:  # inverse-CDF sampling with this run's own noise
                    cdf = torch.softmax(logits / ecfg.temperature, -1).cumsum(-1)
                    action = (cdf < uniform[:, t : t + 1]).sum(-1).clamp(max=logits.shape[-1] - 1)
                else:
                    action = logits.argmax(-1)
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
