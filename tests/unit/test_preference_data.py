"""PreferenceDataset: every preference format (strings with and without a chat template,
both conversational forms) from the source kinds, labels only on the completion, the
shared prompt, collate's interleaved order, truncation that keeps the prompt's end,
bad pairs, the built-in task's pairs and the token cache."""

from __future__ import annotations

import random
import re

import pytest
import torch

from freetx.data import IGNORE_INDEX, ByteTokenizer, EvalShard, PreferenceDataset, collate_pairs
from freetx.data.instruct import BUILTIN_TASKS, builtin_examples
from freetx.data.preference import plausible_wrong
from freetx.errors import DataError
from tests.conftest import run_freetx_here
from tests.unit import test_formats
from tests.unit.test_formats import write

chatml = test_formats.chatml  # the fixture: a tiny BPE with a ChatML template

PAIRS = [(f"Reverse the word: word{i}", f"{i}drow", f"word{i}") for i in range(12)]


def string_rows() -> list[dict]:
    return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def whole(source: str) -> dict:
    """The arguments that make `source` the training split whole, tokenized in memory."""
    return {"source": source, "validation_source": source, "cache": False}


def tokens(sample: dict) -> tuple[list[int], list[int]]:
    """A sample's real tokens (the inputs, then the last label) and its label tokens."""
    real = int(sample["real_tokens"])
    inputs, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
    return inputs[:real] + [labels[real - 1]], [t for t in labels if t != IGNORE_INDEX]


def prompt_and_completion(sample: dict) -> tuple[list[int], list[int]]:
    """The tokens before the labels' first, and the labels (every completion token)."""
    sequence, targets = tokens(sample)
    return sequence[: len(sequence) - len(targets)], targets


def test_string_pairs_without_a_chat_template_are_bos_prompt_completion_eos(tmp_path):
    source = write("jsonl", string_rows(), tmp_path / "pairs")
    tok = ByteTokenizer()
    data = PreferenceDataset(tok, seq_len=64, **whole(source))
    assert len(data) == len(PAIRS)
    for (prompt, chosen, rejected), (good, bad) in zip(PAIRS, data):
        assert good["input_ids"].shape == bad["input_ids"].shape == (64,)
        assert prompt_and_completion(good) == (
            [tok.bos_id, *tok.encode(prompt)],
            [*tok.encode(chosen), tok.eos_id],
        )
        assert prompt_and_completion(bad) == (
            [tok.bos_id, *tok.encode(prompt)],
            [*tok.encode(rejected), tok.eos_id],
        )


def test_string_pairs_with_a_chat_template_are_a_user_turn_and_the_replies(chatml, tmp_path):
    source = write("jsonl", string_rows(), tmp_path / "pairs")
    data = PreferenceDataset(chatml, seq_len=96, **whole(source))
    for (prompt, chosen, rejected), (good, bad) in zip(PAIRS, data):
        rendered = chatml.apply_chat_template([user(prompt)], add_generation_prompt=True)
        for sample, reply in ((good, chosen), (bad, rejected)):
            # the reply and its end of turn, not the newline the template writes after it
            assert prompt_and_completion(sample) == (
                chatml.encode(rendered),
                chatml.encode(reply + "<|im_end|>"),
            )


def test_labels_are_only_on_the_completion_and_the_padding_is_pad(chatml, tmp_path):
    source = write("jsonl", string_rows(), tmp_path / "pairs")
    good, _ = PreferenceDataset(chatml, seq_len=96, **whole(source))[0]
    real = int(good["real_tokens"])
    labels = good["labels"].tolist()
    first = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
    assert all(t != IGNORE_INDEX for t in labels[first:real])
    assert all(t == IGNORE_INDEX for t in labels[real:])
    # the last real token is only a label: the padding starts after it
    assert good["input_ids"][real + 1 :].tolist() == [chatml.pad_id] * (95 - real)


def test_chosen_and_rejected_share_the_prompt_tokens(chatml, tmp_path):
    source = write("jsonl", string_rows(), tmp_path / "pairs")
    for tok in (ByteTokenizer(), chatml):
        for good, bad in PreferenceDataset(tok, seq_len=96, **whole(source)):
            assert prompt_and_completion(good)[0] == prompt_and_completion(bad)[0]


def test_conversational_pairs_take_their_shared_start_as_the_prompt(chatml, tmp_path):
    start = [user("hello"), assistant("Hello, user!"), user("Reverse the word: word1")]
    rows = [{"chosen": [*start, assistant("1drow")], "rejected": [*start, assistant("word1")]}]
    data = PreferenceDataset(chatml, seq_len=128, **whole(write("jsonl", rows, tmp_path / "c")))
    good, bad = data[0]
    rendered = chatml.apply_chat_template(start, add_generation_prompt=True)
    assert prompt_and_completion(good) == (
        chatml.encode(rendered),
        chatml.encode("1drow<|im_end|>"),
    )  # the earlier reply is prompt: no loss on it
    assert prompt_and_completion(bad) == (chatml.encode(rendered), chatml.encode("word1<|im_end|>"))


def test_trl_conversational_pairs_read_as_the_string_pairs(chatml, tmp_path):
    rows = [{"prompt": [user(p)], "chosen": [assistant(c)], "rejected": [assistant(r)]}
            for p, c, r in PAIRS]  # fmt: skip
    conversational = PreferenceDataset(
        chatml, seq_len=96, **whole(write("jsonl", rows, tmp_path / "trl"))
    )
    strings = PreferenceDataset(
        chatml, seq_len=96, **whole(write("jsonl", string_rows(), tmp_path / "s"))
    )
    assert len(conversational) == len(strings) == len(PAIRS)
    for ours, theirs in zip(conversational, strings):
        for a, b in zip(ours, theirs):
            assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_single_turn_conversation_reads_without_a_chat_template(tmp_path):
    rows = [{"prompt": [user(p)], "chosen": [assistant(c)], "rejected": [assistant(r)]}
            for p, c, r in PAIRS]  # fmt: skip
    tok = ByteTokenizer()
    data = PreferenceDataset(tok, seq_len=64, **whole(write("jsonl", rows, tmp_path / "c")))
    assert prompt_and_completion(data[0][0])[1] == [*tok.encode(PAIRS[0][1]), tok.eos_id]


def test_a_multi_turn_conversation_without_a_chat_template_is_a_bad_row(tmp_path):
    start = [user("hello"), assistant("hi"), user("Reverse the word: word1")]
    rows = [{"chosen": [*start, assistant("1drow")], "rejected": [*start, assistant("word1")]}]
    source = write("jsonl", rows, tmp_path / "c")
    with pytest.raises(DataError, match=r"c.jsonl:1 is a conversation .* has no chat template"):
        PreferenceDataset(ByteTokenizer(), seq_len=64, **whole(source))


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "shards", "datasets"])
def test_pairs_from_every_source_kind(tmp_path, kind):
    tok = ByteTokenizer()
    data = PreferenceDataset(tok, seq_len=64, **whole(write(kind, string_rows(), tmp_path / "d")))
    read = [[tok.decode(prompt_and_completion(s)[1][:-1]) for s in pair] for pair in data]
    assert read == [[c, r] for _, c, r in PAIRS]


def test_columns_map_the_datas_names(tmp_path):
    rows = [{"question": p, "good": c, "bad": r} for p, c, r in PAIRS]
    source = write("jsonl", rows, tmp_path / "d")
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    data = PreferenceDataset(ByteTokenizer(), seq_len=64, columns=columns, **whole(source))
    assert len(data) == len(PAIRS)


def test_collate_pairs_puts_each_chosen_before_its_rejected(tmp_path):
    source = write("jsonl", string_rows(), tmp_path / "pairs")
    data = PreferenceDataset(ByteTokenizer(), seq_len=64, **whole(source))
    pairs = [data[i] for i in range(3)]
    batch = collate_pairs(pairs)
    assert batch.input_ids.shape == (6, 64)
    for i, (good, bad) in enumerate(pairs):
        assert torch.equal(batch.input_ids[2 * i], good["input_ids"])
        assert torch.equal(batch.labels[2 * i + 1], bad["labels"])
        assert batch.real_tokens[2 * i + 1] == bad["real_tokens"]


def test_truncation_keeps_the_prompts_end_and_counts_the_pairs_cut(tmp_path):
    long_prompt = "the start " * 10 + "THE END: "
    rows = [*string_rows()[:3], {"prompt": long_prompt, "chosen": "yes", "rejected": "no"}]
    tok = ByteTokenizer()
    data = PreferenceDataset(tok, seq_len=32, **whole(write("jsonl", rows, tmp_path / "d")))
    good, bad = data[3]
    prompt, completion = prompt_and_completion(good)
    assert len(tokens(good)[0]) == 33  # seq_len + 1: the prompt cut just as much as needed
    assert tok.decode(prompt).endswith("THE END: ") and completion == [*tok.encode("yes"), 257]
    assert prompt_and_completion(bad)[0] == prompt  # the same cut for the rejected
    assert (data.fit.samples, data.fit.cut, data.fit.prompts_cut, data.fit.dropped) == (4, 1, 1, 0)
    assert "1 of 4 pairs cut at seq_len=32" in data.fit.line()


def test_max_prompt_len_cuts_every_longer_prompt_to_its_end(tmp_path):
    tok = ByteTokenizer()
    source = write("jsonl", string_rows(), tmp_path / "d")
    data = PreferenceDataset(tok, seq_len=64, max_prompt_len=8, **whole(source))
    for (prompt, _, _), (good, _) in zip(PAIRS, data):
        assert prompt_and_completion(good)[0] == tok.encode(prompt)[-8:]
    assert data.fit.prompts_cut == data.fit.cut == len(PAIRS)


def test_a_long_completion_keeps_half_the_sequence_for_the_prompt_and_loses_its_end(tmp_path):
    rows = [{"prompt": "p" * 40, "chosen": "c" * 100, "rejected": "r"}]
    tok = ByteTokenizer()
    data = PreferenceDataset(tok, seq_len=32, **whole(write("jsonl", rows, tmp_path / "d")))
    good, bad = data[0]
    assert prompt_and_completion(good) == (tok.encode("p" * 16), tok.encode("c" * 17))
    assert prompt_and_completion(bad) == (tok.encode("p" * 16), [*tok.encode("r"), 257])
    assert (data.fit.prompts_cut, data.fit.completions_cut) == (1, 1)


def test_a_file_without_a_rejected_column_is_one_paragraph_naming_the_columns(tmp_path):
    rows = [{"prompt": p, "chosen": c, "worse": r} for p, c, r in PAIRS]
    source = write("jsonl", rows, tmp_path / "d")
    with pytest.raises(DataError) as error:
        PreferenceDataset(ByteTokenizer(), seq_len=64, **whole(source))
    message = str(error.value)
    assert "\n" not in message
    assert "have the columns prompt, chosen, worse" in message  # before the split
    assert "chosen, rejected" in message and "dataset.columns.rejected=COLUMN" in message


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"prompt": "p", "chosen": "", "rejected": "r"}, "has an empty chosen"),
        ({"prompt": "p", "chosen": "c", "rejected": " "}, "has an empty rejected"),
        (
            {"prompt": [user("p")], "chosen": [assistant("")], "rejected": [assistant("r")]},
            "has an empty chosen",
        ),  # fmt: skip
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "has the same chosen and rejected"),
        (
            {"chosen": [user("p"), assistant("a")], "rejected": [user("p"), assistant("a")]},
            "has the same chosen and rejected",
        ),  # fmt: skip
    ],
    ids=["empty chosen", "blank rejected", "empty reply", "chosen is rejected", "same chats"],
)
def test_empty_completions_and_a_chosen_equal_to_its_rejected_are_bad_rows(tmp_path, row, problem):
    source = write("jsonl", [*string_rows(), row], tmp_path / "d")
    with pytest.raises(DataError, match=rf"d.jsonl:13 {problem}"):
        PreferenceDataset(ByteTokenizer(), seq_len=64, **whole(source))
    data = PreferenceDataset(ByteTokenizer(), seq_len=64, on_bad_row="skip", **whole(source))
    assert len(data) == len(PAIRS) and data.bad_rows.skipped == 1
    assert "1 of 13 rows skipped" in data.bad_rows.line()


def test_builtin_pairs_choose_the_right_answer_and_reject_a_plausible_wrong_one():
    tok = ByteTokenizer()
    data = PreferenceDataset(tok, num_builtin_examples=300, seq_len=64, val_fraction=0.05)
    kinds = set()
    for good, bad in data:
        prompt, chosen = (tok.decode(t) for t in prompt_and_completion(good))
        rejected = tok.decode(prompt_and_completion(bad)[1])
        task, word = next(
            (name, m.group(1)) for name, (text, _) in BUILTIN_TASKS.items()
            if (m := re.fullmatch(re.escape(text).replace(r"\{w\}", "([a-z]+)"), prompt))
        )  # fmt: skip
        right = BUILTIN_TASKS[task][1](word)
        assert chosen == right and rejected != right
        if task == "length":
            assert abs(int(rejected) - len(word)) == 1
            kinds.add("length")
        elif task == "reverse":
            near = (
                sorted(rejected) == sorted(right)
                and sum(a != b for a, b in zip(rejected, right)) == 2
            )
            assert rejected == word or near
            kinds.add("reversed" if rejected == word and word != right else "swapped")
        else:
            assert rejected == word or sum(a != b for a, b in zip(rejected, right)) == 1
            kinds.add("lower" if rejected == word else "one lower")
    assert kinds == {"length", "reversed", "swapped", "lower", "one lower"}


def test_builtin_pairs_are_the_instruct_examples_and_deterministic_from_the_seed():
    tok = ByteTokenizer()
    first = PreferenceDataset(tok, num_builtin_examples=100, seq_len=64, seed=3, cache=False)
    again = PreferenceDataset(tok, num_builtin_examples=100, seq_len=64, seed=3, cache=False)
    other = PreferenceDataset(tok, num_builtin_examples=100, seq_len=64, seed=4, cache=False)
    assert [tokens(p[1]) for p in first] == [tokens(p[1]) for p in again]
    assert [tokens(p[1]) for p in first] != [tokens(p[1]) for p in other]
    answers = {(e["prompt"], e["response"]) for e in builtin_examples(100, 3)}
    for good, _ in first:
        prompt, chosen = prompt_and_completion(good)
        assert (tok.decode(prompt), tok.decode(chosen[:-1])) in answers


def test_plausible_wrong_answers_differ_from_a_palindromes_reversal():
    rng = random.Random(0)
    assert {plausible_wrong("reverse", "level", rng) for _ in range(20)} <= {
        "elvel", "lveel", "leevl", "levle"
    }  # fmt: skip
    assert plausible_wrong("reverse", "xxxx", rng) == "xxx"  # the corpus has it


def test_builtin_refuses_a_format_or_columns():
    with pytest.raises(DataError, match="source=builtin is freetx's own preference pairs"):
        PreferenceDataset(ByteTokenizer(), columns={"chosen": "good"})


def test_a_max_prompt_len_below_one_is_meaningless():
    assert "max_prompt_len" in PreferenceDataset.meaningless({"max_prompt_len": 0})
    with pytest.raises(DataError, match="dataset.max_prompt_len=0"):
        PreferenceDataset(ByteTokenizer(), max_prompt_len=0)


def test_a_token_cache_hit_gives_the_same_samples(tmp_path):
    source = write("parquet", string_rows(), tmp_path / "d")
    kwargs = dict(
        source=source, validation_source=source, seq_len=64, cache_dir=str(tmp_path / "c")
    )
    built = PreferenceDataset(ByteTokenizer(), **kwargs)
    hit = PreferenceDataset(ByteTokenizer(), **kwargs)
    assert (built.token_cache.state, hit.token_cache.state) == ("built", "hit")
    assert len(hit) == len(built) == len(PAIRS)
    for ours, theirs in zip(hit, built):
        for a, b in zip(ours, theirs):
            assert all(torch.equal(a[k], b[k]) for k in b)


def test_the_summary_counts_pairs_and_two_sequences_each(tmp_path):
    source = write("jsonl", string_rows(), tmp_path / "d")
    summary = PreferenceDataset(ByteTokenizer(), seq_len=64, **whole(source)).summary()
    assert (summary.samples, summary.sequences, summary.unit) == (12, 24, "pairs")
    assert summary.lines()[0].startswith("data: 12 pairs -> 24 sequences of 64 tokens")


def test_a_preference_file_given_to_the_instruct_dataset_names_the_format(tmp_path):
    from freetx.data import InstructDataset

    source = write("jsonl", string_rows(), tmp_path / "d")
    with pytest.raises(DataError, match="looks like format preference"):
        InstructDataset(ByteTokenizer(), seq_len=64, **whole(source))


def test_data_show_renders_a_pairs_chosen_and_rejected():
    shown = run_freetx_here(
        "data", "show", "llm/instruct_tiny", "1", "dataset._component_=freetx.data.PreferenceDataset",
        "dataset.num_builtin_examples=40",
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    pair = lines.index("--- pair 1 of 37 (training split) ---")
    assert lines[pair + 1].startswith("chosen: [<bos>") and "rejected: [<bos>" in shown.stdout
    assert "data: 37 pairs -> 74 sequences of 64 tokens" in shown.stdout


def test_an_evaluation_shard_of_pairs_marks_both_samples_of_a_repeated_pair(tmp_path):
    source = write("jsonl", string_rows(), tmp_path / "d")
    data = PreferenceDataset(ByteTokenizer(), seq_len=64, **whole(source))
    shard = EvalShard(data, rank=2, world_size=5)  # pairs 2, 7 and 12: a repeat (of pair 0)
    batch = collate_pairs([shard[i] for i in range(len(shard))])
    assert batch.padding.tolist() == [False, False, False, False, True, True]
    assert torch.equal(batch.input_ids[2], data[7][0]["input_ids"])


def test_a_pairs_margin_column_reaches_its_batch_and_a_pair_without_one_has_margin_0(tmp_path):
    """TRL's reward modeling reads `margin` from the row: kept beside the pair's tokens (in
    the token cache too), served on both samples, 0 where the row has none; the split does
    not depend on it."""
    from freetx.data.preference import margin_row, row_margin

    for value in (0.0, -2.5, 1e-3, 37.25):
        assert row_margin(margin_row(value)) == pytest.approx(value, rel=1e-7)
    rows = [{**row, "margin": float(i) / 4} for i, row in enumerate(string_rows())]
    del rows[3]["margin"]  # a row without one
    source = write("jsonl", rows, tmp_path / "d")
    for cache in (False, True, True):  # in memory, a cache miss, a cache hit
        data = PreferenceDataset(ByteTokenizer(), seq_len=64, source=source,
                                 validation_source=source, cache=cache,
                                 cache_dir=str(tmp_path / "cache"))  # fmt: skip
        batch = collate_pairs([data[i] for i in range(len(data))])
        want = [0.0 if i == 3 else i / 4 for i in range(len(PAIRS))]
        assert batch.pair_margins().tolist() == want
        assert batch.margins[1::2].tolist() == want  # the rejected sample carries it too
    # the margin moves no row to the other split
    split = dict(source=source, val_fraction=0.3, cache=False)
    plain = write("jsonl", string_rows(), tmp_path / "plain")
    for name in ("train", "validation"):
        with_margins = PreferenceDataset(ByteTokenizer(), seq_len=64, split=name, **split)
        without = PreferenceDataset(ByteTokenizer(), seq_len=64, split=name,
                                    **{**split, "source": plain})  # fmt: skip
        assert [tokens(s[0]) for s in with_margins] == [tokens(s[0]) for s in without]


@pytest.mark.parametrize("margin", ["big", True, float("inf"), 1e39, 10**400])
def test_a_margin_that_is_no_finite_float32_is_a_bad_row_and_nan_is_none(tmp_path, margin):
    source = write("jsonl", [*string_rows(), {**string_rows()[0], "margin": margin}],
                   tmp_path / "d")  # fmt: skip
    with pytest.raises(DataError, match=r"d.jsonl:13 has .* in 'margin'.* finite number"):
        PreferenceDataset(ByteTokenizer(), seq_len=64, **whole(source))
    missing = write("jsonl", [{**row, "margin": float("nan")} for row in string_rows()],
                    tmp_path / "nan")  # fmt: skip
    data = PreferenceDataset(ByteTokenizer(), seq_len=64, **whole(missing))
    assert collate_pairs([data[0], data[1]]).pair_margins().tolist() == [0.0, 0.0]
