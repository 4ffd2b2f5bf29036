"""A frozen model a reward runs (a judge, a reward model): read once onto the run's device
(`place`), sharded like a reference model under a policy sharded by FSDP2 and gathered
whole only while it scores (`gathered`), its batches scored one at a time (`scored`).

The weights are frozen, bfloat16 on CUDA and float32 on the CPU: under a policy sharded by
FSDP2 without tensor parallelism, per block like a reference (`parallelize_frozen`: each
rank reading its rows) and gathered whole around each scoring, on every rank at once
(the rollout enters `gathered` on every rank); else whole on every rank (a
torchao-quantized folder too, and a LoRA run: its adapters unmerged over its base). A
call its deadline or a stop signal abandoned may run on in its thread: a sharded model
refuses to score outside `gathered` (its forwards would gather blocks on this rank
alone), and `gathered` waits for a batch still being scored.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from freetx.checkpoint import load_initial_weights
from freetx.checkpoint.loading import (
    load_source_model,
    quantization_method,
    source_model_on_meta,
    source_parameters,
)
from freetx.data import ByteTokenizer, HFTokenizer
from freetx.distributed import ParallelPlan, gathered_whole, parallelize_frozen
from freetx.errors import ConfigError
from freetx.training.export import recorded_peft


class HeldModel:
    """The model at `path` (an HF folder, a run, a DCP checkpoint) that a reward runs, and
    its tokenizer (`tokenizer`: a folder with tokenizer.json, default `path`; `bytes`: a
    byte model's); `what` names it in messages ("the judge"). A subclass says which models
    it takes (`check`) and scores its batches through `scored`."""

    what = "the model"

    def __init__(self, path: str, tokenizer: str | None = None) -> None:
        self.path = path
        folder = Path(tokenizer or path).expanduser()
        if tokenizer != "bytes" and not (folder / "tokenizer.json").is_file():
            raise ValueError(
                f"{folder} has no tokenizer.json; point tokenizer at {self.what}'s tokenizer "
                "folder (a run of a byte model: tokenizer: bytes)"
            )
        self.tokenizer = ByteTokenizer() if tokenizer == "bytes" else HFTokenizer(str(folder))
        self.model: torch.nn.Module | None = None
        self.sharded = self.whole = False  # sharded by FSDP2; gathered whole now
        self.scoring = threading.Lock()  # a batch being scored

    def check(self, model: torch.nn.Module) -> None:
        """Refuse a model of the wrong kind for this reward (a ConfigError naming it)."""

    def parameter_bytes(self) -> int:
        """The weights in bytes as placed on a GPU (bfloat16), from their shapes alone."""
        return source_parameters(self.path) * 2

    def place(self, device: torch.device, plan: ParallelPlan | None = None) -> None:
        """Read the weights onto `device`, frozen (the run calls it once, at setup, on every
        rank): sharded like the `plan`'s policy where it is sharded by FSDP2 without tensor
        parallelism, else whole (module docstring)."""
        if device.type == "cuda":  # whole while it scores
            free, _ = torch.cuda.mem_get_info(device)
            need = self.parameter_bytes()
            if need > free:
                raise ConfigError(
                    f"{self.what} {self.path} needs {need / 2**30:.1f} GiB for its weights, "
                    f"gathered whole while it scores, and {device} has {free / 2**30:.1f} GiB "
                    "free; use a smaller model (freetx estimate counts it)."
                )
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        adapters = recorded_peft(self.path)  # a LoRA run's: its adapters over the base
        self.sharded = (
            adapters is None
            and plan is not None
            and not plan.replicated
            and plan.groups.size("tp") == 1
            and quantization_method(self.path) is None
        )
        if self.sharded:
            model = source_model_on_meta(self.path)
            self.check(model)
            cfg = copy.deepcopy(plan.cfg)
            cfg.mixed_precision.param_dtype = dtype  # what a whole one keeps
            model = parallelize_frozen(model, plan.groups, cfg, seed=0)
            load_initial_weights(model, self.path)
        else:  # read on the CPU (a LoRA run's adapters unmerged over its base), then moved
            cpu = torch.device("cpu")
            model = load_source_model(self.path, cpu, dtype, adapters).to(device)
            self.check(model)
        self.model = model.eval().requires_grad_(False)

    @contextmanager
    def gathered(self):
        """The model whole for the scoring inside (`gathered_whole`: one all-gather per
        sharded block on entry, every rank entering together; nothing for a whole one)."""
        if self.model is None:
            raise RuntimeError(f"{self.what} {self.path} was not placed on a device (place())")
        with gathered_whole(self.model):
            self.whole = True
            try:
                yield
            finally:
                with self.scoring:
                    self.whole = False

    def scored(
        self, inputs: list[Any], batch_size: int, score: Callable[[list[Any]], list]
    ) -> list:
        """`score` of each batch of `batch_size` of `inputs`, one batch at a time, while the
        model is whole (a sharded one refuses outside `gathered`)."""
        if self.model is None:
            raise RuntimeError(f"{self.what} {self.path} was not placed on a device (place())")
        out: list = []
        for start in range(0, len(inputs), batch_size):
            with self.scoring:
                if self.sharded and not self.whole:
                    raise RuntimeError(
                        f"{self.what} {self.path} scored outside its gathered() (a call left "
                        "running after the rollout moved on): stopped before any collective"
                    )
                out += score(inputs[start : start + batch_size])
        return out
