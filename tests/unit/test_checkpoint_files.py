"""Conversion, inspection, initial weights and damaged checkpoints (one process)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from freetx.checkpoint import convert, inspect_report, load_initial_weights, open_tensors
from freetx.distributed import materialize
from freetx.errors import CheckpointError
from freetx.models.transformer import decoder
from freetx.models.transformer_hf import LLAMA_LAYOUT
from tests.conftest import flat, run_freetx, run_freetx_here


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of llm/tiny after 2 steps, made through the CLI."""
    out = tmp_path_factory.mktemp("run")
    result = run_freetx(
        "run", "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={out}", "max_steps=2",
        "eval.max_batches=1", "metric_loggers=[]",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out / "checkpoints" / "step_000002"


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    source = open_tensors(path)
    return dict(source.model_tensors())


def fresh_model():
    with torch.device("meta"):
        model = decoder("tiny")
    materialize(model, torch.device("cpu"), seed=123)  # different weights from the run
    return model


def test_dcp_to_safetensors_streams_the_model(checkpoint, tmp_path):
    out = tmp_path / "m.safetensors"
    result = convert(checkpoint, out)
    assert result["format"] == "safetensors" and result["tensors"] == 38
    written = load_file(out)
    expected = model_tensors(checkpoint)
    assert set(written) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name


def test_dtype_cast(checkpoint, tmp_path):
    convert(checkpoint, tmp_path / "m.safetensors", dtype="bf16")
    written = load_file(tmp_path / "m.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in written.values())


def test_dcp_to_torch_full_and_model_only(checkpoint, tmp_path):
    convert(checkpoint, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert any(k.startswith("optimizer.state.") for k in full)
    assert "train.step" in full and full["train.step"] == 2
    convert(checkpoint, tmp_path / "model.pt", model_only=True)
    only = torch.load(tmp_path / "model.pt", weights_only=True)
    model = fresh_model()
    model.load_state_dict(only)  # the plain state-dict layout of the model
    assert torch.equal(model.norm.weight, model_tensors(checkpoint)["norm.weight"])


def test_safetensors_to_dcp_and_back(checkpoint, tmp_path):
    convert(checkpoint, tmp_path / "a.safetensors")
    convert(tmp_path / "a.safetensors", tmp_path / "dcp", to="dcp")
    convert(tmp_path / "dcp", tmp_path / "b.safetensors")
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hf_folder_round_trip(checkpoint, tmp_path):
    convert(checkpoint, tmp_path / "hf", to="hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (
        192,
        4,
        2,
    )
    assert config["tie_word_embeddings"] is True and config["intermediate_size"] == 512
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in hf and "lm_head.weight" not in hf
    convert(tmp_path / "hf", tmp_path / "back", to="dcp")
    original, back = model_tensors(checkpoint), model_tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_hf_names_cover_the_decoder():
    for name, _ in fresh_model().named_parameters():
        assert LLAMA_LAYOUT.from_hf_name(LLAMA_LAYOUT.to_hf_name(name)) == name
    assert (
        LLAMA_LAYOUT.to_hf_name("layers.3.feed_forward.w1.weight")
        == "model.layers.3.mlp.gate_proj.weight"
    )


@pytest.mark.parametrize("kind", ["dcp", "safetensors", "hf"])
def test_initial_weights_from_each_format(checkpoint, tmp_path, kind):
    path = {"dcp": checkpoint, "safetensors": tmp_path / "m.safetensors", "hf": tmp_path / "hf"}[
        kind
    ]
    if kind != "dcp":
        convert(checkpoint, path, to=kind)
    model = fresh_model()
    load_initial_weights(model, path)
    expected = model_tensors(checkpoint)
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_initial_weights_of_another_shape_list_the_tensors(checkpoint, tmp_path):
    with torch.device("meta"):
        model = decoder("tiny", vocab_size=300)
    materialize(model, torch.device("cpu"), seed=0)
    convert(checkpoint, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError) as error:
        load_initial_weights(model, tmp_path / "m.safetensors")
    assert "shape of tok_embeddings.weight: model [300, 192], checkpoint [259, 192]" in str(
        error.value
    )


def test_inspect_reports_run_facts_and_totals(checkpoint, tmp_path):
    report = inspect_report(checkpoint)
    assert "step: 2" in report and "world_size: 1" in report and "strategy: fsdp" in report
    assert "model_class: freetx.models.transformer.Transformer" in report
    assert re.search(r"model.layers.0.attention.wq.weight +\[192, 192\] +float32 +147,456", report)
    assert "model: 38 tensors, 6,497,280 bytes" in report
    assert "optimizer:" in report
    convert(checkpoint, tmp_path / "m.safetensors")
    assert "tok_embeddings.weight" in inspect_report(tmp_path / "m.safetensors")


def test_truncated_file_is_named(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    data = broken / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is truncated"):
        open_tensors(broken)


def test_corrupt_index_is_named(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read"):
        open_tensors(broken)


def test_missing_path_and_non_checkpoint_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_tensors(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="neither a DCP checkpoint"):
        open_tensors(tmp_path)


def test_cli_convert_and_inspect(checkpoint, tmp_path):
    result = run_freetx("checkpoint", "convert", str(checkpoint), str(tmp_path / "m.safetensors"))
    assert result.returncode == 0 and "38 tensors" in result.stdout
    result = run_freetx_here("checkpoint", "inspect", str(checkpoint))
    assert result.returncode == 0 and "world_size: 1" in result.stdout
    result = run_freetx_here("checkpoint", "convert", str(checkpoint), str(tmp_path / "x.bin2"))
    assert result.returncode == 1 and "--to" in flat(result.stderr)
    result = run_freetx_here("checkpoint", "inspect", str(tmp_path / "nope"))
    assert result.returncode == 1 and "does not exist" in flat(result.stderr)
    assert "Traceback" not in result.stderr


def test_torch_files_load_with_weights_only(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    torch.save({"w": torch.zeros(2), "evil": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="weights_only"):
        open_tensors(tmp_path / "evil.pt")
