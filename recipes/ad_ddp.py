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
from omegaconf import MISSING, DictConfig, OmegaConf

from freetx.checkpoint import Checkpointer, TrainState, build_meta, training_state
from freetx.config import instantiate, parse
from freetx.data import build_train_loader, micro_batch_size
from freetx.data.darkroom import (
    NUM_ACTIONS,
    ADWindows,
    DarkRoom,
    DarkRoomConfig,
    HistoryConfig,
    goal_split,
    histories_folder,
    histories_ready,
    load_histories,
    optimal_return,
    random_return,
    subsample_episodes,
    write_history_metadata,
    write_history_shard,
)
from freetx.distributed import (
    DistributedConfig,
    autocast,
    canonical_strategy,
    gradient_scaler,
    init_distributed,
    parallelize,
    unwrap,
)
from freetx.errors import ConfigError
from freetx.logging import build_metric_loggers, training_banner
from freetx.training import (
    LRScheduleConfig,
    ThroughputMeter,
    TrainingConfig,
    accumulate_gradients,
    build_lr_scheduler,
    build_optimizer,
    default_metric_loggers,
    optimizer_step,
    peak_flops,
    seed_everything,
    train_step_metrics,
)

MIN_EPISODES_IN_CONTEXT = 4


@dataclass
class InContextEvalConfig:
    every_n_steps: int = 0  # 0: only at the end of training
    episodes: int = 30  # in-context episodes per held-out goal
    seeds: int = 2  # evaluation seeds per goal (returns averaged over goals x seeds)
    temperature: float = 1.0  # sampling the model's actions; 0: greedy


@dataclass
class ADRecipeConfig(TrainingConfig):
    """The schema of ad_ddp's configs (after TrainingConfig's run and loop keys); a key
    not listed is an error. batch_size: global windows per step (seed: train_batch_size
    x GPUs x accumulation)."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *TrainingConfig.fixed_on_resume, "model", "env", "histories",
    )  # fmt: skip

    data_dir: Optional[str] = None  # histories; null: <output_dir>/data
    env: DarkRoomConfig = field(default_factory=DarkRoomConfig)
    histories: HistoryConfig = field(default_factory=HistoryConfig)
    model: Any = MISSING
    optimizer: Any = MISSING
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    distributed: DistributedConfig = field(
        default_factory=lambda: DistributedConfig(strategy="ddp")
    )
    eval: InContextEvalConfig = field(default_factory=InContextEvalConfig)
    metric_loggers: list[Any] = field(default_factory=default_metric_loggers)


class ADRecipeDDP:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device)
        self.device = self.runtime.device
        self.world_size = self.runtime.world_size
        self.strategy = canonical_strategy(cfg.distributed.strategy)
        self.accumulation = cfg.gradient_accumulation_steps
        self.env_cfg = DarkRoomConfig(**OmegaConf.to_container(cfg.env))
        self.history_cfg = HistoryConfig(**OmegaConf.to_container(cfg.histories))
        seed_everything(cfg.seed, self.runtime.rank)
        self.progress = TrainState()

    def setup(self) -> None:
        cfg, rank = self.cfg, self.runtime.rank
        micro_batch_size(cfg.batch_size, self.world_size, self.accumulation)  # fails early
        self.checkpointer = Checkpointer(cfg, rank)  # claims output_dir, plans the resume
        self.loggers = build_metric_loggers(cfg.metric_loggers, cfg.output_dir, cfg.max_steps, rank)
        # Cheap checks first: a model that does not fit the environment, or an empty
        # evaluation, fails before any history is generated.
        with torch.device("meta"):
            model = instantiate(cfg.model)
        self.n_transit = model.config.max_seq_len
        self.check_settings(model.config)
        histories = self.make_histories()
        windows = ADWindows(
            histories, self.n_transit, self.env_cfg.horizon, model.no_action, model.no_reward
        )
        self.model = parallelize(model, self.runtime, cfg.distributed, seed=cfg.seed)
        self.optimizer = build_optimizer(cfg.optimizer, self.model, self.strategy, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)
        self.scaler = gradient_scaler(self.runtime, cfg.distributed)
        self.train_loader = build_train_loader(
            windows, cfg.batch_size, self.accumulation, rank, self.world_size, cfg.seed,
            num_workers=cfg.num_workers,
        )  # fmt: skip
        self.meter = ThroughputMeter(
            unwrap(self.model).flops_per_token(self.n_transit),
            self.world_size,
            peak_flops(self.device, cfg.peak_flops),
        )
        kind = "expert (ED)" if self.history_cfg.expert else "Q-learning (AD)"
        self.loggers.write(
            training_banner(
                "ad_ddp", self.runtime, self.strategy, cfg, n_transit=self.n_transit,
                parameters=unwrap(self.model).num_parameters(), windows=len(windows),
                histories=kind,
            )
        )  # fmt: skip

        meta = build_meta(unwrap(self.model), asdict(model.config), self.world_size, self.strategy)
        self.state = training_state(
            self.model, self.optimizer, self.lr_scheduler, self.progress, self.train_loader, rank
        )
        message = self.checkpointer.restore(self.state, self.model, meta)
        if message:
            self.loggers.write(message)
        self.saved_step = self.progress.step
        self.evaluated_step = None

    def check_settings(self, model_config) -> None:
        """The model against the environment, and an evaluation that measures something."""
        env, horizon = self.env_cfg, self.env_cfg.horizon
        for key in ("episodes", "seeds"):
            if self.cfg.eval[key] < 1:
                raise ConfigError(
                    f"eval.{key}={self.cfg.eval[key]}: the in-context evaluation needs at "
                    f"least 1. Set eval.{key} to 1 or more (defaults: episodes 30, seeds 2)."
                )
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
        data_dir = self.cfg.data_dir or str(Path(self.cfg.output_dir) / "data")
        folder = histories_folder(data_dir, self.env_cfg, self.history_cfg)
        if not histories_ready(folder):
            kind = "expert (ED)" if self.history_cfg.expert else "Q-learning"
            self.loggers.write(f"generating {kind} histories into {folder}")
            write_history_shard(
                folder, self.runtime.rank, self.world_size, self.env_cfg, self.history_cfg
            )
            dist.barrier()
            if self.runtime.is_rank_zero:
                write_history_metadata(folder, self.world_size, self.env_cfg, self.history_cfg)
            dist.barrier()
        histories = load_histories(folder)
        return subsample_episodes(histories, self.history_cfg.subsample, self.env_cfg.horizon)

    def train(self) -> None:
        cfg = self.cfg
        data = iter(self.train_loader)
        self.model.train()
        while self.progress.step < cfg.max_steps:
            batches = [next(data) for _ in range(self.accumulation)]
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_tokens = accumulate_gradients(
                self.model, batches, self.compute_loss, self.runtime, cfg.distributed, self.scaler
            )
            grad_norm = optimizer_step(
                self.model, self.optimizer, self.scaler, self.lr_scheduler, cfg.max_grad_norm
            )
            self.progress.step += 1
            self.progress.tokens_seen += cfg.batch_size * self.n_transit
            self.meter.update(cfg.batch_size * self.n_transit)

            step = self.progress.step
            if step % cfg.log_every_n_steps == 0 or step == cfg.max_steps:
                metrics = train_step_metrics(
                    sums, num_tokens, grad_norm, self.lr_scheduler, self.meter, self.device
                )
                self.loggers.log(step, metrics)
            if cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0:
                self.evaluate()
            if cfg.checkpoint.every_n_steps and step % cfg.checkpoint.every_n_steps == 0:
                self.save_checkpoint()
        if self.evaluated_step != self.progress.step:  # also after a resume with nothing to train
            self.evaluate()
        if cfg.checkpoint.save_final and self.saved_step != self.progress.step:
            self.save_checkpoint()

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

    def save_checkpoint(self) -> None:
        self.checkpointer.save(
            self.progress.step, self.state, {"tokens_seen": self.progress.tokens_seen}
        )
        self.saved_step = self.progress.step

    @torch.no_grad()
    def evaluate(self) -> None:
        """In-context RL on held-out goals: returns per episode, averaged over goals x seeds."""
        cfg, ecfg = self.cfg, self.cfg.eval
        _, test_goals = goal_split(self.env_cfg)
        runs = [(g, s) for s in range(ecfg.seeds) for g in range(len(test_goals))]
        # every rank runs the same number of environments (padding repeats the last run,
        # weight 0), so every rank makes the same number of forward passes
        per_rank = -(-len(runs) // self.world_size)
        first = self.runtime.rank * per_rank
        mine = [runs[min(i, len(runs) - 1)] for i in range(first, first + per_rank)]
        weights = np.array([1.0 if first + i < len(runs) else 0.0 for i in range(per_rank)])
        # DDP: the unwrapped module (no collective in its forward); FSDP: every rank's forward
        model = unwrap(self.model) if self.strategy in ("ddp", "zero1") else self.model
        model.eval()
        returns = self.rollout(model, test_goals, mine, ecfg)
        model.train()
        self.evaluated_step = self.progress.step
        summed = torch.tensor(returns.T @ weights, dtype=torch.float64, device=self.device)
        count = torch.tensor(weights.sum(), dtype=torch.float64, device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(summed)
            dist.all_reduce(count)
        curve = (summed / count).tolist()
        optimal = float(optimal_return(test_goals, self.env_cfg).mean())
        random = float(random_return(test_goals, self.env_cfg, seed=cfg.seed).mean())
        metrics = {
            "eval/return_first2": float(np.mean(curve[:2])),
            "eval/return_last5": float(np.mean(curve[-5:])),
            "eval/optimal_return": optimal,
            "eval/random_return": random,
        }
        metrics.update({f"eval/return_episode_{k + 1:02d}": v for k, v in enumerate(curve)})
        self.loggers.log(self.progress.step, metrics)
        self.loggers.write(
            f"in-context returns on {len(test_goals)} held-out goals x {ecfg.seeds} seeds: "
            f"first 2 episodes {metrics['eval/return_first2']:.2f}, last 5 "
            f"{metrics['eval/return_last5']:.2f} (optimal {optimal:.2f}, random {random:.2f})"
        )
        if self.runtime.is_rank_zero:
            out = Path(cfg.output_dir) / "eval"
            out.mkdir(parents=True, exist_ok=True)
            (out / "in_context_returns.json").write_text(json.dumps({
                "step": self.progress.step, "returns_per_episode": curve,
                "optimal_return": optimal, "random_return": random,
                "test_goals": test_goals.tolist(), "seeds": ecfg.seeds,
            }, indent=2))  # fmt: skip

    def rollout(self, model, goals: np.ndarray, runs: list[tuple[int, int]], ecfg) -> np.ndarray:
        """Act for `episodes` episodes in each (goal index, eval seed) run, with a
        sliding, episode-aligned context. Returns [runs, episodes].

        The context holds the last n_transit // horizon - 1 whole episodes and the
        current one so far, the layout of the training windows. Each run samples its
        actions from its own random stream, so results do not depend on how the runs
        are split across ranks.
        """
        horizon = self.env_cfg.horizon
        keep = max(1, self.n_transit // horizon - 1)  # whole past episodes in context
        env = DarkRoom(goals[[g for g, _ in runs]], self.env_cfg)
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
                with autocast(model, self.runtime, self.cfg.distributed):
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
        self.checkpointer.close()
        self.loggers.close()


@parse(ADRecipeConfig)
def recipe_main(cfg: DictConfig) -> None:
    recipe = ADRecipeDDP(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
