"""`freetx spectrum scan --nproc-per-node 2`: the matrices split over two processes (the
scores gathered through freetx.distributed) score as in one process (to the rounding of
a different thread count) and select the same modules."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from freetx.distributed import materialize
from freetx.models.transformer import decoder
from tests.conftest import run_freetx


@pytest.mark.slow  # two scans, 1 and 2 processes: 10 s
def test_two_processes_score_what_one_does(tmp_path):
    with torch.device("meta"):
        model = decoder("tiny", vocab_size=259, max_seq_len=64)
    materialize(model, torch.device("cpu"), seed=0)
    weights = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    scores = {}
    for nproc in ("1", "2"):
        result = run_freetx("spectrum", "scan", str(weights), "--nproc-per-node", nproc,
                            "--rescan", "-o", str(tmp_path / f"selection_{nproc}.yaml"))  # fmt: skip
        assert result.returncode == 0, result.stderr
        scores[nproc] = json.loads((tmp_path / "spectrum_scores.json").read_text())["scores"]
    assert scores["1"] and scores["1"].keys() == scores["2"].keys()
    for name, one in scores["1"].items():  # 1 vs 2 threads per process: rounding differs
        assert one == pytest.approx(scores["2"][name], rel=1e-5), name
    assert (tmp_path / "selection_1.yaml").read_text() == (
        tmp_path / "selection_2.yaml"
    ).read_text()
