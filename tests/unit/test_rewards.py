"""Rewards: the built-in ones, building them from config nodes (a user's own function
included, as docs/rewards.md shows it), and scoring that never hides a failure."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from freetx.config.schema import check_config
from freetx.errors import ConfigError, FreetxError
from freetx.fields import component_list
from freetx.objectives import (
    ExactMatch,
    LengthPenalty,
    RegexFormat,
    Reward,
    RewardError,
    build_rewards,
    score_completions,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


def node(component: str, **keys) -> dict:
    return {"_component_": component, **keys}


@pytest.mark.parametrize(
    "extract, completion, answer, score",
    [
        ("none", "  42\n", "42", 1.0),
        ("none", "42 apples", "42", 0.0),
        ("none", "3.0", "3", 1.0),
        ("none", "1,000", "1000", 1.0),
        ("none", "cba", "abc", 0.0),
        ("hash", "so 6 * 12 = 72\n#### 72", "72", 1.0),
        ("hash", "#### 7 then #### 72 ", "72", 1.0),
        ("hash", "the answer is 72", "72", 0.0),
        ("hash", "#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
        ("boxed", r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}", 1.0),
        ("boxed", r"\boxed{1} no, \boxed{ 2 }", "2", 1.0),
        ("boxed", r"\boxed{2", "2", 0.0),
        ("boxed", "2", "2", 0.0),
    ],
)
def test_exact_match_extracts_and_compares_answers(extract, completion, answer, score):
    assert ExactMatch(extract=extract)("prompt", completion, {"answer": answer}) == score


def test_exact_match_reads_the_answer_field_it_is_given():
    assert ExactMatch(answer_field="solution")("p", "x", {"solution": "x"}) == 1.0


def test_exact_match_on_a_row_without_the_field_names_it_and_the_fields_there():
    with pytest.raises(RewardError, match="field 'answer', and the row has only level, task"):
        ExactMatch()("p", "x", {"task": "t", "level": 1})


def test_exact_match_refuses_an_unknown_extractor():
    with pytest.raises(ValueError, match="extract='last'"):
        ExactMatch(extract="last")


@pytest.mark.parametrize(
    "pattern, full_match, completion, score",
    [
        (r"<think>.*</think>\d+", True, "<think>hm</think>42", 1.0),
        (r"<think>.*</think>\d+", True, "<think>hm</think>42 ok", 0.0),
        (r"\d+", False, "it is 42 ok", 1.0),
        (r"\d+", False, "none", 0.0),
    ],
)
def test_regex_format_matches_all_or_part_of_the_completion(pattern, full_match, completion, score):
    assert RegexFormat(pattern, full_match)("p", completion, {}) == score


@pytest.mark.parametrize(
    "length, score", [(0, 0.0), (60, 0.0), (70, -0.25), (100, -1.0), (101, -1.0)]
)
def test_length_penalty_is_dapos_overlong_shaping(length, score):
    assert (
        LengthPenalty(max_tokens=100, soft_tokens=40)("p", "c", {"completion_tokens": length})
        == score
    )


def test_length_penalty_refuses_a_soft_zone_wider_than_the_limit():
    with pytest.raises(ValueError, match="soft_tokens=200"):
        LengthPenalty(max_tokens=100, soft_tokens=200)


def test_rewards_are_built_from_nodes_with_weights_and_snake_case_names():
    nodes = OmegaConf.create(
        {"rewards": [
            node("freetx.objectives.ExactMatch", extract="hash"),
            node("freetx.objectives.ExactMatch", weight=0.5),
            node("freetx.objectives.RegexFormat", pattern=r"\d+", weight=2, name="digits"),
        ]}
    ).rewards  # fmt: skip
    rewards = build_rewards(nodes)
    assert [(r.name, r.weight) for r in rewards] == [
        ("exact_match", 1.0), ("exact_match_2", 0.5), ("digits", 2.0),
    ]  # fmt: skip
    assert rewards[0].function.extract == "hash" and isinstance(rewards[2].function, RegexFormat)


def test_a_plain_list_of_dicts_builds_too():
    (reward,) = build_rewards(
        [node("freetx.objectives.LengthPenalty", max_tokens=8, soft_tokens=2)]
    )
    assert reward.name == "length_penalty"


@pytest.mark.parametrize(
    "nodes, problem",
    [
        ([], "at least one reward"),
        ([node("freetx.objectives.ExactMatch", weight="high")], "rewards[0].weight is 'high'"),
        ([node("freetx.objectives.ExactMatch", weight=math.nan)], "rewards[0].weight is nan"),
        ([{"weight": 1.0}], "rewards[0] is"),
        ([node("freetx.objectives.ExactMatch"), node("freetx.objectives.RegexFormat", pattern="(")],
         "rewards[1]: building freetx.objectives.RegexFormat failed: '(' is no regular"),
        ([node("freetx.objectives.ExactMatch", answer="x")], "takes no argument 'answer'"),
        ([node("freetx.objectives.ExactMach")], "did you mean 'freetx.objectives.ExactMatch'"),
        ([node("os.system")], "is refused"),
    ],
)  # fmt: skip
def test_a_bad_reward_node_is_a_config_error_naming_it(nodes, problem):
    with pytest.raises(ConfigError) as error:
        build_rewards(nodes)
    assert problem in str(error.value)


def write_module(folder: Path, monkeypatch, name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("FREETX_TRUST", name)  # the user's own code: trusted for the command


def test_a_function_with_the_wrong_signature_is_refused_with_the_expected_one(
    tmp_path, monkeypatch
):
    write_module(
        tmp_path, monkeypatch, "wrong_rewards", "def two(prompt, completion):\n    return 1.0\n"
    )
    with pytest.raises(ConfigError) as error:
        build_rewards([node("wrong_rewards.two")])
    assert "wrong_rewards.two(prompt, completion)" in str(error.value)
    assert "def reward(prompt: str, completion: str, row: dict) -> float" in str(error.value)


@pytest.mark.parametrize(
    "source, said",
    [
        ("class Plain:\n    pass\n", "builds a Plain, which cannot be called"),
        (
            "class TwoArgs:\n    def __call__(self, prompt, completion):\n        return 1.0\n",
            "TwoArgs(prompt, completion) cannot be called",
        ),
    ],
)
def test_a_class_whose_objects_are_no_reward_is_refused(source, said, tmp_path, monkeypatch):
    name = source.split()[1].rstrip(":")
    write_module(tmp_path, monkeypatch, f"rewards_{name}", source)  # a module each: no cache
    with pytest.raises(ConfigError, match=re.escape(said)):
        build_rewards([node(f"rewards_{name}.{name}")])


def test_a_function_given_settings_is_refused(tmp_path, monkeypatch):
    write_module(
        tmp_path, monkeypatch, "set_rewards", "def f(prompt, completion, row):\n    return 1.0\n"
    )
    with pytest.raises(ConfigError, match="is a function, so it is the reward itself.*sets scale"):
        build_rewards([node("set_rewards.f", scale=2)])


def docs_example() -> tuple[str, dict]:
    """docs/rewards.md's my_rewards.py and its node."""
    text = DOCS.read_text()
    source = re.search(r"`my_rewards.py`:\n\n```python\n(.*?)```", text, re.S).group(1)
    yaml = re.search(r"and its node:\n\n```yaml\n(.*?)```", text, re.S).group(1)
    return source, OmegaConf.create(yaml)


def test_the_docs_example_reward_builds_and_scores(tmp_path, monkeypatch):
    source, cfg = docs_example()
    write_module(tmp_path, monkeypatch, "my_rewards", source)
    (reward,) = build_rewards(cfg.rewards)
    assert (reward.name, reward.weight) == ("count_words", 0.5)
    scores = score_completions(
        [reward], ["Say three words."] * 2, ["one two three", "one two"],
        [{"words": 3, "completion_tokens": 3}] * 2, ["row 0", "row 1"],
    )  # fmt: skip
    assert scores.tolist() == [[1.0], [0.0]]


def test_scores_are_each_rewards_own_values_as_float32():
    rewards = build_rewards([node("freetx.objectives.ExactMatch", weight=3.0),
                             node("freetx.objectives.RegexFormat", pattern="a.*", weight=0.5)])  # fmt: skip
    scores = score_completions(
        rewards, ["p", "p", "p"], ["abc", "x", "a"], [{"answer": "abc"}] * 3, ["0", "1", "2"]
    )
    assert scores.dtype == torch.float32
    assert scores.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]  # not weighted


def failing(prompt: str, completion: str, row: dict) -> float:
    return 1 / row["zero"]


@pytest.mark.parametrize(
    "function, said",
    [
        (failing, "failed: ZeroDivisionError: division by zero"),
        (lambda p, c, r: None, "returned None, not a finite number"),
        (lambda p, c, r: math.nan, "returned nan, not a finite number"),
        (lambda p, c, r: "1.0", "returned '1.0', not a finite number"),
    ],
)
def test_a_reward_that_fails_names_itself_and_the_row_never_a_silent_zero(function, said):
    rewards = [Reward("exact_match", ExactMatch(), 1.0), Reward("mine", function, 1.0)]
    long_prompt = "Reverse the word: " + "x" * 200
    with pytest.raises(RewardError) as error:
        score_completions(
            rewards, [long_prompt], ["olleh"], [{"zero": 0, "answer": "olleh"}], ["data.jsonl:17"]
        )
    message = str(error.value)
    assert "reward mine on data.jsonl:17" in message and said in message
    assert "'Reverse the word: xxx" in message and "'olleh'" in message
    assert len(message) < 400 and "\n" not in message  # the prompt shortened, one paragraph
    assert isinstance(error.value, FreetxError)


def test_a_reward_error_from_a_missing_field_names_the_row():
    with pytest.raises(RewardError, match=r"reward exact_match on builtin prompt 3 .*'answer'"):
        score_completions([Reward("exact_match", ExactMatch(), 1.0)], ["p"], ["c"], [{}],
                          ["builtin prompt 3"])  # fmt: skip


@dataclasses.dataclass
class GrpoLike:
    rewards: list[Any] = component_list("weight", "name")


def test_validate_checks_reward_nodes_without_their_weight_and_name():
    cfg = OmegaConf.create({"rewards": [
        node("freetx.objectives.ExactMatch", weight=1.0, name="right"),
        node("freetx.objectives.LengthPenalty", max_tokens=10, soft_tokens=20, weight=0.1),
        node("freetx.objectives.RegexFormat", patern="x"),
    ]})  # fmt: skip
    problems = check_config(cfg, GrpoLike)
    assert len(problems) == 2, problems
    assert "rewards[1].soft_tokens" in problems[0]
    assert "takes no argument 'patern' (did you mean 'pattern'?)" in problems[1]


TWINS = """
def count_words(prompt, completion, row):
    return 1.0 if len(completion.split()) == int(row["words"]) else 0.0

def count_words_trl(prompts, completions, completion_ids, words, **kwargs):
    seen.append({"prompts": prompts, "completions": completions, "ids": completion_ids, **kwargs})
    return [1.0 if len(c.split()) == int(w) else 0.0 for c, w in zip(completions, words)]

def first_word_trl(prompts, completions, **kwargs):  # conversational: messages in and out
    return [None if p[-1]["content"] == "skip" else float(c[0]["content"] == "yes")
            for p, c in zip(prompts, completions)]

def no_kwargs(prompts, completions, completion_ids):
    return [0.0 for _ in completions]

seen = []
"""


@pytest.fixture
def twins(tmp_path, monkeypatch):
    """A reward in freetx's form and its TRL-style batched twin, in the user's module."""
    write_module(tmp_path, monkeypatch, "twin_rewards", TWINS)
    monkeypatch.setenv("FREETX_TRUST", "twin_rewards")
    import twin_rewards

    return twin_rewards


def test_a_trl_batched_reward_is_taken_unchanged_and_scores_as_its_twin(twins):
    plain, trl = build_rewards(
        [node("twin_rewards.count_words"), node("twin_rewards.count_words_trl")]
    )
    assert (plain.batched, trl.batched) == (False, True)
    completions = ["one two three", "one two", "a"]
    rows = [{"words": 3, "task": "t", "completion_tokens": n} for n in (3, 2, 1)]
    scores = score_completions([plain, trl], ["p0", "p1", "p2"], completions, rows,
                               ["row 0", "row 1", "row 2"], completion_ids=[[1, 2], [3], [4]])  # fmt: skip
    assert scores[:, 0].tolist() == scores[:, 1].tolist() == [1.0, 0.0, 0.0]
    (call,) = twins.seen  # one call for the batch, every argument by keyword, columns as lists
    assert call == {"prompts": ["p0", "p1", "p2"], "completions": completions,
                    "ids": [[1, 2], [3], [4]], "task": ["t"] * 3, "completion_tokens": [3, 2, 1]}  # fmt: skip


def test_a_trl_reward_reads_conversations_and_none_is_not_applicable(twins):
    rewards = build_rewards([node("twin_rewards.first_word_trl"),
                             node("freetx.objectives.RegexFormat", pattern="y.*", weight=0.5)])  # fmt: skip
    talks = [[{"role": "user", "content": q}] for q in ("ask", "skip")]
    scores = score_completions(rewards, ["ask", "skip"], ["yes", "yes"], [{}, {}], ["r0", "r1"],
                               conversations=talks)  # fmt: skip
    assert scores[0].tolist() == [1.0, 1.0] and math.isnan(scores[1, 0])
    from freetx.objectives.rewards import weighted

    assert weighted(scores, torch.tensor([1.0, 0.5])).tolist() == [1.5, 0.5]  # None left out
    with pytest.raises(RewardError, match="no reward applies to the completion on r1"):
        score_completions(rewards[:1], ["ask", "skip"], ["yes", "yes"], [{}, {}], ["r0", "r1"],
                          conversations=talks)  # fmt: skip


def test_a_trl_reward_without_kwargs_is_refused_before_it_runs(twins):
    with pytest.raises(ConfigError, match=r"no_kwargs\(prompts, completions, completion_ids\) "
                       r"names `completions`.*has no \*\*kwargs"):  # fmt: skip
        build_rewards([node("twin_rewards.no_kwargs")])


def test_a_reward_past_its_deadline_stops_the_run_naming_it_and_the_row():
    def stuck(prompt: str, completion: str, row: dict) -> float:
        time.sleep(60)
        return 0.0

    with pytest.raises(RewardError) as error:
        score_completions([Reward("stuck", stuck, 1.0)], ["Reverse abc"], ["cba"], [{}],
                          ["data.jsonl:3"], timeout_s=0.2)  # fmt: skip
    message = str(error.value)
    assert "reward stuck on data.jsonl:3 (prompt 'Reverse abc', completion 'cba')" in message
    assert "did not return within reward_timeout_s=0.2 s" in message and "\n" not in message
