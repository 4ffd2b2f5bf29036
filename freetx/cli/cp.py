"""`freetx cp NAME DEST`: copy a built-in recipe (.py) or config (.yaml) to edit it."""

from __future__ import annotations

import argparse
from pathlib import Path

from freetx import registry
from freetx.errors import FreetxError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetx cp",
        description=(
            "Copy a built-in recipe (to a .py file) or config (to a .yaml file) so you can "
            "edit it; run the copy with `freetx run ./file.py --config ./file.yaml`."
        ),
    )
    p.add_argument("name", help="a recipe name (full_finetune_fsdp2) or config name (llm/tiny)")
    p.add_argument("dest", help="destination file or existing directory")
    p.add_argument(
        "--overwrite", action="store_true", help="replace DEST if it exists (refused otherwise)"
    )
    p.add_argument(
        "-n",
        "--no-clobber",
        action="store_true",
        help="refuse to overwrite (the default; torchtune's flag)",
    )
    p.add_argument("--make-parents", action="store_true", help="create missing parent directories")
    return p


def _source(name: str) -> Path:
    recipe = registry.get_recipe(name.removesuffix(".py"))
    if recipe is not None:
        return registry.recipe_file(recipe)
    config = registry.config_file(name)
    if config is not None:
        return config
    names = [r.name for r in registry.RECIPES] + registry.config_names()
    hint = registry.closest(name, names)
    raise FreetxError(
        f"'{name}' is neither a built-in recipe nor a built-in config"
        + (f" (did you mean '{hint}'?)" if hint else "")
        + ". `freetx ls` lists them."
    )


def main(args: argparse.Namespace) -> int:
    from freetx.user_files import refuse_existing, write_user_file

    src = _source(args.name)
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / src.name
    elif dest.suffix == "":
        dest = dest.with_suffix(src.suffix)
    if dest.suffix != src.suffix:
        raise FreetxError(
            f"{args.name} is a {src.suffix} file but the destination {dest} ends in "
            f"{dest.suffix}; use a {src.suffix} name so it can be run or loaded."
        )
    overwrite = args.overwrite and not args.no_clobber
    refuse_existing(dest, overwrite, "another DEST")
    if not dest.parent.exists():
        if not args.make_parents:
            raise FreetxError(
                f"the directory {dest.parent} does not exist; create it or add --make-parents."
            )
        dest.parent.mkdir(parents=True)
    write_user_file(dest, src.read_bytes(), overwrite, "another DEST")
    print(f"Copied {args.name} to {dest}")
    return 0
