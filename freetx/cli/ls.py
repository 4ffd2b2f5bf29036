"""`freetx ls`: the built-in recipes, their configs, and whether they run distributed."""

from __future__ import annotations

import argparse

from freetx import registry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetx ls",
        description="List the built-in recipes, their configs, and whether they run distributed.",
    )
    return p


def main(args: argparse.Namespace) -> int:
    rows = [("RECIPE", "CONFIG", "DISTRIBUTED")]
    for recipe in registry.RECIPES:
        configs = recipe.configs or ("-",)
        for i, config in enumerate(configs):
            first = i == 0
            rows.append(
                (
                    recipe.name if first else "",
                    config,
                    ("yes" if recipe.supports_distributed else "no") if first else "",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0
