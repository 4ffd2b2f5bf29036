"""2-process checks of an exact resume for tiny HF folders of every architecture family
freetx reads (run by test_folder_resume.py through torchrun, one launch for every family). Each
family's model is built as full_finetune_fsdp2 builds it: `hf_model` on the meta device,
`parallelize` under fsdp without random init, the folder's weights read by each rank for
its shard (`load_initial_weights`), AdamW with the recipe's schedule; each step runs
`accumulate_gradients` and `optimizer_step` with the recipe's CrossEntropyLoss (router loss
included). A straight run takes 4 steps, saving the model, optimizer, schedule and step
after step 2 (DCP, freetx.checkpoint's states); a second model built the same way, loaded
from that save, takes steps 3 and 4 again. Arguments: `FAMILY=FOLDER SAVE_ROOT`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from freetx.checkpoint import (
    LRSchedulerState,
    ModelState,
    OptimizerState,
    TrainState,
    load_initial_weights,
)
from freetx.checkpoint.dcp_folder import SafeLoadPlanner
from freetx.data.batch import TokenBatch
from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
from freetx.models import hf_model
from freetx.objectives import CrossEntropyLoss, loss_tokens
from freetx.training import (
    LRScheduleConfig,
    accumulate_gradients,
    build_lr_scheduler,
    optimizer_step,
)
from tests.distributed.launcher import write_results

STEPS, SAVED_AT, SEED, VOCAB, TOKENS = 4, 2, 0, 384, 64
ADAMW = {"_component_": "torch.optim.AdamW", "lr": 1e-3, "betas": [0.9, 0.95]}


def batch(step: int, rank: int) -> TokenBatch:
    """Step `step`'s micro-batch of this rank: 2 rows of TOKENS tokens (longer than the tiny
    folders' sliding windows), the labels the next token (the last position ignored)."""
    ids = torch.randint(
        3, VOCAB, (2, TOKENS + 1), generator=torch.Generator().manual_seed(step * 10 + rank)
    )
    labels = ids[:, 1:].clone()
    labels[:, -1] = -100
    return TokenBatch(input_ids=ids[:, :-1], labels=labels)


class Run:
    """One family's model, optimizer and schedule, built as the recipe builds them."""

    def __init__(self, folder: Path, groups, cfg, read_folder: bool) -> None:
        with torch.device("meta"):
            model = hf_model(str(folder), max_seq_len=TOKENS)
        self.plan = parallelize(model, groups, cfg, seed=SEED, init_weights=False)
        if read_folder:  # a resume reads the checkpoint instead
            load_initial_weights(self.plan.model, folder)
        self.optimizer = self.plan.build_optimizer(OmegaConf.create(ADAMW))
        self.schedule = build_lr_scheduler(self.optimizer, STEPS, LRScheduleConfig(warmup_steps=1))
        self.progress = TrainState()
        self.loss = CrossEntropyLoss()

    def state(self) -> dict:
        model = self.plan.model
        return {"model": ModelState(model), "optimizer": OptimizerState(model, self.optimizer),
                "lr_scheduler": LRSchedulerState(self.schedule), "train": self.progress}  # fmt: skip

    def step(self, rank: int) -> float:
        """One optimizer step; returns its loss over both ranks' loss tokens."""
        self.optimizer.zero_grad(set_to_none=True)
        self.plan.model.train()
        sums, total = accumulate_gradients(
            self.plan, [batch(self.progress.step + 1, rank)], self.compute_loss, count=loss_tokens
        )
        optimizer_step(self.plan, self.optimizer, self.schedule, max_grad_norm=1.0)
        self.progress.step += 1
        loss = sums["loss"].clone()
        torch.distributed.all_reduce(loss)
        return (loss / total).item()

    def compute_loss(self, batch: TokenBatch):
        return self.loss(self.plan.model, batch.input_ids, batch.labels)


def main() -> None:
    runtime = init_distributed("cpu")
    cfg = OmegaConf.structured(DistributedConfig(strategy="fsdp"))
    groups = build_groups(runtime, cfg)
    *families, save_root = sys.argv[1:]
    results = {}
    for item in families:
        family, folder = item.split("=", 1)
        saved = Path(save_root) / family
        straight = Run(Path(folder), groups, cfg, read_folder=True)
        losses = []
        for step in range(1, STEPS + 1):
            losses.append(straight.step(runtime.rank))
            if step == SAVED_AT:
                dcp.save(straight.state(), checkpoint_id=str(saved))
        resumed = Run(Path(folder), groups, cfg, read_folder=False)
        state = resumed.state()
        dcp.load(state, checkpoint_id=str(saved), planner=SafeLoadPlanner())
        results[family] = {
            "straight": losses,
            "resumed_from": resumed.progress.step,
            "resumed": [resumed.step(runtime.rank) for _ in range(SAVED_AT, STEPS)],
        }
    write_results(results)


if __name__ == "__main__":
    main()
