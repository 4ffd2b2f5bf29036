"""The formats users have (messages, sharegpt, alpaca, prompt_response, text) from every
kind of source (JSON lines, JSON, parquet, a folder of shards, a `datasets` save_to_disk
folder), column mapping, bad rows either way, and the hashed validation split."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from freetx.data import ByteTokenizer, HFTokenizer, InstructDataset, PackedTextDataset
from freetx.data.chat import ChatDataset
from freetx.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, Format
from freetx.data.text import read_documents, text_format
from freetx.data.tokenizers import leading_bos
from freetx.errors import DataError

PAIRS = [(f"Reverse the word: word{i}", f"{i}drow") for i in range(12)]
DOCS = [f"Document {i}: " + " ".join(f"w{i}_{j}" for j in range(20)) for i in range(12)]
ALPACA_INPUT = {3: "with this context", 7: "and this"}  # rows with an input


def rows_of(format: str) -> list[dict]:
    """PAIRS (DOCS for text) as rows of `format`."""
    if format == "messages":
        return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]}
                for p, r in PAIRS]  # fmt: skip
    if format == "sharegpt":
        return [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
                for p, r in PAIRS]  # fmt: skip
    if format == "alpaca":
        return [{"instruction": p, "input": ALPACA_INPUT.get(i, ""), "output": r}
                for i, (p, r) in enumerate(PAIRS)]  # fmt: skip
    if format == "prompt_response":
        return [{"prompt": p, "response": r, "id": i} for i, (p, r) in enumerate(PAIRS)]
    return [{"text": d} for d in DOCS]


def expected_pairs(format: str) -> list[dict]:
    if format != "alpaca":  # every other format holds PAIRS as they are
        return [{"prompt": p, "response": r} for p, r in PAIRS]
    return [
        {"prompt": ALPACA_PROMPT.format(instruction=p, input=ALPACA_INPUT[i])
         if i in ALPACA_INPUT else ALPACA_PROMPT_NO_INPUT.format(instruction=p), "response": r}
        for i, (p, r) in enumerate(PAIRS)
    ]  # fmt: skip


def write(kind: str, rows: list[dict], path: Path) -> str:
    """`rows` as a source of `kind`; returns dataset.source."""
    if kind == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path = path.with_suffix(".json")
        path.write_text(json.dumps(rows, indent=1))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
    elif kind == "shards":  # a folder: JSON lines, a JSON list and parquet, sorted by name
        path.mkdir()
        write("jsonl", rows[:4], path / "a")
        write("json", rows[4:8], path / "b")
        write("parquet", rows[8:], path / "c")
    else:
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def examples_of(data) -> list[dict]:
    """An InstructDataset's pairs, read back from its rows (byte tokenizer: BOS + prompt,
    then response + EOS as the targets)."""
    tok, pairs = ByteTokenizer(), []
    for i in range(len(data.rows)):
        ids, targets = data.rows[i]
        prompt = [t for t, target in zip(ids, targets) if not target][len(leading_bos(tok)) :]
        response = [t for t, target in zip(ids, targets) if target][:-1]
        pairs.append({"prompt": tok.decode(prompt), "response": tok.decode(response)})
    return pairs


def whole(source: str) -> dict:
    """The arguments that make `source` the training split whole."""
    return {"source": source, "validation_source": source}


KINDS = ["jsonl", "json", "parquet", "shards", "datasets"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("format", ["messages", "sharegpt", "alpaca", "prompt_response"])
def test_every_pair_format_from_every_source_kind(tmp_path, kind, format):
    source = write(kind, rows_of(format), tmp_path / "data")
    data = InstructDataset(ByteTokenizer(), seq_len=256, format=format, **whole(source))
    assert examples_of(data) == expected_pairs(format)


@pytest.mark.parametrize("kind", KINDS)
def test_text_from_every_source_kind(tmp_path, kind):
    source = write(kind, rows_of("text"), tmp_path / "data")
    assert read_documents(source) == DOCS
    data = PackedTextDataset(ByteTokenizer(), seq_len=32, **whole(source))
    tok = ByteTokenizer()
    assert data.tokens.tolist() == [t for d in DOCS for t in [tok.bos_id, *tok.encode(d), 257]]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> HFTokenizer:
    """A tiny BPE with ChatML's template; a system message cannot be rendered."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(["Reverse the word: word1 1drow"], trainer)
    folder = tmp_path_factory.mktemp("chatml")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}"
        "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    )
    return HFTokenizer(str(folder))


def test_chat_reads_every_format_as_the_same_conversations(chatml, tmp_path):
    """messages, sharegpt and prompt_response give the same token rows; alpaca's prompt
    is its template's."""
    rows = {}
    for format in ("messages", "sharegpt", "prompt_response", "alpaca"):
        source = write("jsonl", rows_of(format), tmp_path / format)
        data = ChatDataset(chatml, seq_len=512, format=format, **whole(source))
        rows[format] = [data.rows[i] for i in range(len(data))]
    assert rows["messages"] == rows["sharegpt"] == rows["prompt_response"]
    alpaca_text = chatml.decode(rows["alpaca"][0][0])
    assert "### Instruction:\nReverse the word: word0\n\n### Response:\n" in alpaca_text


def test_the_format_is_found_from_the_columns_as_trl_names_them(chatml, tmp_path):
    """No dataset.format: InstructDataset and ChatDataset (llm/hf_tiny_kd's and hf_tiny_full's)
    read a chat file, a prompt/completion file of strings or of messages (TRL's
    conversational, prompt-completion and conversational prompt-completion formats),
    sharegpt and alpaca alike, by the columns of their first rows."""
    completion = [{"prompt": p, "completion": r} for p, r in PAIRS]
    turns = [{"prompt": [{"role": "user", "content": p}],
              "completion": [{"role": "assistant", "content": r}]} for p, r in PAIRS]  # fmt: skip
    chat = {}
    for name, rows in [*((f, rows_of(f)) for f in ("messages", "sharegpt", "alpaca")),
                       ("completion", completion), ("turns", turns)]:  # fmt: skip
        source = write("parquet" if name == "sharegpt" else "jsonl", rows, tmp_path / name)
        pairs = examples_of(InstructDataset(ByteTokenizer(), seq_len=256, **whole(source)))
        assert pairs == expected_pairs(name), name
        data = ChatDataset(chatml, seq_len=512, **whole(source))
        chat[name] = [data.rows[i] for i in range(len(data))]
    assert chat["messages"] == chat["completion"] == chat["turns"] == chat["sharegpt"]


def test_rows_of_another_format_are_refused_before_the_split_naming_the_columns(tmp_path):
    """Each kind of dataset checks its first rows' columns against its format before the
    hashed split (which sends rows without those columns all one way): one paragraph with
    the columns found, those expected and the keys that read them."""
    from freetx.data import PreferenceDataset, PromptDataset

    chat = write("jsonl", rows_of("messages"), tmp_path / "chat")
    cases = [
        (InstructDataset, {"format": "prompt_response", "seq_len": 64}, chat,
         "the columns messages, and InstructDataset reads them as format prompt_response "
         "(dataset.format), whose rows have the columns prompt, response. The data looks like "
         "format messages: set dataset.format=messages"),
        (InstructDataset, {}, write("jsonl", [{"question": p, "answer": r} for p, r in PAIRS],
                                    tmp_path / "qa"),
         "the columns question, answer, and InstructDataset reads them as format prompt_response "
         "(its default: dataset.format is not set), whose rows have the columns prompt, "
         "response. Map those columns onto yours with dataset.columns"),
        (PackedTextDataset, {}, chat, "looks like format messages: conversations and "
         "prompt/response pairs are freetx.data.ChatDataset's"),
        (PreferenceDataset, {}, chat, "whose rows have the columns chosen, rejected (and prompt, "
         "unless they hold messages). The data looks like format messages"),
        (PromptDataset, {}, write("jsonl", rows_of("text"), tmp_path / "text"),
         "the columns text, and PromptDataset reads them as format prompt (its default: "
         "dataset.format is not set), whose rows have the columns prompt (or messages). The "
         "data looks like format text: plain text is freetx.data.PackedTextDataset's"),
    ]  # fmt: skip
    for dataset, keys, source, fragment in cases:
        with pytest.raises(DataError) as error:
            dataset(ByteTokenizer(), **keys, **whole(source))
        assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_builtin_examples_are_prompt_response_rows(chatml):
    chat = ChatDataset(chatml, source="builtin", seq_len=512, num_builtin_examples=40)
    pairs = InstructDataset(ByteTokenizer(), source="builtin", num_builtin_examples=40)
    assert len(chat) == len(pairs) > 30  # the same rows in the training split
    with pytest.raises(DataError, match="source=builtin is freetx's own prompt/response"):
        ChatDataset(chatml, source="builtin", seq_len=512, format="sharegpt")


def test_column_mapping(tmp_path):
    # ShareGPT-like data under other names, read as messages (roles as they are)
    renamed = [{"turns": [{"speaker": "user", "text": p}, {"speaker": "assistant", "text": r}]}
               for p, r in PAIRS]  # fmt: skip
    source = write("jsonl", renamed, tmp_path / "renamed")
    columns = {"messages": "turns", "role": "speaker", "content": "text"}
    data = InstructDataset(ByteTokenizer(), format="messages", columns=columns, **whole(source))
    assert examples_of(data) == expected_pairs("messages")
    # text in another column: columns and the older text_field alike
    body = write("parquet", [{"body": d, "other": 1} for d in DOCS], tmp_path / "body")
    mapped = PackedTextDataset(ByteTokenizer(), seq_len=32, columns={"text": "body"}, **whole(body))
    older = PackedTextDataset(ByteTokenizer(), seq_len=32, text_field="body", **whole(body))
    assert mapped.tokens.tolist() == older.tokens.tolist()
    assert read_documents(body, text_format(None, {"text": "body"}, "text", body)) == DOCS
    with pytest.raises(DataError, match="names speaker, which format alpaca does not read"):
        InstructDataset(ByteTokenizer(), format="alpaca", columns={"speaker": "x"}, **whole(source))


@pytest.mark.parametrize(
    "dataset, format, error",
    [
        (InstructDataset, "csv", "dataset.format='csv' is not a format freetx reads"),
        (InstructDataset, "text", "InstructDataset reads the formats .* not text"),
        (PackedTextDataset, "alpaca", "PackedTextDataset reads the formats text, not alpaca"),
    ],
)
def test_a_format_a_dataset_does_not_read(tmp_path, dataset, format, error):
    source = write("jsonl", rows_of("prompt_response"), tmp_path / "d")
    with pytest.raises(DataError, match=error):
        dataset(ByteTokenizer(), format=format, **whole(source))


# -- bad rows --------------------------------------------------------------------------
def with_bad_rows(kind: str, tmp_path: Path) -> tuple[str, str]:
    """prompt_response rows with two bad ones (a missing column; a number, or a null);
    where the first one is."""
    rows = rows_of("prompt_response")
    rows[2] = {"prompt": "no response"}
    # a column holds one type in parquet and datasets: there a null is the bad value
    rows[5] = {"prompt": "a number", "response": 5 if kind in ("jsonl", "json") else None}
    source = write(kind, rows, tmp_path / "bad")
    where = {"jsonl": f"{source}:3", "json": f"{source}, item 2", "parquet": f"{source}, row 2",
             "datasets": f"{source}, row 2"}[kind]  # fmt: skip
    return source, where


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "datasets"])
def test_a_bad_row_is_named_or_skipped_and_counted(tmp_path, kind):
    source, where = with_bad_rows(kind, tmp_path)
    with pytest.raises(DataError) as error:
        InstructDataset(ByteTokenizer(), **whole(source))
    message = str(error.value)
    assert message.startswith(f"{where} has no 'response' column"), message
    assert "dataset.on_bad_row=skip" in message
    data = InstructDataset(ByteTokenizer(), on_bad_row="skip", **whole(source))
    assert len(data) == len(PAIRS) - 2
    assert (data.bad_rows.skipped, data.bad_rows.rows) == (2, len(PAIRS))
    assert data.bad_rows.line().startswith(
        f"dataset {source} (train): 2 of 12 rows skipped (dataset.on_bad_row=skip); the first: "
        f"{where}"
    )


def test_unreadable_lines_and_unrenderable_conversations_are_bad_rows(chatml, tmp_path):
    lines = [json.dumps(r) for r in rows_of("messages")[:4]]
    lines[1] = '{"messages": ['  # not JSON
    lines[2] = json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                        *rows_of("messages")[2]["messages"]]})  # fmt: skip
    source = tmp_path / "chat.jsonl"
    source.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"chat.jsonl:2 is not valid JSON"):
        ChatDataset(chatml, seq_len=64, **whole(str(source)))
    data = ChatDataset(chatml, seq_len=64, on_bad_row="skip", **whole(str(source)))
    assert len(data) == 2 and data.bad_rows.skipped == 2
    lines[1] = lines[0].replace("word0", "word9")
    source.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"chat.jsonl:3 cannot be rendered: .*no system messages"):
        ChatDataset(chatml, seq_len=64, **whole(str(source)))


def test_sources_that_cannot_be_read(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    both = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows_of("prompt_response"))})
    both.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"holds a DatasetDict .*dict/train"):
        InstructDataset(ByteTokenizer(), **whole(str(tmp_path / "dict")))
    folder = write("datasets", rows_of("prompt_response"), tmp_path / "saved")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DataError, match="needs the datasets library: pip install datasets"):
        InstructDataset(ByteTokenizer(), **whole(folder))
    parquet = write("parquet", rows_of("text"), tmp_path / "texts")
    with pytest.raises(DataError, match=r"columns text, .*prompt, response\. .*PackedTextDataset"):
        InstructDataset(ByteTokenizer(), **whole(parquet))
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(Path(parquet).read_bytes()[:-100])
    with pytest.raises(DataError, match=r"damaged.parquet is not a readable parquet file"):
        PackedTextDataset(ByteTokenizer(), **whole(str(damaged)))


# -- the validation split ----------------------------------------------------------------
def task_rows(count: int) -> list[dict]:
    """Rows cycling over 4 tasks, as generated and merged sets often are."""
    tasks = ["Reverse", "Capitalize", "Count the letters of", "Spell"]
    return [{"prompt": f"{tasks[i % 4]} word{i}", "response": f"answer {i}"} for i in range(count)]


def split_prompts(source: str, split: str, **kwargs) -> list[str]:
    data = InstructDataset(ByteTokenizer(), source=source, split=split, **kwargs)
    return [e["prompt"] for e in examples_of(data)]


def test_the_validation_split_of_periodic_rows_holds_every_kind(tmp_path):
    """Every 4th row would be one task; a hash of each row takes all four."""
    source = write("jsonl", task_rows(400), tmp_path / "tasks")
    val = split_prompts(source, "validation", val_fraction=0.25)
    train = split_prompts(source, "train", val_fraction=0.25)
    assert {p.rsplit(" ", 1)[0] for p in val} == {
        "Reverse", "Capitalize", "Count the letters of", "Spell"
    }  # fmt: skip
    assert set(val).isdisjoint(train) and len(val) + len(train) == 400
    assert 70 < len(val) < 130  # about val_fraction of the rows


def test_the_split_is_stable_as_the_file_grows_and_in_any_order(tmp_path):
    rows = task_rows(300)
    first = split_prompts(write("jsonl", rows[:200], tmp_path / "first"), "validation")
    grown = split_prompts(write("jsonl", rows, tmp_path / "grown"), "validation")
    shuffled = split_prompts(write("parquet", rows[::-1], tmp_path / "reversed"), "validation")
    assert first == [p for p in grown if int(p.rsplit("word", 1)[1]) < 200]
    assert sorted(grown) == sorted(shuffled)
    other_seed = split_prompts(write("jsonl", rows, tmp_path / "seeded"), "validation", seed=1)
    assert sorted(other_seed) != sorted(grown)


def test_a_validation_source_is_the_whole_validation_split(tmp_path):
    train_source = write("jsonl", task_rows(40), tmp_path / "train")
    val_source = write("parquet", rows_of("prompt_response"), tmp_path / "val")
    kwargs = {"validation_source": val_source}
    assert len(split_prompts(train_source, "train", **kwargs)) == 40
    assert split_prompts(train_source, "validation", **kwargs) == [p for p, _ in PAIRS]
    text = write("jsonl", rows_of("text"), tmp_path / "text")
    val = PackedTextDataset(ByteTokenizer(), seq_len=32, split="validation", source="builtin",
                            validation_source=text)  # fmt: skip
    assert val.files_read == [Path(text)] and len(val) == (len(val.tokens) - 1) // 32


def test_an_empty_validation_split_says_how_to_fix_it(tmp_path):
    source = write("jsonl", rows_of("prompt_response")[:1], tmp_path / "one")
    with pytest.raises(
        DataError, match="split takes a row by a seeded hash .*dataset.validation_source"
    ):
        InstructDataset(ByteTokenizer(), source=source, split="validation")


def test_format_keys_hash_the_columns_read_not_the_rest():
    fmt = Format.of(None, None, "InstructDataset", ("prompt_response",), "prompt_response")
    from freetx.data.sources import Record

    a = Record("a:1", {"prompt": "p", "response": "r", "id": 1})
    b = Record("b:9", {"response": "r", "prompt": "p", "id": 2})
    assert fmt.key(a) == fmt.key(b)  # the same example: the same split, wherever it is


def test_a_text_source_counts_its_bad_rows_once_for_both_splits(tmp_path):
    source = tmp_path / "docs.jsonl"
    lines = [json.dumps(r) for r in rows_of("text")]
    source.write_text("\n".join([*lines[:5], "not json", *lines[5:]]) + "\n")
    with pytest.raises(DataError, match=r"docs.jsonl:6 is not valid JSON"):
        PackedTextDataset(ByteTokenizer(), source=str(source), seq_len=16)
    tok = ByteTokenizer()  # one, as a run has: the splits share the token stream
    train, val = (
        PackedTextDataset(tok, source=str(source), seq_len=16, split=split,
                          on_bad_row="skip", val_fraction=0.2)
        for split in ("train", "validation")
    )  # fmt: skip
    assert train.bad_rows.line() == val.bad_rows.line()  # one read: one line at start-up
    assert f"{source} (train and validation): 1 of 13 rows skipped" in train.bad_rows.line()
    alone = PackedTextDataset(tok, source="builtin", validation_source=str(source), seq_len=16,
                              split="validation", on_bad_row="skip")  # fmt: skip
    assert f"{source} (validation): 1 of 13 rows skipped" in alone.bad_rows.line()
