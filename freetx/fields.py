"""Schema field helpers for config dataclasses anywhere in freetx (imports nothing of freetx).

`at_least(n)` marks a count or size that must be `n` or more; the schema checks
(`freetx.config.schema`) report a smaller value with the key's path.

A config dataclass whose values can make a knob meaningless (LoRA's alpha of 0:
adapters that never change the output; BatchTopK keeping every feature) follows
`ChecksMeaning`: a static method `meaningless(values) -> {key: why and the fix}`, reading the keys it
needs from `values` (a key it needs may be absent: then it checks nothing about
it). `field_problems` asks it, so the same rules refuse such a value when a config
is validated (`freetx validate`, and every run before it launches: schema sections
and the config classes of `_component_` builders, `freetx.models.protocol.builds`)
and when the dataclass is made (`refuse_meaningless`, from its `__post_init__`).

A `_component_` target that builds some of its arguments itself from their nodes (a
dataset mixture's sources, which need the recipe's tokenizer and split) follows
`BuildsParts`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

MIN_KEY = "min"
_REQUIRED = "???"  # OmegaConf's MISSING


def at_least(minimum: int, default: Any = _REQUIRED) -> Any:
    """A schema field whose value must be `minimum` or more (a count, a size, a period)."""
    return dataclasses.field(default=default, metadata={MIN_KEY: minimum})


ACCEPTS_KEY = "accepts"


def accepting(default: Any, accepts: str) -> Any:
    """A schema field whose values its type does not say (words, or a path): `accepts`
    says them, and the schema checks name them when a value is of another type."""
    return dataclasses.field(default=default, metadata={ACCEPTS_KEY: accepts})


WRITES_KEY = "writes"


def written_folder(default: Any = _REQUIRED, *, own: bool = False) -> Any:
    """A schema field naming a folder the command writes into (None: not used). `freetx
    run` and `freetx validate` check it can be written before anything is launched
    (`freetx.user_files.check_written_folders`). `own`: the folder is freetx's alone (a
    cache), so an existing folder holding other files is refused too."""
    return dataclasses.field(default=default, metadata={WRITES_KEY: "own" if own else "any"})


def written_folders(config: Any) -> list[tuple[str, str, bool]]:
    """(key, folder, own) of every `written_folder` field set in a config dataclass
    instance and its dataclass sections, keys named from the top ("activations.cache")."""
    return [(key, value, mark == "own") for key, value, mark in _marked(config, WRITES_KEY)]


def _marked(config: Any, mark: str, path: str = "") -> list[tuple[str, str, Any]]:
    """(key, path, the mark's value) of every field of a config dataclass instance and its
    dataclass sections whose metadata holds `mark` and whose value is a path, keys named
    from the top."""
    found = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        if f.metadata.get(mark) and isinstance(value, str) and value:
            found.append((path + f.name, value, f.metadata[mark]))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            found.extend(_marked(value, mark, f"{path}{f.name}."))
    return found


READS_KEY = "reads"


def read_path(default: Any = _REQUIRED) -> Any:
    """A schema field naming a file or folder the run reads (None: not used): `freetx run`
    and `freetx validate` check it exists before anything is launched
    (`freetx.training.check_read_paths`)."""
    return dataclasses.field(default=default, metadata={READS_KEY: True})


def read_paths(config: Any) -> list[tuple[str, str]]:
    """(key, path) of every `read_path` field set in a config dataclass instance and its
    dataclass sections, keys named from the top ("teacher.weights")."""
    return [(key, value) for key, value, _ in _marked(config, READS_KEY)]


HOLDS_KEY = "holds"


def component_list(*keys: str, default_factory: Any = None) -> Any:
    """A schema field holding a list of `_component_` nodes, each of which may also set
    `keys`: the recipe reads them itself (a reward's `weight` and `name`), they are no
    arguments of the node's target. `freetx validate` checks a node's other keys against
    its target (`freetx.config.instantiate.check_components`), and
    `instantiate_except(node, keys)` builds it without them. No default_factory: required."""
    if default_factory is None:
        return dataclasses.field(default=_REQUIRED, metadata={HOLDS_KEY: keys})
    return dataclasses.field(default_factory=default_factory, metadata={HOLDS_KEY: keys})


def component_node(*keys: str, optional: bool = False) -> Any:
    """A schema field holding one `_component_` node that may also set `keys`, which the
    recipe (or freetx) reads itself: the optimizer's memory rungs (`offload`, ...), an
    environment's `max_turns`; no arguments of its class. Checked and built as
    `component_list`'s nodes are. Required, or None by default (`optional`)."""
    return dataclasses.field(default=None if optional else _REQUIRED, metadata={HOLDS_KEY: keys})


def held_keys(schema: type) -> dict[str, tuple[str, ...]]:
    """Field name -> the keys its `component_list` nodes hold for the recipe."""
    return {
        f.name: f.metadata[HOLDS_KEY] for f in dataclasses.fields(schema) if HOLDS_KEY in f.metadata
    }


@runtime_checkable
class ChecksMeaning(Protocol):
    """A config dataclass that can tell which of its values make a knob meaningless."""

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]: ...


@runtime_checkable
class BuildsConfig(Protocol):
    """A builder (a `_component_` target) that names the config dataclass of the fields it
    takes (`freetx.models.protocol.builds`): `freetx validate` checks a config's keys
    and values against it before anything is built."""

    config_class: type
    presets: dict[str, dict[str, Any]]  # `preset:` name -> the fields it sets


@runtime_checkable
class BuildsParts(Protocol):
    """A `_component_` target that builds some of its arguments itself, with arguments only
    it has (`freetx.data.Mixture`: its sources, each with the tokenizer and split the
    recipe passed to the mixture). `built_later` names those arguments: `instantiate`
    passes each component node given for one (or a list of them) as a factory,
    `functools.partial(instantiate, node)`, instead of the built object, and the target
    calls `factory(**its_arguments)`. `freetx validate` checks the nodes' keys as any."""

    built_later: tuple[str, ...]  # argument names, a class attribute


@runtime_checkable
class ChoosesConfig(Protocol):
    """A builder whose config dataclass depends on its arguments (`freetx.models.hf_model`:
    a folder's model_type picks the decoder's fields or the generic path's); `freetx
    validate` checks a config's keys against the class it picks."""

    def config_for(self, fields: dict[str, Any]) -> tuple[type, str]:
        """The config class for these keys, and a sentence saying why that class ("" when
        it is the builder's `config_class`)."""
        ...


def _defaults(config_class: type) -> dict[str, Any]:
    """The fields of a dataclass that have a default, with it."""
    found = {}
    for f in dataclasses.fields(config_class):
        if f.default_factory is not dataclasses.MISSING:
            found[f.name] = f.default_factory()
        elif f.default is not dataclasses.MISSING and not (
            isinstance(f.default, str) and f.default == _REQUIRED
        ):
            found[f.name] = f.default
    return found


def field_problems(config_class: Any, values: dict[str, Any], path: str = "") -> list[str]:
    """What `config_class.meaningless` finds in `values` (over the class's defaults, for a
    dataclass), each naming its key under `path` ("peft.") and its value; [] for a class
    without it. `config_class` may be a `_component_` target itself (a dataset, a loss)
    whose `meaningless` reads its constructor's keywords. A subclass's `meaningless` adds
    to its bases' (a recipe's schema keeps TrainingConfig's checks)."""
    if not isinstance(config_class, ChecksMeaning):
        return []
    defaults = _defaults(config_class) if dataclasses.is_dataclass(config_class) else {}
    merged = {**defaults, **values}
    owners = [c for c in getattr(config_class, "__mro__", ()) if "meaningless" in vars(c)]
    found: dict[str, str] = {}
    try:
        for check in [c.meaningless for c in reversed(owners)] or [config_class.meaningless]:
            found.update(check(merged))
    except TypeError:  # a value of the wrong type: the type checks or the builder say so
        return []
    return [f"'{path}{key}' is {_value_at(merged, key)!r}: {why}" for key, why in found.items()]


def _value_at(values: dict[str, Any], key: str) -> Any:
    """The value of a key, or of a dotted key into a section given as a dict ("optimizer.lr")."""
    if key in values:
        return values[key]
    head, _, rest = key.partition(".")
    inner = values.get(head)
    return _value_at(inner, rest) if rest and isinstance(inner, dict) else None


def refuse_meaningless(config: Any) -> None:
    """Raise ValueError naming every meaningless value of a config dataclass instance
    (call it from the class's `__post_init__`)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    problems = field_problems(type(config), values)
    if problems:
        raise ValueError(" ".join(problems))


@runtime_checkable
class ReadsFiles(Protocol):
    """A dataset or tokenizer built from files (the data a run trains on, the tokenizer
    that gives its ids their meaning): a run records them by identity and refuses to
    resume on files that changed since (`freetx.checkpoint.files_read_by`). Nothing read
    from files: an empty list. Here, below data and checkpoint alike: a dataset made of
    others (`freetx.data.Mixture`) gathers its parts' files."""

    files_read: list[Path]
