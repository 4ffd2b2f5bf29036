"""Issue 36, `freetx estimate --measure` and the audit's weak cases of this part: the
documented llama3_8b line (compile: true, the chunked loss on fake tensors)."""

from __future__ import annotations

import pytest
import torch

from freetx.models.chunked_loss import ChunkedCrossEntropy, chunk_bounds
from tests.conftest import run_freetx_here

# llm/llama3_8b's keys at a tiny shape: its `compile: true`, fsdp, its 8-chunk loss
_SMALL_LLAMA = (
    "model.hidden_dim=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.vocab_size=512", "model.max_seq_len=64", "loss.num_chunks=8", "batch_size=4",
    "gradient_accumulation_steps=1", "dataset.seq_len=32",
)  # fmt: skip


def test_estimate_llama3_8b_measure_with_compile_true_runs():
    result = run_freetx_here(
        "estimate", "llm/llama3_8b", "--world-size", "1", *_SMALL_LLAMA,
        "distributed.activation_checkpointing=selective", "distributed.ac_every_n_blocks=2",
        "--measure",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "measured peak" in result.stdout
    assert "blocks uncompiled" in result.stdout  # the config's compile: true, said


@pytest.mark.slow
def test_estimate_llama3_8b_measure_without_compile_runs():
    result = run_freetx_here(
        "estimate", "llm/llama3_8b", "--world-size", "2", *_SMALL_LLAMA,
        "distributed.compile=false", "--measure",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "measured peak" in result.stdout
    assert "uncompiled" not in result.stdout


def test_chunked_loss_runs_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from freetx.models.protocol import OutputLayer

    with FakeTensorMode():
        weight = torch.randn(50, 8, requires_grad=True)
        hidden = torch.randn(2, 7, 8, requires_grad=True)
        labels = torch.randint(0, 50, (2, 7))
        layer = OutputLayer(lambda h: h @ weight.T, [weight], 50, None)
        total, _ = ChunkedCrossEntropy(labels, num_chunks=3)(hidden, layer)
        total.backward()
        assert weight.grad.shape == weight.shape and hidden.grad.shape == hidden.shape


def test_chunk_bounds_are_tensor_splits():
    for n, chunks in [(14, 3), (5, 8), (16, 4), (1, 1)]:
        splits = torch.arange(n).tensor_split(chunks)
        expected = [(int(s[0]), int(s[-1]) + 1) for s in splits if s.numel()]
        assert chunk_bounds(n, chunks) == expected


# -- warnings: torch's deprecated collectives, torchao's enums -----------------------------


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_cp_collectives_emit_no_future_warning(collective):
    """llm/tiny_cp printed torch's `reduce_scatter_tensor` FutureWarning once per rank."""
    import warnings

    from freetx.distributed import DistributedRuntime, MeshShape, ParallelGroups, fake_world

    with fake_world(2):
        runtime = DistributedRuntime(0, 0, 2, torch.device("cpu"))
        groups = ParallelGroups(runtime, MeshShape("ddp", dp_replicate=2), {})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning of the call fails the test
            if collective == "reduce_scatter":
                assert groups.reduce_scatter(torch.zeros(2, 3)).shape == (3,)
            else:
                assert groups.all_gather(torch.zeros(3)).shape == (2, 3)


@pytest.mark.parametrize("name", ["ScaleCalculationMode", "KernelPreference"])
def test_generic_path_prints_no_torchao_deprecation_line(name):
    """transformers imports torchao on every generic-path run, and torchao registers its
    enums with pytree (`torchao.utils.register_as_pytree_constant`), which torch logs as
    deprecated: freetx's filter drops that record for these two enums, and nothing else."""
    import enum
    import logging

    from freetx.noise import quiet_known_noise

    quiet_known_noise()
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger, handler = logging.getLogger("torch.utils._pytree"), Keep()
    logger.addHandler(handler)
    try:
        torchao_enum = enum.Enum(name, "A B", type=str)  # torchao's enum, as torchao registers it
        torch.utils._pytree.register_constant(torchao_enum)
        other = enum.Enum("SomeoneElsesEnum", "A B", type=str)  # not torchao's: still shown
        torch.utils._pytree.register_constant(other)
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 1 and "SomeoneElsesEnum" in seen[0], seen


# -- an int32 embedding in an HF folder ---------------------------------------------------


def test_an_int32_embedding_in_an_hf_folder_is_refused_naming_tensor_dtype_and_file(tmp_path):
    from safetensors.torch import load_file, save_file

    from freetx.checkpoint import load_model
    from freetx.errors import CheckpointError
    from tests.hf_folders import make_folder

    folder = make_folder(tmp_path / "llama", "llama_head_dim")
    file = folder / "model.safetensors"
    tensors = load_file(file)
    name = "model.embed_tokens.weight"
    tensors[name] = (tensors[name] * 100).to(torch.int32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as error:
        load_model(folder, "cpu")
    message = " ".join(str(error.value).split())
    assert f"{name} in {file} is torch.int32" in message
    assert "floating-point weights" in message  # the fix
    assert "\n\n" not in str(error.value)


# -- spectrum: cached scores of other weights ---------------------------------------------


def _tiny_weights(path, seed: int):
    from safetensors.torch import save_file

    from freetx.distributed import materialize
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model = decoder("tiny", vocab_size=64, max_seq_len=16, num_layers=1)
    materialize(model, torch.device("cpu"), seed=seed)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def test_spectrum_scores_of_earlier_weights_are_not_reused_after_the_model_trained_on(tmp_path):
    import json

    weights, cache = tmp_path / "model.safetensors", tmp_path / "spectrum_scores.json"
    _tiny_weights(weights, seed=0)

    def scan(top: str):
        out = tmp_path / f"top{top}.yaml"
        result = run_freetx_here("spectrum", "scan", str(weights), "--top-percent", top, "-o", str(out))  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout, json.loads(cache.read_text())["scores"]

    _, first = scan("25")
    out, again = scan("50")  # the same weights: the cache serves
    assert "reusing the scores" in out and again == first
    _tiny_weights(weights, seed=1)  # trained on: other weights in the same file
    out, fresh = scan("75")
    assert "reusing" not in out and "scanning again" in out
    assert fresh != first
    out, _ = scan("10")
    assert "reusing the scores" in out  # keyed by the new weights now


# -- crosscoder analyze: every source, rounded figures ------------------------------------


def _crosscoder(path, sources: int):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    m, d = 16, 4
    decoder = torch.randn(m, sources, d, generator=g)
    save_file({"W_dec": decoder, "W_enc": torch.randn(m, sources, d, generator=g),
               "b_enc": torch.zeros(m), "b_dec": torch.zeros(sources, d)}, str(path))  # fmt: skip
    return path


def test_crosscoder_analyze_compares_every_source_and_prints_rounded_cosines(tmp_path):
    import json
    import re

    crosscoder, out = _crosscoder(tmp_path / "cc.safetensors", 3), tmp_path / "analysis"
    result = run_freetx_here("crosscoder", "analyze", str(crosscoder), "-o", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 sources: each source against source 0" in result.stdout
    assert "source 1 vs 0:" in result.stdout and "source 2 vs 0:" in result.stdout
    cosines = re.findall(r"decoder cosine ([^)]*)\)", result.stdout)
    assert len(cosines) == 2
    for cosine in cosines:  # 4 significant digits at most, not float's 16
        float(cosine)  # a figure (the features are shared)
        assert len(cosine.lstrip("-0.").replace(".", "")) <= 4, cosine
    analysis = json.loads((out / "analysis.json").read_text())
    assert analysis["compared"] == "each source against source 0"
    assert [pair["sources"] for pair in analysis["pairs"]] == [[0, 1], [0, 2]]
    assert (out / "relative_decoder_norm.png").is_file()
    assert (out / "relative_decoder_norm_0_vs_2.png").is_file()


def test_crosscoder_analyze_of_one_named_pair_says_which(tmp_path):
    crosscoder, out = _crosscoder(tmp_path / "cc.safetensors", 3), tmp_path / "analysis"
    args = ("crosscoder", "analyze", str(crosscoder), "-o", str(out), "--sources", "2", "1")
    result = run_freetx_here(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 sources: source 1 against source 2" in result.stdout
    assert "source 1 vs 2:" in result.stdout and "vs 0" not in result.stdout
