"""A pretrained HF folder through the CLI: full fine-tuning on 2 processes from a folder
transformers wrote (weights, tokenizer, chat template), export back to an HF folder that
transformers loads with the same logits (by `checkpoint.final_export=hf` at the end of the
run, and by `freetx checkpoint convert --to hf`: the same tensors), and sampling from it;
Qwen3 and OLMo 2 folders fine-tuned and exported the same way, and LoRA on a Qwen3 folder
exported to PEFT."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import flat, run_freetx, run_freetx_here
from tests.hf_folders import RANDOM_WEIGHTS_LR, hf_logits, make_folder, make_tokenizer

transformers = pytest.importorskip("transformers")


JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"


def tiny_folder(root, family):
    """A tiny model folder of the family, as transformers writes it, with a tokenizer."""
    from freetx.data.corpus import builtin_documents

    folder = make_folder(root / family, family)
    make_tokenizer(folder, builtin_documents()[:20])
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("hf"), "llama3_2")


def load_checkpoint_as(folder, checkpoint):
    """freetx's decoder of an HF folder's shape with a checkpoint's weights."""
    from freetx.checkpoint import load_initial_weights
    from freetx.distributed import materialize
    from freetx.models.transformer import hf_decoder

    with torch.device("meta"):
        model = hf_decoder(str(folder))
    materialize(model, torch.device("cpu"), seed=0)
    load_initial_weights(model, checkpoint)
    return model.eval()


def tensor_names(folder):
    from safetensors import safe_open

    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return names


def same_tensors(a, b) -> bool:
    """Whether two HF folders hold the same tensors (however sharded)."""
    from safetensors.torch import load_file

    def tensors(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    left, right = tensors(a), tensors(b)
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_finetune_export_and_generate(tmp_path, model_dir):
    run = tmp_path / "run"
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/hf_tiny_full",
        RANDOM_WEIGHTS_LR, f"model_dir={model_dir}", f"output_dir={run}", "max_steps=20", "log_every_n_steps=5",
        "checkpoint.final_export=hf",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"exported step_000020 as hf to {run / 'export' / 'hf'}" in result.stdout
    assert f"initial weights from {model_dir}" in result.stdout
    assert "| model: native freetx decoder for llama |" in result.stdout
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses

    out = tmp_path / "exported"
    converted = run_freetx_here("checkpoint", "convert", str(run / "checkpoints" / "step_000020"),
                           str(out), "--to", "hf", "--max-shard-size", "50KB")  # fmt: skip
    assert converted.returncode == 0, converted.stderr
    files = sorted(p.name for p in out.iterdir())
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # fmt: skip
        assert name in files, files
    # transformers reads it: the same logits as freetx's own model from the DCP checkpoint
    ours = load_checkpoint_as(out, run / "checkpoints" / "step_000020")
    ids = torch.randint(0, 384, (2, 64))
    with torch.no_grad():
        assert (hf_logits(out, ids) - ours.eval()(ids)).abs().max() < 1e-4
        # the final export equals the conversion: the same files, the same tensors
        final = run / "export" / "hf"
        assert (hf_logits(final, ids) - ours.eval()(ids)).abs().max() < 1e-4
    assert sorted(p.name for p in final.iterdir() if not p.name.startswith("model")) == sorted(
        p.name for p in out.iterdir() if not p.name.startswith("model")
    )
    assert same_tensors(final, out)
    assert (final / "config.json").read_bytes() == (out / "config.json").read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|eot_id|>"
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 256  # the source's, not the run's 128 tables

    sampled = run_freetx("run", "generate", "--config", "llm/hf_generate", f"checkpoint={out}",
                         f"output_dir={tmp_path / 'gen'}", "max_new_tokens=8")  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    samples = [
        json.loads(x) for x in (tmp_path / "gen" / "samples.jsonl").read_text().split("\n") if x
    ]
    assert len(samples) == 2
    assert all(s["prompt"] == "Reverse the word: python" for s in samples)
    assert all("Reverse the word" not in s["reply"] for s in samples)  # the reply alone


def test_greedy_generate_equals_transformers_and_stops_at_eos(tmp_path, model_dir):
    """temperature=0 gives transformers' greedy tokens on the prompt as transformers encodes
    it (a tokenizer that adds no BOS); the reply holds the generated text alone, cut at
    EOS, and sampling stops once every reply has ended."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():  # large random weights: greedy text that does not repeat one token
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.5)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    prompt = "the cat"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert tokenizer.bos_token_id not in ids[0].tolist()  # named, but the folder adds none
    theirs = model.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None,
                            pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()  # fmt: skip
    # a greedy token that first appears after two others becomes EOS: the reply stops there
    stop = next(i for i in range(2, len(theirs)) if theirs[i] not in theirs[:i])
    eos, cut = theirs[stop], theirs[:stop]
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    tokenizer.save_pretrained(folder)
    result = run_freetx(
        "run", "generate", "--config", "llm/hf_generate", f"checkpoint={folder}", "chat=false", f"prompts=[{prompt!r}]", "temperature=0",
        "samples_per_group=2", "max_new_tokens=12", f"output_dir={tmp_path / 'gen'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    samples = [
        json.loads(x) for x in (tmp_path / "gen" / "samples.jsonl").read_text().split("\n") if x
    ]
    assert [s["reply"] for s in samples] == [tokenizer.decode(cut)] * 2
    assert all(s["stopped_at_eos"] and s["reply_tokens"] == len(cut) for s in samples)
    assert f"prompt: {prompt!r}" in result.stdout and "tokens/s" in result.stdout


def losses(run) -> dict[int, float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


# every native family's tiny folder, one of each block kind (their resume:
# tests/distributed/test_folder_resume.py's NATIVE): (family, config.json keys the export must
# give back as the folder has them)
EXPORTED_KEYS = {"gemma2": ("sliding_window", "attn_logit_softcapping", "layer_types"),
           "llama3_2": ("rope_parameters", "tie_word_embeddings"),
           "qwen3": ("head_dim",), "olmo2": (), "mistral_window": ("sliding_window",),
           "qwen3_moe": ("num_local_experts", "num_experts_per_tok", "mlp_only_layers"),
           "gemma3_text": ("layer_types", "rope_parameters"),
           "smollm3_window": ("no_rope_layers", "use_sliding_window", "layer_types")}  # fmt: skip


@pytest.mark.slow  # one 2-process launch each
@pytest.mark.parametrize("family", list(EXPORTED_KEYS))
def test_a_folder_of_each_family_finetunes_on_2_processes_and_exports(tmp_path, family):
    """A 2-process run through the CLI (Gemma 2's soft-capped, windowed attention through
    the explicit kernel on CPU, a window of 40 in 64-token sequences; Qwen3-MoE's experts
    sharded by FSDP) whose last checkpoint converts to a folder with the source's tensor
    names and config keys that transformers loads with freetx's logits. Each family's exact
    resume: tests/distributed/test_folder_resume.py (one launch for all)."""
    folder = tiny_folder(tmp_path, family)
    run = tmp_path / "run"
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/hf_tiny_full",
        f"model_dir={folder}", RANDOM_WEIGHTS_LR, "max_steps=2", "log_every_n_steps=1",
        "eval.max_batches=1", "dataset.num_builtin_examples=400", JSONL, f"output_dir={run}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(losses(run)) == [1, 2]
    out = tmp_path / "exported"
    last = run / "checkpoints" / "step_000002"
    converted = run_freetx_here("checkpoint", "convert", str(last), str(out), "--to", "hf")
    assert converted.returncode == 0, converted.stderr
    assert tensor_names(out) == tensor_names(folder)  # HF's names, none more or fewer
    config, source = (json.loads((f / "config.json").read_text()) for f in (out, folder))
    for key in ("model_type", "architectures", *EXPORTED_KEYS[family]):
        assert config.get(key) == source.get(key), key
    ids = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        trained = hf_logits(out, ids)
        assert (trained - load_checkpoint_as(out, last)(ids)).abs().max() < 1e-4
        assert (trained - hf_logits(folder, ids)).abs().max() > 1e-3  # the 2 steps trained


@pytest.mark.parametrize(
    "family, options",
    [pytest.param("qwen3", [], marks=pytest.mark.slow, id="qwen3"),
     pytest.param("llama3_2", ["peft.use_dora=true"], marks=pytest.mark.slow, id="dora"),
     pytest.param("llama3_2", ["peft.quantize_base=nf4"], marks=pytest.mark.slow, id="qlora"),
     *(pytest.param(f, [], marks=pytest.mark.slow, id=f)
       for f in ("gemma2", "mistral", "qwen2", "olmo2", "gemma3_text", "smollm3")),
     pytest.param("mixtral", ["peft.target_modules=[q_proj,k_proj,v_proj,o_proj]"],
                  marks=pytest.mark.slow, id="mixtral")],
)  # fmt: skip
def test_lora_qlora_dora_from_only_model_dir_export_adapters_that_peft_loads(
    tmp_path, family, options
):
    lora_export_loads_in_peft(tmp_path, tiny_folder(tmp_path, family), *options)


def lora_export_loads_in_peft(tmp_path, folder, *overrides):
    """LoRA on an HF folder for 2 steps by llm/hf_tiny_lora, which takes only model_dir=
    (its targets, or `overrides`): the final PEFT export loads in PEFT with the logits of
    `checkpoint merge`'s folder."""
    peft = pytest.importorskip("peft")
    run = tmp_path / "run"
    lora_run(folder, run, *overrides)
    merged = run_freetx_here("checkpoint", "merge", str(run / "checkpoints" / "step_000002"),
                        "--base", str(folder), str(tmp_path / "merged"))  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    auto = transformers.AutoModelForCausalLM
    ids = torch.randint(0, 259, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(
            auto.from_pretrained(folder), run / "export" / "peft"
        )
        with_adapter = adapted.eval()(ids).logits
        plain = hf_logits(folder, ids)
        merged_logits = hf_logits(tmp_path / "merged", ids)
    assert (with_adapter - plain).abs().max() > 1e-3  # the adapter changed something
    assert (with_adapter - merged_logits).abs().max() < 1e-4


def lora_run(folder, run, *overrides):
    """2 steps of llm/hf_tiny_lora on an HF folder into `run` (final PEFT export); the
    finished command."""
    result = run_freetx(
        "run", "lora_finetune_fsdp2", "--config", "llm/hf_tiny_lora", f"model_dir={folder}",
        f"output_dir={run}", "max_steps=2", "optimizer.lr=0.02", "lr_schedule.warmup_steps=0",
        "eval.max_batches=1", "dataset.num_builtin_examples=400", "dataset.seq_len=64", JSONL,
        *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, model_dir):
    result = run_freetx(  # refused by the recipe, which reads the tokenizer
        "run", "full_finetune_fsdp2", "--config", "llm/hf_tiny_full", f"model_dir={model_dir}",
        f"output_dir={tmp_path}", "model.vocab_size=300",
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "tokens but the model's embedding has 300 rows" in flat(result.stderr)


def test_model_dir_must_be_given():
    result = run_freetx_here("validate", "llm/hf_tiny_full")
    assert result.returncode == 1 and "add model_dir=VALUE" in flat(result.stderr)


@pytest.mark.slow  # 20 s on 2 CPU cores
@pytest.mark.parametrize("family", ["gemma2", "mixtral"])
def test_spectrum_scans_and_trains_a_native_hf_folder(tmp_path, family):
    """`freetx spectrum scan` reads an HF folder by freetx's names (Gemma's sandwich norms,
    an MoE block's router; the grouped expert tensors are not matrices and are not
    scored), and its selection trains exactly those modules."""
    folder = tiny_folder(tmp_path, family)
    scanned = run_freetx("spectrum", "scan", str(folder), "--top-percent", "50")
    assert scanned.returncode == 0, scanned.stderr
    selection = folder / "spectrum_top50.yaml"
    chosen = [line.split()[1] for line in selection.read_text().splitlines() if "  - " in line]
    assert chosen and not any("experts" in name for name in chosen)
    result = run_freetx(
        "run", "lora_finetune_fsdp2", "--config", "llm/hf_tiny_full", f"model_dir={folder}",
        f"output_dir={tmp_path / 'run'}", "max_steps=2", "peft.method=spectrum",
        f"peft.spectrum_selection={selection}", "eval.max_batches=1",
        "dataset.num_builtin_examples=400", RANDOM_WEIGHTS_LR,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"trains Spectrum: {len(chosen)} modules (top 50%)" in flat(result.stdout)
