"""4-process checks of expert parallelism (run by test_expert_parallel.py through
torchrun): a Qwen3-MoE-shaped decoder (mesh_checks' "moe": 4 experts, 2 per token, its
router loss) under each layout of `LAYOUTS`, against one process taking the data-parallel
ranks' micro-batches one after another (the router loss is a micro-batch's): the initial
weights, one step's gradients (2 micro-batches per rank: gradient accumulation), the
clipped SGD update (the norm over the experts' 2-D meshes), the loss, the logits in
eval mode and those of a frozen copy (`parallelize_frozen`: a reference model, a
teacher); and how many of a block's experts each rank holds."""

from __future__ import annotations

import sys

import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from freetx.distributed import (
    DistributedConfig,
    build_groups,
    init_distributed,
    parallelize,
    parallelize_frozen,
)
from freetx.distributed.expert_parallel import expert_modules
from freetx.distributed.parameters import materialize
from freetx.models.peft import apply_lora
from tests.distributed.launcher import write_results
from tests.distributed.mesh_checks import MODELS, SEED, batch, build, max_diff, step

LAYOUTS = {
    "ep2": dict(ep=2),  # on 2 processes (the fast tier's)
    "ep2_dp2": dict(ep=2),
    "ep4": dict(ep=4),
    "ep2_tp2": dict(ep=2, tp=2),
    "ep2_cp2": dict(ep=2, cp=2),
    "ep4_zero2_ac": dict(ep=4, strategy="zero2", activation_checkpointing="full"),
    "hsdp2_ep2": dict(ep=2, strategy="hsdp", replicate_degree=2),
    "pp2_ep2": dict(ep=2, pp=2),
    "ep2_dp2_lora": dict(ep=2),  # LoRA on the experts (and attention): adapters spread too
}
ACCUMULATION = 2


def build_case(name: str, layout: dict):
    """The decoder of a layout; `*_lora`: LoRA on the experts and q, v (r 2)."""
    model = build("moe", fields(layout))
    if name.endswith("_lora"):
        apply_lora(model, ["experts", "q", "v"], rank=2, alpha=4)
    return model


def fields(layout: dict) -> dict:
    """The decoder of a layout: with pp, 4 blocks, 2 per stage, the first stage's first
    an MoE block, the others dense (a stage without experts spreads none)."""
    if layout.get("pp", 1) == 1:
        return MODELS["moe"]
    return dict(MODELS["moe"], num_layers=4, mlp_only_layers=[1, 2, 3])


def experts_held(plan, groups) -> int:
    """The experts of the first block this rank computes: its rows of the ep-sharded
    w1, times the ranks FSDP2 shards them over."""
    held = list(expert_modules(plan.module).values())  # a pipeline stage's: maybe none
    if not held or not isinstance(held[0].w1, DTensor):
        return 0
    return held[0].w1.to_local().shape[0] * groups.size("expert_fsdp")


def main() -> None:
    """The layouts named on the command line."""
    runtime = init_distributed("cpu")
    results = {}
    for name in sys.argv[1:]:
        layout = LAYOUTS[name]
        cfg = OmegaConf.structured(DistributedConfig(**layout))
        groups = build_groups(runtime, cfg)
        with torch.device("meta"):
            reference = build_case(name, layout)
        materialize(reference, torch.device("cpu"), SEED)
        want = step(reference.train(), None, 1, ACCUMULATION, False, groups.dp_size)
        with torch.device("meta"):
            model = build_case(name, layout)
        plan = parallelize(model, groups, cfg, seed=SEED, micro_batches=ACCUMULATION)
        got = step(plan.model.train(), plan, 1, ACCUMULATION, False, groups.dp_size)
        for i, part in enumerate(("init", "grad", "param")):
            results[f"{name}/{part}"] = max_diff(got[i], want[i])
        results[f"{name}/loss"] = abs(got[3] - want[3])
        results[f"{name}/experts_per_rank"] = experts_held(plan, groups)
        results[f"{name}/expert_grad"] = sum(
            g.abs().sum().item() for n, g in got[1].items() if ".experts." in n
        )
        if layout.get("pp", 1) > 1 or name.endswith("_lora"):  # pp: the schedule's forward
            continue
        with torch.device("meta"):  # the initial weights, frozen
            frozen, initial = build("moe", MODELS["moe"]), build("moe", MODELS["moe"])
        frozen = parallelize_frozen(frozen, groups, cfg, SEED, init_weights=True)
        materialize(initial, torch.device("cpu"), SEED)
        ids = batch(False)[0][groups.dp_rank :: groups.dp_size]  # each rank its own rows
        with torch.no_grad():
            logits = plan.model.eval()(ids) - reference.eval()(ids)  # after the step
            results[f"{name}/logits"] = logits.abs().max().item()
            logits = frozen(ids) - initial.eval()(ids)
            results[f"{name}/frozen_logits"] = logits.abs().max().item()
    write_results(results)


if __name__ == "__main__":
    main()
