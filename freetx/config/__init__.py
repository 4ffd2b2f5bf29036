"""Configs: load YAML, apply overrides, check against a schema, build components.

See `loading.py` for the override grammar, `schema.py` for schema checks,
`instantiate.py` for `_component_` nodes, `run_config.py` for a run's config (argv -> schema instance, config.yaml).
"""

from freetx.config.instantiate import check_components, instantiate, to_container
from freetx.config.loading import apply_overrides, compose, load_config, resolve_config_path
from freetx.config.run_config import load_recipe_config, write_resolved_config
from freetx.config.schema import apply_schema, at_least, check_config
from freetx.errors import ConfigError

__all__ = [
    "ConfigError",
    "apply_overrides",
    "apply_schema",
    "at_least",
    "check_components",
    "check_config",
    "compose",
    "instantiate",
    "load_config",
    "load_recipe_config",
    "resolve_config_path",
    "to_container",
    "write_resolved_config",
]
