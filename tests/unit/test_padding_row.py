"""The embedding's padding row: transformers builds every native family's embedding with
padding_idx = config.json's pad_token_id (its config class's default where the file has
none), so that row gets no gradient from the lookup; freetx's decoder reads the same id
and gives the same gradients."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from freetx.distributed import materialize
from freetx.models import hf_model
from tests.conftest import flat, run_freetx_here
from tests.hf_folders import make_folder

transformers = pytest.importorskip("transformers")
PAD = 0


def folder_with_pad(root, family):
    """The family's tiny folder; Llama's config.json gets pad_token_id (its class has none)."""
    folder = make_folder(root, family)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if config.get("pad_token_id") is None:
        config["pad_token_id"] = PAD
    path.write_text(json.dumps(config))
    return folder


def batch_with_pads() -> torch.Tensor:
    ids = torch.randint(1, 384, (2, 48), generator=torch.Generator().manual_seed(3))
    ids[:, 30:] = PAD  # right padding, as a batch of unequal samples holds it
    ids[0, 5] = PAD
    return ids


def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("family", ["llama3_1_old_layout", "gemma2", "qwen3_moe"])
def test_embedding_gradients_equal_transformers_on_a_batch_with_the_pad_id(tmp_path, family):
    from freetx.checkpoint import load_initial_weights

    folder = folder_with_pad(tmp_path / family, family)
    with torch.device("meta"):
        ours = hf_model(str(folder))
    materialize(ours, torch.device("cpu"), seed=0)
    load_initial_weights(ours, folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert ours.config.pad_token_id == theirs.model.embed_tokens.padding_idx == PAD
    ids = batch_with_pads()
    ours.eval(), theirs.eval()  # no dropout; the MoE's aux loss is not part of this loss
    loss(ours(ids), ids).backward()
    loss(theirs(ids).logits, ids).backward()
    mine, reference = ours.tok_embeddings.weight.grad, theirs.model.embed_tokens.weight.grad
    assert (mine - reference).abs().max().item() <= 1e-5
    if not ours.config.tie_embeddings:  # untied: the lookup is the row's only gradient
        assert torch.count_nonzero(mine[PAD]) == 0 and torch.count_nonzero(mine[1:].sum(1)) > 0


def test_the_pad_id_is_written_back_on_export(tmp_path):
    from freetx.checkpoint import convert

    folder = folder_with_pad(tmp_path / "src", "llama3_1_old_layout")
    convert(folder, tmp_path / "dcp", to="dcp")
    convert(tmp_path / "dcp", tmp_path / "out", to="hf")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["pad_token_id"] == PAD


@pytest.mark.parametrize("family", ["llama3_1_old_layout", "granite"])  # granite: generic
def test_a_randomly_initialized_model_starts_its_padding_row_at_zero(tmp_path, family):
    folder = folder_with_pad(tmp_path / family, family)
    with torch.device("meta"):
        model = hf_model(str(folder))
    materialize(model, torch.device("cpu"), seed=0)
    embedding = model.hf.get_input_embeddings() if family == "granite" else model.tok_embeddings
    assert embedding.padding_idx == PAD
    assert torch.count_nonzero(embedding.weight[PAD]) == 0
    assert torch.count_nonzero(embedding.weight[1]) > 0


def test_a_default_pad_id_outside_the_vocabulary_is_refused_with_the_fix(tmp_path):
    """Phi3Config assumes pad 32000 where config.json has none: outside a 384-token vocabulary
    transformers cannot build the model, and freetx says so before writing anything."""
    folder = make_folder(tmp_path / "phi3", "phi3")
    path = folder / "config.json"
    config = json.loads(path.read_text())
    del config["pad_token_id"]
    path.write_text(json.dumps(config))
    result = run_freetx_here("checkpoint", "convert", str(folder), str(tmp_path / "dcp"),
                             "--to", "dcp")  # fmt: skip
    message = flat(result.stderr)
    assert result.returncode == 1 and "Traceback" not in message, message
    assert "config.json has none, and phi3 assumes pad_token_id=32000, outside vocab_size=384" in (
        message
    )
    assert "Set pad_token_id in config.json to the tokenizer's pad id, or null" in message
    assert not (tmp_path / "dcp").exists()
