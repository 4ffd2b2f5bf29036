"""An HF folder (sharded, written by transformers) loads on 2 processes under every
strategy with transformers' logits, natively or through the generic transformers path;
under FSDP each rank reads about half the bytes."""

from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_checks
from tests.hf_folders import hf_logits, make_folder

pytest.importorskip("transformers")
SCRIPT = Path(__file__).with_name("hf_checks.py")
STRATEGIES = ["fsdp", "zero2", "hsdp", "ddp", "zero1"]


@pytest.mark.parametrize(
    "family",
    [
        "llama3_2",
        *(
            pytest.param(f, marks=pytest.mark.slow)
            for f in ("qwen2", "qwen3", "olmo2", "granite", "starcoder2", "gemma2", "gemma3_text")
        ),
    ],
)
def test_hf_folder_loads_under_every_strategy(tmp_path, family):
    folder = make_folder(tmp_path / "m", family)
    ranks = run_checks(SCRIPT, tmp_path / "out", 2, str(folder), *STRATEGIES)
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(5))
    expected = hf_logits(folder, ids)
    file_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    for strategy in STRATEGIES:
        for rank in ranks:
            diff = (torch.tensor(rank[strategy]["logits"]) - expected).abs().max().item()
            assert diff < 1e-4, (strategy, diff)
        read = [rank[strategy]["bytes_read"] for rank in ranks]
        if strategy in ("fsdp", "zero2", "hsdp"):  # its half of every tensor (1 x 2 mesh)
            assert all(0.45 * file_bytes < r < 0.55 * file_bytes for r in read), (read, file_bytes)
        else:  # replicated: every rank reads the whole model
            assert all(0.95 * file_bytes < r <= file_bytes for r in read), (read, file_bytes)


def test_a_judge_sharded_like_the_policy_scores_as_the_whole_judge(tmp_path):
    """Held in shares between scorings, whole while it scores (each rank its own number of
    completions), its verdicts those of the whole judge on one process."""
    from freetx.data.corpus import builtin_documents
    from freetx.objectives import Judge
    from tests.distributed.judge_checks import COMPLETIONS, TEMPLATE
    from tests.hf_folders import make_tokenizer

    folder = make_folder(tmp_path / "judge", "llama3_2")
    make_tokenizer(folder, builtin_documents()[:20])
    ranks = run_checks(SCRIPT.with_name("judge_checks.py"), tmp_path / "out", 2, str(folder))
    whole = Judge(str(folder), TEMPLATE)
    whole.place(torch.device("cpu"))
    expected = whole(["What is 2+2?"] * len(COMPLETIONS), COMPLETIONS, [[]] * len(COMPLETIONS))
    total = sum(p.numel() for p in whole.model.parameters())
    for rank, found in enumerate(ranks):
        assert found["scores"] == pytest.approx(expected[: rank + 1], abs=1e-5)
        before, during, after = found["held"]
        assert before == after < 0.6 * total and during == total, found["held"]
