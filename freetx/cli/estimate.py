"""`freetx estimate CONFIG [key=value ...] --world-size N [--device h100|a100|cpu]`: memory
per rank and step time of a training config (a decoder's, AD's, a crosscoder's) for every
strategy, before renting GPUs (freetx/training/estimate.py says what is counted and what
is not)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    from freetx.cli.common import at_least_one, number

    p = argparse.ArgumentParser(prog="freetx estimate", description=__doc__.splitlines()[0])
    p.add_argument("config", help="a built-in config name or a .yaml path")
    p.add_argument("overrides", nargs="*", help="key=value")
    p.add_argument("--world-size", type=at_least_one, default=8)
    p.add_argument("--replicas", type=at_least_one, default=1, help="hsdp: replica groups")
    p.add_argument("--device", choices=("h100", "a100", "cpu"), default="h100")
    p.add_argument("--mfu", type=number(float, above=0, at_most=1), default=0.4,
                   help="the share of peak FLOP/s reached, in (0, 1]")  # fmt: skip
    p.add_argument("--recipe", help="for a config file outside the built-in ones")
    p.add_argument("--source-dim", type=at_least_one, metavar="D",
                   help="a crosscoder's hooked width, where its source models cannot be read "
                   "yet (a run not made) or the hooks are not on the residual stream")  # fmt: skip
    p.add_argument(
        "--measure",
        action="store_true",
        help="also run one step per strategy on fake tensors and a fake process "
        "group, and print what rank 0 held at its peak (seconds per strategy)",
    )
    p.add_argument("--json", metavar="PATH", help="write the figures (bytes) to this file")
    p.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    return p


@dataclasses.dataclass
class ConfigEstimate:
    """`estimate_config`'s answer: the meta model, the micro-batch per rank (sequences of
    `seq_len` tokens; a crosscoder's rows: 1), a row per strategy a run would accept, why
    it refuses the rest, and a crosscoder's sources (None for other models)."""

    model: Any
    micro: int
    seq_len: int
    rows: list  # freetx.training.estimate.Estimate
    refused: dict[str, str]
    sources: Any = None  # freetx.training.estimate.ActivationSources
    shapes: list = dataclasses.field(default_factory=list)  # MeshShape, per strategy estimated


def estimate_config(
    cfg: Any,
    world_size: int,
    device: str,
    mfu: float = 0.4,
    replicas: int = 1,
    source_dim: int | None = None,
) -> ConfigEstimate:
    """The analytic estimate of a training config (a schema instance) at `world_size` ranks
    of `device` (a key of freetx.training.estimate.DEVICES), under the run's own checks: a
    batch that does not split refuses it all; a strategy that a run would refuse gets no
    row. A crosscoder's config (`activations:`) is estimated with its source models
    (`activation_sources`; `source_dim`: its hooked width where they cannot be read)."""
    from freetx.data import micro_batch_size
    from freetx.data.activations import ActivationsConfig
    from freetx.distributed import Layout
    from freetx.distributed.parallelize import strategy_shapes
    from freetx.training.checks import dataset_seq_len
    from freetx.training.estimate import (
        activation_sources,
        estimate,
        meta_model,
        pipeline_stage_shapes,
    )

    refuse_untrained(cfg)
    processes = Layout(world_size, device_type="cpu" if device == "cpu" else "cuda")
    # replicas: hsdp's replicate degree (the other strategies ignore it)
    shapes, refused = strategy_shapes(cfg.distributed, processes, replicas)
    data_ranks = shapes[0].dp if shapes else world_size  # a pp x cp x tp group reads one share
    micro = micro_batch_size(cfg.batch_size, data_ranks, cfg.gradient_accumulation_steps)
    sources = None
    if isinstance(getattr(cfg, "activations", None), ActivationsConfig):  # a crosscoder
        sources = activation_sources(cfg.activations, device, source_dim)
        model = meta_model(
            cfg.model, num_sources=sources.num_sources, source_dim=sources.source_dim
        )
        seq_len = 1  # a row is one token's activations
    else:
        model = meta_model(cfg.model, getattr(cfg, "peft", None))
        seq_len = (  # AD's windows: the model's context (n_transit)
            dataset_seq_len(cfg) if hasattr(cfg, "dataset") else model.config.max_seq_len
        )
    dist = cfg.distributed

    def rows_of(part, stage=None):
        return estimate(
            part, shapes, micro * seq_len, seq_len, dist.mixed_precision.param_dtype,
            dist.activation_checkpointing, dist.ac_every_n_blocks, device, mfu,
            sources=sources.bytes if sources else 0.0,
            optimizer_bytes=2.0 if "8bit" in str(cfg.optimizer.get("_component_", "")) else 8.0,
            loss_chunks=loss_chunks(cfg, model), stage=stage,
            sequence_parallel=dist.sequence_parallel and dist.pp == 1,
        )  # fmt: skip

    if dist.pp == 1:
        rows = rows_of(model)
    else:  # the first stage (most micro-batches in flight) or the last (the loss): the fuller
        stages = pipeline_stage_shapes(dist, cfg.gradient_accumulation_steps)
        staged = [rows_of(stage_model(cfg, dist, end), shape)
                  for end, shape in zip(("first", "last"), stages)]  # fmt: skip
        rows = [max(pair, key=lambda r: r.peak) for pair in zip(*staged)]
    return ConfigEstimate(model, micro, seq_len, rows, refused, sources, shapes)


def stage_model(cfg: Any, dist: Any, end: str):
    """The meta model of the pipeline rank holding the first or the last stage."""
    from freetx.distributed.parallelize import find_blocks
    from freetx.distributed.pipeline import check_stages, num_stages, rank_stages, stage_blocks
    from freetx.training.estimate import meta_model

    model = meta_model(cfg.model, getattr(cfg, "peft", None))
    check_stages(model)
    num_blocks = len(find_blocks(model))
    blocks = stage_blocks(num_blocks, num_stages(dist), dist.pp_blocks_per_stage)
    rank = 0 if end == "first" else dist.pp - 1
    mine = [blocks[s] for s in rank_stages(rank, dist.pp, dist.pp_stages_per_rank)]
    model.keep_blocks(sorted(i for stage in mine for i in stage), first=rank == 0,
                      last=mine[-1].stop == num_blocks)  # fmt: skip
    return model


def loss_chunks(cfg: Any, model) -> int:
    """How many chunks of tokens a training config's loss makes the logits in
    (`num_chunks`, or the default by the model's vocabulary)."""
    from freetx.models.output_loss import default_num_chunks

    loss = getattr(cfg, "loss", None)
    chunks = loss.get("num_chunks") if loss is not None else None
    vocab = getattr(model.config, "vocab_size", 0)
    return int(chunks) if chunks else default_num_chunks(vocab)


def refuse_untrained(cfg: Any) -> None:
    """A config without a model or a training batch (generate's) has nothing to estimate."""
    from freetx.errors import ConfigError

    if not hasattr(cfg, "model") or not hasattr(cfg, "batch_size"):
        raise ConfigError(
            "freetx estimate reads training configs (a model and a batch_size); this one "
            "trains nothing.",
            fix="Give a training config: full_finetune_fsdp2, lora_finetune_fsdp2, ad_ddp or "
            "crosscoder_fsdp2's.",
        )


def main(args: argparse.Namespace) -> int:
    import torch

    from freetx.cli.common import load_recipe
    from freetx.config.run_config import load_recipe_config
    from freetx.distributed import ShardLayout
    from freetx.errors import ConfigError
    from freetx.files import refuse_existing, write_user_file
    from freetx.models import num_active_parameters
    from freetx.registry import recipe_for_config
    from freetx.training.estimate import DEVICES, GIB, measure

    if args.json:
        refuse_existing(Path(args.json), args.overwrite, "another --json PATH")
    recipe = args.recipe or getattr(recipe_for_config(args.config), "name", None)
    if recipe is None:
        raise ConfigError(f"{args.config} is not a built-in config: give --recipe too.")
    target = load_recipe(recipe)
    cfg = load_recipe_config(args.config, list(args.overrides), target.schema)
    refuse_untrained(cfg)
    if args.measure and not hasattr(cfg, "dataset"):
        raise ConfigError(
            f"--measure steps a decoder's token batches; {args.config} is not a decoder config.",
            fix="Leave out --measure: the analytic estimate counts this model.",
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
    hbm = DEVICES[args.device][2]
    batch = f"{micro} rows" if sources else f"{micro} x {seq_len} tokens"
    active = num_active_parameters(model)
    if active < params:  # a mixture of experts: what one token computes with
        trainable_text = f"{trainable / 1e9:.3f}B trained, {active / 1e9:.3f}B active per token"
    else:
        trainable_text = f"{trainable / 1e9:.3f}B trained"
    shape = found.shapes[0] if found.shapes else None  # the axes are the same in each
    axes = "".join(f" x {name} {getattr(shape, name)}" for name in ("pp", "cp", "tp")
                   if shape is not None and getattr(shape, name) > 1)  # fmt: skip
    grid = f" as {shape.dp} data-parallel{axes}" if axes else ""
    print(f"{args.config}: {params / 1e9:.3f}B parameters ({trainable_text}), "
          f"{args.world_size} x {args.device}{grid}, micro-batch {batch}, "
          f"{dist.mixed_precision.param_dtype}, activation checkpointing "
          f"{dist.activation_checkpointing}, MFU {args.mfu:g}")  # fmt: skip
    measured = {}
    if args.measure and trainable < params:
        raise ConfigError(
            f"--measure cannot step {args.config}: it has frozen parameters (LoRA, QLoRA or "
            "Spectrum), and torch's memory tracker hooks every parameter's gradient.",
            fix="Leave out --measure: the analytic estimate counts adapters, frozen "
            "bases and NF4 weights.",
        )
    if args.measure and shape is not None and shape.has_axes:
        raise ConfigError(
            "--measure steps the data-parallel strategies on one process; it does not slice "
            "layers over tensor-parallel ranks or sequences over context-parallel ranks yet.",
            fix="Leave out --measure for distributed.tp, cp or pp > 1 (the analytic estimate "
            "counts them), or measure at tp=1, cp=1 and pp=1.",
        )
    if args.measure:  # one step per distinct layout (at world size 1: the plain model, once)
        steps = {}
        for each in found.shapes:
            key = dataclasses.astuple(ShardLayout.of(each))[1:] if args.world_size > 1 else ()
            if key not in steps:
                steps[key] = measure(cfg, each)
            measured[each.strategy] = steps[key]
    header = ["strategy", "params", "grads", "optim", "gathered", "activations", "loss",
              "peak GiB", "fits", "step s", "tokens/s/rank"]  # fmt: skip
    if measured:
        header[-3:-3] = ["measured peak", "measured activations"]
    harvested = sources is not None and bool(sources.bytes or sources.unread)  # from models
    if harvested:
        header[7:7] = ["sources"]
    table = [header]
    for r in rows:
        g = lambda v: f"{v / GIB:.2f}"  # noqa: E731
        row = [r.strategy, g(r.parameters), g(r.gradients), g(r.optimizer), g(r.gathered),
               g(r.activations), g(r.loss), g(r.peak), "yes" if r.peak / GIB < hbm else "no",
               f"{r.step_s:.2f}", f"{micro * seq_len / shape.per_data_rank / r.step_s:,.0f}"]  # fmt: skip
        if measured:
            m = measured[r.strategy]
            row[-3:-3] = [g(m["peak"]), g(m["activations"])]
        if harvested:
            row[7:7] = [g(r.sources)]
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print("(GiB per rank; `gathered`: unsharded blocks and gradient buckets in flight; the "
          "allocator's caching and fragmentation come on top, 5-10% on CUDA)")  # fmt: skip
    if harvested:
        print(f"(crosscoder: {sources.num_sources} sources x d {sources.source_dim}; `sources`: "
              f"the source models' weights {sources.weights / GIB:.2f} GiB and one harvesting "
              f"forward {sources.harvest / GIB:.2f} GiB, on every rank)")  # fmt: skip
        if sources.unread:
            print(f"(not counted: the source models {', '.join(sources.unread)}, which cannot "
                  "be read yet: their weights come on top)")  # fmt: skip
    for strategy, reason in refused.items():
        print(f"{strategy}: not estimated, a run would refuse it: {reason}")
    if measured:
        kernels = "CUDA's" if torch.cuda.is_available() else "the CPU's"
        print(
            f"(measured: rank 0's tensors at the peak of a steady training step, on fake "
            f"tensors with {kernels} kernels; activations include temporaries and the loss)"
        )
    if args.json:
        analytic = {r.strategy: {**dataclasses.asdict(r), "peak": r.peak} for r in rows}
        figures = json.dumps({"analytic": analytic, "measured": measured})
        write_user_file(Path(args.json), figures, args.overwrite, "another --json PATH")
    return 0
