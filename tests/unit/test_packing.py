"""Packing (freetx/data/packing.py) and document masking (freetx/models/attention.py, the
decoder's `documents`): a packed sample's loss and gradients are the same sample's alone,
for every kind of native family; packs are deterministic in the seed; the kernels agree."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from freetx.data import ByteTokenizer, InstructDataset, PackedTextDataset
from freetx.data.packing import pack_lengths, packed_sample, positions_taken
from freetx.data.sampling import IGNORE_INDEX
from freetx.distributed.parameters import materialize
from freetx.models import PacksDocuments
from freetx.models.attention import (
    AttentionSpec,
    attend,
    choose_kernel,
    document_mask,
    document_positions,
)
from freetx.models.hf import hf_model
from freetx.models.transformer import decoder
from tests.hf_folders import make_folder

# sample lengths (tokens) of one pack: 4 documents, 212 positions of 224; the longest
# passes the tiny folders' windows (40, 48) and phi3_longrope's short range (64) while
# the others stay within it
LENGTHS = [30, 90, 21, 75]
SEQ_LEN = 224


def samples(lengths=LENGTHS, vocab=384, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator) for n in lengths]


def pack(docs, seq_len=SEQ_LEN, pad_id=0):
    """One packed row (batch of one) of `docs`, every token a target."""
    row = packed_sample([(d.tolist(), [True] * len(d)) for d in docs], seq_len, pad_id)
    return {k: v[None] for k, v in row.items()}


def loss_and_grads(model, input_ids, labels, documents=None):
    model.zero_grad(set_to_none=True)
    extra = {} if documents is None else {"documents": documents}
    logits = model(input_ids, **extra)
    logits = logits[0] if isinstance(logits, tuple) else logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_each_sample_as_if_alone(model, docs):
    packed = pack(docs)
    assert (packed["documents"] == -1).any()  # with padding at the end
    for d, doc in enumerate(docs):
        alone = loss_and_grads(model, doc[None, :-1], doc[None, 1:])
        labels = packed["labels"].masked_fill(packed["documents"] != d, IGNORE_INDEX)
        together = loss_and_grads(model, packed["input_ids"], labels, packed["documents"])
        assert (alone[0] - together[0]).abs().item() <= 1e-5, (d, alone[0], together[0])
        assert alone[1].keys() == together[1].keys()
        worst = max((alone[1][n] - together[1][n]).abs().max().item() for n in alone[1])
        assert worst <= 1e-5, (d, worst)


# llama-style (llama3 rope, tied), a sliding window in every layer (Mistral), Gemma 2
# (attention and final soft-capping, windows in alternate layers), Gemma 3 (local RoPE
# base in sliding layers), Phi-3 LongRoPE (fused projections; one document long, the
# others short), OLMo 2, and MoE (Mixtral, Qwen3-MoE)
FAMILIES = ["llama3_2", "mistral_window", "gemma2", "gemma3_text", "phi3_longrope", "olmo2",
            "mixtral", "qwen3_moe"]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_samples_loss_and_gradients_are_the_sample_alone(tmp_path, family):
    folder = make_folder(tmp_path / family, family)
    with torch.device("meta"):
        model = hf_model(str(folder))
    materialize(model, torch.device("cpu"), seed=0)
    assert isinstance(model, PacksDocuments)
    assert_each_sample_as_if_alone(model.eval(), samples())


def test_the_routers_statistics_leave_out_padding():
    """An MoE decoder's load-balancing loss over a pack with padding is the loss over its
    documents without the padding."""
    model = decoder("tiny", num_experts=4, experts_per_token=2, router_aux_loss_coef=0.01)
    materialize(model, torch.device("cpu"), seed=0)
    model.train()
    docs = samples([40, 30], vocab=259)
    padded = pack(docs, seq_len=96)
    tight = pack(docs, seq_len=68)
    with torch.no_grad():
        a = model(padded["input_ids"], documents=padded["documents"])
        b = model(tight["input_ids"], documents=tight["documents"])
    assert torch.allclose(a.metrics["aux_loss"], b.metrics["aux_loss"], atol=1e-6)
    assert torch.allclose(a.logits[:, :68], b.logits, atol=1e-5)


def test_positions_restart_per_document_and_padding_counts_as_one_more():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    positions, lengths = document_positions(documents)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert lengths.tolist() == [[3, 3, 3, 2, 2, 1, 2, 2]]


@pytest.mark.parametrize(
    "spec",
    [AttentionSpec(), AttentionSpec(window=5), AttentionSpec(softcap=2.0),
     AttentionSpec(window=5, softcap=2.0, scale=0.3)],
)  # fmt: skip
def test_flex_attention_within_documents_equals_the_dense_mask(spec):
    """FlexAttention's block mask (CUDA's kernel) against SDPA's or the explicit kernel's
    boolean mask (CPU's), forward on CPU; padding rows have no NaN."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=generator) for h in (4, 2, 2))
    documents = torch.tensor([[0] * 7 + [1] * 9 + [2] * 5 + [-1] * 3, [0] * 20 + [1] * 4])
    dense = "sdpa_mask" if spec.softcap is None else "explicit"
    reference = attend(q, k, v, spec, mask=document_mask(documents, spec, kernel=dense))
    with warnings.catch_warnings():  # eager FlexAttention warns that it is not compiled
        warnings.simplefilter("ignore")
        flex = attend(q, k, v, spec, mask=document_mask(documents, spec, kernel="flex"))
    assert not reference.isnan().any()
    assert (flex - reference).abs().max() <= 1e-5
    # each document's rows are that document's attention alone
    first = attend(q[:, :, 7:16], k[:, :, 7:16], v[:, :, 7:16], spec, kernel=dense)
    assert (reference[:1, :, 7:16] - first[:1]).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "device,spec,dropout,kernel",
    [("cpu", AttentionSpec(), 0.0, "sdpa_mask"), ("cpu", AttentionSpec(window=5), 0.0, "sdpa_mask"),
     ("cpu", AttentionSpec(softcap=2.0), 0.0, "explicit"), ("cuda", AttentionSpec(), 0.0, "flex"),
     ("cuda", AttentionSpec(softcap=2.0), 0.0, "flex"), ("cuda", AttentionSpec(), 0.1, "sdpa_mask"),
     ("cuda", AttentionSpec(softcap=2.0), 0.1, "explicit")],
)  # fmt: skip
def test_documents_take_a_masked_kernel_on_cpu_and_flex_on_cuda(device, spec, dropout, kernel):
    assert choose_kernel(device, spec, dropout, documents=True) == kernel


@pytest.mark.slow  # compiling FlexAttention on 2 CPU cores
def test_compiled_flex_attention_within_documents_equals_the_dense_mask():
    """What `distributed.compile` makes of a packed batch's block on CUDA: FlexAttention
    with the batch's block mask traced into the graph (here on CPU, the forward)."""
    spec = AttentionSpec(window=5, softcap=2.0)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=generator) for h in (4, 2, 2))
    documents = torch.tensor([[0] * 7 + [1] * 9 + [2] * 5 + [-1] * 3, [0] * 20 + [1] * 4])
    flex = document_mask(documents, spec, kernel="flex")
    with torch.no_grad():
        compiled = torch.compile(lambda q, k, v: attend(q, k, v, spec, mask=flex))(q, k, v)
    reference = attend(q, k, v, spec, mask=document_mask(documents, spec, kernel="explicit"))
    assert (compiled - reference).abs().max() <= 1e-5


def test_packs_are_first_fit_decreasing_and_deterministic_in_the_seed():
    lengths = np.random.default_rng(0).integers(2, 300, size=500)
    packs = pack_lengths(lengths, 256, seed=1)
    assert sorted(i for p in packs for i in p) == list(range(500))  # each sample once
    assert all(positions_taken(lengths[p], 256).sum() <= 256 for p in packs)
    assert packs == pack_lengths(lengths, 256, seed=1)
    assert packs != pack_lengths(lengths, 256, seed=2)
    fill = positions_taken(lengths, 256).sum() / (len(packs) * 256)
    assert fill > 0.95  # FFD leaves little room (this set: 96%)
    # longer than seq_len + 1: cut as unpacked samples are, a pack to itself
    assert pack_lengths(np.array([600, 2]), 256, seed=0) in ([[0], [1]], [[1], [0]])


def test_a_pack_keeps_every_loss_token_and_no_label_crosses_a_boundary():
    tokenizer = ByteTokenizer()
    plain = InstructDataset(tokenizer, num_builtin_examples=400, seq_len=256)
    packed = InstructDataset(tokenizer, num_builtin_examples=400, seq_len=256, packed=True)
    assert len(packed) < len(plain) / 3  # the short examples share sequences
    rows = [packed[i] for i in range(len(packed))]
    labels = sorted(t for r in rows for t in r["labels"].tolist() if t != IGNORE_INDEX)
    expected = sorted(
        t for i in range(len(plain)) for t in plain[i]["labels"].tolist() if t != IGNORE_INDEX
    )
    assert labels == expected
    for row in rows:
        real = int(row["real_tokens"])
        assert (row["documents"][:real] >= 0).all() and (row["documents"][real:] == -1).all()
        ends = (row["documents"][1:] != row["documents"][:-1]).nonzero().flatten()
        # a document's last position predicts its own EOS, never the next one's BOS
        assert (row["labels"][ends][row["documents"][ends] >= 0] == tokenizer.eos_id).all()
    again = InstructDataset(tokenizer, num_builtin_examples=400, seq_len=256, packed=True)
    assert all(torch.equal(again[i]["input_ids"], rows[i]["input_ids"]) for i in range(5))


def test_packed_text_windows_mark_documents_at_each_eos(tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(f'{{"text": "document {i} {"x" * (i % 50)}"}}\n' for i in range(200)))
    tokenizer = ByteTokenizer()
    plain = PackedTextDataset(tokenizer, str(source), seq_len=128)
    packed = PackedTextDataset(tokenizer, str(source), seq_len=128, packed=True)
    assert len(plain) == len(packed)
    a, b = plain[3], packed[3]
    assert torch.equal(a["input_ids"], b["input_ids"])
    eos = a["input_ids"] == tokenizer.eos_id
    assert eos.any()
    assert torch.equal(b["labels"], a["labels"].masked_fill(eos, IGNORE_INDEX))
    starts = (b["documents"][1:] != b["documents"][:-1]).nonzero().flatten()
    assert torch.equal(starts, eos[:-1].nonzero().flatten())  # a new document after each EOS
    assert int(b["real_tokens"]) == 128


def test_models_that_cannot_keep_documents_apart_are_refused_for_a_packed_dataset(tmp_path):
    from freetx.errors import ConfigError
    from freetx.models.free_transformer import free_transformer
    from freetx.training import check_packing

    folder = make_folder(tmp_path / "starcoder2", "starcoder2")
    with torch.device("meta"):
        native = decoder("tiny")
        free = free_transformer("tiny")
        generic = hf_model(str(folder))
    check_packing(native, True)
    check_packing(type(native), True)
    for model, name in ((free, "Free Transformer"), (type(free), "FreeTransformer"),
                        (generic, "transformers")):  # fmt: skip
        check_packing(model, False)
        with pytest.raises(ConfigError, match="dataset.packed=true") as refused:
            check_packing(model, True)
        assert name in str(refused.value) and "Set dataset.packed=false" in str(refused.value)
