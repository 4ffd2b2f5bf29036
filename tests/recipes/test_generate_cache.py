"""`generate` with a KV cache through the CLI, as a user runs it: every prompt's samples
of a group in one left-padded batch give the replies each prompt gets alone with a full
forward per token; a generation longer than the model's RoPE tables is refused before
anything is written."""

from __future__ import annotations

import json

import pytest

from tests.conftest import one_paragraph, run_freetx
from tests.hf_folders import make_folder, make_tokenizer, spread_weights

pytest.importorskip("transformers")

PROMPTS = ["the cat", "a longer prompt about the dog that sat on the mat", "hello there"]


@pytest.fixture(scope="module")
def lively_llama(tmp_path_factory):
    """A tiny Llama 3.2 folder with weights whose greedy text changes token, a tokenizer."""
    from freetx.data.corpus import builtin_documents

    root = tmp_path_factory.mktemp("hf")
    folder = spread_weights(make_folder(root / "llama", "llama3_2"), root / "model")
    make_tokenizer(folder, builtin_documents()[:20])
    return folder


def generate(folder, out, *overrides):
    return run_freetx(
        "run", "generate", "--config", "llm/hf_generate", f"checkpoint={folder}", "chat=false",
        "temperature=0", "samples_per_group=2", "max_new_tokens=24", f"output_dir={out}",
        *overrides,
    )  # fmt: skip


def samples(out) -> list[dict]:
    return [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]


def test_batched_prompts_with_the_cache_reply_as_each_prompt_alone_without_it(
    tmp_path, lively_llama
):
    prompts = "prompts=[" + ",".join(repr(p) for p in PROMPTS) + "]"
    cached = generate(lively_llama, tmp_path / "cached", prompts)
    assert cached.returncode == 0, cached.stderr
    assert "| generation engine (paged KV cache)" in cached.stdout
    # without a cache a batch holds prompts of one token length: here, one prompt each
    full = generate(lively_llama, tmp_path / "full", prompts, "kv_cache=false")
    assert full.returncode == 0, full.stderr
    assert "| a full forward per token" in full.stdout
    ours, theirs = samples(tmp_path / "cached"), samples(tmp_path / "full")
    assert [s["prompt"] for s in ours] == [p for p in PROMPTS for _ in range(2)]
    assert ours == theirs
    assert len({s["reply"] for s in ours}) == 3  # three different replies, each its own
    assert all(s["reply_tokens"] > 1 for s in ours)
    # a row that ends at its EOS ("the cat", after 2 tokens) beside rows that run on
    assert {s["stopped_at_eos"] for s in ours} == {True, False}
    for prompt in PROMPTS:  # the console: each prompt once, its replies under it
        assert cached.stdout.count(f"prompt: {prompt!r}") == 1


def test_a_generation_past_the_rope_tables_is_refused_before_any_work(tmp_path, lively_llama):
    out = tmp_path / "gen"
    result = generate(lively_llama, out, "max_new_tokens=300")
    message = one_paragraph(result)
    assert "goes past the model's max_seq_len=256" in message
    assert "Lower max_new_tokens or shorten the prompts" in message
    assert not (out / "samples.jsonl").exists()


@pytest.mark.slow  # 5-15 s on 2 CPU cores: make test's budget
def test_a_generic_model_that_takes_no_kv_cache_is_refused_with_the_fix(tmp_path):
    """RWKV keeps a recurrent state of its own: kv_cache=false samples it."""
    import torch
    import transformers

    config = transformers.RwkvConfig(vocab_size=384, hidden_size=64, num_hidden_layers=2,
                                     attention_hidden_size=64, intermediate_size=128)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "rwkv")
    byte_level = "tokenizer={_component_: freetx.data.ByteTokenizer}"
    out = tmp_path / "gen"
    message = one_paragraph(generate(tmp_path / "rwkv", out, byte_level))
    assert "RwkvForCausalLM takes no KV cache" in message and "kv_cache=false" in message
    assert not (out / "samples.jsonl").exists()
    result = generate(tmp_path / "rwkv", out, byte_level, "kv_cache=false", "max_new_tokens=4")
    assert result.returncode == 0, result.stderr
    assert len(samples(out)) == 2
