"""The config keys every training recipe shares: the run and its loop."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Protocol, runtime_checkable

from freetx.checkpoint import CheckpointConfig
from freetx.distributed import DistributedConfig
from freetx.distributed.expert_parallel import check_same_forwards
from freetx.distributed.optimizer import OPTIMIZER_KEYS
from freetx.fields import accepting, at_least, component_node, written_folder
from freetx.loggers import LoggersConfig
from freetx.training.lr_schedule import LRScheduleConfig
from freetx.training.profiling import ProfilerConfig


def _number(value: Any) -> float:
    """A value as a float (a string too: `lr=nan` on a command line), NaN when it is none."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def default_metric_loggers() -> list[Any]:
    """A progress bar and metrics.jsonl (both on rank 0 only)."""
    return [
        {"_component_": "freetx.loggers.ProgressBarLogger"},
        {"_component_": "freetx.loggers.JSONLLogger"},
    ]


@dataclass(frozen=True)
class PlannedRun:
    """What a training config trains, as `freetx estimate` and `check_layout` read it
    (`TrainingConfig.planned`)."""

    model: Any  # the model's node
    seq_len: int | None = None  # tokens per sample; None: the model's context (max_seq_len)
    adapters: Any = None  # the `peft:` section, applied to the model
    loss: Any = None  # an LM loss's node (its num_chunks): what `estimate --measure` steps
    activations: Any = None  # a crosscoder's `activations:`: the rows and their source models
    rows_per_sample: int = 1  # sequences per sample: a preference pair's 2
    # a preference loss's reference: none, adapters_off (one more forward), frozen_copy (a
    # copy in the compute dtype, sharded like the policy, one more forward) or precomputed
    reference: str = "none"
    # online RL: the completions generated per prompt of the batch in one generation
    # (num_generations x steps_per_generation), each of up to seq_len tokens: the
    # generation phase holds every parameter gathered and their KV cache
    generations_per_prompt: int = 0
    engine: Any = None  # online RL: the generation engine's `EngineConfig` (slots, pool)
    judges: tuple[str, ...] = ()  # online RL: the models of judge rewards (whole as they score)
    tokenizer: Any = None  # the tokenizer's node (None: the recipe has none)
    dataset: Any = None  # the dataset's node (a mixture's, its sources in it; None: none)


@runtime_checkable
class ForwardsPerRank(Protocol):
    """A config section that has the run run forwards that differ between ranks (each rank
    its own rows, until they end: lm-eval scoring, generation), which expert parallelism
    cannot run (`check_per_rank_forwards`)."""

    def per_rank_forwards(self) -> str | None:
        """What runs them, for the refusal; None when this run does not."""
        ...


def check_per_rank_forwards(cfg: Any, ep: int) -> None:
    """Refuse, with ep > 1, the sections of a training config that run forwards that differ
    between ranks (`ForwardsPerRank`; `check_same_forwards`): before anything is launched
    (`check_layout`) and by the run (`TrainingRun`) alike, as `ParallelPlan.gathered`
    refuses them when they run."""
    if not dataclasses.is_dataclass(cfg):
        return
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section) and isinstance(section, ForwardsPerRank):
            what = section.per_rank_forwards()
            if what:
                check_same_forwards(ep, what)


@dataclass
class FinalTasksConfig:
    """A training recipe's `eval:` keys for lm-eval tasks on its final model
    (`eval.after_training`, `freetx.evaluation.FinalTasks`)."""

    # lm-eval tasks on the final model, after the final save: <output_dir>/eval.json, as
    # the eval recipe writes it (docs/recipes/eval.md); needs the `eval` extra
    after_training: bool = False
    tasks: list[str] = field(default_factory=list)  # lm-eval task names
    include_path: Optional[str] = None  # a folder of local task YAMLs
    num_fewshot: Optional[int] = at_least(0, default=None)  # None: each task's own
    limit: Optional[int] = at_least(1, default=None)  # documents per task; None: all

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """after_training with no task to score, by key: why, and the fix."""
        if values.get("after_training") and not values.get("tasks"):
            return {
                "after_training": "it scores lm-eval tasks at the end of the run, and "
                "eval.tasks names none; set eval.tasks=[TASK, ...] (with eval.include_path= "
                "for a folder of local task YAMLs), or eval.after_training=false."
            }
        return {}

    def per_rank_forwards(self) -> str | None:
        """after_training: lm-eval scores each rank's own requests (`ForwardsPerRank`)."""
        return "eval.after_training's lm-eval scoring" if self.after_training else None


@dataclass
class TokenEvalConfig(FinalTasksConfig):
    """The `eval:` section of a recipe that measures a validation loss over token batches."""

    every_n_steps: int = at_least(0, default=0)  # 0: only at the end of training
    # validation sequences per forward pass, over all ranks (like batch_size): the same
    # samples at any world size
    batch_size: int = at_least(1, default=16)
    max_batches: Optional[int] = at_least(1, default=None)  # of those; None: the whole split


@dataclass
class TrainingConfig:
    """What every training recipe's schema starts with: the run, its loop, the optimizer,
    the schedule, parallelism and loggers. A recipe's schema subclasses it and adds what
    it trains (model, data, evaluation)."""

    # Keys a resume may not change: they decide what the saved weights and optimizer
    # state mean, or the order of the data. A recipe adds its own (model, data).
    # Every other key may change on resume; the change is applied and listed.
    fixed_on_resume: ClassVar[tuple[str, ...]] = ("seed", "batch_size", "optimizer._component_")

    output_dir: str = written_folder()
    seed: int = 0
    # torch's deterministic algorithms, cuDNN's deterministic kernels, cuBLAS's fixed
    # workspace: the same numbers run to run on a GPU, slower (docs/configs.md)
    deterministic: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_steps: int = at_least(1)
    batch_size: int = at_least(1)  # global: samples per optimizer step, over all ranks
    gradient_accumulation_steps: int = at_least(1, default=1)
    max_grad_norm: Optional[float] = 1.0  # null: no clipping (the norm is still logged)
    # a NaN or Inf loss or gradient: the update is skipped; `skip` goes on (up to
    # max_nonfinite_skips in a row), `stop` ends the run; no checkpoint holds one
    on_nonfinite: Literal["skip", "stop"] = "skip"
    max_nonfinite_skips: int = at_least(1, default=10)
    log_every_n_steps: int = at_least(1, default=10)
    peak_flops: Optional[float] = None  # per device, for MFU where the GPU table has none
    num_workers: int = at_least(0, default=0)
    resume: str = accepting(
        "auto",
        "auto (the newest checkpoint in output_dir, if any), never (start afresh) or the "
        "path of a checkpoint to continue from (for resume=false, write resume=never)",
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # a _component_ node: torch.optim.AdamW, torchao's, ...; and freetx's memory rungs
    # (offload: cpu, in_backward: true, state_dtype: bfloat16: freetx.distributed.optimizer)
    optimizer: Any = component_node(*OPTIMIZER_KEYS)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    metric_loggers: list[Any] = field(default_factory=default_metric_loggers)
    loggers: LoggersConfig = field(default_factory=LoggersConfig)  # more, by name: loggers.wandb
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)  # torch.profiler traces

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values the loop would read as something else (freetx.fields: checked by `freetx
        validate` and before every run), by key: why, and the fix."""
        found = {}
        norm = values.get("max_grad_norm")
        if norm is not None and not norm > 0:
            found["max_grad_norm"] = (
                "gradients are clipped to a positive norm; set one (e.g. 1.0), or "
                "max_grad_norm=null for no clipping."
            )
        flops = values.get("peak_flops")
        if flops is not None and not 0 < flops < math.inf:
            found["peak_flops"] = (
                "it is a device's peak FLOP/s, for MFU; set a positive number (e.g. 1e14), or "
                "null (the GPU table's, or no MFU)."
            )
        optimizer = values.get("optimizer")
        lr = optimizer.get("lr") if isinstance(optimizer, dict) else None
        if lr is not None and not isinstance(lr, bool) and not 0 <= _number(lr) < math.inf:
            found["optimizer.lr"] = (
                "a learning rate is a finite number, 0 or more; set one (e.g. 3e-4)."
            )
        return found

    def planned(self) -> PlannedRun | None:
        """What this config trains, for `freetx estimate`: a recipe's schema says it (None:
        nothing the estimate counts)."""
        return None

    def cautions(self) -> list[str]:
        """Settings that are legal and pointless (a run that cannot learn), one paragraph
        each: printed by `freetx validate` and once at the run's start, never refused."""
        return []

    def refuse_combinations(self) -> None:
        """Raise a ConfigError for settings of several sections that the recipe cannot
        run together (a schema's own: a precomputed reference with adapters); checked by
        `check_layout`, so validate, run, launch and estimate refuse alike, and by the
        recipe before any work."""
