"""The (dp, cp, tp) mesh on 4 gloo processes, one launch per layout: (dp 2, tp 2),
(dp 2, cp 2) and (cp 2, tp 2). Each gives the same initial weights, gradients and
clipped update as 1 process on the whole batch, for a dense decoder (tied and untied
head) and an MoE one; under cp also sliding-window, soft-capped layers and packed
documents."""

from pathlib import Path

import pytest

from tests.distributed.launcher import run_checks

TIGHT = 2e-6  # fp32: differences come only from the order of summation
LAYOUTS = {
    "dp2_tp2": ("--tp", "2"),
    "dp2_cp2": ("--cp", "2"),
    "cp2_tp2": ("--cp", "2", "--tp", "2"),
}
# [dp, cp, tp] of ranks 0..3: the inner axes are the ranks next to each other
AXES = {
    "dp2_tp2": [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]],
    "dp2_cp2": [[0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]],
    "cp2_tp2": [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]],
}
MODELS = {"dp2_tp2": ("untied", "tied", "moe"), "dp2_cp2": ("untied", "tied", "moe", "sliding"),
          "cp2_tp2": ("untied", "tied", "moe")}  # fmt: skip


def cases(layout: str) -> list[str]:
    runs = ["chunks1/accumulation1", "chunks3/accumulation2"]
    if "cp" in layout:
        runs.append("chunks1/accumulation2/packed")
    return [f"{model}/{run}" for model in MODELS[layout] for run in runs]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tmp_path_factory):
    name = request.param
    script = Path(__file__).with_name("mesh_checks.py")
    out = tmp_path_factory.mktemp(name)
    return name, run_checks(script, out, 4, *LAYOUTS[name])


def test_ranks_form_the_mesh(layout):
    """Ranks next to each other hold the same data's parts (cp) or slices (tp)."""
    name, results = layout
    assert [rank["axes"] for rank in results] == AXES[name]


def test_every_layout_trains_as_one_process(layout):
    name, results = layout
    for case in cases(name):
        for rank in results:
            assert rank[f"{case}/init"] == 0.0  # initialized from the full tensors
            assert rank[f"{case}/grad"] < TIGHT, case
            assert rank[f"{case}/param"] < TIGHT, case
