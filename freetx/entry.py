"""The entry point of every recipe: parse `--config CFG [overrides]`, check, run.

    @freetx.entry.parse(FullFinetuneConfig)
    def recipe_main(cfg: FullFinetuneConfig) -> None:
        ...

    if __name__ == "__main__":
        sys.exit(recipe_main())

Called without arguments, `recipe_main` reads `sys.argv`, loads and checks the
config against the schema and runs the recipe. A user error prints as one
paragraph without a traceback and gives exit code 1; the process group is
destroyed on the way out, also after an exception; a collective that timed out
is reported with the step this process was in (`at_step`, which the recipe's
`TrainingRun` calls each step). Called with a config (`recipe_main(cfg)`, e.g.
from a test) it just runs.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from freetx.config.run_config import load_recipe_config, split_recipe_args
from freetx.errors import (
    LAUNCHER_REPORTS_ERRORS,
    STOPPED_BY_PEER_EXIT_CODE,
    USER_ERROR_KEY,
    FreetxError,
    debug_enabled,
    files_errors_explained,
    lost_a_peer,
    report_error,
)
from freetx.noise import quiet_known_noise


class _Position:
    """Where this process is in its training loop, for the message of a collective that
    timed out (a recipe without a TrainingRun leaves it unknown)."""

    step: int | None = None


_position = _Position()


class _Running:
    """The file of the recipe this process runs (set when its `recipe_main` is called)."""

    file: Path | None = None


_running = _Running()


def running_recipe_file() -> Path | None:
    """The file of the recipe this process runs (a built-in's or a user's copy), or None
    outside a recipe's `recipe_main`."""
    return _running.file


def at_step(step: int) -> None:
    """Record the training step this process is in (TrainingRun calls it every step)."""
    _position.step = step


def _destroy_process_group() -> None:
    """Leave the process group, if the recipe made one (a recipe that never imported
    torch made none)."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _record_for_torchrun(error: BaseException) -> None:
    """Write torchrun's error file, so `freetx run` can name the rank that failed first.

    A user error is written as its message with USER_ERROR_KEY set: `freetx run`
    prints each distinct message once, naming the ranks that raised it.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    if isinstance(error, FreetxError):
        record = {"message": str(error), "timestamp": int(time.time()), USER_ERROR_KEY: True}
        Path(path).write_text(json.dumps(record))
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(error)


def _launcher_reports_errors() -> bool:
    """True under `freetx run`, which prints the ranks' user errors once, deduplicated."""
    return os.environ.get(LAUNCHER_REPORTS_ERRORS) == "1"


def _is_collective_timeout(error: Exception) -> bool:
    """A collective that other ranks did not join in time (gloo; NCCL's watchdog aborts)."""
    text = str(error)
    return "Timed out waiting" in text or "collective operation timeout" in text


def _current_step() -> str:
    """The training step this process was in, when a recipe's TrainingRun runs."""
    return "?" if _position.step is None else str(_position.step)


def run_from_argv(
    recipe_main: Callable[[Any], object], schema: type | None, argv: list[str]
) -> int:
    """Parse argv, run the recipe, turn user errors into one paragraph; the exit code."""
    quiet_known_noise()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"freetx [rank {rank}]" if world_size > 1 else "freetx"
    try:
        config, overrides = split_recipe_args(argv)
        cfg = load_recipe_config(config, overrides, schema)
    except FreetxError as e:
        # every rank parses the same config; one message is enough
        return report_error(e, "freetx") if rank == 0 else e.exit_code
    try:
        with files_errors_explained():
            recipe_main(cfg)
        return 0
    except FreetxError as e:
        _record_for_torchrun(e)
        if debug_enabled():
            traceback.print_exc()
        if _launcher_reports_errors():
            return e.exit_code
        return report_error(e, prefix)
    except Exception as e:
        if world_size > 1 and _is_collective_timeout(e) and not debug_enabled():
            error = FreetxError(
                f"a collective did not complete within distributed.collective_timeout_s: this "
                f"rank waited at step {_current_step()} for rank(s) that did not arrive (a rank "
                "stuck in a slow save, a data loader or a hang). The job is stopped; the "
                "checkpoints so far are intact. Raise the timeout if the wait was legitimate."
            )
            _record_for_torchrun(error)
            if not _launcher_reports_errors():
                report_error(error, prefix)
            os._exit(error.exit_code)  # the group is broken: leave without tearing it down
        if world_size > 1 and lost_a_peer(e) and not debug_enabled():
            if not _launcher_reports_errors():
                print(
                    f"{prefix}: stopped because another rank failed; its message is above.",
                    file=sys.stderr,
                    flush=True,
                )
            os._exit(
                STOPPED_BY_PEER_EXIT_CODE
            )  # the group is broken: leave without tearing it down
        _record_for_torchrun(e)
        raise
    finally:
        _destroy_process_group()


def parse(schema: type | None = None, *, supports_distributed: bool = True):
    """Decorate a recipe's `recipe_main(cfg)` so that `recipe_main()` parses sys.argv.

    `schema` is the recipe's config dataclass; `supports_distributed=False`
    makes `freetx run` refuse launch options for this recipe.
    """

    def decorate(recipe_main: Callable[[Any], object]):
        @functools.wraps(recipe_main)
        def wrapper(cfg: Any = None) -> int | None:
            _running.file = Path(inspect.getfile(recipe_main)).resolve()
            if cfg is not None:
                recipe_main(cfg)
                return None
            return run_from_argv(recipe_main, schema, sys.argv[1:])

        wrapper.config_schema = schema
        wrapper.supports_distributed = supports_distributed
        return wrapper

    return decorate
