"""Dataset mixtures (`freetx.data.Mixture`): training samples in the proportions of the
weights, a seeded order the world size does not change (also across a resume at
another world size), validation as every source's split whole, nested `_component_`
sources built with the recipe's tokenizer and split (`freetx.fields.BuildsParts`), one
paragraph for each mistake, `freetx validate` looking inside the sources, and `freetx
data prepare` caching every source."""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from freetx.config import check_components, instantiate
from freetx.data import ByteTokenizer, GlobalBatchSampler, InstructDataset, Mixture
from freetx.data.mixture import _shares
from freetx.errors import ConfigError
from tests.conftest import flat, run_freetx_here

TOK = ByteTokenizer()


def write_pairs(path: Path, tag: str, count: int) -> str:
    path.write_text("".join(
        json.dumps({"prompt": f"{tag} question {i}?", "response": f"{tag} answer {i}"}) + "\n"
        for i in range(count)
    ))  # fmt: skip
    return str(path)


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    """Two instruction sources, each with its own validation file: a (40 + 5 rows),
    b (20 + 3 rows)."""
    return {
        "a": write_pairs(tmp_path / "a.jsonl", "alpha", 40),
        "a_val": write_pairs(tmp_path / "a_val.jsonl", "alpha-val", 5),
        "b": write_pairs(tmp_path / "b.jsonl", "beta", 20),
        "b_val": write_pairs(tmp_path / "b_val.jsonl", "beta-val", 3),
    }


def source(path: str, validation: str, **keys):
    """A factory as `instantiate` passes one: the recipe's tokenizer and split at the call."""
    return functools.partial(
        InstructDataset, source=path, validation_source=validation, seq_len=48, cache=False,
        **keys,
    )  # fmt: skip


def mixture(files, split="train", **keys) -> Mixture:
    sources = [source(files["a"], files["a_val"]), source(files["b"], files["b_val"])]
    return Mixture(TOK, sources, split=split, **keys)


def text_of(sample: dict) -> str:
    return TOK.decode([t for t in sample["input_ids"].tolist() if t != TOK.pad_id])


def texts(data) -> list[str]:
    return [text_of(data[i]) for i in range(len(data))]


def test_proportions_follow_the_weights(files):
    up = mixture(files, weights=[3, 1], num_samples=100)  # a: 75 of 40 rows, b: 25 of 20
    assert len(up) == 100 and up.counts == [75, 25] and up.lengths == [40, 20]
    sources = Counter(int(up[i]["source"]) for i in range(len(up)))
    assert sources == {0: 75, 1: 25}
    for i, (count, length) in enumerate(zip(up.counts, up.lengths)):
        seen = Counter(text_of(up[j]) for j in range(len(up)) if int(up[j]["source"]) == i)
        assert len(seen) == length and sum(seen.values()) == count  # every row, then repeats
        assert set(seen.values()) == {1, 2}  # a second pass, cut where the count ends
    down = mixture(files, weights=[1, 3], num_samples=40)  # a: 10 of its 40 rows
    assert down.counts == [10, 30]
    a_rows = [text_of(down[j]) for j in range(10)]
    assert len(set(a_rows)) == 10 and all(t.startswith("alpha") for t in a_rows)
    assert _shares([1, 1, 1], 10) == [4, 3, 3]  # largest remainder: they add up
    assert _shares([0.1, 0.2, 0.7], 7) == [1, 1, 5]


def test_default_weights_concatenate_the_sources(files):
    whole = mixture(files)
    assert whole.counts == whole.lengths == [40, 20]
    assert sorted(texts(whole)) == sorted(
        texts(InstructDataset(TOK, files["a"], 48, validation_source=files["a_val"], cache=False))
        + texts(InstructDataset(TOK, files["b"], 48, validation_source=files["b_val"], cache=False))
    )


def test_the_order_is_the_seeds(files):
    first = texts(mixture(files, weights=[3, 1], num_samples=60, seed=5))
    assert first == texts(mixture(files, weights=[3, 1], num_samples=60, seed=5))
    assert first != texts(mixture(files, weights=[3, 1], num_samples=60, seed=6))
    # a source's order is (seed, source, pass)'s: fewer samples take a prefix of it
    shorter = texts(mixture(files, weights=[3, 1], num_samples=40, seed=5))
    assert shorter[:30] == first[:30]


def test_validation_is_every_source_whole_in_turn(files):
    val = mixture(files, split="validation", weights=[3, 1], num_samples=7)  # both unused
    expected = [f"alpha-val question {i}?alpha-val answer {i}" for i in range(5)]
    expected += [f"beta-val question {i}?beta-val answer {i}" for i in range(3)]
    assert [t.replace(chr(TOK.eos_id), "") for t in texts(val)] == expected
    assert [int(val[i]["source"]) for i in range(len(val))] == [0] * 5 + [1] * 3
    assert val[0]["source"].dtype == torch.int64
    assert set(val[0]) == {*val.parts[0][0], "source"}  # the source's sample, and its index
    assert all(torch.equal(val[6][k], val.parts[1][1][k]) for k in val.parts[1][1])


def _global_reads(dataset, world_size, accumulation, steps, state=None):
    """The samples (text, source) each global step reads, over all ranks in rank order."""
    samplers = [
        GlobalBatchSampler(len(dataset), 8, accumulation, r, world_size, seed=3)
        for r in range(world_size)
    ]
    if state is not None:
        for sampler in samplers:
            sampler.load_state_dict(state)
    iters = [iter(s) for s in samplers]
    reads = []
    for _ in range(steps):
        step = []
        for it in iters:
            for _ in range(accumulation):
                step += [(text_of(dataset[i]), int(dataset[i]["source"])) for i in next(it)]
        reads.append(step)
    return reads, samplers[0].state_dict()


def test_the_global_order_is_the_same_at_any_world_size_and_across_a_resume(files):
    data = mixture(files, weights=[3, 1], num_samples=64)  # 8 steps an epoch: crosses two
    one, _ = _global_reads(data, world_size=1, accumulation=2, steps=12)
    two, _ = _global_reads(data, world_size=2, accumulation=1, steps=12)
    assert one == two
    # 5 steps on two ranks, saved; resumed on one rank (another mixture object, rebuilt)
    _, state = _global_reads(data, world_size=2, accumulation=1, steps=5)
    again = mixture(files, weights=[3, 1], num_samples=64)
    resumed, _ = _global_reads(again, world_size=1, accumulation=2, steps=7, state=state)
    assert resumed == one[5:]


def config(files, **dataset) -> OmegaConf:
    node = {
        "_component_": "freetx.data.Mixture",
        "weights": [3, 1],
        "names": ["alpha", "beta"],
        "num_samples": 16,
        "sources": [
            {"_component_": "freetx.data.InstructDataset", "source": files["a"],
             "validation_source": files["a_val"], "seq_len": 48, "cache": False},
            {"_component_": "freetx.data.InstructDataset", "source": files["b"],
             "validation_source": files["b_val"], "seq_len": 48, "cache": False},
        ],
        **dataset,
    }  # fmt: skip
    return OmegaConf.create({"dataset": node})


def test_instantiate_builds_nested_sources_with_the_call_site_arguments(files):
    cfg = config(files)
    train = instantiate(cfg.dataset, tokenizer=TOK, split="train")
    val = instantiate(cfg.dataset, tokenizer=TOK, split="validation")
    assert isinstance(train, Mixture) and len(train) == 16 and train.counts == [12, 4]
    assert all(isinstance(p, InstructDataset) and p.tokenizer is TOK for p in train.parts)
    assert len(val) == 8 and val.source_names == ["alpha", "beta"]
    assert train.seq_len == 48 and train.packed is False
    assert train.files_read == [Path(files[k]) for k in ("a", "b")]
    assert val.files_read == [Path(files[k]) for k in ("a_val", "b_val")]
    assert "dataset mixture (train): 16 samples: alpha 12 (75.0%" in train.line()
    cfg.dataset.sources[1].seq_len = 0  # a source's own refusal still names its node
    with pytest.raises(Exception, match="seq_len"):
        instantiate(cfg.dataset, tokenizer=TOK, split="train")
    cfg.dataset.sources[1].seq_len = 48
    cfg.dataset.sources[1].sed = 1
    with pytest.raises(ConfigError, match=r"dataset.sources\[1\]: .*'sed' \(did you mean 'seed'"):
        instantiate(cfg.dataset, tokenizer=TOK, split="train")


class Holder:
    """A BuildsParts target: it gets factories for `parts` and builds them itself."""

    built_later = ("parts", "one")

    def __init__(self, parts, one, other):
        self.parts = [factory(out_features=3) for factory in parts]
        self.one, self.other = one, other


def test_built_later_arguments_get_factories_and_others_are_built(monkeypatch):
    monkeypatch.setenv("FREETX_TRUST", __name__)  # a test's own class: trusted here
    linear = {"_component_": "torch.nn.Linear", "in_features": 2}
    cfg = OmegaConf.create({"h": {"_component_": f"{__name__}.Holder", "parts": [linear, linear],
                                  "one": linear, "other": {**linear, "out_features": 5}}})  # fmt: skip
    built = instantiate(cfg.h)
    assert [p.out_features for p in built.parts] == [3, 3]
    assert isinstance(built.one, functools.partial) and built.one(out_features=4).out_features == 4
    assert isinstance(built.other, torch.nn.Linear)  # not named in built_later: built first


def test_validate_checks_the_keys_inside_the_sources(files):
    cfg = config(files)
    assert check_components(cfg) == []
    cfg.dataset.sources[0].val_fractoin = 0.1
    cfg.dataset.wieghts = [1, 1]
    problems = check_components(cfg)
    assert len(problems) == 2
    assert problems[0].startswith("dataset: freetx.data.Mixture takes no argument 'wieghts'")
    assert problems[1].startswith(
        "dataset.sources[0]: freetx.data.InstructDataset takes no argument 'val_fractoin' "
        "(did you mean 'val_fraction'?)"
    )


def never_built(**_):
    raise AssertionError("a source was built before the arguments were checked")


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(sources=[]), "dataset.sources is empty: a mixture needs at least one source. "
                           "List the datasets to mix"),
        (dict(weights=[1]), "dataset.weights has 1 value(s) for 2 source(s). Give one weight "
                            "per source"),
        (dict(weights=[1, 0]), "dataset.weights[1] is 0; a weight is a positive number"),
        (dict(weights=[-1, 2]), "dataset.weights[0] is -1; a weight is a positive number"),
        (dict(num_samples=0), "dataset.num_samples is 0; it is the training split's size, a "
                              "positive whole number. Set it to 1 or more"),
        (dict(names=["x"]), "dataset.names has 1 name(s) for 2 source(s)."),
        (dict(names=["x", "x"]), "dataset.names ['x', 'x'] must be distinct, non-empty strings "
                                 "('x' is there twice)."),
        (dict(sources=[never_built, "data.jsonl"]), "dataset.sources[1] is 'data.jsonl', not a "
                                                    "dataset node."),
    ],
)  # fmt: skip
def test_each_mistake_is_one_paragraph_before_any_source_is_built(keys, message):
    keys = {"sources": [never_built, never_built], **keys}
    with pytest.raises(ConfigError) as caught:
        Mixture(TOK, **keys)
    assert message in flat(str(caught.value)) and "\n" not in str(caught.value)


def test_sources_that_disagree_are_named(files):
    a, b = source(files["a"], files["a_val"]), source(files["b"], files["b_val"])
    with pytest.raises(ConfigError) as caught:
        Mixture(TOK, [a, functools.partial(b, seq_len=32)], names=["chat", "text"])
    assert str(caught.value) == (
        "the mixture's sources 'chat' and 'text' differ in seq_len: 48 and 32; a batch stacks "
        "samples of every source, so they must agree. Set the same seq_len in every node of "
        "dataset.sources."
    )
    with pytest.raises(ConfigError, match="differ in packed: False and True"):
        Mixture(TOK, [a, functools.partial(b, packed=True)])
    with pytest.raises(
        ConfigError, match="source 'b' gets none of its 10 training samples: its weight is 1 of 101"
    ):
        Mixture(TOK, [a, b], weights=[100, 1], num_samples=10)


class Other(torch.utils.data.Dataset):
    """A dataset whose samples hold a key InstructDataset's do not."""

    seq_len, packed = 48, False

    def __init__(self, tokenizer, split):
        pass

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return {"input_ids": torch.zeros(48), "labels": torch.zeros(48), "extra": torch.ones(1)}


def test_sources_whose_samples_hold_other_keys_are_named(files):
    a = source(files["a"], files["a_val"])
    with pytest.raises(ConfigError) as caught:
        Mixture(TOK, [a, Other], names=["pairs", "other"])
    assert "the mixture's sources 'pairs' and 'other' give samples with different keys (" in (
        str(caught.value)
    )
    assert "and extra, input_ids, labels), and a batch stacks samples" in str(caught.value)


def test_default_names_are_the_files_made_unique(files, tmp_path):
    (tmp_path / "other").mkdir()
    again = write_pairs(tmp_path / "other" / "a.jsonl", "gamma", 10)
    parts = [source(files["a"], files["a_val"]), source(again, files["b_val"]),
             functools.partial(InstructDataset, num_builtin_examples=50, seq_len=48)]  # fmt: skip
    data = Mixture(TOK, parts)
    assert data.source_names == ["a_1", "a_2", "InstructDataset"]
    assert data.files_read == [Path(files["a"]), Path(again)]  # builtin reads none


def test_data_prepare_caches_every_source(tmp_path):
    cache = tmp_path / "cache"
    paths = [write_pairs(tmp_path / f"{tag}.jsonl", tag, 60) for tag in ("alpha", "beta")]
    args = ["data", "prepare", "llm/mixture_tiny", "dataset.sources.1._component_="
            "freetx.data.InstructDataset"]  # fmt: skip
    for i, path in enumerate(paths):
        args += [f"dataset.sources.{i}.source={path}", f"dataset.sources.{i}.cache_dir={cache}",
                 f"dataset.sources.{i}.val_fraction=0.2"]  # fmt: skip
    first = run_freetx_here(*args)
    assert first.returncode == 0, first.stderr
    out = flat(first.stdout)
    for path in paths:
        for split in ("train", "validation"):
            assert f"token cache: {path} ({split}) built in" in out
    assert out.count("token cache:") == 4
    again = flat(run_freetx_here(*args).stdout)
    assert again.count("reused") == 4 and "built" not in again
