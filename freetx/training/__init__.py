"""What training loops share: the run's lifecycle, gradient accumulation and the optimizer
step, schedules, clipping, seeding, meters, the checks before a run, the final export.
The losses and what they need are `freetx.objectives`'."""

from freetx.training.checks import (
    check_context,
    check_layout,
    check_model_and_data,
    check_packing,
    check_read_paths,
    check_written_folders,
    dataset_seq_len,
    model_vocab_size,
)
from freetx.training.config import (
    FinalTasksConfig,
    PlannedRun,
    TokenEvalConfig,
    TrainingConfig,
    default_metric_loggers,
)
from freetx.training.grad import clip_grad_norm
from freetx.training.lifecycle import TrainingRun, claim_folder, training_state
from freetx.training.lr_schedule import LRScheduleConfig, build_lr_scheduler, lr_multiplier
from freetx.training.meters import (
    ThroughputMeter,
    first_batches_padding,
    measure_matmul_flops,
    memory_stats,
    peak_flops,
    per_source_means,
    real_tokens,
    train_step_metrics,
)
from freetx.training.seed import rng_state, seed_everything, set_rng_state
from freetx.training.step import (
    accumulate_gradients,
    count_over_ranks,
    evaluation_sums,
    optimizer_step,
    validation_means,
)

__all__ = [
    "FinalTasksConfig",
    "PlannedRun",
    "LRScheduleConfig",
    "ThroughputMeter",
    "TokenEvalConfig",
    "TrainingConfig",
    "TrainingRun",
    "claim_folder",
    "accumulate_gradients",
    "evaluation_sums",
    "build_lr_scheduler",
    "check_layout",
    "check_read_paths",
    "check_written_folders",
    "check_model_and_data",
    "check_context",
    "check_packing",
    "dataset_seq_len",
    "model_vocab_size",
    "clip_grad_norm",
    "count_over_ranks",
    "default_metric_loggers",
    "lr_multiplier",
    "measure_matmul_flops",
    "memory_stats",
    "optimizer_step",
    "peak_flops",
    "rng_state",
    "seed_everything",
    "set_rng_state",
    "train_step_metrics",
    "per_source_means",
    "first_batches_padding",
    "real_tokens",
    "training_state",
    "validation_means",
]
