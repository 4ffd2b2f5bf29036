"""`freetx data prepare CONFIG [key=value ...]`: tokenize a config's dataset into the token
cache on this machine (no torchrun), so that runs start by mapping it
(freetx/data/token_cache.py says what is cached, where, and under which key).

`freetx data show CONFIG [N] [key=value ...]`: the first N sequences of the training split
as the model sees them (decoded, the tokens without loss in [brackets], document
boundaries of packed sequences marked; a preference dataset's first N pairs, chosen
and rejected), and what the split is made of (samples ->
sequences, padding), as a run prints it at start-up. `freetx data show FILE [N]`: a data
file's rows, columns, the format they look like and its first N rows (`show_data_file`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from freetx.cli.common import add_trust_option

LEGEND = (
    "legend: [bracketed] text has no loss (masked: prompts, padding, a sequence's first "
    "token); plain text is trained on; ‖ separates the documents packed into one sequence; "
    "[<pad> x N] is N positions of padding"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetx data",
        description=(
            "prepare: build the token cache of CONFIG's dataset (every source of a mixture), "
            "both splits, as the run "
            "would (same key: dataset settings, tokenizer, source contents), printing what it "
            "wrote (rows, tokens, size, time) or that it was already there. The cache folder "
            "is dataset.cache_dir, else $FREETX_CACHE, else ~/.cache/freetx/tokens. "
            "show: the first N (default 3) training sequences as the model sees them, the "
            "tokens without loss in [brackets], and the samples -> sequences summary; for a "
            "data file (show FILE [N]): its rows, columns, format and first N rows. No "
            "process group needed."
        ),
    )
    # a positional with choices keeps options and overrides intermixed
    p.add_argument(
        "action",
        choices=("prepare", "show"),
        help="prepare: tokenize into the cache; show: render training sequences",
    )
    p.add_argument(
        "config", help="a config name (llm/tiny) or a path to a .yaml file (show: or a data file)"
    )
    p.add_argument("overrides", nargs="*", help="show: N first, then key=value or ~key")
    p.add_argument("--recipe", help="for a config file outside the built-in ones")
    add_trust_option(p)
    return p


# the built-in config whose dataset reads rows of each format (`format_of_shape`'s names)
CONFIG_FOR_FORMAT = {"preference": "llm/dpo_tiny", "unpaired": "llm/kto_tiny", "text": "llm/tiny"}
ROW_CHARS = 200  # of a row shown by `show FILE`


def data_file(config: str) -> Path | None:
    """`config` when it names a data file or folder (not a config: no .yaml), else None."""
    path = Path(config).expanduser()
    return path if path.exists() and path.suffix not in (".yaml", ".yml") else None


def show_data_file(path: Path, count: int) -> int:
    """`freetx data show FILE`: what a data file (or folder of them) holds: its rows, their
    columns, the format they look like, the first `count` rows; and the command that shows
    them as a model sees them."""
    import json

    from freetx.data.sources import TEXT_SUFFIX, format_of_shape, format_overrides, read_records

    if path.suffix == TEXT_SUFFIX:  # one document, whole (PackedTextDataset's reading)
        text = path.read_text(encoding="utf-8")
        print(f"{path}: plain text, one document of {len(text):,} characters")
        print("\n".join(text.splitlines()[:count]))
        print(f"\nAs a model sees it: freetx data show llm/tiny dataset.source={path}")
        return 0
    records = list(read_records(str(path), None))
    rows = [r.fields for r in records if r.fields is not None]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print(f"{path}: rows: {len(rows):,}; columns: {', '.join(columns) or 'none'}")
    bad = [r for r in records if r.fields is None]
    if bad:
        print(
            f"unreadable rows: {len(bad):,}, e.g. {bad[0].where} {bad[0].problem} (a run "
            "refuses them; dataset.on_bad_row=skip leaves them out)"
        )
    found = format_of_shape(rows[0]) if rows else None
    overrides = f" {format_overrides(*found)}" if found and found[1] else ""
    if found:
        print(f"format: {found[0]}{overrides and f' (with{overrides})'}")
    else:
        print("format: none of freetx's (set dataset.format and dataset.columns: docs/data.md)")
    for index, row in enumerate(rows[:count]):
        text = json.dumps(row, ensure_ascii=False)
        print(f"{index + 1}: {text[:ROW_CHARS]}{'...' if len(text) > ROW_CHARS else ''}")
    config = CONFIG_FOR_FORMAT.get(found[0] if found else "", "llm/instruct_tiny")
    print(f"\nAs a model sees them: freetx data show {config} dataset.source={path}{overrides}")
    return 0


def _dataset_config(args: argparse.Namespace, overrides: list[str]):
    """The run's config, or None when it has no tokenized dataset (said on stdout)."""
    from freetx.cli.common import load_recipe
    from freetx.config.run_config import load_recipe_config
    from freetx.errors import ConfigError
    from freetx.registry import recipe_for_config

    if data_file(args.config) is not None:  # show's is shown before: prepare's
        raise ConfigError(
            f"{args.config} is a data file, and freetx data prepare tokenizes a config's dataset.",
            fix=f"Give a config whose dataset reads it: freetx data prepare llm/instruct_tiny "
            f"dataset.source={args.config} (`freetx data show {args.config}` says its format).",
        )
    recipe = args.recipe or getattr(recipe_for_config(args.config), "name", None)
    if recipe is None:
        raise ConfigError(
            f"{args.config} is not a built-in config, so freetx cannot tell which recipe's "
            "schema it follows.",
            fix="Add --recipe NAME (the recipe you run it with, e.g. --recipe "
            "full_finetune_fsdp2, or --recipe ./my_recipe.py).",
        )
    cfg = load_recipe_config(args.config, overrides, load_recipe(recipe).schema)
    node = getattr(cfg, "dataset", None)
    if not hasattr(cfg, "tokenizer") or "_component_" not in (node or {}):
        what = "cache" if args.action == "prepare" else "show"
        print(
            f"{args.config}: nothing to {what} (no tokenized dataset: no `dataset` "
            "with a `_component_` and a `tokenizer`)."
        )
        return None
    return cfg


def main(args: argparse.Namespace) -> int:
    if args.action == "show":
        return show(args)
    import time

    from freetx.config import instantiate
    from freetx.data import checked_tokenizer
    from freetx.data.mixture import MadeOfParts
    from freetx.data.token_cache import UsesTokenCache

    cfg = _dataset_config(args, list(args.overrides))
    if cfg is None:
        return 0
    start = time.perf_counter()
    tokenizer = checked_tokenizer(instantiate(cfg.tokenizer))
    # by (part, label): a text dataset's one entry serves both splits
    lines: dict[tuple[int, str], str] = {}
    for split in ("train", "validation"):
        data = instantiate(cfg.dataset, tokenizer=tokenizer, split=split)
        parts = data.parts if isinstance(data, MadeOfParts) else [data]  # a Mixture's sources
        cached = [(i, p) for i, p in enumerate(parts) if isinstance(p, UsesTokenCache)]
        if not cached:
            print(
                f"{args.config}: nothing to cache ({type(data).__name__} keeps no token "
                "cache; its data is made in memory)."
            )
            return 0
        for i, part in cached:
            lines.setdefault((i, part.token_cache.label), part.token_cache.line())
    print("\n".join(lines.values()))
    print(f"{args.config}: done in {time.perf_counter() - start:.1f} s")
    return 0


def _count(overrides: list[str]) -> tuple[int, list[str]]:
    """`show`'s N (the first of the overrides when it is a number; default 3) and the rest."""
    from freetx.errors import ConfigError

    if not overrides or "=" in overrides[0] or overrides[0].startswith("~"):
        return 3, overrides
    if not overrides[0].isdigit() or int(overrides[0]) < 1:
        raise ConfigError(
            f"freetx data show: {overrides[0]!r} is neither a number of sequences (N, at "
            "least 1) nor an override (key=value).",
            fix="Write it as: freetx data show CONFIG [N] [key=value ...], e.g. "
            "freetx data show llm/instruct_tiny 2 dataset.packed=true.",
        )
    return int(overrides[0]), overrides[1:]


def show(args: argparse.Namespace) -> int:
    from freetx.config import instantiate
    from freetx.data import checked_tokenizer
    from freetx.data.mixture import summary_lines

    count, overrides = _count(list(args.overrides))
    path = data_file(args.config)
    if path is not None:
        return show_data_file(path, count)
    cfg = _dataset_config(args, overrides)
    if cfg is None:
        return 0
    tokenizer = checked_tokenizer(instantiate(cfg.tokenizer))
    data = instantiate(cfg.dataset, tokenizer=tokenizer, split="train")
    print(LEGEND)
    shown = min(count, len(data))
    for index in range(shown):
        sample = data[index]
        if isinstance(sample, tuple):  # a preference pair: (chosen, rejected)
            print(f"\n--- pair {index + 1} of {len(data):,} (training split) ---")
            for name, part in zip(("chosen", "rejected"), sample):
                print(f"{name}: {render_sample(part, tokenizer)}")
            continue
        if PROMPT_IDS in sample:  # a prompt (GRPO's): generated from, trained on no token
            print(f"\n--- prompt {index + 1} of {len(data):,} (training split) ---")
            print(render_prompt(sample, tokenizer))
            continue
        print(f"\n--- sequence {index + 1} of {len(data):,} (training split) ---")
        print(render_sample(sample, tokenizer))
    if shown < count:
        unit = "pairs" if shown and isinstance(data[0], tuple) else "sequences"
        unit = "prompts" if shown and PROMPT_IDS in data[0] else unit
        print(f"\n(the training split holds {len(data):,} {unit})")
    print()
    for line in summary_lines(data):
        print(line)
    return 0


def _token_names(tokenizer) -> dict[int, str]:
    """The special tokens by id, as they are shown: their text, else <bos>, <eos>, <pad>."""
    names = {}
    for role in ("pad", "bos", "eos"):  # eos last: a pad that is eos shows as eos
        token = getattr(tokenizer, f"{role}_id", None)
        if token is not None:
            names[int(token)] = tokenizer.decode([token]) or f"<{role}>"
    return names


PROMPT_IDS = "prompt_ids"  # freetx.data.PromptDataset's samples


def render_prompt(sample: dict, tokenizer) -> str:
    """A prompt sample as text: its tokens (all [bracketed]: no loss on a prompt), then the
    row's other fields, which the rewards read."""
    tokens = [(token, False) for token in sample[PROMPT_IDS].tolist()]
    return f"{_spans(tokens, tokenizer, _token_names(tokenizer))}\nfields: {sample['fields']}"


def render_sample(sample: dict, tokenizer) -> str:
    """One token sample as text: each document's tokens (the inputs, then the last label),
    the ones without loss in [brackets], documents separated by ‖, padding counted."""
    from freetx.data.batch import DOCUMENTS, IGNORE_INDEX, INPUT_IDS, LABELS, REAL_TOKENS

    inputs, labels = sample[INPUT_IDS].tolist(), sample[LABELS].tolist()
    real = int(sample[REAL_TOKENS]) if REAL_TOKENS in sample else len(inputs)
    documents = sample[DOCUMENTS].tolist() if DOCUMENTS in sample else [0] * len(inputs)
    names = _token_names(tokenizer)
    pieces: list[str] = []
    start = 0
    while start < real:
        end = start
        while end < real and documents[end] == documents[start]:
            end += 1
        # (token, trained): a document's first token is no label; each next token is the
        # label of the position before it where that is a target, else the next input
        tokens = [(inputs[start], False)]
        for position in range(start, end):
            if labels[position] != IGNORE_INDEX:
                tokens.append((labels[position], True))
            elif position + 1 < end:
                tokens.append((inputs[position + 1], False))
        if pieces:
            pieces.append(" ‖ ")
        pieces.append(_spans(tokens, tokenizer, names))
        start = end
    if real < len(inputs):
        pad = names.get(int(getattr(tokenizer, "pad_id", -1)), "<pad>")
        pieces.append(f"[{pad} x {len(inputs) - real}]")
    return "".join(pieces)


def _spans(tokens: list[tuple[int, bool]], tokenizer, names: dict[int, str]) -> str:
    """Runs of tokens decoded together, the untrained runs in [brackets]."""
    out, run, trained = [], [], None

    def flush() -> None:
        if not run:
            return
        text, plain = [], []
        for token in run + [None]:
            if token is None or token in names:
                if plain:
                    text.append(tokenizer.decode(plain))
                    plain = []
                if token is not None:
                    text.append(names[token])
            else:
                plain.append(token)
        joined = "".join(text)
        out.append(joined if trained else f"[{joined}]")

    for token, is_trained in tokens:
        if is_trained != trained:
            flush()
            run, trained = [], is_trained
        run.append(int(token))
    flush()
    return "".join(out)
