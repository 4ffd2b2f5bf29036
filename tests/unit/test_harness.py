"""freetx's lm-evaluation-harness adapter (freetx.evaluation.harness) against lm-eval's own
Hugging Face backend (HFLM) on one tiny Llama folder and local task files: the same
log-likelihoods, rolling log-likelihoods, greedy generations and task scores."""

from __future__ import annotations

import json
import sys
import threading

import pytest
import torch

from freetx.errors import ConfigError
from freetx.evaluation import evaluate_tasks, harness_model, reassemble, share
from tests.conftest import flat
from tests.hf_folders import make_folder, make_tokenizer, spread_weights

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

MAX_LENGTH = 24  # short, so that rolling texts span several windows
TEXTS = ["the cat sat on the mat.", "a dog ran in the park.", "is the sky blue? yes.",
         "is grass red? no.", "the park is green and the mat is red."]  # fmt: skip
MC_ROWS = [
    {"question": "the cat sat on the", "choices": ["mat", "park", "sky"], "answer": 0},
    {"question": "a dog ran in the", "choices": ["park", "mat", "cat"], "answer": 0},
    {"question": "is the sky blue?", "choices": ["yes", "no"], "answer": 0},
    {"question": "is grass red?", "choices": ["yes", "no"], "answer": 1},
    {"question": "the park is", "choices": ["green", "red", "blue"], "answer": 0},
    {"question": "the mat is", "choices": ["red", "green"], "answer": 0},
]
GEN_ROWS = [{"question": q, "answer": a} for q, a in
            [("the cat sat on", " the mat"), ("a dog ran", " in the park"),
             ("is the sky blue?", " yes"), ("the park is", " green")]]  # fmt: skip
MC_TASK = """task: freetx_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_TASK = """task: freetx_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
"""


def tiny_folder(root, family: str, bos: bool = True):
    """A tiny folder of `family` with spread weights (greedy text that changes token) and a
    tokenizer that starts a text with BOS, as Llama 3's does; with `bos=False` one that
    names a BOS and adds none, as SmolLM2's."""
    folder = spread_weights(make_folder(root / "base", family), root / "model", std=0.2)
    make_tokenizer(folder, TEXTS * 8)
    if not bos:
        return folder
    file = folder / "tokenizer.json"
    tokenizer = json.loads(file.read_text())
    bos = "<|begin_of_text|>"
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 0}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}},
    }  # fmt: skip
    file.write_text(json.dumps(tokenizer))
    return folder


def adapter_and_hflm(folder):
    """(freetx's adapter, lm-eval's HFLM) on the same folder."""
    from lm_eval.models.huggingface import HFLM

    from freetx.checkpoint import load_model
    from freetx.data import HFTokenizer
    from freetx.models.hf import end_token_ids

    model = load_model(str(folder), torch.device("cpu"))
    tokenizer = HFTokenizer(str(folder))
    ours = harness_model(model, tokenizer, "cpu", batch_size=3, max_length=MAX_LENGTH,
                         end_ids=[*end_token_ids(folder), tokenizer.eos_id])  # fmt: skip
    theirs = HFLM(pretrained=str(folder), batch_size=3, max_length=MAX_LENGTH, device="cpu",
                  dtype="float32")  # fmt: skip
    return ours, theirs


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A folder of two local task YAMLs, their rows in local jsonl files."""
    root = tmp_path_factory.mktemp("tasks")
    for name, rows, task in [("mc", MC_ROWS, MC_TASK), ("gen", GEN_ROWS, GEN_TASK)]:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (root / f"{name}.yaml").write_text(task.format(data=data))
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(freetx's adapter, lm-eval's HFLM) on a Llama 3.2 folder (freetx's native decoder)."""
    return adapter_and_hflm(tiny_folder(tmp_path_factory.mktemp("llama"), "llama3_2"))


def requests(kind: str, args: list[tuple]) -> list:
    return [Instance(kind, {}, arguments, idx=i) for i, arguments in enumerate(args)]


PAIRS = [("the cat sat on the", " mat"), ("the cat sat on the ", "mat"), ("", "the park"),
         ("is the sky blue?", " yes."), ("a dog", " ran in the park and the cat sat")]  # fmt: skip


def test_loglikelihoods_equal_lm_evals_hf_backend(models):
    ours, theirs = models
    settings = {"until": [], "max_gen_toks": 2}
    (greedy,) = ours.generate_until(requests("generate_until", [("is the sky", settings)]))
    pairs = [*PAIRS, ("is the sky", greedy)]  # the model's own continuation
    mine = ours.loglikelihood(requests("loglikelihood", pairs))
    hf = theirs.loglikelihood(requests("loglikelihood", pairs))
    assert mine[-1][1] and not mine[0][1]
    assert [greedy for _, greedy in mine] == [greedy for _, greedy in hf]
    assert [logp for logp, _ in mine] == pytest.approx([logp for logp, _ in hf], abs=1e-4)


def test_trailing_spaces_of_a_context_move_to_the_continuation(models):
    ours, _ = models
    spaced, plain = ours.loglikelihood(requests("loglikelihood", PAIRS[:2]))
    assert spaced[0] == pytest.approx(plain[0], abs=1e-5)


def test_rolling_loglikelihoods_over_several_windows_equal_lm_evals(models):
    ours, theirs = models
    texts = [(" ".join(TEXTS * 2),), (TEXTS[0],)]
    assert len(ours.encode(texts[0][0])) > 2 * MAX_LENGTH  # three windows at least
    mine = ours.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    hf = theirs.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    assert mine == pytest.approx(hf, abs=1e-4)


def test_a_tokenizer_that_adds_no_bos_scores_as_lm_evals_hf_backend(tmp_path):
    """SmolLM2's kind of folder (a BOS named, none added): no BOS before a text, as HFLM."""
    ours, theirs = adapter_and_hflm(tiny_folder(tmp_path, "llama3_2", bos=False))
    assert not ours.tokenizer.add_bos_token
    mine = ours.loglikelihood(requests("loglikelihood", PAIRS))
    hf = theirs.loglikelihood(requests("loglikelihood", PAIRS))
    assert [logp for logp, _ in mine] == pytest.approx([logp for logp, _ in hf], abs=1e-4)
    texts = [(" ".join(TEXTS),)]
    rolling = ours.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    assert rolling == pytest.approx(
        theirs.loglikelihood_rolling(requests("loglikelihood_rolling", texts)), abs=1e-4
    )


GENERATIONS = [
    ("the cat sat on", {"until": ["."], "max_gen_toks": 10, "do_sample": False}),
    ("a dog", {"until": ["==", "park"], "max_gen_toks": 20, "do_sample": False}),
    ("is the sky blue?", {"until": ["is"], "max_gen_toks": 7}),
    ("the", {"until": ["."], "max_gen_toks": 10, "do_sample": False}),
    ("the cat", {"until": ["never said"], "max_gen_toks": 20}),  # in rounds of 16 and 4
]


def test_greedy_generations_equal_lm_evals_hf_backend(models):
    ours, theirs = models
    mine = ours.generate_until(requests("generate_until", GENERATIONS))
    hf = theirs.generate_until(requests("generate_until", GENERATIONS))
    assert mine == hf
    assert len(mine[1]) < 20 and "==" not in mine[1]  # cut at a stop string


def test_the_generic_hf_path_scores_as_lm_evals_hf_backend(tmp_path):
    """A family freetx computes through transformers' modules (Granite): the same
    log-likelihoods and greedy generations."""
    ours, theirs = adapter_and_hflm(tiny_folder(tmp_path, "granite"))
    assert "HFGeneric" in type(ours.model).__name__
    mine = ours.loglikelihood(requests("loglikelihood", PAIRS))
    hf = theirs.loglikelihood(requests("loglikelihood", PAIRS))
    assert [logp for logp, _ in mine] == pytest.approx([logp for logp, _ in hf], abs=1e-4)
    assert ours.generate_until(requests("generate_until", GENERATIONS)) == theirs.generate_until(
        requests("generate_until", GENERATIONS)
    )


def test_task_scores_equal_lm_evals_hf_backend(models, tasks):
    ours, theirs = models
    names = ["freetx_tiny_mc", "freetx_tiny_gen"]
    mine = evaluate_tasks(ours, names, include_path=str(tasks))
    hf = evaluate_tasks(theirs, names, include_path=str(tasks))
    assert mine["freetx_tiny_mc"]["acc"] == hf["freetx_tiny_mc"]["acc"]
    assert mine["freetx_tiny_mc"]["acc_norm"] == hf["freetx_tiny_mc"]["acc_norm"]
    assert mine["freetx_tiny_gen"]["exact_match"] == hf["freetx_tiny_gen"]["exact_match"]
    assert mine["lm_eval"]["results"]["freetx_tiny_mc"]["acc,none"] == mine["freetx_tiny_mc"]["acc"]
    json.dumps(mine)  # what the eval recipe writes


def test_max_gen_toks_that_leave_no_room_for_the_prompt_are_refused(models):
    ours, _ = models
    settings = {"until": ["."], "max_gen_toks": MAX_LENGTH}
    with pytest.raises(ConfigError) as error:
        ours.generate_until(requests("generate_until", [("the cat", settings)]))
    assert f"max_gen_toks={MAX_LENGTH}" in flat(str(error.value))
    assert "max_length" in flat(str(error.value))


@pytest.mark.slow  # indexes the harness's own tasks (6 s)
def test_an_unknown_task_is_refused_naming_include_path(models, tasks):
    ours, _ = models
    with pytest.raises(ConfigError) as error:
        evaluate_tasks(ours, ["freetx_no_such_task"], include_path=str(tasks))
    assert "'freetx_no_such_task'" in flat(str(error.value))
    assert "include_path=" in flat(str(error.value))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shares_of_the_processes_reassemble_in_order(world_size):
    for count in range(9):
        items = list(range(count))
        shares = [share(items, rank, world_size) for rank in range(world_size)]
        assert sorted(sum(shares, [])) == items
        assert reassemble(shares) == items


def test_two_processes_give_the_results_of_one(models):
    """Two ranks (threads here, a gather between them standing in for the gloo group):
    each scores its share, and both return every result in order."""
    ours, _ = models
    barrier, box = threading.Barrier(2), [None, None]

    def gather_for(rank):
        def gather(mine):
            box[rank] = mine
            barrier.wait()
            everyone = list(box)
            barrier.wait()
            return everyone

        return gather

    one = (ours.loglikelihood(requests("loglikelihood", PAIRS)),
           ours.generate_until(requests("generate_until", GENERATIONS)))  # fmt: skip
    results = [None, None]

    def rank_main(rank):
        lm = harness_model(ours.model, ours.tokenizer, "cpu", batch_size=3,
                           max_length=MAX_LENGTH, rank=rank, world_size=2,
                           end_ids=ours.end_ids, gather=gather_for(rank))  # fmt: skip
        results[rank] = (lm.loglikelihood(requests("loglikelihood", PAIRS)),
                         lm.generate_until(requests("generate_until", GENERATIONS)))  # fmt: skip

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[0] == results[1]
    assert [g for _, g in results[0][0]] == [g for _, g in one[0]]
    assert [p for p, _ in results[0][0]] == pytest.approx([p for p, _ in one[0]], abs=1e-5)
    assert results[0][1] == one[1]


def score_in_a_process_group(rank: int, folder: str, rendezvous: str, out: str) -> None:
    """One of two processes of a gloo group: the adapter's results on PAIRS and
    GENERATIONS, its share gathered over the group harness_model makes."""
    import torch.distributed as dist

    from freetx.checkpoint import load_model
    from freetx.data import HFTokenizer
    from freetx.models.hf import end_token_ids

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    tokenizer = HFTokenizer(folder)
    lm = harness_model(load_model(folder, torch.device("cpu")), tokenizer, "cpu", batch_size=3,
                       max_length=MAX_LENGTH, rank=rank, world_size=2,
                       end_ids=[*end_token_ids(folder), tokenizer.eos_id])  # fmt: skip
    results = [lm.loglikelihood(requests("loglikelihood", PAIRS)),
               lm.generate_until(requests("generate_until", GENERATIONS))]  # fmt: skip
    with open(f"{out}.{rank}", "w") as file:
        json.dump(results, file)
    dist.destroy_process_group()


@pytest.mark.slow  # starts two processes (37 s on a loaded 2-core machine)
def test_two_gloo_processes_give_the_results_of_one(models, tmp_path):
    import torch.multiprocessing as mp

    ours, _ = models
    folder = str(ours.tokenizer.path)
    out = str(tmp_path / "results")
    mp.start_processes(score_in_a_process_group, args=(folder, str(tmp_path / "rdv"), out),
                       nprocs=2, start_method="spawn")  # fmt: skip
    one = [ours.loglikelihood(requests("loglikelihood", PAIRS)),
           ours.generate_until(requests("generate_until", GENERATIONS))]  # fmt: skip
    for rank in range(2):
        logps, texts = json.loads((tmp_path / f"results.{rank}").read_text())
        assert [p for p, _ in logps] == pytest.approx([p for p, _ in one[0]], abs=1e-5)
        assert [g for _, g in logps] == [g for _, g in one[0]]
        assert texts == one[1]


def test_world_size_without_a_process_group_is_refused(models):
    ours, _ = models
    with pytest.raises(ConfigError, match="torch.distributed is not initialized"):
        harness_model(ours.model, ours.tokenizer, "cpu", rank=0, world_size=2)


def test_a_missing_lm_eval_is_refused_naming_the_extra(models, monkeypatch):
    ours, _ = models
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    with pytest.raises(ConfigError) as error:
        harness_model(ours.model, ours.tokenizer, "cpu")
    assert "pip install 'freetx[eval]'" in flat(str(error.value))
