"""The (pp, dp, cp, tp) mesh on 4 gloo processes, one launch per layout: (dp 2, tp 2) here
(tp with sequence parallelism, its default), and in the slow tier (dp 2, cp 2), (pp 2,
dp 2), (dp 2, tp 2) without sequence parallelism, (cp 2, tp 2), (pp 2, dp 2) with
interleaved 1F1B and with GPipe, (pp 2, tp 2) and (pp 2, cp 2), and hsdp's 2 replicas
with tp 2, cp 2 and pp 2. Each gives the same
initial weights, gradients and clipped update as 1 process on the whole batch, for a
dense decoder (tied and untied head; untied under pp) and an MoE one; under tp also
LoRA on every projection (two steps); under cp also sliding-window, soft-capped layers
and DeepSeek-V3's block (latent attention, sigmoid router, shared expert); packed
documents under cp and pp; under pp the
micro-batches of an optimizer step through the stages, and the stages' parameters
together the whole model's."""

from pathlib import Path

import pytest

from tests.distributed.launcher import run_checks

TIGHT = 2e-6  # fp32: differences come only from the order of summation
LAYOUTS = {
    "dp2_tp2": ("--tp", "2"),
    "dp2_tp2_no_sp": ("--tp", "2", "--no-sequence-parallel"),
    "dp2_cp2": ("--cp", "2"),
    "pp2_dp2": ("--pp", "2"),
    "cp2_tp2": ("--cp", "2", "--tp", "2"),
    "pp2_dp2_interleaved": ("--pp", "2", "--schedule", "interleaved_1f1b"),
    "pp2_dp2_gpipe": ("--pp", "2", "--schedule", "gpipe"),
    "pp2_tp2": ("--pp", "2", "--tp", "2"),
    "pp2_cp2": ("--pp", "2", "--cp", "2"),
    # hsdp: 2 replicas as the data-parallel axis, each sharded over the rest of its ranks
    "hsdp2_tp2": ("--replicas", "2", "--tp", "2"),
    "hsdp2_cp2": ("--replicas", "2", "--cp", "2"),
    "pp2_hsdp2": ("--replicas", "2", "--pp", "2"),
}
FAST = ("dp2_tp2",)  # the others: ~15 s each, the slow tier
# [dp, cp, tp(, pp)] of ranks 0..3: the inner axes are the ranks next to each other
AXES = {
    "dp2_tp2": [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]],
    "dp2_cp2": [[0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]],
    "cp2_tp2": [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]],
    "pp2_dp2": [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 1]],
    "pp2_tp2": [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 1, 1]],
    "pp2_cp2": [[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1], [0, 1, 0, 1]],
}
AXES["pp2_dp2_interleaved"] = AXES["pp2_dp2_gpipe"] = AXES["pp2_dp2"]
AXES["dp2_tp2_no_sp"] = AXES["hsdp2_tp2"] = AXES["dp2_tp2"]
AXES["hsdp2_cp2"], AXES["pp2_hsdp2"] = AXES["dp2_cp2"], AXES["pp2_dp2"]


def cases(layout: str) -> list[str]:
    if layout.startswith("pp"):
        runs = ["chunks1/accumulation2", "chunks3/accumulation4", "chunks1/accumulation2/packed"]
        models = ("untied", "moe")
    else:
        runs = ["chunks1/accumulation1", "chunks3/accumulation2"]
        if "cp" in layout:
            runs.append("chunks1/accumulation2/packed")
        models = (
            ("untied", "tied", "moe", "sliding", "mla")
            if layout in ("dp2_cp2", "hsdp2_cp2")
            else ("untied", "tied", "moe")
        )
    return [f"{model}/{run}" for model in models for run in runs]


@pytest.fixture(
    scope="module",
    params=[
        name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS
    ],
)
def layout(request, tmp_path_factory):
    name = request.param
    script = Path(__file__).with_name("mesh_checks.py")
    out = tmp_path_factory.mktemp(name)
    return name, run_checks(script, out, 4, *LAYOUTS[name])


def test_ranks_form_the_mesh(layout):
    """Ranks next to each other hold the same data's parts (cp) or slices (tp); pipeline
    stages are the outermost axis."""
    name, results = layout
    assert [rank["axes"] for rank in results] == AXES[name]


def test_every_layout_trains_as_one_process(layout):
    name, results = layout
    for case in cases(name):
        for rank in results:
            assert rank[f"{case}/init"] == 0.0  # initialized from the full tensors
            assert rank[f"{case}/grad"] < TIGHT, case
            assert rank[f"{case}/param"] < TIGHT, case
            assert rank[f"{case}/loss"] < TIGHT, case  # the loss per token of the last step
            if f"{case}/logits" in rank:  # forward without a loss: the whole logits
                assert rank[f"{case}/logits"] < 1e-5, case
        if name.startswith("pp"):  # each stage holds its part; together the whole model
            held = {n for rank in results for n in rank[f"{case}/held"]}
            assert held == set(results[0][f"{case}/all"]), case
            assert len(results[0][f"{case}/held"]) < len(held)
