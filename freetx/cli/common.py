"""What several subcommands share: finding a recipe by name or path, reading its schema."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetx import registry
from freetx.errors import ConfigError, FreetxError


@dataclass
class RecipeTarget:
    """A recipe to validate or run: its file, schema, and whether it runs distributed."""

    path: Path
    name: str
    schema: type | None
    supports_distributed: bool


def resolve_recipe_file(name_or_path: str) -> Path:
    """A built-in recipe name or a path to a .py file -> the file."""
    recipe = registry.get_recipe(name_or_path)
    if recipe is not None:
        return registry.recipe_file(recipe)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".py":
        if not path.is_file():
            raise FreetxError(f"recipe file {name_or_path} does not exist; check the path.")
        return path.resolve()
    hint = registry.closest(name_or_path, [r.name for r in registry.RECIPES])
    raise FreetxError(
        f"'{name_or_path}' is not a built-in recipe"
        + (f" (did you mean '{hint}'?)" if hint else "")
        + " and not a path to a .py file. `freetx ls` lists the recipes; a copied recipe "
        "is given by its path, e.g. ./my_recipe.py."
    )


def load_recipe(name_or_path: str) -> RecipeTarget:
    """Import a recipe file by path (not as __main__) to read its schema and flags.

    The recipe's `recipe_main` must be decorated with `freetx.entry.parse`.
    """
    path = resolve_recipe_file(name_or_path)
    module_name = f"freetx_recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise FreetxError(f"cannot load recipe file {path}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses need their module registered
    try:
        spec.loader.exec_module(module)
    except FreetxError:
        raise
    except Exception as e:
        raise FreetxError(
            f"importing recipe file {path} failed: {type(e).__name__}: {e}. "
            "Fix the file (run with --debug for the traceback)."
        ) from e
    entry = getattr(module, "recipe_main", None)
    if entry is None or not hasattr(entry, "config_schema"):
        raise FreetxError(
            f"{path} has no `recipe_main` decorated with @freetx.entry.parse(Schema); "
            "a recipe file must define one (see any built-in recipe)."
        )
    return RecipeTarget(
        path=path,
        name=name_or_path,
        schema=entry.config_schema,
        supports_distributed=entry.supports_distributed,
    )


def add_trust_option(parser: argparse.ArgumentParser) -> None:
    """`--trust NAME`: code a config may name for this command beyond the allowlist
    (`freetx.config.trust`; the ranks inherit it as FREETX_TRUST)."""
    parser.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="NAME",
        help="let the config run this code for this command: your module (my_rewards) or a "
        "dotted name, remote_code (trust_remote_code), env:NAME (${oc.env:NAME}), or an "
        "lm-eval task folder with !function; comma-separated or repeated (docs/trust.md)",
    )


def number(
    kind: type = int,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
):
    """An argparse type for a number flag: `kind` (int: a whole number) within bounds, so
    that a count of 0, a negative size or a share over 1 is refused before any work."""

    def parse(value: str):
        try:
            result = kind(value)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}") from None
        if result != result or result in (float("inf"), float("-inf")):  # nan, inf
            raise argparse.ArgumentTypeError(f"{value!r} is not a finite number")
        if at_least is not None and result < at_least:
            raise argparse.ArgumentTypeError(f"{value} is less than {at_least:g}")
        if above is not None and result <= above:
            raise argparse.ArgumentTypeError(f"{value} is not above {above:g}")
        if at_most is not None and result > at_most:
            raise argparse.ArgumentTypeError(f"{value} is more than {at_most:g}")
        return result

    parse.__name__ = kind.__name__
    return parse


at_least_one = number(int, at_least=1)  # counts: processes, ranks, replicas, nodes
at_least_zero = number(int, at_least=0)  # restarts, ranks' indices
port = number(int, at_least=1, at_most=65535)


def config_device(device: str) -> str | None:
    """The device type a config's `device:` names (None for auto: known only where it runs)."""
    return None if device == "auto" else device


def check_recipe_fits(recipe_name: str, cfg: Any) -> None:
    """What a built-in recipe asks of a config beyond its schema (`freetx validate` and
    `freetx run`, before anything is launched): lora_finetune_fsdp2 trains adapters, so a
    config without a `peft:` method (a full fine-tune) is refused."""
    recipe = registry.get_recipe(recipe_name)
    peft = getattr(cfg, "peft", None)  # a schema without one: nothing to compare
    method = getattr(peft, "method", None)
    if recipe is None or not recipe.trains_adapters or method != "none":
        return
    examples = ", ".join(c for c in recipe.configs if c.endswith("_tiny"))
    raise ConfigError(
        f"recipe {recipe.name} trains adapters, and this config sets no peft.method (no "
        "`peft:` section), so it would fine-tune every weight without a word.",
        fix=f"Add peft.method=lora (with peft.rank=..., peft.use_dora=true for DoRA; the "
        f"configs {examples} show the section), or run full_finetune_fsdp2 for a full "
        "fine-tune.",
    )


def config_owner_hint(config: str, recipe_name: str) -> str | None:
    """A line naming the recipe a config belongs to, when it is another than the one it was
    given to (a built-in config: the registry says; a file: guessed from its top-level
    keys), with the command that runs it; None otherwise. Added to a config's problems."""
    owner = registry.recipe_for_config(config)
    if owner is None and Path(config).is_file():
        import yaml

        try:
            data = yaml.safe_load(Path(config).read_text())
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            data = None
        if isinstance(data, dict):
            owner = registry.recipe_guessed_for({str(k) for k in data})
    given = registry.get_recipe(recipe_name)
    if owner is None or owner.name == recipe_name or (given and given.file == owner.file):
        return None
    known = "is a config of" if registry.recipe_for_config(config) else "looks like a config of"
    return (
        f"{config} {known} recipe {owner.name}, not {recipe_name}: run it with "
        f"`freetx run {owner.name} --config {config}`."
    )
