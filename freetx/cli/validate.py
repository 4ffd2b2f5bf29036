"""`freetx validate CONFIG [--recipe R] [overrides]`: every problem of a config, at once."""

from __future__ import annotations

import argparse

from freetx import registry
from freetx.errors import FreetxError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetx validate",
        description=(
            "Check a config: unknown or misspelt keys, wrong types, missing required keys, "
            "`_component_` targets that do not import, keys that do not bind to the target's "
            "signature. Reports every problem; exit 0 when clean, 1 otherwise."
        ),
    )
    p.add_argument("config", help="a config name (llm/tiny) or a path to a .yaml file")
    p.add_argument(
        "--recipe",
        help="recipe name or .py path whose schema to check against "
        "(default: the recipe a built-in config belongs to)",
    )
    p.add_argument("overrides", nargs="*", help="key=value or ~key")
    return p


def main(args: argparse.Namespace) -> int:
    from freetx.cli.common import load_recipe
    from freetx.config.run_config import load_and_check
    from freetx.config.schema import apply_schema
    from freetx.errors import ConfigError

    recipe_name = args.recipe
    if recipe_name is None:
        builtin = registry.recipe_for_config(args.config)
        if builtin is None:
            raise FreetxError(
                f"{args.config} is not a built-in config, so freetx cannot tell which "
                "recipe's schema applies; add --recipe NAME (or --recipe ./my_recipe.py)."
            )
        recipe_name = builtin.name
    target = load_recipe(recipe_name)
    cfg, problems = load_and_check(args.config, args.overrides, target.schema)
    if not problems and target.schema is not None:
        try:
            apply_schema(cfg, target.schema)
        except ConfigError as e:
            problems = e.problems
    if problems:
        print(
            f"{args.config}: {len(problems)} problem{'s' if len(problems) > 1 else ''} "
            f"(recipe {recipe_name}):"
        )
        for p in problems:
            print(f"  - {p}")
        return 1
    print(f"{args.config}: OK (recipe {recipe_name})")
    return 0
