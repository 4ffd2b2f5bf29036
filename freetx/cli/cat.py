"""`freetx cat CONFIG [overrides]`: print a config with overrides applied and resolved."""

from __future__ import annotations

import argparse

from freetx.cli.common import add_trust_option


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetx cat",
        description="Print a config (built-in name or path) with overrides applied, resolved.",
    )
    p.add_argument("config", help="a config name (llm/tiny) or a path to a .yaml file")
    p.add_argument("overrides", nargs="*", help="key=value or ~key")
    add_trust_option(p)
    return p


def main(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from freetx.config import compose

    cfg = compose(args.config, args.overrides)
    print(OmegaConf.to_yaml(cfg, resolve=True), end="")
    return 0
