"""Build objects from `_component_` nodes, and check them without building.

A component node names a callable by its dotted import path; its other keys are
keyword arguments:

    optimizer:
      _component_: torch.optim.AdamW
      lr: 3e-4

`instantiate(cfg.optimizer, model.parameters())` calls
`torch.optim.AdamW(model.parameters(), lr=3e-4)`. Nested component nodes are
built first; keyword arguments given at the call site override the file.
Every error names the config path of the node.

A target that builds some arguments itself (`freetx.fields.BuildsParts`: a dataset
mixture's sources need the tokenizer and split the recipe passes to the mixture) is
given, for each argument it names in `built_later`, a factory per nested node instead:
`functools.partial(instantiate, node)`, which it calls with those arguments.

Trust (docs/trust.md): a config is data, and names code only from an allowlist
(`freetx.config.trust.check_component`); anything else runs when the user trusts it for
the command (`--trust NAME`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from freetx.config.trust import check_component, place
from freetx.errors import ConfigError
from freetx.fields import BuildsConfig, BuildsParts, ChoosesConfig, field_problems

COMPONENT = "_component_"


def node_path(node: Any, default: str = "<config>") -> str:
    """The dotted config path of an OmegaConf node (`optimizer`, `loggers[0]`)."""
    if isinstance(node, (DictConfig, ListConfig)):
        # asked of its parent: a list item's own full key drops the brackets (`loggers0`)
        parent = node._get_parent()
        key = parent._get_full_key(node._key()) if parent is not None else None
        return str(key) if key else default
    return default


def is_component(node: Any) -> bool:
    return isinstance(node, (DictConfig, dict)) and COMPONENT in node


# modules freetx renamed: a config that names the old path is told the new one
RENAMED_MODULES = {"freetx.logging": "freetx.loggers"}

# components freetx moved without changing them: a config naming the old path (a run's
# saved config.yaml, a user's copy) builds the same object, and a resume compares the two
# names as one (`current_name`). A key ending in "." moves a module's every name.
MOVED_COMPONENTS = {
    **{f"freetx.training.{name}": f"freetx.objectives.{name}" for name in (
        "CrossEntropyLoss", "PreferenceLoss", "GRPOLoss", "DistillationLoss", "ExactMatch",
        "RegexFormat", "LengthPenalty",
    )},
    **{f"freetx.training.{old}.": f"freetx.objectives.{new}." for old, new in (
        ("loss", "cross_entropy"), ("preference", "preference"), ("grpo", "grpo"),
        ("distillation", "distillation"), ("rewards", "rewards"),
    )},
}  # fmt: skip


def current_name(dotted: str) -> str:
    """`dotted` with a moved component's old path replaced by its new one."""
    for old, new in MOVED_COMPONENTS.items():
        if dotted == old or (old.endswith(".") and dotted.startswith(old)):
            return new + dotted[len(old) :]
    return dotted


def with_current_names(node: Any) -> Any:
    """A plain config tree (dicts and lists) with each `_component_`'s `current_name`."""
    if isinstance(node, dict):
        return {
            k: current_name(v) if k == COMPONENT and isinstance(v, str) else with_current_names(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [with_current_names(v) for v in node]
    return node


def import_component(dotted: Any, where: str) -> Any:
    """Import the object `pkg.module.attr`; errors name `where` and what failed. A
    component outside the allowlist that the user does not trust is refused, before its
    module is imported (`check_component`)."""
    if not isinstance(dotted, str) or not dotted.strip():
        raise ConfigError(
            f"{where}: expected a dotted import path such as torch.optim.AdamW, got {dotted!r}."
        )
    dotted = current_name(dotted.strip())
    for old, new in RENAMED_MODULES.items():
        if dotted.strip().startswith(old + "."):
            raise ConfigError(
                f"{where}: '{dotted}' names the module {old}, which freetx renamed {new}.",
                fix=f"Write '{new}{dotted.strip()[len(old) :]}' in the config.",
            )
    check_component(dotted, where, [])  # the path as written, before any import
    parts = dotted.strip().split(".")
    module = None
    consumed = 0
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            module = importlib.import_module(name)
            consumed = i
        except ModuleNotFoundError as e:
            if e.name != name:  # the module exists but needs something missing
                raise ConfigError(
                    f"{where}: importing '{name}' for '{dotted}' failed because "
                    f"module '{e.name}' is not installed. Install it (pip install {e.name}) "
                    "or pick another component."
                ) from e
            break
        except Exception as e:
            raise ConfigError(
                f"{where}: importing '{name}' for '{dotted}' failed: {type(e).__name__}: {e}"
            ) from e
    if module is None:
        raise ConfigError(
            f"{where}: cannot import '{dotted}': there is no module named '{parts[0]}'. "
            "Check the spelling of the dotted path."
        )
    obj: Any = module
    places = [place(module)]
    for j in range(consumed, len(parts)):
        if not hasattr(obj, parts[j]):
            owner = ".".join(parts[:j])
            hint = difflib.get_close_matches(
                parts[j], [a for a in dir(obj) if not a.startswith("_")], n=1
            )
            suggestion = f" (did you mean '{owner}.{hint[0]}'?)" if hint else ""
            raise ConfigError(
                f"{where}: cannot import '{dotted}': '{owner}' has no attribute "
                f"'{parts[j]}'{suggestion}."
            )
        obj = getattr(obj, parts[j])
        places.append(place(obj))
    check_component(dotted.strip(), where, [p for p in places if p], obj)
    if not callable(obj):
        raise ConfigError(f"{where}: '{dotted}' is not callable, so it cannot be built.")
    return obj


def _signature(target: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have no signature
        return None


def _bind_problem(
    target: Any, dotted: str, where: str, args: tuple, kwargs: dict, held: tuple[str, ...] = ()
) -> str | None:
    """Why `target(*args, **kwargs)` would not bind, or None when it binds; `held`: the
    keys the node may also set for the recipe (named in the hint for a misspelt one)."""
    sig = _signature(target)
    if sig is None:
        return None
    try:
        if args is None:  # checking a config alone: call-site arguments are unknown
            sig.bind_partial(**kwargs)
        else:
            sig.bind(*args, **kwargs)
        return _config_field_problem(target, dotted, where, sig, kwargs)
    except TypeError as e:
        params = [p for p in sig.parameters if p not in ("self", "args", "kwargs")]
        params += list(held)
        unknown = [k for k in kwargs if k not in sig.parameters]
        if unknown and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
        ):
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, params, n=1)
                hints.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
            return (
                f"{where}: {dotted} takes no argument {', '.join(hints)}; "
                f"it takes: {', '.join(params)}."
            )
        return f"{where}: the keys do not fit {dotted}{sig}: {e}."


def builder_config(target: Any, fields: dict[str, Any]) -> tuple[type | None, str]:
    """The config dataclass a builder takes these `**fields` for (`BuildsConfig`; the one it
    picks by them: `ChoosesConfig`), or None; and why that one ("": the builder's own)."""
    if isinstance(target, type) or not isinstance(target, BuildsConfig):
        return None, ""
    config_class, why = target.config_class, ""
    if isinstance(target, ChoosesConfig):
        config_class, why = target.config_for(fields)
    return (config_class if dataclasses.is_dataclass(config_class) else None), why


def _config_field_problem(
    target: Any, dotted: str, where: str, sig: inspect.Signature, kwargs: dict
) -> str | None:
    """A builder that takes `**fields` of a config dataclass (its `config_class`, see
    freetx.models.protocol.builds): keys that are no field of it, with a hint."""
    config_class, why = builder_config(target, kwargs)
    if config_class is None:
        return None
    known = [p for p in sig.parameters if p not in ("fields", "kwargs")]
    known += [f.name for f in dataclasses.fields(config_class)]
    unknown = [k for k in kwargs if k not in known]
    if not unknown:
        return None
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    return (
        f"{where}: {dotted} takes no argument {', '.join(hints)}; {why + '; ' if why else ''}"
        f"it takes: {', '.join(known)}."
    )


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """Build the object a `_component_` node describes.

    Positional `args` and keyword `kwargs` come from the call site (for
    instance the parameters an optimizer needs); call-site keywords override
    the node's keys. Nested component nodes are built first, but for the arguments a
    `BuildsParts` target builds itself (`built_later`): those get factories.
    """
    return instantiate_except(node, (), *args, **kwargs)


def instantiate_except(node: Any, held: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
    """`instantiate(node, *args, **kwargs)`, the node's `held` keys left out: they are the
    recipe's to read (a reward's weight and name: `freetx.fields.component_list`)."""
    if node is None:
        return None
    where = node_path(node)
    if not is_component(node):
        raise ConfigError(
            f"{where}: expected a node with a `_component_` key naming what to build."
        )
    target = import_component(node[COMPONENT], f"{where}._component_")
    later = target.built_later if isinstance(target, BuildsParts) else ()
    file_kwargs = {
        k: _factories(v) if k in later else _build_value(v)
        for k, v in node.items()
        if k != COMPONENT and k not in held
    }
    merged = {**file_kwargs, **kwargs}
    problem = _bind_problem(target, node[COMPONENT], where, args, merged)
    if problem:
        raise ConfigError(problem)
    try:
        return target(*args, **merged)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: building {node[COMPONENT]} failed: {e}") from e


def _build_value(value: Any) -> Any:
    if is_component(value):
        return instantiate(value)
    if isinstance(value, DictConfig):
        return {k: _build_value(v) for k, v in value.items()}
    if isinstance(value, ListConfig):
        return [_build_value(v) for v in value]
    return value


def _factories(value: Any) -> Any:
    """For an argument its target builds itself: a component node as a factory
    (`partial(instantiate, node)`), a list of them as a list of factories."""
    if is_component(value):
        return functools.partial(instantiate, value)
    if isinstance(value, ListConfig):
        return [_factories(v) for v in value]
    return _build_value(value)


def find_components(cfg: Any, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """Every `_component_` node in a config, with its path, outermost first."""
    if isinstance(cfg, DictConfig):
        if COMPONENT in cfg:
            yield path or "<config>", cfg
        for key, value in cfg.items_ex(resolve=False):
            yield from find_components(value, f"{path}.{key}" if path else str(key))
    elif isinstance(cfg, ListConfig):
        for i, value in enumerate(cfg):
            yield from find_components(value, f"{path}[{i}]")


def check_components(cfg: DictConfig, held: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """Import every component and bind its keys to the signature; list the problems.
    `held`: a top-level key -> the keys its nodes (or its list's nodes) hold for the
    recipe, not for their target (`freetx.fields.component_list`)."""
    problems = []
    for path, node in find_components(cfg):
        try:
            target = import_component(node[COMPONENT], f"{path}._component_")
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        skip = (held or {}).get(re.sub(r"\[\d+\]$", "", path), ())
        keys = {k: v for k, v in _items(node) if k != COMPONENT and k not in skip}
        problem = _bind_problem(target, node[COMPONENT], path, None, keys, skip)
        if problem:
            problems.append(problem)
        else:
            problems.extend(_meaningless_values(target, path, keys))
    return problems


def _meaningless_values(target: Any, where: str, kwargs: dict) -> list[str]:
    """The values of a builder's config dataclass (`freetx.models.protocol.builds`) that it
    calls meaningless (`freetx.fields.field_problems`); building it would refuse them too."""
    config_class, _ = builder_config(target, kwargs)
    if config_class is None:  # a target that checks its own keywords (a dataset, a loss)
        plain = {
            k: OmegaConf.to_container(v) if isinstance(v, ListConfig) else v
            for k, v in kwargs.items()
            if not isinstance(v, DictConfig)
        }
        return field_problems(target, plain, f"{where}.")
    return field_problems(config_class, _field_values(target, config_class, kwargs), f"{where}.")


def _field_values(target: Any, config_class: type, kwargs: dict) -> dict[str, Any]:
    """A builder's config fields a node sets, over its preset's, as plain values."""
    names = {f.name for f in dataclasses.fields(config_class)}
    preset = target.presets.get(kwargs.get("preset"), {})  # the node's keys over its preset's
    return {
        k: OmegaConf.to_container(v) if isinstance(v, ListConfig) else v
        for k, v in {**preset, **kwargs}.items()
        if k in names and not isinstance(v, DictConfig)
    }


def node_config_class(node: DictConfig, target: Any) -> type | None:
    """The config dataclass `target` (a node's builder) picks for the node's keys, or None."""
    return builder_config(target, {k: v for k, v in _items(node) if k != COMPONENT})[0]


def node_config(node: Any) -> Any | None:
    """The config dataclass instance a builder's node makes (a model's shape, from its
    preset and keys: nothing is built), for the checks before a run; None when the node
    names no builder with one, or its values do not make one (validate says why)."""
    if not isinstance(node, DictConfig) or not isinstance(node.get(COMPONENT), str):
        return None
    try:
        target = import_component(node[COMPONENT], f"model.{COMPONENT}")
    except ConfigError:
        return None
    kwargs = {k: v for k, v in _items(node) if k != COMPONENT}
    config_class, _ = builder_config(target, kwargs)
    if config_class is None:
        return None
    try:
        return config_class(**_field_values(target, config_class, kwargs))
    except (TypeError, ValueError):
        return None


def _items(node: DictConfig) -> list[tuple[Any, Any]]:
    """A node's keys and values, resolved where every interpolation resolves here."""
    try:
        return list(node.items_ex(resolve=True))
    except OmegaConfBaseException:
        return list(node.items_ex(resolve=False))


def to_container(node: Any) -> Any:
    """A config node as plain Python (dicts and lists), interpolations resolved."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node
