"""Evaluating a model on tasks: lm-evaluation-harness through a freetx adapter
(harness.py: `harness_model`, `evaluate_tasks`; lm-eval is the optional extra
`freetx[eval]`, imported only when used). Imported by recipes and the CLI only."""

from freetx.evaluation.harness import evaluate_tasks, harness_model, reassemble, share

__all__ = ["evaluate_tasks", "harness_model", "reassemble", "share"]
