"""The WandB logger writes a run in wandb's offline mode (no network)."""

from __future__ import annotations

import pytest


def test_wandb_logger_writes_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    from freetx.loggers import WandBLogger

    logger = WandBLogger(str(tmp_path), 10, project="crosscoder-multigpu",
                         name="gpt2_ae32768_gpu{world_size}", mode="offline")  # fmt: skip
    assert not (tmp_path / "wandb").exists()  # nothing before the first record
    logger.log(1, {"loss": 2.5, "l0": 40.0, "note": "text is left out"})
    logger.log(2, {"loss": 2.0})
    assert logger.run.name == "gpt2_ae32768_gpu2"
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
