"""Expert parallelism on 4 gloo processes (ep 2 on 2 in the fast tier): a Qwen3-MoE-
shaped decoder's initial weights, gradients (router loss and gradient accumulation
included), clipped update, loss and logits (and a frozen copy's) equal one process's
under (ep 2 x dp 2), (ep 4), (ep 2 x tp 2), (ep 2 x cp 2), (ep 4, zero2, full
activation checkpointing), (hsdp's 2 replicas x ep 2) and (pp 2 x dp 2, ep 2), each
rank holding E / ep experts; a checkpoint saved at ep 4 resumes at ep 2 and on one
process through the CLI with the straight run's losses."""

import shutil
from pathlib import Path

import pytest

from tests.distributed.launcher import run_checks

TIGHT = 2e-6  # fp32: differences come only from the order of summation
# the experts of a block (of 4) the ranks compute (pp: the second stage has no MoE block)
LAYOUTS = {"ep2_dp2": {2}, "ep4": {1}, "ep2_tp2": {2}, "ep2_cp2": {2}, "ep4_zero2_ac": {1},
           "hsdp2_ep2": {2}, "pp2_ep2": {2, 0}, "ep2_dp2_lora": {2}}  # fmt: skip


SCRIPT = Path(__file__).with_name("expert_parallel_checks.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_checks(SCRIPT, tmp_path_factory.mktemp("expert_parallel"), 4, *LAYOUTS)


def check_layout_results(results: list[dict], layout: str, experts: set[int]) -> None:
    for rank in results:
        assert rank[f"{layout}/init"] == 0.0
        for part in ("grad", "param", "loss", "logits", "frozen_logits"):
            assert rank.get(f"{layout}/{part}", 0.0) < TIGHT, part  # pp: no logits
        if rank[f"{layout}/experts_per_rank"]:
            assert rank[f"{layout}/expert_grad"] > 0  # the experts train
    assert {rank[f"{layout}/experts_per_rank"] for rank in results} == experts


@pytest.mark.slow  # 2 processes, ~13 s on 2 cores: the fast tier is at its 12 minutes
def test_ep2_on_two_processes_repeats_one_process(tmp_path):
    """2 of 4 experts per rank, the whole world one ep group."""
    check_layout_results(run_checks(SCRIPT, tmp_path, 2, "ep2"), "ep2", experts={2})


@pytest.mark.slow  # one launch of 4 processes, 7 layouts: ~30 s on 2 cores
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layouts_repeat_one_process(results, layout):
    check_layout_results(results, layout, LAYOUTS[layout])


@pytest.mark.slow  # 4 runs of a Qwen3-MoE folder (1 or 4 processes): ~1.5 minutes on 2 cores
def test_a_save_at_ep4_resumes_at_ep2_and_on_one_process_with_the_straight_runs_losses(tmp_path):
    """The folder's 4 experts per block: 1 per rank at ep 4, 2 at ep 2 (FSDP2 over the 2
    ranks holding the same ones); one process takes the 4 data-parallel ranks' micro-batches
    one after another (the router loss is a micro-batch's). Saved at step 4 of 8."""
    pytest.importorskip("transformers")
    from tests.hf_folders import RANDOM_WEIGHTS_LR
    from tests.recipes.test_hf_finetune import tiny_folder
    from tests.recipes.test_mesh_finetune import assert_same, losses

    folder = tiny_folder(tmp_path, "qwen3_moe")
    moe = ["--config", "llm/hf_tiny_full", f"model_dir={folder}", RANDOM_WEIGHTS_LR,
           "checkpoint.every_n_steps=4", "dataset.num_builtin_examples=400"]  # fmt: skip
    alone = ["gradient_accumulation_steps=4"]
    straight = losses(tmp_path / "straight", 1, *moe, *alone, "max_steps=8")
    saved = tmp_path / "ep4"
    assert_same(losses(saved, 4, *moe, "max_steps=4", "distributed.ep=4"), straight, range(1, 5))
    for name, nproc, layout in [("ep2", 4, ["distributed.ep=2"]), ("one", 1, alone)]:
        shutil.copytree(saved, tmp_path / name)
        resumed = losses(tmp_path / name, nproc, *moe, "max_steps=8", *layout)
        assert_same(resumed, straight, range(5, 9))
