"""A 2-process fsdp fine-tune of a tiny folder transformers wrote resumes exactly, for one
folder of each block kind freetx computes natively (Llama 3.2, Qwen3, OLMo 2, Mistral's
window, Qwen3-MoE's experts sharded by FSDP, Gemma 2's soft-capped windowed attention
through the explicit kernel on CPU, Gemma 3, SmolLM3's window and NoPE layers) and each MoE
and hybrid architecture of issue 41 (native DeepSeek-V3 and GLM-4.5; the generic path's
Qwen2-MoE, OLMoE, GPT-OSS, Qwen3.5 and Qwen3.5-MoE): the model built as full_finetune_fsdp2
builds it, on 64-token rows (longer than the folders' windows), saved after step 2 of 4 and
resumed into a fresh model, whose steps 3 and 4 have the straight run's losses bit for bit.
One torchrun launch for all of them (folder_resume_checks.py); each family's run through
the CLI and its export: tests/recipes/test_hf_finetune.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launcher import run_checks
from tests.recipes.test_hf_finetune import EXPORTED_KEYS

NATIVE = list(EXPORTED_KEYS)  # one folder of each block kind freetx computes natively
FAMILIES = [*NATIVE, "deepseek_v3", "qwen2_moe", "qwen3_5_text", "qwen3_5_moe_text", "glm4_moe",
            "olmoe", "gpt_oss"]  # fmt: skip
SCRIPT = Path(__file__).with_name("folder_resume_checks.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_folders import make_folder

    root = tmp_path_factory.mktemp("folder_resume")
    folders = [f"{family}={make_folder(root / family, family)}" for family in FAMILIES]
    return run_checks(SCRIPT, root / "results", 2, *folders, str(root / "saved"))


@pytest.mark.slow  # one launch of 2 processes, 15 models
@pytest.mark.parametrize("family", FAMILIES)
def test_a_2_process_fsdp_finetune_of_each_folder_resumes_with_the_straight_runs_losses(
    results, family
):
    for rank in results:
        got = rank[family]
        print(f"{family}: straight {got['straight']} resumed {got['resumed']}")
        assert got["resumed_from"] == 2
        assert got["resumed"] == got["straight"][2:]  # bit for bit
    assert results[0][family] == results[1][family]  # the losses are over both ranks
