"""Strategies on 2 gloo processes: same init, same gradients and updates as 1 process;
the float16 scaler skips and scales as on 1 process."""

import pytest

from tests.distributed.launcher import run_checks

STRATEGIES = ["fsdp", "zero3", "zero2", "zero1", "ddp", "hsdp2", "hsdp1"]
TIGHT = 2e-6  # fp32: differences come only from the order of summation


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from pathlib import Path

    script = Path(__file__).with_name("parallel_checks.py")
    ranks = run_checks(script, tmp_path_factory.mktemp("parallel"))
    assert ranks[0]["world_size"] == 2
    return ranks


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_initial_weights_match_single_process(results, strategy):
    for rank in results:
        assert rank[f"{strategy}/init"] == 0.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradients_match_single_process_full_batch(results, strategy):
    for rank in results:
        assert rank[f"{strategy}/grad"] < TIGHT


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_update_matches_single_process(results, strategy):
    for rank in results:
        assert rank[f"{strategy}/param"] < 10 * TIGHT


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_accumulation_equals_one_big_batch(results, strategy):
    for rank in results:
        assert rank[f"accumulation/{strategy}/grad"] < TIGHT
        assert rank[f"accumulation/{strategy}/param"] < 10 * TIGHT


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_memory_not_gradients(results, mode):
    for rank in results:
        assert rank[f"ac/{mode}/grad"] < TIGHT
        assert rank[f"ac/{mode}/saved_ratio"] < 0.9


def test_full_checkpointing_saves_more_than_selective(results):
    assert results[0]["ac/full/saved_ratio"] < results[0]["ac/selective/saved_ratio"]


def test_ranks_read_different_samples(results):
    assert results[0]["sampler/overlap"] == 0


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_free_transformer_gradients_match_with_the_latent_path_sharded(results, strategy):
    for rank in results:
        assert rank[f"free_transformer/{strategy}/grad"] < TIGHT
        assert (
            rank[f"free_transformer/{strategy}/latent_grad_norm"] > 1e-3
        )  # the latent path trains


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_algorithm_distillation_gradients_match_single_process(results, strategy):
    for rank in results:
        assert rank[f"ad/{strategy}/grad"] < TIGHT


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_model_without_blocks_is_sharded_whole(results, strategy):
    for rank in results:
        assert rank[f"blockless/{strategy}/grad"] < TIGHT


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_chunked_loss_gives_the_unchunked_gradients_and_update(results, strategy):
    """CrossEntropyLoss(num_chunks=3): the logits a chunk of tokens at a time, gradients
    of the head and the hidden states taken per chunk in forward; 2 micro-batches."""
    for rank in results:
        assert rank[f"chunked/{strategy}/grad"] < TIGHT
        assert rank[f"chunked/{strategy}/param"] < TIGHT


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_chunked_loss_trains_lora_on_the_output_head_as_unchunked(results, method):
    """LoRA adapters on the head (QLoRA: on its NF4 base) get the unchunked gradients."""
    for rank in results:
        assert rank[f"chunked/{method}/grad"] < TIGHT


@pytest.mark.parametrize("method", ["lora", "dora", "spectrum", "qlora"])
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_peft_gradients_of_the_trainable_parameters_match_single_process(results, method, strategy):
    for rank in results:
        assert rank[f"peft/{method}/{strategy}/grad"] < TIGHT
        trainable = rank[f"peft/{method}/{strategy}/trainable"]
        assert trainable == rank[f"peft/{method}/reference_trainable"]
        if method == "spectrum":
            assert trainable == ["layers.1.attention.wq.weight", "layers.2.feed_forward.w2.weight",
                                 "tok_embeddings.weight"]  # fmt: skip
        else:
            assert trainable and all(".lora_" in n for n in trainable)


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "batchtopk"])
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_crosscoder_gradients_and_scales_match_single_process(results, activation, strategy):
    """Loss inside forward on a sharded dictionary (decoder norms on gathered weights),
    BatchTopK's threshold over all ranks' rows, the normalization all-reduced."""
    for rank in results:
        assert rank[f"crosscoder/{activation}/{strategy}/grad"] < 1e-5
        scale = rank[f"crosscoder/{activation}/{strategy}/scale"]
        assert scale == pytest.approx(rank["crosscoder/reference_scale"], rel=1e-6)
    assert (
        results[0][f"crosscoder/{activation}/{strategy}/scale"]
        == (results[1][f"crosscoder/{activation}/{strategy}/scale"])
    )  # bit-identical on every rank


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "ddp"])
def test_float16_scaler_skips_and_scales_like_one_process(results, strategy):
    """An Inf in rank 1's gradient shard only: both ranks skip the step and halve the
    scale, as torch's GradScaler does on one process with the whole gradients; a finite
    round is unscaled exactly and steps to the same parameters."""
    for rank in results:
        assert rank["scaler/reference/scales"] == [32768.0, 32768.0]
        assert rank[f"scaler/{strategy}/scales"] == rank["scaler/reference/scales"]
        assert rank[f"scaler/{strategy}/changed_by_skipped"] == 0.0
        assert rank[f"scaler/{strategy}/unscaled"] == 0.0
        assert rank[f"scaler/{strategy}/params"] == 0.0
