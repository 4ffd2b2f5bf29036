"""`freetx cp NAME DEST`: copy a built-in recipe (.py) or config (.yaml) to edit it."""

from __future__ import annotations

import argparse
import re
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


# a config's top-level `output_dir: VALUE`, with any comment after it
_OUTPUT_DIR = re.compile(r"^output_dir:[ \t]*(?P<value>[^#\n]*?)(?P<rest>[ \t]*(#.*)?)$", re.M)


def own_output_dir(text: str, dest: Path) -> tuple[str, str | None]:
    """A copied config's text with its `output_dir` named after the copy (`my.yaml`:
    `runs/my`), so that its runs get their own folder instead of resuming the original's;
    the rest of the file (comments, layout) as it was. The new value, or None when the
    config names no output_dir at the top level."""
    match = _OUTPUT_DIR.search(text)
    if match is None:
        return text, None
    value = f"runs/{dest.stem}"
    start, end = match.span("value")
    return text[:start] + value + text[end:], value


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
    data, output_dir = src.read_bytes(), None
    if src.suffix == ".yaml":
        text, output_dir = own_output_dir(data.decode("utf-8"), dest)
        data = text.encode("utf-8")
    write_user_file(dest, data, overwrite, "another DEST")
    if output_dir is None:
        print(f"Copied {args.name} to {dest}")
    else:
        print(
            f"Copied {args.name} to {dest} with output_dir: {output_dir} (named after the "
            f"copy: its runs get their own folder, not {args.name}'s)"
        )
    return 0
