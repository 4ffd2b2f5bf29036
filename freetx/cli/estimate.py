"""`freetx estimate CONFIG [key=value ...] --world-size N [--device h100|h200|a100|rtx4090|cpu]
[--ladder]`: memory per rank and step time of a training config (a decoder's, AD's, a
crosscoder's) for every strategy, before renting GPUs (freetx/planning/estimate.py says
what is counted and what is not); `--ladder`: for the config's strategy, rung by rung of
the memory ladder (freetx/planning/ladder.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from freetx.cli.common import add_trust_option

DEVICE_NAMES = ("h100", "h200", "a100", "rtx4090", "cpu")  # freetx.planning.estimate.DEVICES' keys
# what a preference loss's reference (`PlannedRun.reference`) costs, as the table counts it
REFERENCE_NOTES = {
    "frozen_copy": "a frozen copy of the model in the compute dtype, sharded like the "
    "policy (`reference` column), and one more forward per micro-batch in `step s`",
    "adapters_off": "the base with its adapters disabled: no copy, one more forward per "
    "micro-batch in `step s`",
    "precomputed": "its log-probs computed in one pass over the data before training, "
    "then freed: nothing while training",
}


def build_parser() -> argparse.ArgumentParser:
    from freetx.cli.common import at_least_one, number

    p = argparse.ArgumentParser(prog="freetx estimate", description=__doc__.splitlines()[0])
    p.add_argument("config", help="a built-in config name or a .yaml path")
    p.add_argument("overrides", nargs="*", help="key=value")
    p.add_argument("--world-size", type=at_least_one, default=8)
    p.add_argument("--replicas", type=at_least_one, default=1, help="hsdp: replica groups")
    p.add_argument("--device", choices=DEVICE_NAMES, default="h100")
    p.add_argument(
        "--mfu",
        type=number(float, above=0, at_most=1),
        default=0.4,
        help="the share of peak FLOP/s reached, in (0, 1]",
    )
    p.add_argument("--recipe", help="for a config file outside the built-in ones")
    p.add_argument(
        "--source-dim",
        type=at_least_one,
        metavar="D",
        help="a crosscoder's hooked width, where its source models cannot be read "
        "yet (a run not made) or the hooks are not on the residual stream",
    )
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--measure",
        action="store_true",
        help="also run one step per strategy on fake tensors and a fake process "
        "group, and print what rank 0 held at its peak (seconds per strategy)",
    )
    kind.add_argument(
        "--ladder",
        action="store_true",
        help="for the config's strategy, a row per rung of the memory ladder switched on "
        "(from a baseline with every rung off): device and host memory per rank, step time",
    )
    p.add_argument("--json", metavar="PATH", help="write the figures (bytes) to this file")
    p.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    add_trust_option(p)
    return p


def main(args: argparse.Namespace) -> int:
    import torch

    from freetx.cli.common import load_recipe
    from freetx.config.run_config import load_recipe_config
    from freetx.distributed import StateSharding
    from freetx.errors import ConfigError
    from freetx.models import num_active_parameters
    from freetx.planning.config import estimate_config, planned_run
    from freetx.planning.estimate import DEVICES, GIB, GenerationPhase
    from freetx.planning.measure import measure
    from freetx.registry import recipe_for_config
    from freetx.user_files import refuse_existing, write_user_file

    if args.json:
        refuse_existing(Path(args.json), args.overwrite, "another --json PATH")
    recipe = args.recipe or getattr(recipe_for_config(args.config), "name", None)
    if recipe is None:
        raise ConfigError(f"{args.config} is not a built-in config: give --recipe too.")
    target = load_recipe(recipe)
    cfg = load_recipe_config(args.config, list(args.overrides), target.schema)
    if args.measure and planned_run(cfg).loss is None:
        raise ConfigError(
            f"--measure steps a decoder's token batches; {args.config} is not a decoder config.",
            fix="Leave out --measure: the analytic estimate counts this model.",
        )
    if args.measure and planned_run(cfg).rows_per_sample > 1:
        raise ConfigError(
            f"--measure steps a token loss on one batch of sequences; {args.config} trains on "
            "groups of sequences (preference pairs, or an RL prompt's completions) with a "
            "reference model or a generation phase, which it does not step yet.",
            fix="Leave out --measure: the analytic estimate counts the rows, the reference "
            "and the generation.",
        )
    found = estimate_config(
        cfg, args.world_size, args.device, args.mfu, args.replicas, args.source_dim
    )
    model, micro, seq_len, rows, refused, sources = (
        found.model,
        found.micro,
        found.seq_len,
        found.rows,
        found.refused,
        found.sources,
    )
    dist = cfg.distributed
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    hbm = DEVICES[args.device].memory_gib
    generations = found.planned.generations_per_prompt  # online RL: completions per prompt
    pairs = found.planned.rows_per_sample == 2 and not generations  # preference pairs
    batch = f"{micro} rows" if sources else f"{micro} x {seq_len} tokens"
    batch = f"{micro} pairs x 2 x {seq_len} tokens" if pairs else batch
    if generations:
        batch = f"{micro} prompts x {found.planned.rows_per_sample} completions x {seq_len} tokens"
    active = num_active_parameters(model)
    if active < params:  # a mixture of experts: what one token computes with
        trainable_text = f"{trainable / 1e9:.3f}B trained, {active / 1e9:.3f}B active per token"
    else:
        trainable_text = f"{trainable / 1e9:.3f}B trained"
    shape = found.shapes[0] if found.shapes else None  # the axes are the same in each
    axes = "".join(
        f" x {name} {getattr(shape, name)}"
        for name in ("pp", "cp", "tp", "ep")
        if shape is not None and getattr(shape, name) > 1
    )
    grid = f" as {shape.dp} data-parallel{axes}" if axes else ""
    print(
        f"{args.config}: {params / 1e9:.3f}B parameters ({trainable_text}), "
        f"{args.world_size} x {args.device}{grid}, micro-batch {batch}, "
        f"{dist.mixed_precision.param_dtype}, activation checkpointing "
        f"{dist.activation_checkpointing}, MFU {args.mfu:g}"
    )
    if args.ladder:
        return _print_ladder(cfg, args, hbm)
    measured = {}
    if args.measure and trainable < params:
        raise ConfigError(
            f"--measure cannot step {args.config}: it has frozen parameters (LoRA, QLoRA or "
            "Spectrum), and torch's memory tracker hooks every parameter's gradient.",
            fix="Leave out --measure: the analytic estimate counts adapters, frozen "
            "bases and NF4 weights.",
        )
    if args.measure and shape is not None and (shape.has_axes or shape.ep > 1):
        raise ConfigError(
            "--measure steps the data-parallel strategies on one process; it does not slice "
            "layers over tensor-parallel ranks, sequences over context-parallel ranks or "
            "experts over expert-parallel ones yet.",
            fix="Leave out --measure for distributed.tp, cp, pp or ep > 1 (the analytic "
            "estimate counts them), or measure at tp=1, cp=1, pp=1 and ep=1.",
        )
    if args.measure:  # one step per distinct layout (at world size 1: the plain model, once)
        steps = {}
        for each in found.shapes:
            key = dataclasses.astuple(StateSharding.of(each))[1:] if args.world_size > 1 else ()
            if key not in steps:
                steps[key] = measure(cfg, each)
            measured[each.strategy] = steps[key]
    header = ["strategy", "params", "grads", "optim", "gathered", "activations", "loss"]
    header += ["peak GiB", "fits", "step s", "tokens/s/rank"]
    if measured:
        header[-3:-3] = ["measured peak", "measured activations"]
    harvested = sources is not None and bool(sources.bytes or sources.unread)  # from models
    if harvested:
        header[7:7] = ["sources"]
    copied = found.planned.reference == "frozen_copy"
    if copied:
        header[7:7] = ["reference"]
    if generations:
        header[7:7] = ["generation"]
    hosted = any(r.host for r in rows)  # an offloaded optimizer, offloaded activations
    if hosted:
        header[header.index("peak GiB") + 1 : header.index("peak GiB") + 1] = ["host GiB"]
    table = [header]
    micro_tokens = micro * found.planned.rows_per_sample * seq_len
    for r in rows:
        g = lambda v: f"{v / GIB:.2f}"  # noqa: E731
        fits = "yes" if r.peak / GIB < hbm else "no"
        tokens_per_s = micro_tokens / shape.per_data_rank / r.step_s
        row = [r.strategy, g(r.parameters), g(r.gradients), g(r.optimizer), g(r.gathered)]
        row += [g(r.activations), g(r.loss), g(r.peak), fits, f"{r.step_s:.2f}"]
        row += [f"{tokens_per_s:,.0f}"]
        if measured:
            m = measured[r.strategy]
            row[-3:-3] = [g(m["peak"]), g(m["activations"])]
        if harvested:
            row[7:7] = [g(r.sources)]
        if copied:
            row[7:7] = [g(r.reference)]
        if generations:
            row[7:7] = [g(r.generation)]
        if hosted:
            row[header.index("host GiB") : header.index("host GiB")] = [g(r.host)]
        table.append(row)
    _print_table(table)
    print(
        "(GiB per rank; `gathered`: unsharded blocks and gradient buckets in flight; the "
        "allocator's caching and fragmentation come on top, 5-10% on CUDA)"
    )
    if shape is not None and shape.ep > 1:
        print(
            f"(ep {shape.ep}: each rank computes 1/{shape.ep} of every MoE block's "
            "experts, which FSDP2 shards over the dp / ep x cp ranks of a replica: "
            + ", ".join(f"{r.strategy} {r.expert_states / GIB:.2f} GiB" for r in rows)
            + " of their parameters, gradients and optimizer states per rank, within the "
            f"states above; the tokens' all-to-all {rows[0].all_to_all / GIB:.3f} GiB per "
            "rank and micro-batch, in step s)"
        )
    if hosted:
        print(
            "(host: CPU memory per rank, not in the peak: an offloaded optimizer's states, "
            "fp32 copy and gradients; offloaded activations)"
        )
    if harvested:
        print(
            f"(crosscoder: {sources.num_sources} sources x d {sources.source_dim}; `sources`: "
            f"the source models' weights {sources.weights / GIB:.2f} GiB and one harvesting "
            f"forward {sources.harvest / GIB:.2f} GiB, on every rank)"
        )
        if sources.unread:
            print(
                f"(not counted: the source models {', '.join(sources.unread)}, which cannot "
                "be read yet: their weights come on top)"
            )
    if found.judges:
        print(
            f"(judge rewards: their models' weights {found.judges / GIB:.2f} GiB, gathered "
            "whole while they score (sharded like the policy between scorings under FSDP2), "
            f"within the peak: {', '.join(found.planned.judges)})"
        )
    if generations:
        rows = cfg.batch_size // shape.dp * generations
        phase = GenerationPhase(rows, seq_len, found.planned.engine)
        blocks, size, slots = phase.pool_blocks(model)
        print(
            "(generation: the generation phase, instead of gathered + activations + loss: "
            "every parameter gathered in the compute dtype (sharded strategies), the KV "
            f"cache's pool of {blocks} blocks of {size} tokens for {rows} completions per "
            f"rank in {slots} slots (generation.engine.kv_blocks, .slots) and a step's "
            "logits per slot; peak counts the larger phase)"
        )
    reference = REFERENCE_NOTES.get(found.planned.reference)
    if reference and copied and not generations:  # dpo_fsdp2's other choice
        reference += "; reference.precompute=true frees it after one pass over the data"
    if reference:
        print(f"(reference: {reference})")
    for strategy, reason in refused.items():
        print(f"{strategy}: not estimated, a run would refuse it: {reason}")
    if measured:
        kernels = "CUDA's" if torch.cuda.is_available() else "the CPU's"
        print(
            f"(measured: rank 0's tensors at the peak of a steady training step, on fake "
            f"tensors with {kernels} kernels; activations include temporaries and the loss)"
        )
        if dist.compile:
            print(
                "(measured with the blocks uncompiled: distributed.compile's savings, a few "
                "percent, are not counted)"
            )
    if args.json:
        analytic = {r.strategy: _figures(r) for r in rows}
        figures = json.dumps({"analytic": analytic, "measured": measured})
        write_user_file(Path(args.json), figures, args.overwrite, "another --json PATH")
    return 0


def _figures(row) -> dict:
    """An estimate's row for --json: its figures (bytes), and its peak."""
    return {**dataclasses.asdict(row), "peak": row.peak}


def _print_table(table: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _print_ladder(cfg, args: argparse.Namespace, hbm: float) -> int:
    """The `--ladder` table: a row per rung, ratios to the baseline's (the first row)."""
    from freetx.planning.estimate import DEVICES, GIB
    from freetx.planning.ladder import ladder
    from freetx.user_files import write_user_file

    rungs = ladder(cfg, args.world_size, args.device, args.mfu, args.replicas)
    base = rungs[0].row
    table = [["rung", "peak GiB", "x base", "host GiB", "fits", "step s", "x base"]]
    for rung in rungs:
        r = rung.row
        if r is None:
            table.append([rung.name, "refused"] + [""] * 5)
            continue
        table.append(
            [
                rung.name,
                f"{r.peak / GIB:.2f}",
                f"{r.peak / base.peak:.2f}" if base else "",
                f"{r.host / GIB:.2f}",
                "yes" if r.peak / GIB < hbm else "no",
                f"{r.step_s:.2f}",
                f"{r.step_s / base.step_s:.2f}" if base else "",
            ]
        )
    print(
        f"memory ladder, {cfg.distributed.strategy} on {args.world_size} x {args.device}, "
        "each row adding its rung to those above:"
    )
    _print_table(table)
    print(
        "(GiB per rank: peak on the device, host in CPU memory; baseline: no activation "
        "checkpointing, num_chunks 1, fp32 AdamW; optimizer in backward without "
        "max_grad_norm; float8: tensorwise, devices with float8 matmuls only)"
    )
    for rung in rungs:
        if rung.row is None:
            print(f"{rung.name}: not estimated, a run would refuse it: {rung.refused}")
    if DEVICES[args.device].float8_peak is None:
        print(f"(no float8 row: the {args.device} has no float8 matmuls)")
    if args.json:
        figures = {rung.name: None if rung.row is None else _figures(rung.row) for rung in rungs}
        write_user_file(
            Path(args.json), json.dumps({"ladder": figures}), args.overwrite, "another --json PATH"
        )
    return 0
