"""A run's config: `--config CFG [overrides]` -> a checked schema instance, and the
resolved `<output_dir>/config.yaml`.

The recipe entry point (`freetx.entry.parse`) and the launchers (`freetx run`,
`validate`, `launch`, `estimate`) read configs through these. A recipe writes
`<output_dir>/config.yaml` (`write_resolved_config`) once it starts training,
so a run refused at set-up never replaces the config of the checkpoints beside it.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from freetx.config.loading import check_override_syntax, compose, resolve_config_path
from freetx.config.schema import apply_schema, as_schema_instance, check_config, config_as_dict
from freetx.errors import ConfigError, UsageError

CONFIG_FILE_NAME = "config.yaml"
# the config file this process read (`load_and_check`): a run never writes over it
_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("config", default=None)


def loaded_config_file() -> Path | None:
    """The config file this process's run was given (None: none read yet)."""
    return _config_file.get()


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
    _config_file.set(resolve_config_path(config))
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
