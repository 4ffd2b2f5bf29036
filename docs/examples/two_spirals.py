"""Classify two interleaved spirals with an MLP: a recipe of its own on freetx's lifecycle.

freetx run --nproc-per-node 2 docs/examples/two_spirals.py --config docs/examples/two_spirals.yaml
"""

import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from freetx.config import at_least
from freetx.data import build_train_loader
from freetx.distributed import build_groups, init_distributed, parallelize
from freetx.entry import parse
from freetx.training import (
    TrainingConfig,
    TrainingRun,
    accumulate_gradients,
    build_lr_scheduler,
    optimizer_step,
    seed_everything,
)


@dataclass
class MLPConfig:
    hidden: int = at_least(1, default=64)
    layers: int = at_least(1, default=3)


class MLP(torch.nn.Sequential):
    """The model protocol: a config, no block classes (sharded whole), its own init."""

    config_class, block_types = MLPConfig, ()

    def __init__(self, cfg: MLPConfig) -> None:
        sizes = [2] + [cfg.hidden] * cfg.layers
        layers = [
            torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh())
            for a, b in zip(sizes, sizes[1:])
        ]
        super().__init__(*layers, torch.nn.Linear(cfg.hidden, 2))
        self.config = cfg

    def init_parameter(self, name: str, tensor: torch.Tensor, generator) -> None:
        fan_in = self.get_submodule(name.rpartition(".")[0]).in_features
        tensor.normal_(0.0, 1 / math.sqrt(fan_in), generator=generator)


def spirals(count: int, seed: int) -> list[dict]:
    """`count` points on two interleaved spirals, labelled by spiral."""
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 2, (count,), generator=g)
    t = torch.rand(count, generator=g) * 3 * math.pi
    angle = t + label * math.pi
    points = torch.stack([t * angle.cos(), t * angle.sin()], 1) / 10
    points += 0.02 * torch.randn(count, 2, generator=g)
    return [{"x": p, "label": y} for p, y in zip(points, label)]


@dataclass
class SpiralsConfig(TrainingConfig):  # the run, loop, optimizer, schedule, parallelism, loggers
    samples: int = at_least(64, default=4096)
    model: MLPConfig = field(default_factory=MLPConfig)


class SpiralsRecipe:
    def __init__(self, cfg: SpiralsConfig) -> None:
        self.cfg, self.runtime = (
            cfg,
            init_distributed(cfg.device, cfg.distributed.collective_timeout_s),
        )
        seed_everything(cfg.seed, self.runtime.rank)

    def setup(self) -> None:
        cfg = self.cfg
        self.groups = build_groups(self.runtime, cfg.distributed)  # the ranks: dp, world
        self.run = TrainingRun(cfg, self.groups, "two_spirals")  # claims output_dir first
        with torch.device("meta"):
            model = MLP(cfg.model)
        self.plan = parallelize(model, self.groups, cfg.distributed, seed=cfg.seed)
        self.optimizer = self.plan.build_optimizer(cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)
        data = spirals(cfg.samples, cfg.seed)
        self.loader = build_train_loader(
            data,
            cfg.batch_size,
            cfg.gradient_accumulation_steps,
            self.groups.dp_rank,
            self.groups.dp_size,
            cfg.seed,
        )
        self.run.start(
            self.plan, self.optimizer, self.lr_scheduler, self.loader, tokens_per_sample=1
        )

    def train(self) -> None:
        cfg, run, data = self.cfg, self.run, iter(self.loader)
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            batches = [next(data) for _ in range(cfg.gradient_accumulation_steps)]
            self.optimizer.zero_grad(set_to_none=True)
            sums, count = accumulate_gradients(
                self.plan, batches, self.compute_loss, count=lambda b: len(b["label"])
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.lr_scheduler, cfg.max_grad_norm
            )
            run.advance(grad_norm)  # the NaN guard: a non-finite norm skipped the update
            if run.log_due():
                run.log_train(sums, count, grad_norm)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        run.finish(self.evaluate)

    def compute_loss(self, batch):
        """Summed over the batch's points; the helpers divide by the points of the step."""
        logits = self.plan.model(batch["x"])
        correct = (logits.argmax(-1) == batch["label"]).sum()
        return F.cross_entropy(logits, batch["label"], reduction="sum"), {"accuracy": correct}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Every rank scores the same held-out points (a sharded model needs all of them)."""
        test = spirals(512, seed=self.cfg.seed + 1)
        predicted = self.plan.model(torch.stack([s["x"] for s in test])).argmax(-1)
        labels = torch.stack([s["label"] for s in test])
        return {"test/accuracy": (predicted == labels).float().mean().item()}


@parse(SpiralsConfig)
def recipe_main(cfg: SpiralsConfig) -> None:
    recipe = SpiralsRecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.run.close()


if __name__ == "__main__":
    sys.exit(recipe_main())
