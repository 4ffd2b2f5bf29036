"""`distributed.ep` before any launch: the mesh it makes, every refusal (by `freetx validate`,
`freetx run` and the run alike), what `freetx estimate` counts for it; and the order the
received rows are put in for the local experts."""

from __future__ import annotations

import pytest
import torch

from freetx.distributed import DistributedConfig, MeshShape, Processes, check_distributed
from freetx.distributed.config import strategy_shapes
from freetx.distributed.expert_parallel import expert_major
from freetx.errors import ConfigError
from freetx.models.transformer import decoder
from freetx.planning.estimate import GIB, estimate
from tests.conftest import flat, run_freetx_here

MOE = ["model.num_experts=4", "model.experts_per_token=2"]


def validate_config(config: str, *overrides: str) -> str:
    """`freetx validate CONFIG` with `overrides`: its problem, flattened ('' if none)."""
    result = run_freetx_here("validate", config, *overrides)
    return flat(result.stdout + result.stderr) if result.returncode else ""


def validate(*overrides: str) -> str:
    return validate_config("llm/tiny", *overrides)


def test_ep_borrows_its_ranks_from_the_data_parallel_ones():
    shape = MeshShape.of(DistributedConfig(ep=2), Processes(8))
    assert (shape.world_size, shape.dp, shape.ep, shape.dp_mod_ep, shape.expert_fsdp) == (
        8, 8, 2, 4, 4)  # fmt: skip
    with_axes = MeshShape.of(DistributedConfig(ep=2, cp=2, tp=2), Processes(16))
    # dp 4 = 2 (dp / ep) x 2 (ep); an expert is sharded over dp / ep x cp = 4 ranks
    assert (with_axes.dp, with_axes.dp_mod_ep, with_axes.expert_fsdp) == (4, 2, 4)
    assert with_axes.describe() == "fsdp x cp 2 x tp 2 x ep 2"
    assert MeshShape.of(DistributedConfig(ep=4)).dp == 4  # validate: the smallest world
    # hsdp: ep within each replica's 4 ranks; an expert sharded over the other 2 of them
    hsdp = MeshShape.of(DistributedConfig("hsdp", 2, ep=2), Processes(8))
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp_mod_ep, hsdp.expert_fsdp) == (2, 4, 2, 2)


def test_ep_that_does_not_divide_the_data_parallel_ranks_is_refused():
    with pytest.raises(ConfigError) as refused:
        check_distributed(DistributedConfig(ep=4, tp=2), Processes(4))
    assert "distributed.ep=4 takes its ranks from the data-parallel ones, and does not divide " \
        "the 2 data-parallel rank(s)" in flat(str(refused.value))  # fmt: skip
    assert "run on a multiple of 8 processes" in flat(str(refused.value))


def test_ep_that_does_not_divide_a_replicas_ranks_is_refused():
    with pytest.raises(ConfigError) as refused:
        check_distributed(DistributedConfig("hsdp", 2, ep=4), Processes(4))
    assert "does not divide the 2 data-parallel rank(s) of each of its 2 hsdp replicas" in flat(
        str(refused.value)
    )


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_ep_with_a_replicating_strategy_is_refused(strategy):
    message = validate(*MOE, "distributed.ep=2", f"distributed.strategy={strategy}")
    assert f"it composes with fsdp, zero2 or hsdp, not {strategy}" in message
    assert (
        "Use distributed.strategy=fsdp (or hsdp for replicas), or set distributed.ep=1" in message
    )


def test_ep_that_does_not_divide_the_experts_is_refused():
    message = validate("model.num_experts=6", "distributed.ep=4")
    assert "the model has 6 experts per MoE block, which do not divide into 4" in message
    assert "Pick an ep that divides 6 (2, 3, 6)" in message


def test_ep_on_a_dense_model_is_refused():
    message = validate("distributed.ep=2")
    assert "distributed.ep=2 spreads the experts of MoE blocks over ranks, and the model has " \
        "no native MoE block" in message  # fmt: skip


def test_ep_with_generation_that_differs_between_ranks_is_refused():
    message = validate_config("llm/grpo_tiny", *MOE, "distributed.ep=2")
    assert "distributed.ep=2: the rollouts' generation runs forwards that differ between " \
        "ranks" in message  # fmt: skip
    assert "Set distributed.ep=1 for this run" in message


def test_ep_with_lm_eval_after_training_is_refused_before_the_run():
    message = validate(*MOE, "distributed.ep=2", "eval.after_training=true", "eval.tasks=[t]")
    assert "distributed.ep=2: eval.after_training's lm-eval scoring runs forwards that " \
        "differ between ranks" in message  # fmt: skip


@pytest.mark.parametrize(
    "layout",
    [["distributed.tp=2", "distributed.cp=2"], ["distributed.pp=2", "gradient_accumulation_steps=2"],
     ["distributed.strategy=hsdp", "distributed.replicate_degree=2"]],
    ids=["tp_cp", "pp", "hsdp"],
)  # fmt: skip
def test_ep_that_fits_is_accepted(layout):
    assert validate(*MOE, "distributed.ep=2", *layout) == ""


def moe_estimate(ep: int, checkpointing: str = "none"):
    """fsdp's estimate of a 2-block MoE decoder (hidden 32, 4 experts of 16, top 2) at 4
    ranks, 64 tokens per rank in fp32."""
    with torch.device("meta"):
        model = decoder(vocab_size=64, hidden_dim=32, num_layers=2, num_heads=4,
                        num_kv_heads=2, ffn_hidden_dim=64, moe_ffn_hidden_dim=16,
                        max_seq_len=16, num_experts=4, experts_per_token=2)  # fmt: skip
    cfg = DistributedConfig(ep=ep)
    shapes, _ = strategy_shapes(cfg, Processes(4, device_type="cuda"))
    fsdp = next(s for s in shapes if s.strategy == "fsdp")
    rows = estimate(model, [fsdp], 64, 16, "float32", checkpointing, 1, "h100", 0.4)
    return rows[0]


def test_estimate_counts_the_all_to_all_and_the_experts_states_per_rank():
    plain, spread = moe_estimate(1), moe_estimate(4)
    experts = 2 * 3 * 4 * 16 * 32  # blocks x (w1, w3, w2) x E x F x H elements
    # the same share of every state per rank (1/4 of the experts, each on one rank, as
    # fsdp's 1/4 of each): fp32 masters, their gradients, AdamW's two moments
    assert spread.states == plain.states
    assert spread.expert_states == pytest.approx(experts * (4 + 4 + 8) / 4)
    # a block gathers its one expert of 4: 3 experts' (w1, w3, w2) fewer, in the two
    # blocks gathered at a time (fp32) and the gathered block's gradients
    gathered = plain.gathered - spread.gathered
    assert gathered == pytest.approx((2 * 4 + 4) * 3 * 3 * 16 * 32)
    # 64 tokens x 2 copies x 32 wide x 4 bytes, per block, out and back, forward and
    # backward, 3 of 4 leaving the rank; a recomputed forward adds one pass of 2
    sent = 64 * 2 * 32 * 4 * 2
    assert spread.all_to_all == pytest.approx(2 * 2 * sent * 3 / 4)
    assert moe_estimate(4, "full").all_to_all == pytest.approx(3 * 2 * sent * 3 / 4)
    assert plain.all_to_all == plain.expert_states == 0
    assert spread.expert_states / GIB < spread.states / GIB


def test_freetx_estimate_prints_the_experts_share_and_the_all_to_all():
    result = run_freetx_here("estimate", "llm/tiny", *MOE, "distributed.ep=2", "--world-size", "4")
    assert result.returncode == 0, result.stderr
    out = flat(result.stdout)
    assert "as 4 data-parallel x ep 2" in out
    assert "(ep 2: each rank computes 1/2 of every MoE block's experts" in out
    assert "ddp: not estimated, a run would refuse it: distributed.ep=2" in out


def test_received_rows_are_put_expert_major():
    # from rank 0: 1 row for local expert 0, 2 for expert 1; from rank 1: 3 for expert 0
    incoming = torch.tensor([[1, 2], [3, 0]])
    assert expert_major(incoming).tolist() == [0, 3, 4, 5, 1, 2]
    assert expert_major(torch.zeros(2, 2, dtype=torch.int64)).tolist() == []
