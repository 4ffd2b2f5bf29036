"""What an evaluation writes, and lm-eval tasks at the end of a training run.

The `eval` recipe and a training run with `eval.after_training: true` write the same
file, `<output_dir>/eval.json` (`eval_results`, `write_results`):

    {"checkpoint": "runs/sft",                      # what was evaluated
     "evaluated": {"tasks": [...], "include_path": ..., "num_fewshot": ..., "limit": ...,
                   "dataset": {...}, "rewards": [...]},
     "tasks": {"my_task": {"acc": 0.5, "acc_stderr": 0.2}},   # lm-eval's metrics
     "dataset": {"loss": 2.31, "perplexity": 10.1, "tokens": 4096},
     "rewards": {"reward": 0.4, "rewards/exact_match/mean": 0.4, "completions/mean_length": 12.0},
     "lm_eval": {...}}                              # lm-eval's whole result

(a section only where it was evaluated), and the same console table (`results_table`).

`FinalTasks` is `eval.after_training`: made in a recipe's setup (the task names and
lm-eval checked before anything trains), run after the final save on the in-memory
model: FSDP2's shards gathered once (`ParallelPlan.gathered`), each data-parallel rank
scoring its share of the harness's requests.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from freetx.distributed import ParallelGroups, ParallelPlan
from freetx.errors import ConfigError
from freetx.evaluation.harness import check_tasks, evaluate_tasks, harness_model

EVAL_FILE = "eval.json"


class NamesTasks(Protocol):
    """The keys that name lm-eval tasks: the eval recipe's config, a training recipe's
    `eval:` section (`freetx.training.TokenEvalConfig`)."""

    tasks: list[str]
    include_path: str | None
    num_fewshot: int | None
    limit: int | None


class TasksAfterTraining(NamesTasks, Protocol):
    """A training recipe's `eval:` section (`freetx.training.TokenEvalConfig`)."""

    after_training: bool
    batch_size: int  # sequences per forward pass, over all ranks


def task_settings(spec: NamesTasks) -> dict[str, Any]:
    """The task keys as eval.json's `evaluated` records them."""
    return {
        "tasks": list(spec.tasks),
        "include_path": spec.include_path,
        "num_fewshot": spec.num_fewshot,
        "limit": spec.limit,
    }


def eval_results(
    checkpoint: str,
    evaluated: dict[str, Any],
    tasks: dict[str, Any] | None = None,
    dataset: dict[str, float] | None = None,
    rewards: dict[str, float] | None = None,
    pairs: dict[str, float] | None = None,
) -> dict[str, Any]:
    """eval.json's content: `tasks` as `evaluate_tasks` returns them (lm-eval's whole
    result moved to "lm_eval"); a reward model's `pairs` metrics; sections that were not
    evaluated left out."""
    out: dict[str, Any] = {"checkpoint": checkpoint, "evaluated": evaluated}
    if tasks is not None:
        scores = dict(tasks)
        raw = scores.pop("lm_eval", None)
        out["tasks"] = scores
    if dataset is not None:
        out["dataset"] = dataset
    if rewards is not None:
        out["rewards"] = rewards
    if pairs is not None:
        out["pairs"] = pairs
    if tasks is not None:
        out["lm_eval"] = raw
    return out


def write_results(output_dir: str | Path, results: dict[str, Any]) -> Path:
    """`results` as <output_dir>/eval.json (written whole, then renamed over an older one)."""
    path = Path(output_dir) / EVAL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{EVAL_FILE}.{os.getpid()}")
    staged.write_text(json.dumps(results, indent=2) + "\n")
    staged.replace(path)
    return path


def results_table(results: dict[str, Any]) -> str:
    """The console table of eval.json's scores: one row per task metric, dataset figure,
    reward and pairs figure."""
    rows = [("SECTION", "NAME", "METRIC", "VALUE")]
    for task, metrics in results.get("tasks", {}).items():
        for metric, value in metrics.items():
            if not metric.endswith("_stderr"):
                stderr = metrics.get(f"{metric}_stderr")
                shown = _number(value) + (f" ± {_number(stderr)}" if _finite(stderr) else "")
                rows.append(("task", task, metric, shown))
    for name, value in results.get("dataset", {}).items():
        rows.append(("dataset", "", name, _number(value)))
    for name, value in results.get("rewards", {}).items():
        rows.append(("rewards", "", name, _number(value)))
    for name, value in results.get("pairs", {}).items():
        rows.append(("pairs", "", name, _number(value)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([f"evaluated {results['checkpoint']}", *lines])


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


class FinalTasks:
    """`eval.after_training`: lm-eval tasks scored on a training run's final model.

    self.final_tasks = FinalTasks(cfg.eval, self.groups)  # setup: checked now
    ...
    run.finish(self.evaluate)
    self.final_tasks.run(self.plan, self.tokenizer, cfg.output_dir)   # eval.json
    """

    def __init__(self, spec: TasksAfterTraining, groups: ParallelGroups) -> None:
        self.spec, self.groups, self.enabled = spec, groups, spec.after_training
        if not self.enabled:
            return
        shape = groups.shape
        if shape.tp > 1 or shape.cp > 1 or shape.pp > 1:
            raise ConfigError(
                f"eval.after_training scores lm-eval tasks with each data-parallel rank "
                f"forwarding its own requests, which a model split over ranks (tp={shape.tp}, "
                f"cp={shape.cp}, pp={shape.pp}) cannot do.",
                fix="Set eval.after_training=false and evaluate the final checkpoint with "
                "`freetx eval OUTPUT_DIR --tasks ...` instead.",
            )
        check_tasks(list(spec.tasks), spec.include_path)

    def run(self, plan: ParallelPlan, tokenizer, output_dir: str | Path):
        """Score the tasks on the plan's model (every rank takes part), write eval.json
        and print the table on rank 0; the results (None when not enabled)."""
        if not self.enabled:
            return None
        groups = self.groups
        with plan.gathered() as model, plan.autocast():  # one all-gather, no collective after
            model.eval()
            lm = harness_model(
                model,
                tokenizer,
                plan.runtime.device,
                batch_size=max(1, self.spec.batch_size // groups.dp_size),
                rank=groups.dp_rank,
                world_size=groups.dp_size,
                gather=groups.host().all_gather_object,
            )
            scores = evaluate_tasks(
                lm,
                list(self.spec.tasks),
                self.spec.include_path,
                self.spec.num_fewshot,
                self.spec.limit,
            )
            model.train()
        results = eval_results(str(output_dir), task_settings(self.spec), tasks=scores)
        if plan.runtime.rank == 0:
            write_results(output_dir, results)
            print(results_table(results), flush=True)
        return results
