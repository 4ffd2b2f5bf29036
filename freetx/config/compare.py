"""What changed between the config a checkpoint was saved with and the one resuming it.

A resume may change most settings (lr, max_steps, logging, evaluation,
parallelism): they are applied, and listed so nothing changes silently. Keys a
recipe's schema names in `fixed_on_resume` (the model, the data and its order,
the optimizer class) may not change: the saved weights and optimizer state
would mean something else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from freetx.config.instantiate import with_current_names

# where the run is and what it resumes from: different by design
NOT_COMPARED = ("output_dir", "resume")
# inside a fixed section, but deciding only where tokens are cached, not what they are
FREE_ON_RESUME = ("dataset.cache", "dataset.cache_dir")


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as {dotted key: leaf value}; lists are leaves."""
    if not isinstance(node, dict) or (prefix and not node):
        return {prefix[:-1]: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def schema_of(cfg: Any) -> type:
    """The schema class of a config (a schema instance or a structured OmegaConf node)."""
    return OmegaConf.get_type(cfg) if isinstance(cfg, DictConfig) else type(cfg)


def fixed_on_resume(cfg: Any) -> tuple[str, ...]:
    """The keys the config's schema says a resume may not change."""
    return tuple(getattr(schema_of(cfg), "fixed_on_resume", ()))


def _is_under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def schema_defaults(cfg: Any) -> dict[str, Any]:
    """Each key's default in the config's schema (`cfg`: a config or its schema class; {}
    for a config without one)."""
    schema = cfg if isinstance(cfg, type) else schema_of(cfg)
    if not dataclasses.is_dataclass(schema):  # a plain config: no schema, no defaults
        return {}
    return flatten(OmegaConf.to_container(OmegaConf.structured(schema), resolve=False))


def resume_changes(
    saved: dict[str, Any],
    requested: dict[str, Any],
    fixed: Iterable[str],
    defaults: dict[str, Any] | None = None,
) -> tuple[list[str], list[str]]:
    """(changes that may be applied, changes that are refused), each `key: old -> new`. A
    key the saved config lacks that is at its schema default (`defaults`, flat) is no
    change: the schema gained it since, and its default is what the run did before."""
    # a component freetx moved is the same under its old name (`MOVED_COMPONENTS`)
    old, new = flatten(with_current_names(saved)), flatten(with_current_names(requested))
    allowed, refused = [], []
    for key in sorted(set(old) | set(new)):
        if _is_under(key, NOT_COMPARED):
            continue
        before, after = old.get(key, "(unset)"), new.get(key, "(unset)")
        if key not in old and key in (defaults or {}) and after == defaults[key]:
            continue
        if before == after:
            continue
        line = f"{key}: {before!r} -> {after!r}"
        fixed_key = _is_under(key, fixed) and not _is_under(key, FREE_ON_RESUME)
        (refused if fixed_key else allowed).append(line)
    return allowed, refused
