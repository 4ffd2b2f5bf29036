"""Tokenizers, packed text, instruction data, and the world-size-free sampler."""

import json

import pytest
import torch

from freetx.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    EvalShard,
    GlobalBatchSampler,
    InstructDataset,
    PackedTextDataset,
    micro_batch_size,
    read_documents,
)
from freetx.errors import ConfigError, DataError


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids + [tok.eos_id]) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)


def test_builtin_corpus_is_real_text():
    docs = read_documents("builtin")
    assert len(docs) > 50 and sum(len(d) for d in docs) > 300_000
    assert any("assert" in d for d in docs)


def test_packed_windows_overlap_by_one_and_splits_are_disjoint(tmp_path):
    (tmp_path / "a.txt").write_text("".join(f"line {i} of a text. " for i in range(40)))
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "xyz" * 30}) + "\n")
    tok = ByteTokenizer()
    train = PackedTextDataset(tok, source=str(tmp_path), seq_len=8, split="train", val_fraction=0.2)
    val = PackedTextDataset(
        tok, source=str(tmp_path), seq_len=8, split="validation", val_fraction=0.2
    )
    sample = train[0] if train.starts[0] == 0 else val[0]
    assert sample["input_ids"].shape == (8,) and sample["input_ids"][0] == tok.bos_id
    assert torch.equal(sample["input_ids"][1:], sample["labels"][:-1])
    assert set(train.starts.tolist()).isdisjoint(val.starts.tolist())
    total = (len(train.tokens) - 1) // 8
    assert sorted([*train.starts.tolist(), *val.starts.tolist()]) == [i * 8 for i in range(total)]
    # a sequence is validation by a seeded hash of its place: about val_fraction of them
    assert 0.1 < len(val) / total < 0.3, (len(val), total)


def test_jsonl_without_the_field_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:1 has no 'text' column .* it has body"):
        read_documents(str(path))


def test_instruct_masks_the_prompt_and_padding():
    tok = ByteTokenizer()
    data = InstructDataset(tok, source="builtin", seq_len=64, num_builtin_examples=50)
    sample = data[0]
    ids = sample["input_ids"].tolist()
    text = tok.decode(ids[1 : ids.index(tok.eos_id)])  # the example, read back from its tokens
    prompt, response = text.split("Answer: ")
    example = {"prompt": prompt + "Answer: ", "response": response}
    prompt_len = 1 + len(example["prompt"])  # BOS + prompt bytes
    labels = sample["labels"]
    assert (labels[: prompt_len - 1] == IGNORE_INDEX).all()
    response = labels[prompt_len - 1 : prompt_len - 1 + len(example["response"]) + 1]
    assert tok.decode(response.tolist()) == example["response"]
    assert response[-1] == tok.eos_id
    assert (labels[prompt_len + len(example["response"]) :] == IGNORE_INDEX).all()


def test_batch_split_errors():
    assert micro_batch_size(16, 2, 2) == 4
    with pytest.raises(ConfigError, match="cannot be split"):
        micro_batch_size(10, 2, 3)


def _reads(world_size, accumulation, steps, seed=3):
    """What each global step reads, as a list of sorted index lists, for a world size."""
    per_step = []
    samplers = [
        GlobalBatchSampler(100, 8, accumulation, r, world_size, seed) for r in range(world_size)
    ]
    iters = [iter(s) for s in samplers]
    for _ in range(steps):
        step = []
        for it in iters:
            for _ in range(accumulation):
                step.extend(next(it))
        per_step.append(step)
    return per_step


def test_data_order_does_not_depend_on_world_size():
    one = _reads(world_size=1, accumulation=4, steps=30)  # crosses epochs (12 batches each)
    two = _reads(world_size=2, accumulation=2, steps=30)
    four = _reads(world_size=4, accumulation=1, steps=30)
    assert one == two == four
    assert all(len(set(step)) == 8 for step in one)


def test_sampler_state_resumes_at_another_world_size():
    straight = _reads(world_size=2, accumulation=1, steps=10)
    first = GlobalBatchSampler(100, 8, 1, 0, 2, seed=3)
    it = iter(first)
    for _ in range(6):
        next(it)
    resumed = GlobalBatchSampler(100, 8, 2, 0, 1, seed=3)
    resumed.load_state_dict(first.state_dict())
    it = iter(resumed)
    for step in range(6, 10):
        assert next(it) + next(it) == straight[step]


def test_sampler_state_mid_step_refuses_another_split():
    sampler = GlobalBatchSampler(100, 8, 2, 0, 1, seed=0)
    state = {**sampler.state_dict(), "micro": 1}
    with pytest.raises(DataError, match="middle of an optimizer step"):
        GlobalBatchSampler(100, 8, 1, 0, 2, seed=0).load_state_dict(state)


def test_eval_shards_are_equal_length_and_cover_everything():
    data = [{"input_ids": torch.tensor([i]), "labels": torch.tensor([i])} for i in range(5)]
    shards = [EvalShard(data, r, 2) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 3
    samples = [s[i] for s in shards for i in range(3)]
    real = [int(x["labels"]) for x in samples if not x["padding"]]
    assert sorted(real) == [0, 1, 2, 3, 4]  # every sample once, then one marked padding
    assert sum(bool(x["padding"]) for x in samples) == 1
