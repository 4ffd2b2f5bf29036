"""The embedding's padding row gets no gradient under FSDP2 on 2 processes, and the
embedding's gradient equals transformers' (tests/unit/test_padding_row.py: one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_checks
from tests.unit.test_padding_row import PAD, batch_with_pads, folder_with_pad, loss

transformers = pytest.importorskip("transformers")
SCRIPT = Path(__file__).with_name("padding_checks.py")


@pytest.mark.slow  # 5-15 s on 2 CPU cores: make test's budget
def test_the_padding_row_gets_no_gradient_under_fsdp_on_2_processes(tmp_path):
    folder = folder_with_pad(tmp_path / "m", "llama3_1_old_layout")  # untied
    ranks = run_checks(SCRIPT, tmp_path / "out", 2, str(folder))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = batch_with_pads()
    loss(theirs.eval()(ids).logits, ids).backward()
    for rank in ranks:
        grad = torch.tensor(rank["grad"])
        assert torch.count_nonzero(grad[PAD]) == 0
        assert (grad - theirs.model.embed_tokens.weight.grad).abs().max().item() <= 1e-5
