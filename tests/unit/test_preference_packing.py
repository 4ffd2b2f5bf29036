"""Packed preference pairs: a pack's log-probs by document are each pair's alone, in the
order the loss reads, and the packed set's padding is measured."""

from __future__ import annotations

import torch

from freetx.data import ByteTokenizer, EvalShard, PreferenceDataset, collate_pairs
from freetx.distributed import materialize
from freetx.models.transformer import decoder
from freetx.objectives import PreferenceLoss, sequence_logps


def datasets(packed: bool, seq_len: int = 128):
    return PreferenceDataset(ByteTokenizer(), "builtin", seq_len, num_builtin_examples=300,
                             cache=False, packed=packed)  # fmt: skip


def test_a_packs_log_probs_by_document_are_each_pairs_alone():
    plain, packed = datasets(False), datasets(True)
    with torch.device("meta"):
        model = decoder(vocab_size=259, hidden_dim=32, num_layers=2, num_heads=4,
                        num_kv_heads=2, ffn_hidden_dim=48, max_seq_len=128)  # fmt: skip
    materialize(model, torch.device("cpu"), seed=0)
    packs = collate_pairs([packed[k] for k in range(3)])
    order = [i for k in range(3) for i in packed.packs[k]]
    pairs = collate_pairs([plain[i] for i in order])
    assert len(order) > 3  # the packs hold several pairs each
    with torch.no_grad():
        by_document, _ = sequence_logps(model, packs.input_ids, packs.labels,
                                        documents=packs.documents)  # fmt: skip
        by_row, _ = sequence_logps(model, pairs.input_ids, pairs.labels)
    assert torch.equal(by_document.tokens, by_row.tokens)
    assert torch.allclose(by_document.sum, by_row.sum, rtol=1e-5, atol=1e-4)
    assert int(packs.num_pairs()) == len(order)
    reference = type(by_row)(by_row.sum - 1.0, by_row.tokens)  # any reference
    loss = PreferenceLoss("sigmoid", beta=0.1)
    assert torch.allclose(loss(by_document, reference)[0], loss(by_row, reference)[0], atol=1e-5)


def test_packing_pairs_at_seq_len_128_cuts_the_padding():
    plain, packed = datasets(False).summary(), datasets(True).summary()
    assert plain.samples == packed.samples and packed.sequences < plain.sequences / 2
    assert plain.padding > 0.55 and packed.padding < 0.2


def test_an_evaluation_shards_repeated_pack_counts_no_pair():
    packed = datasets(True)
    assert len(packed) % 2 == 1  # 115 packs: rank 1 of 2 repeats one to fill its share
    shard = EvalShard(packed, rank=1, world_size=2)
    batch = collate_pairs([shard[i] for i in range(len(shard))])
    assert bool(batch.padding[-1])
    real = sum(len(packed.packs[i]) for i in range(1, len(packed), 2))
    assert int(batch.num_pairs()) == real
