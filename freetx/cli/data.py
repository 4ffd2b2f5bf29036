"""`freetx data prepare CONFIG [key=value ...]`: tokenize a config's dataset into the token
cache on this machine (no torchrun), so that runs start by mapping it
(freetx/data/token_cache.py says what is cached, where, and under which key)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetx data",
        description=(
            "prepare: build the token cache of CONFIG's dataset (every source of a mixture), "
            "both splits, as the run "
            "would (same key: dataset settings, tokenizer, source contents), printing what it "
            "wrote (rows, tokens, size, time) or that it was already there. The cache folder "
            "is dataset.cache_dir, else $FREETX_CACHE, else ~/.cache/freetx/tokens. No "
            "process group needed."
        ),
    )
    # one action today; a positional with choices keeps options and overrides intermixed
    p.add_argument("action", choices=("prepare",), help="prepare: tokenize into the cache")
    p.add_argument("config", help="a config name (llm/tiny) or a path to a .yaml file")
    p.add_argument("overrides", nargs="*", help="key=value or ~key")
    p.add_argument("--recipe", help="for a config file outside the built-in ones")
    return p


def main(args: argparse.Namespace) -> int:
    import time

    from freetx.cli.common import load_recipe
    from freetx.config import instantiate
    from freetx.config.run_config import load_recipe_config
    from freetx.data import checked_tokenizer
    from freetx.data.mixture import MadeOfParts
    from freetx.data.token_cache import UsesTokenCache
    from freetx.errors import ConfigError
    from freetx.registry import recipe_for_config

    recipe = args.recipe or getattr(recipe_for_config(args.config), "name", None)
    if recipe is None:
        raise ConfigError(f"{args.config} is not a built-in config: give --recipe too.")
    cfg = load_recipe_config(args.config, list(args.overrides), load_recipe(recipe).schema)
    node = getattr(cfg, "dataset", None)
    if not hasattr(cfg, "tokenizer") or "_component_" not in (node or {}):
        print(f"{args.config}: nothing to cache (no tokenized dataset: no `dataset` with a "
              "`_component_` and a `tokenizer`).")  # fmt: skip
        return 0
    start = time.perf_counter()
    tokenizer = checked_tokenizer(instantiate(cfg.tokenizer))
    # by (part, label): a text dataset's one entry serves both splits
    lines: dict[tuple[int, str], str] = {}
    for split in ("train", "validation"):
        data = instantiate(node, tokenizer=tokenizer, split=split)
        parts = data.parts if isinstance(data, MadeOfParts) else [data]  # a Mixture's sources
        cached = [(i, p) for i, p in enumerate(parts) if isinstance(p, UsesTokenCache)]
        if not cached:
            print(f"{args.config}: nothing to cache ({type(data).__name__} keeps no token "
                  "cache; its data is made in memory).")  # fmt: skip
            return 0
        for i, part in cached:
            lines.setdefault((i, part.token_cache.label), part.token_cache.line())
    print("\n".join(lines.values()))
    print(f"{args.config}: done in {time.perf_counter() - start:.1f} s")
    return 0
