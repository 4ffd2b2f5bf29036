"""PromptDataset: every prompt format, the chat-template path, the built-in tasks, the
split, bad rows, max_prompt_len, and the loaders' batches (collate_prompts)."""

from __future__ import annotations

import pytest

from freetx.data import (
    ByteTokenizer,
    PromptBatch,
    PromptDataset,
    build_eval_loader,
    build_train_loader,
    collate_prompts,
)
from freetx.data.instruct import BUILTIN_TASKS
from freetx.data.prompts import prompt_problems
from freetx.errors import DataError
from tests.unit import test_formats
from tests.unit.test_formats import write

chatml = test_formats.chatml  # the fixture: a tiny BPE with a ChatML template
BYTES = ByteTokenizer()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def whole(source: str, **settings) -> dict:
    """The arguments that make `source` the training split whole."""
    return {"source": source, "validation_source": source, **settings}


def bos_prompt(text: str) -> list[int]:
    return [BYTES.bos_id, *BYTES.encode(text)]


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
def test_string_prompts_keep_their_other_columns_as_fields(kind, tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": i} for i in range(4)]
    source = write(kind, rows, tmp_path / "p")
    data = PromptDataset(BYTES, **whole(source))
    assert (len(data), data.files_read) == (4, [tmp_path / f"p.{kind}"])
    sample = data[2]
    assert sample["prompt"] == "What is 2 + 1?"
    assert sample["prompt_ids"].tolist() == bos_prompt("What is 2 + 1?")
    assert sample["fields"] == {"answer": "3", "level": 2}
    where = {"jsonl": "p.jsonl:3", "json": "p.json, item 2", "parquet": "p.parquet, row 2"}
    assert sample["id"] == str(tmp_path / where[kind])


def test_a_prompt_of_messages_is_one_user_turn_without_a_chat_template(tmp_path):
    rows = [{"prompt": [user("Reverse the word: abc")], "answer": "cba"}]
    data = PromptDataset(BYTES, **whole(write("jsonl", rows, tmp_path / "m")))
    assert data[0]["prompt"] == "Reverse the word: abc"
    assert data[0]["prompt_ids"].tolist() == bos_prompt("Reverse the word: abc")
    assert data[0]["fields"] == {"answer": "cba"}


def test_a_messages_row_ending_in_an_assistant_turn_gives_it_as_the_answer(tmp_path):
    rows = [
        {"messages": [user("Reverse the word: abc"), assistant("cba")]},
        {"messages": [user("Reverse the word: xy"), assistant("yx")], "answer": "given"},
        {"messages": [user("Reverse the word: pq")], "source": "web"},
    ]
    data = PromptDataset(BYTES, **whole(write("jsonl", rows, tmp_path / "m")))
    assert [data[i]["fields"] for i in range(3)] == [
        {"answer": "cba"},
        {"answer": "given"},
        {"source": "web"},
    ]
    assert data[0]["prompt_ids"].tolist() == bos_prompt("Reverse the word: abc")


def test_sharegpt_rows_with_mapped_columns_read_as_messages(tmp_path):
    rows = [{"chat": [{"from": "human", "value": "Say hi"}, {"from": "gpt", "value": "hi"}]}]
    source = write("jsonl", rows, tmp_path / "s")
    data = PromptDataset(BYTES, format="sharegpt", columns={"messages": "chat"}, **whole(source))
    assert (data[0]["prompt"], data[0]["fields"]) == ("Say hi", {"answer": "hi"})


def test_prompts_render_with_the_chat_templates_generation_prompt(chatml, tmp_path):
    conversation = [user("Reverse the word: word1"), assistant("1drow")]
    rows = [{"prompt": "Reverse the word: word1"}, {"messages": conversation}]
    data = PromptDataset(chatml, **whole(write("jsonl", rows, tmp_path / "c")))
    rendered = chatml.apply_chat_template(conversation[:1], add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    for i in range(2):
        assert data[i]["prompt_ids"].tolist() == chatml.encode(rendered)
        assert data[i]["prompt"] == "Reverse the word: word1"
    assert data[1]["fields"] == {"answer": "1drow"}


def test_a_longer_conversation_needs_a_chat_template(chatml, tmp_path):
    rows = [{"messages": [user("hi"), assistant("hello"), user("Reverse the word: word1")]}]
    source = write("jsonl", rows, tmp_path / "c")
    with pytest.raises(DataError, match="no chat template"):
        PromptDataset(BYTES, **whole(source))
    data = PromptDataset(chatml, **whole(source))
    assert data[0]["prompt"] == "Reverse the word: word1"
    assert chatml.decode(data[0]["prompt_ids"]).count("user\n") == 2  # both turns rendered


def test_builtin_prompts_carry_the_right_answer_and_the_task():
    data = PromptDataset(BYTES, num_builtin_examples=200)
    assert {data[i]["id"].rsplit(" ", 1)[0] for i in range(len(data))} == {"builtin prompt"}
    for i in range(len(data)):
        sample = data[i]
        template, answer = BUILTIN_TASKS[sample["fields"]["task"]]
        word = template.split("{w}")[0]
        assert sample["prompt"].startswith(word)
        said = sample["prompt"][len(word) : len(sample["prompt"]) - len(template.split("{w}")[1])]
        assert sample["fields"]["answer"] == answer(said)


def test_builtin_tasks_filter_keeps_only_the_tasks_named():
    data = PromptDataset(BYTES, num_builtin_examples=200, tasks=["reverse", "length"])
    assert {data[i]["fields"]["task"] for i in range(len(data))} == {"reverse", "length"}


def test_tasks_that_are_no_builtin_task_are_refused_naming_them():
    with pytest.raises(DataError, match="reversed is none of them"):
        PromptDataset(BYTES, num_builtin_examples=20, tasks=["reversed"])
    assert "tasks" in prompt_problems({"tasks": []})


def test_tasks_with_a_file_source_are_refused(tmp_path):
    source = write("jsonl", [{"prompt": "x"}], tmp_path / "p")
    with pytest.raises(DataError, match="dataset.source=builtin"):
        PromptDataset(BYTES, tasks=["reverse"], **whole(source))


def test_train_and_validation_splits_are_disjoint_and_cover_the_prompts(tmp_path):
    rows = [{"prompt": f"prompt number {i}", "answer": str(i)} for i in range(200)]
    source = write("jsonl", rows, tmp_path / "p")
    train, val = (
        PromptDataset(BYTES, source=source, split=s, val_fraction=0.2)
        for s in ("train", "validation")
    )
    train_prompts = {train[i]["prompt"] for i in range(len(train))}
    val_prompts = {val[i]["prompt"] for i in range(len(val))}
    assert not train_prompts & val_prompts
    assert len(train_prompts | val_prompts) == 200 and 10 < len(val_prompts) < 80


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"question": "no prompt column"}, "has no 'prompt' column"),
        ({"prompt": "   "}, "empty prompt"),
        ({"prompt": 7}, "has a int in 'prompt'"),
        ({"messages": [assistant("only a reply")]}, "ends with the user's turn"),
    ],
)
def test_bad_rows_are_named_or_skipped_and_counted(row, problem, tmp_path):
    rows = [{"prompt": f"good {i}"} for i in range(3)] + [row]
    source = write("jsonl", rows, tmp_path / "p")
    with pytest.raises(DataError, match=problem) as error:
        PromptDataset(BYTES, **whole(source))
    assert "p.jsonl:4" in str(error.value) and "on_bad_row=skip" in str(error.value)
    data = PromptDataset(BYTES, on_bad_row="skip", **whole(source))
    assert (len(data), data.bad_rows.skipped) == (3, 1)


def test_a_format_prompt_datasets_do_not_read_is_refused():
    with pytest.raises(DataError, match="PromptDataset reads the formats prompt"):
        PromptDataset(BYTES, source="x.jsonl", format="alpaca")
    with pytest.raises(DataError, match="drop dataset.format"):
        PromptDataset(BYTES, num_builtin_examples=20, format="messages")


def test_max_prompt_len_keeps_the_end_of_a_long_prompt_and_counts_it(tmp_path):
    rows = [{"prompt": "short"}, {"prompt": "a long preamble. Then the question?"}]
    data = PromptDataset(BYTES, max_prompt_len=10, **whole(write("jsonl", rows, tmp_path / "p")))
    assert data[0]["prompt_ids"].tolist() == bos_prompt("short")
    assert data[1]["prompt_ids"].tolist() == BYTES.encode(" question?")
    assert data[1]["prompt"] == rows[1]["prompt"]  # the rewards see it whole
    assert (data.fit.cut, data.fit.samples) == (1, 2)
    assert "1 of 2 prompts cut to max_prompt_len=10" in data.fit.line()
    assert data.summary().lines() == [
        "data: 2 prompts -> 2 sequences of 10 tokens, 20.0% padding (not packed)"
    ]  # 6 + 10 tokens of 2 x 10
    with pytest.raises(DataError, match="max_prompt_len=0"):
        PromptDataset(BYTES, max_prompt_len=0, num_builtin_examples=20)


def test_the_fields_served_are_a_copy(tmp_path):
    data = PromptDataset(
        BYTES, **whole(write("jsonl", [{"prompt": "p", "answer": "a"}], tmp_path / "p"))
    )
    data[0]["fields"]["completion_tokens"] = 5
    assert data[0]["fields"] == {"answer": "a"}


def test_the_train_loader_gives_prompt_batches_of_the_micro_batch():
    data = PromptDataset(BYTES, num_builtin_examples=100)
    loader = build_train_loader(data, 8, 2, 0, 1, seed=0, collate=collate_prompts)
    batch = next(iter(loader))
    assert isinstance(batch, PromptBatch)
    assert [len(batch.prompt_ids), len(batch.prompts), len(batch.fields), len(batch.ids)] == [4] * 4
    assert batch.padding == [False] * 4
    index = {data[i]["id"]: i for i in range(len(data))}[batch.ids[0]]
    assert batch.prompt_ids[0] == data[index]["prompt_ids"].tolist()


def test_the_eval_loader_marks_the_repeats_that_fill_the_last_rank(tmp_path):
    rows = [{"prompt": f"p{i}"} for i in range(5)]
    data = PromptDataset(BYTES, **whole(write("jsonl", rows, tmp_path / "p")))
    ranks = [list(build_eval_loader(data, 4, r, 2, collate=collate_prompts)) for r in (0, 1)]
    assert [len(batches) for batches in ranks] == [2, 2]
    assert [ranks[0][-1].padding, ranks[1][-1].padding] == [[False], [True]]  # 3 of 5 each
    seen = [
        p for batches in ranks for b in batches for p, pad in zip(b.prompts, b.padding) if not pad
    ]
    assert sorted(seen) == [f"p{i}" for i in range(5)]
