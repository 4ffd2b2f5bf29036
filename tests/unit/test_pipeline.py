"""Pipeline parallelism's pieces on one process: how blocks split into stages and which
rank holds which, the schedule's rules for micro-batches, a model pruned to its stages
(names kept, the whole model's counts), and the refusals made before any work."""

from __future__ import annotations

import pytest
import torch

from freetx.distributed import DistributedConfig
from freetx.distributed.pipeline import (
    check_micro_batches,
    check_stages,
    rank_stages,
    stage_blocks,
)
from freetx.errors import ConfigError
from freetx.models.decoder.layers import HeldElsewhere
from freetx.models.free_transformer import FreeTransformer
from freetx.models.transformer import decoder


def test_blocks_split_evenly_with_the_rest_in_the_middle_stages():
    assert stage_blocks(8, 2) == [range(0, 4), range(4, 8)]
    assert [len(s) for s in stage_blocks(10, 4)] == [2, 3, 3, 2]
    assert [len(s) for s in stage_blocks(32, 6)] == [5, 5, 6, 6, 5, 5]
    assert stage_blocks(5, 2, [2, 3]) == [range(0, 2), range(2, 5)]


@pytest.mark.parametrize(
    "blocks,stages,given,wanted",
    [(2, 4, None, "makes 4 pipeline stages, and the model has 2 blocks"),
     (6, 2, [2, 3], "gives 5 blocks, and the model has 6"),
     (6, 2, [0, 6], "at least one")],
)  # fmt: skip
def test_a_split_that_leaves_a_stage_empty_is_refused(blocks, stages, given, wanted):
    with pytest.raises(ConfigError, match=wanted):
        stage_blocks(blocks, stages, given)


def test_ranks_hold_stages_in_a_loop():
    assert rank_stages(0, 2, 1) == [0] and rank_stages(1, 2, 1) == [1]
    assert rank_stages(1, 4, 2) == [1, 5]  # interleaved: rank r holds r, r + pp


@pytest.mark.parametrize(
    "schedule,per_rank,micro,ok",
    [("1f1b", 1, 2, True), ("1f1b", 1, 1, False), ("gpipe", 1, 1, True),
     ("interleaved_1f1b", 2, 4, True), ("interleaved_1f1b", 2, 1, True),
     ("interleaved_1f1b", 2, 5, False)],
)  # fmt: skip
def test_the_schedule_takes_the_micro_batches_torch_allows(schedule, per_rank, micro, ok):
    cfg = DistributedConfig(pp=2, pp_schedule=schedule, pp_stages_per_rank=per_rank)
    if ok:
        check_micro_batches(cfg, micro)
    else:
        with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
            check_micro_batches(cfg, micro)


def test_a_pruned_model_keeps_its_names_and_the_whole_models_counts():
    fields = dict(vocab_size=64, hidden_dim=16, num_layers=4, num_heads=2, num_kv_heads=1,
                  ffn_hidden_dim=32, max_seq_len=16, tie_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        whole, stage = decoder(**fields), decoder(**fields)
    stage.keep_blocks([2, 3], first=False, last=True)
    names = {n for n, _ in stage.named_parameters()}
    assert names and names < {n for n, _ in whole.named_parameters()}
    assert all(n.startswith(("layers.2.", "layers.3.", "norm.", "output.")) for n in names)
    assert isinstance(stage.layers[0], HeldElsewhere) and stage.tok_embeddings is None
    assert stage.held_blocks() == [2, 3]
    assert stage.num_parameters() == whole.num_parameters()
    assert stage.flops_per_token(16) == whole.flops_per_token(16)


def test_a_tied_head_and_models_without_stages_are_refused():
    with torch.device("meta"):
        tied = decoder("tiny")
    with pytest.raises(ConfigError, match="ties its head to its embedding") as error:
        tied.keep_blocks([0, 1], first=True, last=False)
    assert "model.tie_embeddings=false" in str(error.value)
    with pytest.raises(ConfigError, match="cannot be split into pipeline stages"):
        check_stages(FreeTransformer)
