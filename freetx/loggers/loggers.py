"""Metric loggers, chosen in the config by `_component_`, used on rank 0 only.

    metric_loggers:
      - _component_: freetx.loggers.ProgressBarLogger
      - _component_: freetx.loggers.JSONLLogger
      - _component_: freetx.loggers.TensorBoardLogger

Every logger is built with `output_dir` and `total_steps` from the recipe plus
its own keys from the config, and receives `log(step, {name: float})`.

A logger can also be added by name, without restating the list (`LoggersConfig`):

    loggers:
      wandb: {project: my-project}       # on the command line: loggers.wandb.project=X
"""

from __future__ import annotations

import abc
import json
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import ListConfig, OmegaConf

from freetx.config.instantiate import instantiate

COUNT_LIKE = ("per_s", "tokens_seen", "rows", "_bytes")  # shown as whole numbers at any size


def format_value(value: float, name: str = "") -> str:
    """Compact numbers for one console line: 2.3456, 3.0e-04, 12,345; rates and counts
    (`tokens_per_s`, ...) as whole numbers at every size (810 and 1,224, not 810.5469)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    whole = any(marker in name for marker in COUNT_LIKE)
    if isinstance(value, int) or (math.isfinite(value) and (abs(value) >= 1000 or whole)):
        return f"{round(value):,}"
    if value != 0 and abs(value) < 1e-2:
        return f"{value:.2e}"
    return f"{value:.4f}"


class MetricLogger(abc.ABC):
    """Base class: receives metrics by step; `close` flushes."""

    def __init__(self, output_dir: str, total_steps: int | None = None):
        self.output_dir = Path(output_dir)
        self.total_steps = total_steps

    def inside(self, name: str, key: str) -> Path:
        """The path `name` names under output_dir; a logger writes in the run folder only,
        so an absolute path or one that climbs out (`..`) is refused (docs/trust.md)."""
        path = Path(name)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            from freetx.errors import ConfigError

            raise ConfigError(
                f"metric_loggers: {type(self).__name__}'s {key}={name!r} would write outside the "
                "run's output_dir; a logger writes in the run folder only.",
                fix=f"Give {key} a name (or a relative path) under output_dir.",
            )
        return self.output_dir / path

    @abc.abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of one step."""

    def write(self, text: str) -> None:
        """A line of text for the console (banner, notices); most loggers ignore it."""

    def hyperparameters(self, config: dict[str, Any]) -> None:
        """The run's resolved config (given before the first `log`); most loggers ignore
        it (config.yaml holds it), a tracking service records it with the run."""

    def resume_at(self, step: int) -> None:
        """The run continues after `step`: records of later steps (from a run that went
        further before it stopped, and is now redone) are dropped, so each step is
        logged once."""

    def close(self) -> None:
        pass


class ProgressBarLogger(MetricLogger):
    """A tqdm bar on a terminal; one plain line per logged step otherwise (files, CI)."""

    def __init__(
        self,
        output_dir: str,
        total_steps: int | None = None,
        keys: list[str] | None = None,
        tty: bool | None = None,
    ):
        super().__init__(output_dir, total_steps)
        self.keys = list(keys) if keys else None
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._bar = None
        self._position = 0

    def _shown(self, metrics: dict[str, float]) -> dict[str, str]:
        keys = self.keys or list(metrics)
        return {k: format_value(metrics[k], k) for k in keys if k in metrics}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = self._shown(metrics)
        if self.tty:
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=self.total_steps, initial=0, dynamic_ncols=True)
            self._bar.update(step - self._position)
            self._position = step
            self._bar.set_postfix(shown, refresh=True)
        else:
            total = f"/{self.total_steps}" if self.total_steps else ""
            fields = " | ".join(f"{k} {v}" for k, v in shown.items())
            print(f"step {step}{total} | {fields}", flush=True)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class JSONLLogger(MetricLogger):
    """`<output_dir>/metrics.jsonl`: one JSON object per logged step (appended on resume).

    The file is opened at the first record, so a run refused at set-up leaves none.
    """

    def __init__(
        self, output_dir: str, total_steps: int | None = None, filename: str = "metrics.jsonl"
    ):
        super().__init__(output_dir, total_steps)
        self.path = self.inside(filename, "filename")
        self._file = None

    def resume_at(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except (ValueError, AttributeError):
                kept.append(line)  # not ours to judge: keep it
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        tmp.replace(self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - see close()
        record: dict[str, Any] = {"step": step, **metrics, "time": round(time.time(), 3)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class TensorBoardLogger(MetricLogger):
    """TensorBoard scalars under `<output_dir>/tb/` (`tensorboard --logdir OUTPUT_DIR/tb`).

    The event file is made at the first record, so a run refused at set-up leaves none.
    """

    def __init__(self, output_dir: str, total_steps: int | None = None, subdir: str = "tb"):
        super().__init__(output_dir, total_steps)
        from torch.utils.tensorboard import SummaryWriter  # imported only when configured

        self.log_dir = self.inside(subdir, "subdir")
        self._writer_class = SummaryWriter
        self.writer = None
        self.purge_step: int | None = None

    def resume_at(self, step: int) -> None:
        self.purge_step = step + 1  # TensorBoard drops the events of later steps

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            self.writer = self._writer_class(log_dir=str(self.log_dir), purge_step=self.purge_step)
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


WANDB_MISSING = (
    "W&B logging needs the wandb package, which is not installed: pip install wandb "
    "(or pip install freetx[wandb])"
)


def wandb_installed() -> bool:
    """Whether `import wandb` would find the package (without importing it)."""
    if "wandb" in sys.modules:
        return sys.modules["wandb"] is not None
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


class WandBLogger(MetricLogger):
    """Weights & Biases (an optional extra: `pip install freetx[wandb]`). The run starts at
    the first record, so a run refused at set-up makes none. `mode: offline` (or
    WANDB_MODE=offline) writes under `<output_dir>/wandb` without a network, for
    `wandb sync` later. `name` may hold `{world_size}` (the seed's
    `{model}_ae{ae_dim}_gpu{world_size}`)."""

    def __init__(
        self,
        output_dir: str,
        total_steps: int | None = None,
        project: str = "freetx",
        name: str | None = None,
        mode: str | None = None,
        tags: list[str] | None = None,
    ):
        super().__init__(output_dir, total_steps)
        if not wandb_installed():
            from freetx.errors import ConfigError

            raise ConfigError(WANDB_MISSING + ", or leave the logger out of metric_loggers.")
        import os

        import wandb

        self._wandb = wandb
        world_size = os.environ.get("WORLD_SIZE", "1")
        self.settings = {
            "project": project,
            "name": name.format(world_size=world_size) if name else None,
            "mode": mode,
            "tags": list(tags or []),
            "dir": str(self.output_dir),
        }
        self.run = None

    def hyperparameters(self, config: dict[str, Any]) -> None:
        self.settings["config"] = config  # wandb.init(config=...): the run's hyperparameters

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.run is None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.run = self._wandb.init(**self.settings)
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.run.log(numbers, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class MetricLoggers:
    """All of a run's loggers behind one object; empty (silent) on ranks other than 0."""

    def __init__(self, loggers: Iterable[MetricLogger] = (), active: bool = True):
        self.loggers = list(loggers)
        self.active = active

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def hyperparameters(self, config: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.hyperparameters(config)

    def resume_at(self, step: int) -> None:
        for logger in self.loggers:
            logger.resume_at(step)

    def write(self, text: str) -> None:
        """Console text (rank 0 only), printed through the progress bar when there is one."""
        if not self.active:
            return
        writers = [lg for lg in self.loggers if type(lg).write is not MetricLogger.write]
        if writers:
            writers[0].write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


# `loggers.NAME`: the logger class each name adds to metric_loggers
NAMED_LOGGERS = {
    "wandb": "freetx.loggers.WandBLogger",
    "tensorboard": "freetx.loggers.TensorBoardLogger",
    "jsonl": "freetx.loggers.JSONLLogger",
}


@dataclass
class LoggersConfig:
    """Loggers added by name to `metric_loggers` (which is then not restated): each key
    holds the logger's own keys, `{}` for its defaults. `loggers.wandb.project=X` turns
    W&B on; a logger already in metric_loggers gets these keys instead of a second copy."""

    wandb: Optional[dict[str, Any]] = None  # WandBLogger: project, name, mode, tags
    tensorboard: Optional[dict[str, Any]] = None  # TensorBoardLogger: subdir
    jsonl: Optional[dict[str, Any]] = None  # JSONLLogger: filename

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """`loggers.wandb` without the wandb package: refused before the run starts."""
        if values.get("wandb") is not None and not wandb_installed():
            return {"wandb": WANDB_MISSING + ", or drop loggers.wandb (~loggers.wandb)."}
        return {}


def logger_nodes(nodes: ListConfig | list | None, named: LoggersConfig | None) -> list[Any]:
    """`metric_loggers` with the loggers of `named` (the `loggers:` section) added."""
    found = [n if OmegaConf.is_config(n) else OmegaConf.create(n) for n in nodes or []]
    for name, keys in (asdict(named) if named is not None else {}).items():
        if keys is None:
            continue
        component = NAMED_LOGGERS[name]
        same = [i for i, n in enumerate(found) if n.get("_component_") == component]
        if same:  # already listed: these keys go to it
            found[same[0]] = OmegaConf.merge(found[same[0]], keys)
        else:
            found.append(OmegaConf.create({"_component_": component, **keys}))
    return found


def build_metric_loggers(
    nodes: ListConfig | list | None,
    output_dir: str,
    total_steps: int | None,
    rank: int,
    named: LoggersConfig | None = None,
    hyperparameters: dict[str, Any] | None = None,
) -> MetricLoggers:
    """Instantiate the configured loggers (`metric_loggers` and the ones added by name) on
    rank 0, giving them the run's resolved config; other ranks get a silent one."""
    nodes = logger_nodes(nodes, named)
    if rank != 0 or not nodes:
        return MetricLoggers([], active=rank == 0)
    loggers = MetricLoggers(
        instantiate(node, output_dir=str(output_dir), total_steps=total_steps) for node in nodes
    )
    if hyperparameters is not None:
        loggers.hyperparameters(hyperparameters)
    return loggers
