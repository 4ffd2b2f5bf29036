"""Metric loggers (progress bar, JSONL, TensorBoard, WandB), used on rank 0."""

from freetx.loggers.banner import training_banner
from freetx.loggers.loggers import (
    JSONLLogger,
    LoggersConfig,
    MetricLogger,
    MetricLoggers,
    ProgressBarLogger,
    TensorBoardLogger,
    WandBLogger,
    build_metric_loggers,
    format_value,
)

__all__ = [
    "JSONLLogger",
    "LoggersConfig",
    "MetricLogger",
    "MetricLoggers",
    "ProgressBarLogger",
    "TensorBoardLogger",
    "WandBLogger",
    "build_metric_loggers",
    "format_value",
    "training_banner",
]
