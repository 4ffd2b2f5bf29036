"""Evaluating a model on tasks: lm-evaluation-harness through a freetx adapter
(harness.py: `harness_model`, `evaluate_tasks`; lm-eval is the optional extra
`freetx[eval]`, imported only when used); what an evaluation writes (results.py:
`eval.json`, the console table, `FinalTasks`: a training run's `eval.after_training`).
Imported by recipes and the CLI only."""

from freetx.evaluation.harness import (
    check_tasks,
    evaluate_tasks,
    harness_model,
    reassemble,
    share,
)
from freetx.evaluation.results import (
    EVAL_FILE,
    FinalTasks,
    NamesTasks,
    eval_results,
    results_table,
    write_results,
)

__all__ = [
    "EVAL_FILE",
    "FinalTasks",
    "NamesTasks",
    "check_tasks",
    "eval_results",
    "evaluate_tasks",
    "harness_model",
    "reassemble",
    "results_table",
    "share",
    "write_results",
]
