"""The token cache: a second build is a hit with the same samples, a change of source or
tokenizer misses, a damaged entry (or one without checksums) is named and rebuilt, a
flipped byte is refused, concurrent builders meet at the lock, and `freetx data prepare`
makes what `freetx run` then reuses."""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from freetx.data import (
    ByteTokenizer,
    ChatDataset,
    GlobalBatchSampler,
    HFTokenizer,
    InstructDataset,
    PackedTextDataset,
)
from freetx.data.token_cache import open_entry
from freetx.errors import DataError
from tests.conftest import REPO, flat, flip_byte, one_paragraph, run_freetx, run_freetx_here


def write_examples(path: Path, count: int, salt: str = "") -> str:
    lines = [
        json.dumps({"prompt": f"Say {i}{salt} twice.\n", "response": f"{i} {i}" + "!" * (i % 7)})
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_documents(path: Path, count: int) -> str:
    docs = [{"text": f"document {i}: " + "lorem ipsum dolor " * (1 + i % 13)} for i in range(count)]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)


def samples(data) -> list[dict[str, torch.Tensor]]:
    return [data[i] for i in range(len(data))]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir() and p.name != "hashes")


def test_a_second_build_maps_the_entry_and_serves_the_same_samples(tmp_path):
    cache, tok = tmp_path / "cache", ByteTokenizer()
    source = write_examples(tmp_path / "pairs.jsonl", 60)
    made = {}
    for split in ("train", "validation"):
        first = InstructDataset(tok, source, seq_len=24, split=split, cache_dir=str(cache))
        again = InstructDataset(tok, source, seq_len=24, split=split, cache_dir=str(cache))
        uncached = InstructDataset(
            tok, source, seq_len=24, split=split, cache=False, cache_dir=str(tmp_path / "off")
        )
        assert (first.token_cache.state, again.token_cache.state) == ("built", "hit")
        assert (
            uncached.token_cache.state == "off" and "cache is false" in uncached.token_cache.line()
        )
        assert isinstance(again.rows.ids, np.memmap)  # mapped, not read
        assert again.rows.ids.dtype == "uint16"  # a 259-token vocabulary fits
        assert same(samples(first), samples(again)) and same(samples(first), samples(uncached))
        assert first.fit == again.fit  # samples cut at seq_len, counted alike
        made[split] = again.token_cache.folder
    assert len(entries(cache)) == 2 and made["train"] != made["validation"]
    assert not (tmp_path / "off").exists()  # cache=false writes nothing, not even hashes
    other = InstructDataset(tok, source, seq_len=24, val_fraction=0.2, cache_dir=str(cache))
    assert other.token_cache.state == "built"  # another split: another entry


def test_text_keeps_no_target_flags_and_its_windows_are_unchanged(tmp_path):
    cache, tok = tmp_path / "cache", ByteTokenizer()
    source = write_documents(tmp_path / "docs.jsonl", 40)
    for split in ("train", "validation"):
        cached = PackedTextDataset(tok, source, seq_len=16, split=split, cache_dir=str(cache))
        memory = PackedTextDataset(tok, source, seq_len=16, split=split, cache=False)
        assert same(samples(cached), samples(memory))
        assert all(s["input_ids"].dtype == torch.long for s in samples(cached)[:3])
    (entry,) = entries(cache)  # one entry for both splits: the split is made from windows
    PackedTextDataset(tok, source, seq_len=32, val_fraction=0.1, cache_dir=str(cache))
    assert entries(cache) == [entry]  # nor does seq_len or val_fraction change the tokens
    assert sorted(p.name for p in entry.iterdir()) == ["ids.bin", "meta.json", "offsets.bin"]


def test_a_changed_source_or_tokenizer_misses(tmp_path):
    pytest.importorskip("transformers")
    from tests.hf_folders import make_tokenizer

    cache = tmp_path / "cache"
    folder = tmp_path / "tok"
    make_tokenizer(folder, ["hello there, how are you? fine thanks"] * 3)
    chats = tmp_path / "chat.jsonl"
    record = lambda i: {"messages": [{"role": "user", "content": f"hi {i}"},  # noqa: E731
                                     {"role": "assistant", "content": f"hello {i}"}]}  # fmt: skip
    chats.write_text("".join(json.dumps(record(i)) + "\n" for i in range(20)))

    def build():
        data = ChatDataset(HFTokenizer(str(folder)), str(chats), seq_len=64, cache_dir=str(cache))
        return data.token_cache.state, samples(data)

    state, before = build()
    assert state == "built" and build()[0] == "hit"
    with open(chats, "a") as f:  # the source grows
        f.write(json.dumps(record(20)) + "\n")
    assert build()[0] == "built"
    template = folder / "chat_template.jinja"  # the tokenizer's files change
    template.write_text(
        template.read_text().replace("<|eot_id|>{% endfor %}", "<|eot_id|>\n{% endfor %}")
    )
    state, after = build()
    assert state == "built" and not same(before, after)
    assert len(entries(cache)) == 3


@pytest.mark.parametrize("damage", ["truncated", "deleted", "garbled", "unchecked"])
def test_a_damaged_entry_is_named_and_rebuilt(tmp_path, capsys, damage):
    cache, tok = tmp_path / "cache", ByteTokenizer()
    source = write_examples(tmp_path / "pairs.jsonl", 40)
    build = lambda: InstructDataset(tok, source, seq_len=24, cache_dir=str(cache))  # noqa: E731
    good = samples(build())
    (entry,) = entries(cache)
    if damage == "truncated":
        ids = entry / "ids.bin"
        ids.write_bytes(ids.read_bytes()[:-10])
        named = "ids.bin holds"
    elif damage == "deleted":
        (entry / "targets.bin").unlink()
        named = "targets.bin is missing"
    elif damage == "garbled":
        (entry / "meta.json").write_text('{"format": 1, "counts": ')
        named = "meta.json does not parse"
    else:  # as an earlier freetx wrote it: not trusted unverified
        meta = json.loads((entry / "meta.json").read_text())
        del meta["checksums"]
        (entry / "meta.json").write_text(json.dumps(meta))
        named = "meta.json records no checksums: an earlier freetx wrote it"
    assert open_entry(entry)[0] is None
    capsys.readouterr()
    rebuilt = build()
    err = flat(capsys.readouterr().err)
    assert f"token cache: {entry} cannot be used ({named}" in err and "building it again" in err
    assert rebuilt.token_cache.state == "rebuilt" and same(samples(rebuilt), good)
    assert build().token_cache.state == "hit" and entries(cache) == [entry]


@pytest.mark.parametrize("array", ["ids", "targets", "offsets", "first_targets"])
def test_a_flipped_byte_is_refused_naming_the_file(tmp_path, array):
    cache, tok = tmp_path / "cache", ByteTokenizer()
    source = write_examples(tmp_path / "pairs.jsonl", 40)
    build = lambda: InstructDataset(tok, source, seq_len=24, cache_dir=str(cache))  # noqa: E731
    build()
    (entry,) = entries(cache)
    flip_byte(entry / f"{array}.bin")  # sizes right, a byte wrong: only the checksum tells
    with pytest.raises(DataError) as error:
        build()
    assert flat(str(error.value)) == (
        f"token cache {entry}: {array}.bin is damaged: its bytes differ from what was saved (its "
        "checksum in meta.json does not match), and reading it would give other tokens than the "
        "dataset's. Delete that folder and run again (or `freetx data prepare` with the run's "
        "config): it is built again. If it happens again, check the disk."
    )


def test_prepare_refuses_a_flipped_entry_in_one_paragraph(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETX_CACHE", str(tmp_path / "cache"))
    source = write_documents(tmp_path / "docs.jsonl", 100)
    args = ("data", "prepare", "llm/tiny", f"dataset.source={source}")
    assert run_freetx_here(*args).returncode == 0
    (entry,) = entries(tmp_path / "cache")
    flip_byte(entry / "ids.bin")
    assert f"token cache {entry}: ids.bin is damaged" in one_paragraph(run_freetx_here(*args))
    shutil.rmtree(entry)  # the fix the message gives
    assert "(all splits) built in" in run_freetx_here(*args).stdout


BUILDER = textwrap.dedent("""
    import hashlib, sys
    from freetx.data import ByteTokenizer, PackedTextDataset
    data = PackedTextDataset(ByteTokenizer(), sys.argv[1], seq_len=16, cache_dir=sys.argv[2])
    print(data.token_cache.state, hashlib.sha256(data.tokens.tobytes()).hexdigest())
""")


def test_processes_building_at_once_meet_at_the_lock_and_one_builds(tmp_path):
    cache = tmp_path / "cache"
    source = write_documents(tmp_path / "docs.jsonl", 300)
    probe = PackedTextDataset(ByteTokenizer(), source, seq_len=16, cache=False)
    expected = hashlib.sha256(probe.tokens.tobytes()).hexdigest()
    # the entry's name, from a build elsewhere (same key: settings, tokenizer, contents)
    other = PackedTextDataset(ByteTokenizer(), source, seq_len=16, cache_dir=str(tmp_path / "o"))
    folder_name = other.token_cache.folder.name
    cache.mkdir()
    with open(cache / f"{folder_name}.lock", "a") as lock:  # held here: both must wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", BUILDER, source, str(cache)],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for _ in range(2)
        ]
        for proc in procs:  # each says it waits (blocks until it does)
            assert "waiting for another process to build" in proc.stderr.readline()
    results = [proc.communicate(timeout=120) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), results
    states = sorted(out.split()[0] for out, _ in results)
    assert states == ["built", "waited"]  # one built it, the other mapped what it built
    assert {out.split()[1] for out, _ in results} == {expected}
    assert [p.name for p in entries(cache)] == [folder_name]


def test_an_unwritable_cache_folder_is_one_paragraph(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    source = write_examples(tmp_path / "pairs.jsonl", 20)
    with pytest.raises(DataError, match="cannot be written in .*dataset.cache=false"):
        InstructDataset(ByteTokenizer(), source, cache_dir=str(blocker / "cache"))


def test_builtin_sources_are_not_cached(tmp_path):
    data = InstructDataset(
        ByteTokenizer(), "builtin", num_builtin_examples=40, cache_dir=str(tmp_path)
    )
    assert data.token_cache.state == "off" and data.token_cache.builtin
    assert list(tmp_path.iterdir()) == []


def test_resumed_at_another_world_size_a_cached_dataset_reads_the_same_samples(tmp_path):
    source = write_examples(tmp_path / "pairs.jsonl", 80)
    data = InstructDataset(ByteTokenizer(), source, seq_len=24, cache_dir=str(tmp_path / "c"))
    assert data.token_cache.state == "built"

    def step_samples(samplers, steps):
        iters = [iter(s) for s in samplers]
        return [
            [data[i]["input_ids"].tolist() for it in iters for i in next(it)] for _ in range(steps)
        ]

    straight = step_samples([GlobalBatchSampler(len(data), 8, 1, r, 2, 5) for r in range(2)], 12)
    first = [GlobalBatchSampler(len(data), 8, 1, r, 2, 5) for r in range(2)]
    step_samples(first, 7)  # 7 steps on 2 ranks, then resumed on 1
    resumed = GlobalBatchSampler(len(data), 8, 1, 0, 1, 5)
    resumed.load_state_dict(first[0].state_dict())
    assert step_samples([resumed], 5) == straight[7:]


@pytest.mark.slow  # a prepare and a run: 14 s
def test_prepare_then_run_reuses_the_cache(tmp_path):
    env = {"FREETX_CACHE": str(tmp_path / "cache")}
    source = write_documents(tmp_path / "docs.jsonl", 400)
    args = ("llm/tiny", f"dataset.source={source}")
    prepared = run_freetx("data", "prepare", *args, env=env)
    assert prepared.returncode == 0, prepared.stderr
    assert "(all splits) built in" in prepared.stdout and "tokens" in prepared.stdout
    again = run_freetx("data", "prepare", *args, env=env)
    assert "(all splits) reused" in again.stdout
    run = run_freetx(
        "run", "full_finetune_fsdp2", "--config", *args, "max_steps=1", "eval.max_batches=1",
        f"output_dir={tmp_path / 'run'}", "metric_loggers=[]", env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"token cache: {source} (all splits) reused" in flat(run.stdout + run.stderr)
    assert "built" not in run.stdout + run.stderr


def test_prepare_says_when_there_is_nothing_to_cache():
    builtin = run_freetx_here(
        "data", "prepare", "llm/tiny", "--recipe", "full_finetune_fsdp2", "dataset.seq_len=64"
    )  # options and overrides in any order
    assert builtin.returncode == 0 and "not cached (a builtin source" in builtin.stdout
    darkroom = run_freetx_here("data", "prepare", "ad/darkroom_tiny")
    assert darkroom.returncode == 0 and "nothing to cache" in darkroom.stdout
    missing = run_freetx_here("data", "prepare", "llm/tiny", "dataset.source=/nonexistent.jsonl")
    assert "does not exist" in one_paragraph(missing)


def test_a_resume_may_move_the_cache_but_not_change_the_data():
    from freetx.config.compare import resume_changes

    saved = {"dataset": {"source": "a.jsonl", "cache": True, "cache_dir": None}}
    moved = {"dataset": {"source": "a.jsonl", "cache": False, "cache_dir": "/scratch/t"}}
    allowed, refused = resume_changes(saved, moved, ("dataset",))
    assert len(allowed) == 2 and refused == []
    other = {"dataset": {**moved["dataset"], "source": "b.jsonl"}}
    assert resume_changes(saved, other, ("dataset",))[1] == [
        "dataset.source: 'a.jsonl' -> 'b.jsonl'"
    ]


def test_first_targets_say_which_samples_keep_a_loss_token_at_each_seq_len():
    from freetx.data.seq_len import fit_to_seq_len
    from freetx.data.token_rows import TokenRows

    rng = np.random.default_rng(0)
    encoded = []
    for _ in range(300):  # empty samples, samples without targets, targets anywhere
        n = int(rng.integers(0, 30))
        flags = (rng.random(n) < rng.choice([0.0, 0.05, 0.5])).tolist()
        encoded.append((rng.integers(0, 259, n).tolist(), flags))
    rows = TokenRows.from_encoded(encoded)
    for seq_len in (1, 3, 10, 40):
        kept = [i for i, (_, flags) in enumerate(encoded) if any(flags[1 : seq_len + 1])]
        assert fit_to_seq_len(rows, seq_len, "train", "x")[0].tolist() == kept
        assert [rows.select(kept)[i] for i in range(len(kept))] == [encoded[i] for i in kept]
