"""LR schedules, loss normalization, metrics formatting."""

import pytest
import torch

from freetx.loggers import format_value
from freetx.models import OutputLayer
from freetx.objectives import CrossEntropyLoss
from freetx.training import LRScheduleConfig, lr_multiplier


def shapes(world_size: int, strategy: str | None = None, **axes):
    """The shape of every strategy (or one) on `world_size` CPU processes, for `estimate`."""
    from freetx.distributed import DistributedConfig, Processes
    from freetx.distributed.config import strategy_shapes

    found, _ = strategy_shapes(DistributedConfig(**axes), Processes(world_size, device_type="cuda"))
    return [s for s in found if strategy in (None, s.strategy)]


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_then_decay(decay):
    cfg = LRScheduleConfig(warmup_steps=10, decay=decay, min_lr_ratio=0.1)
    values = [lr_multiplier(s, 110, cfg) for s in range(110)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    if decay == "constant":
        assert values[-1] == 1.0
    else:
        assert values[10] == pytest.approx(1.0)
        assert values[-1] == pytest.approx(0.1, abs=0.02)
        assert all(a >= b for a, b in zip(values[10:], values[11:]))
    if decay == "linear":
        assert values[60] == pytest.approx(0.55)


def test_cross_entropy_is_a_sum_over_unmasked_tokens():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 2, -100], [0, -100, -100]])

    def model(input_ids, output_loss):  # these logits, as a model hands them over
        return output_loss(logits, OutputLayer(lambda h: h, (), 5))

    loss, extra = CrossEntropyLoss()(model, labels, labels)
    per_token = torch.nn.functional.cross_entropy(
        logits.view(-1, 5), labels.view(-1), reduction="none"
    )
    assert torch.allclose(loss, per_token.sum()) and extra == {}


def test_format_value():
    assert format_value(2.34567) == "2.3457"
    assert format_value(12345.6) == "12,346"
    assert format_value(3e-4) == "3.00e-04"
    assert format_value(7) == "7"


def test_slurm_variables_become_torchrun_ones():
    from freetx.distributed.runtime import first_host, slurm_environment

    assert first_host("gpu[03-05,07],cpu1") == "gpu03"
    assert first_host("node7,node8") == "node7"
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "1234",
           "SLURM_JOB_NODELIST": "gpu[10-11]", "SLURM_NTASKS_PER_NODE": "4(x2)"}  # fmt: skip
    assert slurm_environment(env) == {
        "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu10", "MASTER_PORT": "21234",
    }  # fmt: skip
    assert slurm_environment({**env, "RANK": "0"}) == {}  # torchrun's win
    assert slurm_environment({}) == {}


def test_estimate_counts_model_states_exactly_and_lands_near_torchtitan():
    """llm/small's states are exact; Llama-3.1-8B on 8 GPUs (local batch 2 x 8192, bf16,
    selective AC) lands within 15% of torchtitan's published 82.4 GiB for FSDP, whose loss
    makes the logits whole (loss.num_chunks=1); chunked, the loss holds less."""
    import contextlib
    import io

    from freetx.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["estimate", "llm/llama3_8b", "--world-size", "8", "batch_size=16",
                     "gradient_accumulation_steps=1", "dataset.seq_len=8192", "model.max_seq_len=8192",
                     "distributed.activation_checkpointing=selective",
                     "distributed.ac_every_n_blocks=2", "loss.num_chunks=1"]) == 0  # fmt: skip
    fsdp = next(line.split() for line in out.getvalue().splitlines() if line.startswith("fsdp"))
    assert abs(float(fsdp[7]) - 82.4) / 82.4 < 0.15
    chunked = io.StringIO()
    with contextlib.redirect_stdout(chunked):
        assert main(["estimate", "llm/llama3_8b", "--world-size", "8", "batch_size=16",
                     "gradient_accumulation_steps=1", "dataset.seq_len=8192", "model.max_seq_len=8192",
                     "distributed.activation_checkpointing=selective",
                     "distributed.ac_every_n_blocks=2"]) == 0  # fmt: skip
    rows = chunked.getvalue().splitlines()
    assert float(next(r.split() for r in rows if r.startswith("fsdp"))[7]) < float(fsdp[7]) - 10
    import torch

    from freetx.models.transformer import decoder
    from freetx.planning.estimate import estimate

    with torch.device("meta"):
        model = decoder("small", max_seq_len=64)
    params = sum(p.numel() for p in model.parameters())
    rows = {
        r.strategy: r for r in estimate(model, shapes(2), 32, 32, "float32", "none", 2, "cpu", 0.4)
    }
    assert rows["ddp"].parameters == rows["ddp"].gradients == params * 4
    assert rows["ddp"].optimizer == params * 8 and rows["zero1"].optimizer == params * 4
    assert rows["fsdp"].parameters == params * 2 and rows["fsdp"].optimizer == params * 4


def test_estimate_counts_the_scores_the_explicit_attention_keeps():
    """Soft-capped attention on CPU keeps each token's row of seq_len scores per head and
    layer (tanh output, weights, fp32 softmax); on CUDA compiled FlexAttention keeps none."""
    import torch

    from freetx.models.transformer import decoder
    from freetx.planning.estimate import estimate

    def activations(device, **fields):
        with torch.device("meta"):
            model = decoder("tiny", max_seq_len=64, **fields)
        return estimate(model, shapes(2), 128, 64, "float32", "none", 2, device, 0.4)[0].activations

    capped = {"attn_logit_softcap": 50.0}
    layers, heads = 4, 6  # the tiny preset's
    assert activations("cpu", **capped) - activations("cpu") == 128 * layers * heads * 64 * 12
    assert activations("h100", **capped) == activations("h100")
    assert activations("h100", attention_dropout=0.1, **capped) > activations("h100")


def test_estimate_refuses_a_model_that_does_not_count_its_activations():
    """Each model answers its own activation bytes (`EstimatesActivations`): the estimate
    reads no model's config, and refuses a model without the hook in one paragraph."""
    from freetx.errors import ConfigError
    from freetx.planning.estimate import estimate

    class Plain(torch.nn.Module):
        block_types = ()

        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    with pytest.raises(ConfigError, match="cannot count its activations"):
        estimate(Plain(), shapes(2), 8, 8, "float32", "none", 1, "cpu", 0.4)


MOE_TINY = ["model.num_experts=4", "model.experts_per_token=2"]


@pytest.mark.parametrize(
    "model", [[], pytest.param(MOE_TINY, marks=pytest.mark.slow)], ids=["dense", "moe"]
)
def test_estimate_measure_runs_a_fake_step_per_strategy(tmp_path, model):
    """`--measure` on llm/tiny at 2 ranks: one step per strategy on fake tensors and a fake
    process group. What rank 0 holds matches the analytic model states (FSDP2 pads uneven
    shards: within 0.1%), and the peaks agree within 15%. With experts too: a fake
    router's choices hold no values, so the experts' rows are split evenly."""
    import contextlib
    import io
    import json

    import torch.distributed as dist

    from freetx.cli.main import main

    path = tmp_path / "estimate.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["estimate", "llm/tiny", *model, "--world-size", "2", "--device", "cpu",
                     "--measure", "--json", str(path)]) == 0  # fmt: skip
    assert not dist.is_initialized()  # the fake group is gone
    figures = json.loads(path.read_text())
    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        analytic, measured = figures["analytic"][strategy], figures["measured"][strategy]
        for column in ("parameters", "optimizer"):
            assert abs(measured[column] - analytic[column]) / analytic[column] < 1e-3, strategy
        assert abs(measured["peak"] - analytic["peak"]) / measured["peak"] < 0.15, strategy
    assert figures["measured"]["fsdp"]["parameters"] < figures["measured"]["ddp"]["parameters"]


def test_estimate_measure_refuses_frozen_parameters_with_a_message():
    from tests.conftest import flat, run_freetx_here

    result = run_freetx_here("estimate", "llm/lora_tiny", "--world-size", "2", "--measure")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "frozen parameters" in flat(result.stderr) and "Leave out --measure" in flat(
        result.stderr
    )


def test_a_logged_window_without_loss_tokens_logs_zero_not_a_division_by_zero():
    from freetx.distributed import DistributedRuntime, ParallelGroups
    from freetx.training.meters import ThroughputMeter, train_step_metrics

    groups = ParallelGroups(DistributedRuntime(0, 0, 1, torch.device("cpu")))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), lambda step: 1.0
    )
    metrics = train_step_metrics(
        groups, {"loss": torch.zeros(())}, 0, 1.0, scheduler, ThroughputMeter(1.0, 1, None)
    )
    assert metrics["loss"] == 0.0


def test_time_spent_apart_is_left_out_of_step_time_and_throughput(monkeypatch):
    """An evaluation and a save between two logged steps: step time, tokens/s and MFU are
    the steps' alone; the time apart is logged as time/eval and time/checkpoint."""
    from freetx.training import meters

    now = [0.0]
    monkeypatch.setattr(meters.time, "perf_counter", lambda: now[0])
    meter = meters.ThroughputMeter(flops_per_token=2.0, world_size=1, peak=100.0)
    for _ in range(2):  # two steps of 1 s, 10 tokens each
        now[0] += 1.0
        meter.update(10)
    with meter.apart("eval"):
        now[0] += 90.0
    with meter.apart("checkpoint"):
        now[0] += 5.0
    metrics = meter.read()
    assert metrics["step_time_s"] == 1.0 and metrics["tokens_per_s"] == 10.0
    assert metrics["mfu_pct"] == 20.0
    assert metrics["time/eval"] == 90.0 and metrics["time/checkpoint"] == 5.0
    now[0] += 2.0
    meter.update(10)
    assert "time/eval" not in (later := meter.read()) and later["step_time_s"] == 2.0


def test_a_frozen_weight_counts_4_flops_per_token_and_a_trained_one_6():
    """MFU's FLOPs: a model that trains everything counts its own figure; with its weights
    frozen but an adapter's (LoRA), 6 per trained and 4 per frozen non-embedding weight,
    attention's FLOPs unchanged."""
    from freetx.models import training_flops_per_token
    from freetx.models.peft import PEFTConfig, apply_peft
    from freetx.models.transformer import decoder

    model = decoder("tiny", max_seq_len=64)
    attention = model.flops_per_token(64) - model.flops_per_token(0)
    assert training_flops_per_token(model, 64) == model.flops_per_token(64)
    apply_peft(model, PEFTConfig(method="lora", rank=2, target_modules=["q", "v"]))
    embedding = model.tok_embeddings.weight
    weights = [p for p in model.parameters() if p is not embedding]
    trained = sum(p.numel() for p in weights if p.requires_grad)
    frozen = sum(p.numel() for p in weights if not p.requires_grad)
    assert trained and frozen > 10 * trained
    expected = 6 * trained + 4 * frozen + attention
    assert training_flops_per_token(model, 64) == pytest.approx(expected, rel=1e-3)


def test_estimate_divides_the_sliced_layers_and_their_activations_by_tp():
    """At the same world size, fsdp x tp 2 holds what fsdp holds (each slice sharded over
    half the ranks), keeps less of each token's activations, and adds tp's sums to the
    step; the norms' weights stay whole."""
    import torch

    from freetx.errors import ConfigError
    from freetx.models.transformer import decoder
    from freetx.planning.estimate import estimate

    with torch.device("meta"):
        model = decoder("llama3_8b")
    args = (2 * 8192, 8192, "bfloat16", "none", 2, "h100", 0.4)
    fsdp = estimate(model, shapes(8, "fsdp"), *args)[0]
    sliced = estimate(model, shapes(8, "fsdp", tp=2), *args)[0]
    assert abs(sliced.parameters - fsdp.parameters) / fsdp.parameters < 1e-3
    assert sliced.activations < 0.75 * fsdp.activations
    assert sliced.compute_s == fsdp.compute_s / 2 and sliced.step_s > sliced.compute_s  # + sums
    with torch.device("meta"):
        free = __import__("freetx.models.free_transformer", fromlist=["x"]).free_transformer(
            preset="tiny"
        )
    with pytest.raises(ConfigError, match="tp=1"):
        estimate(free, shapes(8, "fsdp", tp=2), 512, 256, "float32", "none", 2, "cpu", 0.4)


def test_estimate_counts_a_context_shard_and_a_pipeline_stage():
    """cp 2: half the tokens' activations per rank (the keys and values whole), the
    gathers added to the step; pp 2, 1F1B over 4 micro-batches: the first stage holds
    half the blocks for 2 micro-batches at once, no loss; the last its head and loss;
    each does half the work, stretched by the bubble (1/4)."""
    import torch

    from freetx.distributed import DistributedConfig
    from freetx.models.transformer import decoder
    from freetx.planning.estimate import estimate, pipeline_stage_shapes

    with torch.device("meta"):
        model, first, last = (decoder("llama3_8b", tie_embeddings=False) for _ in range(3))
    args = (8192, 8192, "bfloat16", "none", 2, "h100", 0.4)
    whole = estimate(model, shapes(8, "fsdp"), *args)[0]
    split = estimate(model, shapes(8, "fsdp", cp=2), *args)[0]
    assert 0.5 * whole.activations < split.activations < 0.6 * whole.activations
    assert split.compute_s == whole.compute_s / 2 and split.step_s > split.compute_s
    stages = pipeline_stage_shapes(DistributedConfig(pp=2), micro_batches=4)
    first.keep_blocks(list(range(16)), first=True, last=False)
    last.keep_blocks(list(range(16, 32)), first=False, last=True)
    head, tail = (estimate(m, shapes(8, "fsdp", pp=2), *args, stage=s)[0]
                  for m, s in zip((first, last), stages))  # fmt: skip
    assert head.loss == 0 and tail.loss == whole.loss
    assert head.activations == whole.activations  # half the blocks, 2 micro-batches
    assert tail.activations == whole.activations / 2
    assert head.compute_s == whole.compute_s / 2 * (1 + 1 / 4)
