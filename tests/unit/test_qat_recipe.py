"""QAT on the SFT recipes and its exports, on a tiny decoder: the `qat:` section, `freetx
checkpoint convert --quantize` (an HF folder transformers and freetx load with the logits of
the model quantize_ptq made) and its refusals. The runs themselves: tests/slow/test_qat_runs.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from freetx.checkpoint import load_model
from freetx.checkpoint.quantized import export_quantized
from freetx.distributed import materialize
from freetx.errors import CheckpointError
from freetx.models.qat import QuantScheme, quantize_ptq
from freetx.models.transformer import decoder
from tests.conftest import flat, one_paragraph, run_freetx_here

IDS = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
SCHEME = "int8_dynamic_act_int4_weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny decoder (untied head) in a safetensors file that records its class and config,
    and the model itself."""
    from safetensors.torch import save_file

    from freetx.checkpoint.formats import MODEL_CLASS_KEY, MODEL_CONFIG_KEY

    with torch.device("meta"):
        model = decoder(preset="tiny", vocab_size=259, max_seq_len=64, tie_embeddings=False)
    materialize(model, torch.device("cpu"), seed=5)
    path = tmp_path_factory.mktemp("tiny") / "model.safetensors"
    meta = {
        MODEL_CLASS_KEY: "freetx.models.transformer.Transformer",
        MODEL_CONFIG_KEY: json.dumps(model.config.__dict__),
    }
    save_file(dict(model.state_dict()), str(path), metadata=meta)
    return path, model.eval()


def test_the_sft_recipes_have_a_qat_section_fixed_on_resume():
    from recipes.full_finetune_fsdp2 import FullFinetuneConfig

    assert "qat" in FullFinetuneConfig.fixed_on_resume
    assert FullFinetuneConfig().qat.scheme == "none"


def test_validate_refuses_a_qat_scheme_that_is_no_scheme_with_the_fix():
    result = run_freetx_here("validate", "llm/instruct_tiny", "qat.scheme=8da4w")
    assert result.returncode == 1
    assert "did you mean 'int8_dynamic_act_int4_weight'" in " ".join(result.stdout.split())


def test_an_8da4w_export_loads_in_transformers_and_freetx_with_the_quantized_logits(
    saved, tmp_path
):
    from transformers import AutoModelForCausalLM

    path, model = saved
    written = export_quantized(path, tmp_path / "q", QuantScheme(SCHEME, 32))
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    expected = quantize_ptq(copy.deepcopy(model), QuantScheme(SCHEME, 32))
    ours = load_model(tmp_path / "q", torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    assert type(ours.layers[0].attention.wq.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert type(ours.output.weight.data) is torch.Tensor  # the head is not quantized
    with torch.no_grad():
        want = expected(IDS)
        assert torch.allclose(ours(IDS), want, atol=1e-5, rtol=0)
        assert torch.allclose(theirs(IDS).logits, want, atol=1e-5, rtol=0)
    assert written["scheme"] == SCHEME and written["tensors"] == len(model.state_dict())
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / "q").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # not safetensors' 0600


@pytest.mark.parametrize(
    "args, says",
    [
        (["--quantize", "int5"], "there is no such QAT scheme"),
        (["--quantize", "none"], "quantizes nothing"),
        (["--quantize", "int8_dynamic_activation_int4_weight", "--group-size", "48"], "power of 2"),
        (["--quantize", "8da4w", "--group-size", "128"], "--group-size=128 does not divide"),
        (["--quantize", "8da4w", "--to", "safetensors"], "leave out --to"),
        (["--group-size", "64"], "add --quantize SCHEME"),
    ],
)
def test_convert_quantize_mistakes_are_refused_with_the_fix(saved, tmp_path, args, says):
    result = run_freetx_here("checkpoint", "convert", str(saved[0]), str(tmp_path / "q"), *args)
    assert says in one_paragraph(result)
    assert not (tmp_path / "q").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine exports int4_weight")
def test_an_int4_weight_export_on_the_cpu_is_refused_naming_the_command(saved, tmp_path):
    dst = tmp_path / "q"
    result = run_freetx_here("checkpoint", "convert", str(saved[0]), str(dst), "--quantize", "4w")
    text = one_paragraph(result)
    assert "on a CUDA machine" in text
    assert f"convert {saved[0]} {dst} --quantize int4_weight --group-size 32" in text
    assert not dst.exists()


def test_a_folder_quantized_by_another_method_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes"}})
    )
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="quantized by bitsandbytes.*unquantized"):
        load_model(tmp_path, torch.device("cpu"))


def test_validate_refuses_qat_under_tensor_parallelism_with_the_fix():
    result = run_freetx_here(
        "validate", "llm/instruct_tiny", f"qat.scheme={SCHEME}", "distributed.tp=2"
    )
    assert result.returncode != 0
    text = flat(result.stdout + result.stderr)
    assert "distributed.tp=2 slices them" in text and "Set distributed.tp=1" in text
