"""A small recipe for testing the CLI: a few DDP steps on a linear model.

Each rank writes `rank<R>.json` (its rank, the world size and the all-reduced
loss) into output_dir, so a test can check that every rank ran. With
`fail_on_rank: R` that rank raises after the first step while the others wait
in a collective: the job must end with an error, not hang.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from omegaconf import MISSING, DictConfig
from torch.nn.parallel import DistributedDataParallel

from freetx.config import instantiate, write_resolved_config
from freetx.distributed import init_distributed
from freetx.entry import parse
from freetx.errors import FreetxError
from freetx.loggers import build_metric_loggers


@dataclass
class EchoConfig:
    output_dir: str = MISSING
    steps: int = 3
    seed: int = 0
    device: str = "cpu"
    fail_on_rank: Optional[int] = None
    fail_kind: Literal["user", "crash"] = "user"
    model: Any = MISSING
    optimizer: Any = MISSING
    metric_loggers: list[Any] = field(default_factory=list)


class EchoRecipe:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device)
        torch.manual_seed(cfg.seed)

    def setup(self) -> None:
        self.model = DistributedDataParallel(instantiate(self.cfg.model))
        self.optimizer = instantiate(self.cfg.optimizer, self.model.parameters())
        self.loggers = build_metric_loggers(
            self.cfg.metric_loggers, self.cfg.output_dir, self.cfg.steps, self.runtime.rank
        )
        if self.runtime.rank == 0:
            write_resolved_config(self.cfg)  # training starts

    def train(self) -> None:
        generator = torch.Generator().manual_seed(self.cfg.seed + self.runtime.rank)
        in_features = self.model.module.in_features
        for step in range(1, self.cfg.steps + 1):
            x = torch.randn(4, in_features, generator=generator)
            loss = self.model(x).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            if self.cfg.fail_on_rank == self.runtime.rank:
                if self.cfg.fail_kind == "user":
                    raise FreetxError(f"rank {self.runtime.rank} was told to fail at step {step}.")
                raise RuntimeError("a crash that is not a user error")
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            reduced /= self.runtime.world_size
            self.loggers.log(step, {"loss": reduced.item()})
        self.final_loss = reduced.item()

    def save(self) -> None:
        record = {
            "rank": self.runtime.rank,
            "world_size": self.runtime.world_size,
            "loss": self.final_loss,
        }
        path = Path(self.cfg.output_dir) / f"rank{self.runtime.rank}.json"
        path.write_text(json.dumps(record))

    def cleanup(self) -> None:
        self.loggers.close()


@parse(EchoConfig)
def recipe_main(cfg: DictConfig) -> None:
    recipe = EchoRecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.save()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
