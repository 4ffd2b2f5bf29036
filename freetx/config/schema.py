"""Check a config against a recipe's schema, reporting every problem at once.

A recipe declares its schema as a dataclass (an OmegaConf structured config).
Fields typed `Any` hold `_component_` nodes, which stay free-form here and are
checked by binding their keys to the target's signature (see
`instantiate.check_components`). Everything else is checked here: unknown keys
(with the closest valid key as a hint), wrong types, values outside a
`Literal[...]`, numbers below a field's `at_least(n)` bound, values a section's
dataclass calls meaningless (`freetx.fields.field_problems`: LoRA's alpha of 0),
and required keys (default `MISSING`) that are not set.

After the checks a recipe receives its config as an instance of its schema
(`as_schema_instance`): every section declared as a dataclass is a real
dataclass instance (`cfg.distributed.strategy`, `cfg.checkpoint.keep_last`),
plain values are Python values, and only the free-form nodes typed `Any`
(`_component_` nodes, lists of them) stay OmegaConf nodes, so `instantiate`
can name their config path in errors. `config_as_dict` turns it back into
plain data (config.yaml, checkpoints' meta.json).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from freetx.config.foreign_names import foreign_hint
from freetx.config.instantiate import COMPONENT, check_components
from freetx.errors import ConfigError
from freetx.fields import ACCEPTS_KEY, MIN_KEY, at_least, field_problems, held_keys  # noqa: F401 - at_least re-exported

_NONE = type(None)


def _all_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key a schema defines, for hints across sections."""
    keys = []
    for f in dataclasses.fields(schema):
        path = f"{prefix}{f.name}"
        keys.append(path)
        hint = _section(_resolved_hints(schema).get(f.name))
        if dataclasses.is_dataclass(hint):
            keys.extend(_all_keys(hint, path + "."))
    return keys


def _resolved_hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _suggest(
    key: str, level_keys: list[str], schema_root: type, path: str, value: Any = None
) -> str:
    close = difflib.get_close_matches(key, level_keys, n=1, cutoff=0.6)
    foreign = foreign_hint(key, value, _all_keys(schema_root))  # torchtune's, the seeds'
    if foreign and (not path or not close):
        return foreign
    if close:
        return f"did you mean '{path}{close[0]}'?"
    elsewhere = [k for k in _all_keys(schema_root) if k.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"did you mean '{elsewhere[0]}'?"
    close = difflib.get_close_matches(key, _all_keys(schema_root), n=1, cutoff=0.75)
    if close:
        return f"did you mean '{close[0]}'?"
    return "valid keys here: " + ", ".join(level_keys) + "."


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is _NONE:
        return "null"
    if origin in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> bool:
    """Whether a (resolved) config value fits a type annotation."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if tp is _NONE:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, ListConfig):
            return False
        args = typing.get_args(tp)
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, DictConfig)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, DictConfig)
    return True


def schema_problems(cfg: DictConfig, schema: type) -> list[str]:
    """Unknown keys, wrong types and missing required keys, each with its path."""
    problems: list[str] = []
    _check_level(cfg, schema, "", schema, problems)
    return problems


def _check_level(
    node: DictConfig, schema: type, path: str, root: type, problems: list[str]
) -> None:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = _resolved_hints(schema)
    before = len(problems)
    for key in node.keys():
        key = str(key)
        if key not in fields:
            hint = _suggest(key, list(fields), root, path, _plain_value(node, key))
            problems.append(f"unknown key '{path}{key}': {hint}")
            continue
        if OmegaConf.is_missing(node, key):
            continue  # `???`: reported below when the key is required
        value = node[key]
        tp = hints[key]
        if dataclasses.is_dataclass(_section(tp)) and isinstance(value, DictConfig):
            _check_level(value, _section(tp), f"{path}{key}.", root, problems)
        elif not _matches(value, tp):
            shown = (
                OmegaConf.to_container(value)
                if isinstance(value, (DictConfig, ListConfig))
                else value
            )
            said = fields[key].metadata.get(ACCEPTS_KEY) or _describe(tp)
            problems.append(f"'{path}{key}' must be {said}, got {shown!r}.")
        elif MIN_KEY in fields[key].metadata and value is not None:
            if value < fields[key].metadata[MIN_KEY]:
                problems.append(
                    f"'{path}{key}' must be at least {fields[key].metadata[MIN_KEY]}, "
                    f"got {value!r}."
                )
    for name, f in fields.items():
        if name not in node and dataclasses.is_dataclass(hints[name]):
            _check_level(OmegaConf.create({}), hints[name], f"{path}{name}.", root, problems)
            continue
        no_default = f.default is dataclasses.MISSING or (
            isinstance(f.default, str) and f.default == MISSING
        )
        required = no_default and f.default_factory is dataclasses.MISSING
        if required and (name not in node or OmegaConf.is_missing(node, name)):
            problems.append(f"missing required key '{path}{name}' ({_describe(hints[name])}).")
    if len(problems) == before:  # every value has its type: ask what they mean together
        problems.extend(field_problems(schema, _plain_values(node, hints), path))


def _plain_value(node: DictConfig, key: str) -> Any:
    """A key's value as plain data (None where it does not resolve here)."""
    return _plain_values(node, {}).get(key)


def _plain_values(node: DictConfig, hints: dict[str, Any]) -> dict[str, Any]:
    """A section's set values, resolved, as Python values (sections left out)."""
    values = {}
    for key in node.keys():
        key = str(key)
        if OmegaConf.is_missing(node, key) or dataclasses.is_dataclass(_section(hints.get(key))):
            continue
        try:
            value = node[key]
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException:  # an interpolation that does not resolve here
            continue
        values[key] = value
    return values


def check_config(cfg: DictConfig, schema: type | None) -> list[str]:
    """Every problem with a resolved config: schema first, then components."""
    problems = schema_problems(cfg, schema) if schema is not None else []
    if schema is not None:
        cfg = _with_default_components(cfg, schema)
    return problems + check_components(cfg, held_keys(schema) if schema is not None else None)


def _with_default_components(cfg: DictConfig, schema: type) -> DictConfig:
    """The config with the `_component_` of each top-level node the schema gives by default
    (a recipe's loss) where the config sets the node's keys only (`loss.num_chunks=0`), so
    those keys are checked against the component the run builds."""
    filled = None
    for f in dataclasses.fields(schema):
        node = cfg.get(f.name) if f.name in cfg else None
        if not isinstance(node, DictConfig) or COMPONENT in node:
            continue
        if f.default_factory is dataclasses.MISSING:
            continue
        default = f.default_factory()
        if isinstance(default, dict) and COMPONENT in default:
            filled = filled if filled is not None else cfg.copy()
            filled[f.name] = OmegaConf.merge(default, node)
    return cfg if filled is None else filled


def apply_schema(cfg: DictConfig, schema: type) -> DictConfig:
    """The config merged over the schema's defaults: typed, read-only keys fixed.

    Call after `check_config` found no problems. The result is in struct mode,
    so reading a key the schema does not define is an error, not a silent None.
    """
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    except Exception as e:  # any leftover type error is still the user's config
        raise ConfigError(f"the config does not fit the recipe's schema: {e}") from None
    OmegaConf.set_struct(merged, True)
    return merged


def _keeps_node(tp: Any) -> bool:
    """Whether a field's value stays an OmegaConf node: `Any`, or a container of `Any`."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_keeps_node(a) for a in typing.get_args(tp) if a is not _NONE)
    if origin in (list, tuple, dict):
        return any(a is Any for a in typing.get_args(tp))
    return False


def _list_of_dataclass(tp: Any) -> bool:
    args = typing.get_args(tp)
    return (
        typing.get_origin(tp) in (list, list) and bool(args) and dataclasses.is_dataclass(args[0])
    )  # noqa: UP006


def _section(tp: Any) -> Any:
    """A section's dataclass, also of an optional section (`X | None`: null when left out)."""
    present = [arg for arg in typing.get_args(tp) if arg is not type(None)]
    optional = type(None) in typing.get_args(tp) and len(present) == 1
    return present[0] if optional and dataclasses.is_dataclass(present[0]) else tp


def as_schema_instance(cfg: DictConfig, schema: type) -> Any:
    """The checked config as an instance of `schema` (see the module docstring)."""
    hints = _resolved_hints(schema)
    values = {}
    for f in dataclasses.fields(schema):
        tp = _section(hints[f.name])
        if _keeps_node(tp):
            values[f.name] = cfg[f.name]  # a node stays a node; a plain value is resolved
        elif dataclasses.is_dataclass(tp) and isinstance(cfg[f.name], DictConfig):
            values[f.name] = as_schema_instance(cfg[f.name], tp)
        elif _list_of_dataclass(tp) and isinstance(cfg[f.name], ListConfig):
            item = typing.get_args(tp)[0]
            values[f.name] = [as_schema_instance(node, item) for node in cfg[f.name]]
        else:
            value = cfg[f.name]
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True)
            values[f.name] = value
    return schema(**values)


def config_as_dict(cfg: Any) -> Any:
    """A config (schema instance, OmegaConf node, or plain data) as plain, resolved data."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_as_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, dict):
        return {k: config_as_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [config_as_dict(v) for v in cfg]
    return cfg
