"""Issue 36, tokenizers: messages that point at the real problem (a run folder has no
tokenizer, a model_dir that is a file or missing, a missing tokenizer_config.json, a
`tokenizer` node that builds something else), and generation that stops at the model's
end token when the tokenizer's differs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from freetx.data import HFTokenizer, checked_tokenizer, encoded_text
from freetx.errors import ConfigError, DataError
from tests.conftest import flat, run_freetx, run_freetx_here, run_refused_here


def test_run_folder_without_tokenizer_points_to_tokenizer_path_not_sentencepiece(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")  # weights only, as a run's export
    with pytest.raises(DataError) as e:
        HFTokenizer(str(tmp_path))
    message = flat(str(e.value))
    assert "tokenizer.path=FOLDER" in message
    assert "sentencepiece tokenizer.model" not in message and "Convert" not in message


def test_folder_with_sentencepiece_model_still_says_convert(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(DataError, match="Convert it once"):
        HFTokenizer(str(tmp_path))


def test_model_dir_that_is_a_file_is_reported_as_a_file_not_a_tokenizer(tmp_path):
    file = tmp_path / "pytorch_model.bin"
    file.write_bytes(b"\xff\xfe not text")
    result = run_freetx_here("validate", "llm/hf_tiny_lora", f"model_dir={file}")
    text = flat(result.stdout + result.stderr)
    assert result.returncode != 0
    assert f"'model_dir' is '{file}': it is a file, not a folder" in text
    shards = tmp_path / "model.safetensors"  # a .safetensors file is a model_dir
    shards.write_bytes(b"")
    assert "model_dir" not in flat(
        run_freetx_here("validate", "llm/lora_tiny", f"model_dir={shards}").stdout
    )
    assert "UTF-8" not in text and "tokenizer" not in text.split("model_dir")[0]


def test_model_dir_that_does_not_exist_is_reported_as_model_dir(tmp_path):
    missing = tmp_path / "nowhere"
    result = run_refused_here(
        "lora_finetune_fsdp2", "--config", "llm/hf_tiny_lora", f"model_dir={missing}",
        f"output_dir={tmp_path / 'out'}",
    )  # fmt: skip
    text = flat(result.stderr)
    assert result.returncode == 1 and "Traceback" not in text
    assert f"model_dir={missing} does not exist" in text
    assert "tokenizer.path" not in text


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_folders import make_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder, ["the cat sat on the mat", "hello there, general"] * 20)
    return folder


def test_missing_tokenizer_config_json_is_named_not_eos_token(tmp_path, tokenizer_folder):
    shutil.copy(tokenizer_folder / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(DataError) as e:
        HFTokenizer(str(tmp_path))
    message = flat(str(e.value))
    assert "has no tokenizer_config.json" in message and "has no eos_token" not in message


def test_tokenizer_node_that_builds_a_linear_layer_names_the_node():
    result = run_freetx_here("validate", "llm/tiny", "tokenizer._component_=torch.nn.Linear")
    text = flat(result.stdout + result.stderr)
    assert result.returncode != 0 and "Traceback" not in text
    assert "the `tokenizer` node builds torch.nn.modules.linear.Linear" in text
    assert "freetx.data.ByteTokenizer" in text


def test_tokenizer_node_built_into_something_else_is_refused_at_build():
    with pytest.raises(ConfigError, match=r"`activations.tokenizer` node builds a torch\.nn"):
        checked_tokenizer(torch.nn.Identity(), "activations.tokenizer")


@pytest.mark.slow
def test_tokenizer_end_token_differing_from_config_json_warns_and_generation_stops_at_either(
    tmp_path, tokenizer_folder
):
    from tests.hf_folders import hf_logits, make_folder, spread_weights

    folder = spread_weights(make_folder(tmp_path / "llama", "llama3_2"), tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    tok = HFTokenizer(str(folder))
    prompt = "the cat"
    ids = torch.tensor([encoded_text(tok, prompt)])  # as generate encodes it
    first = int(hf_logits(folder, ids)[0, -1].argmax())  # the first token greedy picks
    assert first != tok.eos_id
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = first  # the model's end token is not the tokenizer's
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").unlink(missing_ok=True)
    out = tmp_path / "out"
    result = run_freetx(
        "run", "generate", "--config", "llm/hf_generate", f"checkpoint={folder}", "chat=false",
        "temperature=0", "samples_per_group=1", "max_new_tokens=8", f"output_dir={out}",
        f"prompts=[{prompt!r}]",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = flat(result.stdout)
    assert f"the tokenizer's end token is id {tok.eos_id}" in text
    assert f"eos_token_id {first}" in text and "stops at either" in text
    (sample,) = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sample["stopped_at_eos"] and sample["reply_tokens"] == 0


# -- the llm/tiny HF export: the byte tokenizer in transformers' form --------------

TEXTS = ["hi there", "héllo wörld ✓ 日本", "  spaces\n\ttabs and 'quotes' <s>", ""]


def test_byte_tokenizer_hf_files_encode_as_freetx_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from freetx.data import ByteTokenizer

    byte = ByteTokenizer()
    for name, text in byte.hf_files().items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, 258)
    assert len(hf) == byte.vocab_size
    ours = HFTokenizer(str(tmp_path))  # freetx reads the same files alike
    for text in TEXTS:
        assert hf(text).input_ids == [byte.bos_id, *byte.encode(text)]
        assert hf.decode(hf(text).input_ids, skip_special_tokens=True) == text
        assert ours.encode(text) == byte.encode(text)


@pytest.mark.slow
def test_llm_tiny_hf_export_has_a_tokenizer_and_a_generation_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    result = run_freetx(
        "run", "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={out}",
        "max_steps=2", "eval.max_batches=1", "checkpoint.final_export=hf",
        "metric_loggers=[]",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    converted = run_freetx_here(
        "checkpoint", "convert", str(out), str(tmp_path / "hf"), "--to", "hf"
    )
    assert converted.returncode == 0, converted.stdout + converted.stderr
    assert "no tokenizer files" not in converted.stdout
    for folder in (out / "export" / "hf", tmp_path / "hf"):
        generation = json.loads((folder / "generation_config.json").read_text())
        assert generation == {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
                              "max_length": 256}  # fmt: skip
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        ids = tok("The Python", return_tensors="pt").input_ids
        assert ids[0].tolist() == [256, *b"The Python"]
        new = model.generate(ids, max_new_tokens=5, do_sample=False)
        assert new.shape[1] > ids.shape[1]
        assert isinstance(tok.decode(new[0], skip_special_tokens=True), str)
