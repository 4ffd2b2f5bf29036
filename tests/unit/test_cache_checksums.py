"""The caches a run writes and reads again are checksummed: a flipped byte in a precomputed
table (DPO's reference log-probs, KD's teacher top-k) or in an activation cache is refused
with the message a damaged checkpoint gets, and one an earlier freetx wrote without
checksums is made again. (The token cache's and the learning histories' are in
test_token_cache.py and test_darkroom.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from freetx.data import ShardCache
from freetx.data.activations import build_activation_cache
from freetx.data.batch import INPUT_IDS
from freetx.errors import ConfigError, DataError
from freetx.objectives.distillation import TEACHER_FOLDER
from freetx.objectives.precompute import stored_or_computed
from freetx.objectives.reference import REFERENCE_FOLDER
from tests.conftest import flat, flip_byte

ONE_RANK = SimpleNamespace(
    runtime=SimpleNamespace(is_rank_zero=True), groups=SimpleNamespace(barrier=lambda: None)
)


@pytest.mark.parametrize("folder", [REFERENCE_FOLDER, TEACHER_FOLDER])
def test_a_precomputed_table_is_verified_before_it_is_read(tmp_path, folder):
    path = tmp_path / folder / "train.safetensors"
    computed, lines = [], []

    def compute() -> dict[str, torch.Tensor]:
        computed.append(1)
        return {"logps": torch.arange(64.0).view(16, 2, 2)}

    def read() -> dict[str, torch.Tensor]:
        return stored_or_computed(path, "key", compute, ONE_RANK, lines.append, "the table")

    first = read()
    assert torch.equal(read()["logps"], first["logps"]) and len(computed) == 1
    assert lines[-1] == f"the table read from {path}"

    flip_byte(path, at=path.stat().st_size - 5)  # a value, not the header
    with pytest.raises(DataError) as error:
        read()
    assert flat(str(error.value)) == (
        f"cache {path.parent}: train.safetensors is damaged: its bytes differ from what was "
        "saved (its checksum in train.checksums.json does not match), and reading it would give "
        f"wrong values to train on. Delete {path} and run again: it is computed again. If it "
        "happens again, check the disk."
    )
    assert len(computed) == 1  # refused before any work

    path.with_name("train.checksums.json").unlink()  # as an earlier freetx wrote it
    assert torch.equal(read()["logps"], first["logps"]) and len(computed) == 2
    assert f"{path} has no checksums (an earlier freetx wrote it); computing" in lines[-2]
    read()
    assert len(computed) == 2  # read back, verified


def test_an_activation_cache_is_verified_before_it_is_read(tmp_path, capsys):
    cache = ShardCache(tmp_path / "activations")
    sequences = [{INPUT_IDS: torch.arange(8) + i} for i in range(6)]

    def build(settings: dict) -> torch.Tensor:
        return build_activation_cache(
            cache,
            lambda ids: ids.reshape(-1, 1, 1).float().expand(-1, 2, 4),
            sequences, 0, 1, settings, barrier=lambda: None,
        ).rows  # fmt: skip

    rows = build({"a": 1})
    shard = cache.shard_path(0)
    flip_byte(shard, at=shard.stat().st_size - 3)
    with pytest.raises(DataError) as error:
        build({"a": 1})
    assert flat(str(error.value)).startswith(
        f"data cache {cache.folder}: shard_00000.safetensors is damaged: its bytes differ from "
        "what was saved (its checksum in metadata.json does not match)"
    )

    metadata = cache.folder / "metadata.json"
    made = json.loads(metadata.read_text())
    del made["checksums"]  # as an earlier freetx wrote it: made again, settings still checked
    metadata.write_text(json.dumps(made))
    with pytest.raises(ConfigError, match="was made with other settings"):
        build({"a": 2})
    capsys.readouterr()
    assert torch.equal(build({"a": 1}), rows)
    assert (
        "made by an earlier freetx, without checksums; making it again" in capsys.readouterr().err
    )
