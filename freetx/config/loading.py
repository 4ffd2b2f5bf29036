"""Load a YAML config, apply command-line overrides, resolve interpolations.

Override grammar (everything after the config on the command line):

    key=value            set a key (created when absent); value parsed as YAML
    a.b.c=value          set a nested key; list items as `a.b[0]=value`
    key=[1,2] / {a: 1}   lists and dicts in OmegaConf (YAML flow) syntax
    key=a=b              the value is `a=b`: the split is on the first `=` only
    ~key / ~a.b / ~l[1]  delete a key or a list item
    node=pkg.mod.fn      when `node` is a `_component_` node and the value is a
                         dotted name, swap its `_component_` and keep its keys

The command line wins over the file.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from freetx import registry
from freetx.config.foreign_names import foreign_key, foreign_why
from freetx.config.trust import check_config_doors
from freetx.errors import ConfigError, UsageError, first_line

_DOTTED_NAME = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")


def resolve_config_path(name_or_path: str) -> Path:
    """A built-in config name (`llm/tiny`) or a path to a YAML file -> the file."""
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.resolve()
    builtin = registry.config_file(name_or_path)
    if builtin is not None:
        return builtin
    if path.suffix in (".yaml", ".yml"):
        raise ConfigError(
            f"config file {name_or_path} does not exist.",
            fix="Check the path, or use a built-in config name (`freetx ls` lists them).",
        )
    hint = registry.closest(name_or_path, registry.config_names())
    raise ConfigError(
        f"config '{name_or_path}' is not a built-in config name"
        + (f" (did you mean '{hint}'?)" if hint else "")
        + " and is not a path to a .yaml file.",
        fix="`freetx ls` lists the built-in configs; a path must end in .yaml.",
    )


def load_config(path: str | Path) -> DictConfig:
    """Read a YAML file into a DictConfig (interpolations not yet resolved)."""
    try:
        cfg = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist.") from None
    except Exception as e:  # YAML syntax errors come in several types
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(
            f"config file {path} holds a {type(cfg).__name__}, not a mapping of keys to values."
        )
    return cfg


def parse_value(raw: str):
    """Parse an override's value the way OmegaConf parses YAML values; an interpolation
    (`${key}`) stays unresolved, to be resolved against the whole config."""
    return OmegaConf.from_dotlist([f"value={raw}"])._get_node("value")._value()


def check_override_syntax(overrides: list[str]) -> None:
    """Raise a UsageError for an argument that is neither `key=value` nor `~key`."""
    for item in overrides:
        key = item[1:] if item.startswith("~") else item.split("=", 1)[0]
        if item.startswith("-") and not item.startswith("~"):
            raise UsageError(_option_after_recipe(item))
        if not (item.startswith("~") or "=" in item) or not key:
            raise UsageError(
                f"'{item}' is not an override. Write overrides as key=value "
                "(nested: a.b=value) or ~key to delete a key."
            )


def _option_after_recipe(item: str) -> str:
    """`--batch_size 256` after the recipe: an option of the command, or a key written
    as another system's flag (the seeds' `--batch_size`)."""
    name = item.lstrip("-").split("=", 1)[0]
    text = (
        f"'{item}' after the recipe is not an override: after the recipe come only --config "
        "and key=value overrides, and the command's own options (--nproc-per-node, -o, ...) "
        "go before the recipe: freetx run [OPTIONS] RECIPE --config CFG [key=value ...]."
    )
    key = foreign_key(name) or (name if name.isidentifier() else None)
    if key:
        why = foreign_why(name)
        text += f" As an override it is {key}=VALUE" + (f" ({why})." if why else ".")
    return text


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Apply `key=value` / `~key` overrides in order; the command line wins."""
    check_override_syntax(overrides)
    for item in overrides:
        if item.startswith("~"):
            _delete(cfg, item[1:])
            continue
        key, raw = item.split("=", 1)
        _check_parents(cfg, key, item)
        try:
            value = parse_value(raw)
        except Exception as e:  # YAML's own parse errors
            raise ConfigError(
                f"the value of override '{item}' is not valid YAML ({first_line(e)}). Quote "
                "it, or close its brackets: a.b=[1,2] or a.b={k: v}."
            ) from None
        existing = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if (
            isinstance(existing, DictConfig)
            and "_component_" in existing
            and isinstance(value, str)
            and _DOTTED_NAME.match(value)
        ):
            existing["_component_"] = value  # component shorthand: swap the target
            continue
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except OmegaConfBaseException as e:
            raise ConfigError(f"cannot apply override '{item}': {first_line(e)}") from None
    return cfg


def _check_parents(cfg: DictConfig, key: str, item: str) -> None:
    """Refuse `lr.x=1` when `lr` is a value: OmegaConf would silently make it a section."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        value = OmegaConf.select(cfg, parent, default=None, throw_on_resolution_failure=False)
        index = parts[i].strip("[]")
        if isinstance(value, ListConfig) and index.isdigit() and int(index) >= len(value):
            named = (
                " To add a logger without restating the list, name it: "
                "loggers.wandb.project=NAME (or loggers.tensorboard={})."
                if parent == "metric_loggers"
                else ""
            )
            raise ConfigError(
                f"cannot apply override '{item}': '{parent}' is a list of {len(value)} "
                f"item(s) (indices 0 to {len(value) - 1}); an override cannot append to it. "
                f"Give the whole list instead ({parent}=[...]).{named}"
            )
        if value is not None and not OmegaConf.is_config(value):
            raise ConfigError(
                f"cannot apply override '{item}': '{parent}' holds the value {value!r}, "
                f"not a section with keys; set '{parent}=...' itself instead."
            )


def _delete(cfg: DictConfig, key: str) -> None:
    item = re.match(r"^(.+)\[(\d+)\]$", key)
    if item:  # a list element: ~metric_loggers[2]
        items = OmegaConf.select(cfg, item[1], default=None)
        if not isinstance(items, ListConfig) or int(item[2]) >= len(items):
            raise ConfigError(f"cannot delete '~{key}': the config has no list item '{key}'.")
        del items[int(item[2])]
        return
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        raise ConfigError(f"cannot delete '~{key}': the config has no key '{key}'.")
    del parent[leaf]


def resolve(cfg: DictConfig) -> DictConfig:
    """Resolve `${...}` interpolations in place, naming the key that fails."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, ConfigError):  # a resolver's refusal (`oc.env`)
            raise e.__cause__ from None
        where = f" in '{e.full_key}'" if getattr(e, "full_key", None) else ""
        missing = re.search(r"Missing mandatory value: ([\w.]+)", str(e))
        if missing:
            raise ConfigError(
                f"'{missing.group(1)}' must be given (the config leaves it ??? and "
                f"'{getattr(e, 'full_key', '?')}' refers to it): add "
                f"{missing.group(1)}=VALUE to the command line."
            ) from None
        raise ConfigError(
            f"cannot resolve the interpolation{where}: {first_line(e)}. A ${{...}} reference "
            "names another key of the config (e.g. ${output_dir}); fix it or give a plain value."
        ) from None
    return cfg


def compose(name_or_path: str, overrides: list[str] | None = None) -> DictConfig:
    """Load a config by name or path, apply overrides, refuse what it may not do without
    the user's `--trust` (`check_config_doors`), resolve interpolations."""
    cfg = load_config(resolve_config_path(name_or_path))
    apply_overrides(cfg, list(overrides or []))
    check_config_doors(cfg)
    return resolve(cfg)
