"""The entry point of every recipe: parse `--config CFG [overrides]`, check, run.

    @freetx.config.parse(FullFinetuneConfig)
    def recipe_main(cfg: FullFinetuneConfig) -> None:
        ...

    if __name__ == "__main__":
        sys.exit(recipe_main())

Called without arguments, `recipe_main` reads `sys.argv`, loads and checks the
config against the schema and runs the recipe. A user error prints as one
paragraph without a traceback and gives exit code 1; the process group is
destroyed on the way out, also after an exception. Called with a config
(`recipe_main(cfg)`, e.g. from a test) it just runs. The recipe writes
`<output_dir>/config.yaml` (`write_resolved_config`) once it starts training,
so a run refused at set-up never replaces the config of the checkpoints beside it.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from freetx.config.loading import check_override_syntax, compose
from freetx.config.schema import apply_schema, as_schema_instance, check_config, config_as_dict
from freetx.errors import (
    LAUNCHER_REPORTS_ERRORS,
    STOPPED_BY_PEER_EXIT_CODE,
    USER_ERROR_KEY,
    ConfigError,
    FreetxError,
    UsageError,
    debug_enabled,
    report_error,
)

CONFIG_FILE_NAME = "config.yaml"


def split_recipe_args(argv: list[str]) -> tuple[str, list[str]]:
    """`--config CFG k=v ...` (in any order) -> (CFG, overrides)."""
    config, rest = None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c"):
            if i + 1 >= len(argv):
                raise UsageError("--config needs a value: a config name or a path to a .yaml file.")
            config = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if config is None:
        raise UsageError(
            "no config given. Pass --config NAME_OR_PATH (`freetx ls` lists the built-in "
            "configs), then any key=value overrides."
        )
    check_override_syntax(rest)
    return config, rest


def load_and_check(
    config: str, overrides: list[str], schema: type | None
) -> tuple[DictConfig, list[str]]:
    """The composed config and every problem found in it (empty when clean)."""
    cfg = compose(config, overrides)
    return cfg, check_config(cfg, schema)


def load_recipe_config(config: str, overrides: list[str], schema: type | None) -> Any:
    """Compose and check a recipe's config; raise one ConfigError listing all problems.

    With a schema, the result is an instance of it (`as_schema_instance`: sections are
    dataclass instances, `_component_` nodes stay config nodes); without, a DictConfig.
    """
    cfg, problems = load_and_check(config, overrides, schema)
    if problems:
        raise ConfigError(problems, fix="Fix them in the YAML file or with key=value overrides.")
    if schema is None:
        return cfg
    return as_schema_instance(apply_schema(cfg, schema), schema)


def write_resolved_config(cfg: Any) -> Path | None:
    """Save the run's resolved config as `<output_dir>/config.yaml` (rank 0, when training
    starts: the checkpointer calls it once the run's resume was accepted)."""
    data = config_as_dict(cfg)
    output_dir = data.get("output_dir")
    if not output_dir:
        return None
    path = Path(output_dir) / CONFIG_FILE_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
    except OSError as e:
        raise ConfigError(
            f"cannot write the run's config to {path}: {e.strerror}.",
            fix="Pick an output_dir you can write to (output_dir=PATH).",
        ) from None
    return path


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


def _is_peer_failure(error: Exception) -> bool:
    """A collective that failed because another rank's process ended."""
    text = str(error)
    return "closed by peer" in text or "reset by peer" in text or "remote worker" in text


def _is_collective_timeout(error: Exception) -> bool:
    """A collective that other ranks did not join in time (gloo; NCCL's watchdog aborts)."""
    text = str(error)
    return "Timed out waiting" in text or "collective operation timeout" in text


def _current_step() -> str:
    """The training step this process was in, when a recipe's TrainingRun runs."""
    signals = sys.modules.get("freetx.training.signals")
    return str(getattr(signals, "current_step", "?"))


def run_from_argv(
    recipe_main: Callable[[Any], object], schema: type | None, argv: list[str]
) -> int:
    """Parse argv, run the recipe, turn user errors into one paragraph; the exit code."""
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
        if world_size > 1 and _is_peer_failure(e) and not debug_enabled():
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
            if cfg is not None:
                recipe_main(cfg)
                return None
            return run_from_argv(recipe_main, schema, sys.argv[1:])

        wrapper.config_schema = schema
        wrapper.supports_distributed = supports_distributed
        return wrapper

    return decorate
