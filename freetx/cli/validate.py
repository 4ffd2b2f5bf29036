"""`freetx validate CONFIG [--recipe R] [overrides]`: every problem of a config, at once."""

from __future__ import annotations

import argparse

from freetx import registry
from freetx.cli.common import add_trust_option, at_least_one
from freetx.errors import FreetxError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetx validate",
        description=(
            "Check a config: unknown or misspelt keys, wrong types, missing required keys, "
            "`_component_` targets that do not import, keys that do not bind to the target's "
            "signature, and every refusal a run makes before its first step (strategy, "
            "dtype, offload; with --world-size, the hsdp mesh and the batch split too). "
            "Reports every problem; exit 0 when clean, 1 otherwise."
        ),
    )
    p.add_argument("config", help="a config name (llm/tiny) or a path to a .yaml file")
    p.add_argument(
        "--recipe",
        help="recipe name or .py path whose schema to check against "
        "(default: the recipe a built-in config belongs to)",
    )
    p.add_argument(
        "--world-size",
        type=at_least_one,
        help="check the layout for this many processes too (nodes x processes per node)",
    )
    p.add_argument("overrides", nargs="*", help="key=value or ~key")
    add_trust_option(p)
    return p


def main(args: argparse.Namespace) -> int:
    from freetx.cli.common import (
        check_recipe_fits,
        config_device,
        config_owner_hint,
        load_recipe,
    )
    from freetx.config.run_config import load_and_check
    from freetx.config.schema import apply_schema, as_schema_instance
    from freetx.distributed import Processes
    from freetx.errors import ConfigError
    from freetx.training import (
        TrainingConfig,
        check_layout,
        check_read_paths,
        check_written_folders,
    )

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
    cautions: list[str] = []
    if not problems and target.schema is not None:
        try:  # the run's own checks, with what is known before it starts
            instance = as_schema_instance(apply_schema(cfg, target.schema), target.schema)
            cautions = instance.cautions() if isinstance(instance, TrainingConfig) else []
            device = config_device(cfg.get("device", "auto"))
            check_layout(instance, Processes(args.world_size, device_type=device))
            check_written_folders(instance)
            check_read_paths(instance)
            check_recipe_fits(recipe_name, instance)
        except ConfigError as e:
            problems = [*e.problems[:-1], f"{e.problems[-1]} {e.fix or ''}".rstrip()]
        except FreetxError as e:  # a folder the run would write cannot be written
            problems = [str(e)]
    hint = config_owner_hint(args.config, recipe_name) if problems else None
    if hint:
        problems = [*problems, hint]
    if problems:
        print(
            f"{args.config}: {len(problems)} problem{'s' if len(problems) > 1 else ''} "
            f"(recipe {recipe_name}):"
        )
        for p in problems:
            print(f"  - {p}")
        return 1
    print(f"{args.config}: OK (recipe {recipe_name})")
    for caution in cautions:  # legal, and pointless: the run prints them too
        print(f"  warning: {caution}")
    return 0
