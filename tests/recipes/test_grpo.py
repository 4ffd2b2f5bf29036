"""grpo_fsdp2 through the CLI: LoRA GRPO of an HF folder with a reward from the user's own
module, trusted for the run (docs/recipes/grpo_fsdp2.md's command as written; refused
without --trust), its TRL-style twin scoring the same, exported for PEFT; a reward that
raises or blocks past reward_timeout_s is named with its row; a SIGTERM while a reward
blocks saves the step and stops; validate refuses what the run refuses, and warns that
greedy rollouts cannot learn; estimate counts the generation phase and a judge's
weights; 2 processes (fsdp with the static batch, and tp 2 with another slot count and
pool) give 1 process's rollouts, rewards and losses, and so do multi-turn episodes; a
resume of multi-turn episodes, at another world size too, repeats the uninterrupted run;
docs/environments.md's user environment and tool train an HF folder with LoRA on 2
processes and export for PEFT."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.conftest import REPO, flat, one_paragraph, run_freetx, run_freetx_here
from tests.hf_folders import make_folder, make_tokenizer

JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"
GUESS = "llm/guess_grpo_tiny"  # multi-turn: the guessing game
# a randomly initialized tiny decoder (seed 0) samples bytes; a completion is rewarded when
# it holds a vowel, which some of a group's do and some do not: advantages that are not 0
VOWEL = "rewards=[{_component_: freetx.objectives.RegexFormat, pattern: '(?s).*[aeiou].*'}]"
RANDOM = ["model_dir=null", "dataset.num_builtin_examples=400", "eval.every_n_steps=0",
          "eval.max_batches=1", "eval.batch_size=8", "log_every_n_steps=1",
          "checkpoint.every_n_steps=0", "batch_size=4", "generation.num_generations=4",
          "generation.max_completion_length=8", "samples.every_n_steps=0",
          "lr_schedule.warmup_steps=0", "optimizer.lr=1e-2", VOWEL, JSONL]  # fmt: skip


def metrics(output_dir) -> dict[int, dict]:
    """step -> the training step's logged metrics."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def grpo(tmp_path, name, *overrides, nproc=1, config="llm/grpo_tiny", env=None):
    out = tmp_path / name
    args = ["run"] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    result = run_freetx(*args, "grpo_fsdp2", "--config", config, f"output_dir={out}",
                        *RANDOM, *overrides, env=env)  # fmt: skip
    return out, result


def ran(pair):
    out, result = pair
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


USER_REWARDS = """
import os, signal, time

def count_words(prompt, completion, row):
    return -abs(len(completion.split()) - int(row['words']))

def count_words_trl(prompts, completions, completion_ids, words, **kwargs):  # TRL's form
    return [-abs(len(c.split()) - int(w)) for c, w in zip(completions, words)]

def boom(prompt, completion, row):
    raise KeyError('score')

def stuck(prompt, completion, row):
    time.sleep(3600)

calls = []

def sigterm_in_step_2(prompt, completion, row):  # 16 completions a step
    calls.append(1)
    if len(calls) == 17:
        os.kill(os.getpid(), signal.SIGTERM)  # a pre-emption while the reward blocks
        time.sleep(3600)
    return float(len(calls) % 2)
"""


def docs_command(folder, prompts, trust: bool = True) -> list[str]:
    """docs/recipes/grpo_fsdp2.md's command for an HF folder and the user's own reward, as
    written (`PYTHONPATH=. freetx run ...`, run in the reward module's folder), DIR and
    prompts.jsonl replaced by the test's; without `--trust my_rewards` when not `trust`."""
    text = (REPO / "docs" / "recipes" / "grpo_fsdp2.md").read_text()
    line = re.search(r"^PYTHONPATH=\. freetx (run .*llm/hf_tiny_grpo \\\n.*)$", text, re.M)[1]
    line = line.replace("\\\n", " ").replace("DIR", str(folder))
    words = shlex.split(line.replace("prompts.jsonl", str(prompts)))
    return words if trust else [w for w in words if w not in ("--trust", "my_rewards")]


def user_env(user) -> dict:
    return {"PYTHONPATH": str(user), "FREETX_TRUST": "my_rewards"}


@pytest.fixture(scope="module")
def hf_prompts(tmp_path_factory):
    """A tiny Llama-shaped HF folder with a chat template, a prompts file asking for a
    number of words, and the user's reward module scoring it."""
    from freetx.data.corpus import builtin_documents

    root = tmp_path_factory.mktemp("grpo_hf")
    folder = make_folder(root / "llama", "llama3_2")
    make_tokenizer(folder, builtin_documents()[:20])
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"Say {i % 4 + 1} words.", "words": i % 4 + 1}) + "\n")
    module = root / "user" / "my_rewards.py"
    module.parent.mkdir()
    module.write_text(USER_REWARDS)
    return folder, prompts, module.parent


def test_lora_grpo_of_an_hf_folder_with_the_users_reward_exports_for_peft(tmp_path, hf_prompts):
    """Trained on every prompt (dataset.val_fraction=0): no validation, none at the end. A
    judge (the folder itself) as a third reward, sharded like the policy."""
    folder, prompts, user = hf_prompts
    out = tmp_path / "hf_grpo"
    judge = f"{{_component_: freetx.objectives.Judge, model: {folder}, template: '{{completion}}'}}"
    result = run_freetx(
        *docs_command(folder, prompts),
        "rewards=[{_component_: my_rewards.count_words}, "
        f"{{_component_: my_rewards.count_words_trl, name: trl}}, {judge}]",
        "dataset.val_fraction=0", f"output_dir={out}", "max_steps=2", "log_every_n_steps=1", "batch_size=2",
        "generation.num_generations=4", "generation.max_completion_length=12",
        "eval.every_n_steps=0", "eval.max_batches=1", "eval.batch_size=2",
        "samples.every_n_steps=1", "checkpoint.every_n_steps=0", JSONL,
        cwd=user, env={"PYTHONPATH": "."},  # PYTHONPATH=. as the docs write it; no FREETX_TRUST
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "reference adapters off" in flat(result.stdout)  # beta 0.04: the base
    assert "no validation: dataset.val_fraction=0" in flat(result.stdout)
    assert not any("val/" in line for line in (out / "metrics.jsonl").read_text().splitlines())
    logged = metrics(out)
    assert set(logged) == {1, 2}
    for name in ("reward", "rewards/count_words/mean", "kl", "clip_ratio/region_mean",
                 "completions/mean_length", "entropy", "generation/tokens_per_s",
                 "time/generation", "time/scoring", "time/training", "frac_reward_zero_std"):  # fmt: skip
        assert name in logged[2], name
    assert logged[1]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is its reference
    for step in (1, 2):  # TRL's batched form, taken unchanged, scores as its twin
        assert logged[step]["rewards/trl/mean"] == logged[step]["rewards/count_words/mean"]
        assert 0 < logged[step]["rewards/judge/mean"] < 1  # a probability of "Yes"
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 1} and "count_words" in samples[0]["rewards"]
    adapter = json.loads((out / "export" / "peft" / "adapter_config.json").read_text())
    assert adapter["r"] == 16


def docs_environment(folder) -> tuple[str, list[str]]:
    """docs/environments.md's example: the user's module as written, and its command for
    an HF folder (DIR replaced by the test's)."""
    text = (REPO / "docs" / "environments.md").read_text()
    part = text[text.index("## Your own environment and tools") :]
    module = re.search(r"```python\n(.*?)```", part, re.S)[1]
    line = re.search(r"^(PYTHONPATH=\. freetx run .*my_env.*\\\n.*)$", part, re.M)[1]
    words = shlex.split(line.replace("\\\n", " ").replace("DIR", str(folder)))
    return module, words[words.index("run") :]


@pytest.mark.slow  # 2 processes, LoRA, 2 steps of multi-turn episodes
def test_the_users_environment_and_tool_train_an_hf_folder_with_lora_and_export(tmp_path):
    """docs/environments.md's example as written: the user's environment and tool in their
    module, an HF folder whose chat template renders tools (Hermes calls), LoRA on 2
    processes; episodes of up to 3 turns; exported for PEFT."""
    from freetx.data.corpus import builtin_documents
    from tests.hf_folders import TOOLS_TEMPLATE

    folder = make_folder(tmp_path / "llama", "llama3_2")
    make_tokenizer(folder, builtin_documents()[:20], TOOLS_TEMPLATE)
    module, command = docs_environment(folder)
    (tmp_path / "my_env.py").write_text(module)
    words = {"cat": "feline", "dog": "canine"}
    with (tmp_path / "quiz.jsonl").open("w") as f:
        for i in range(24):
            word = list(words)[i % 2]
            f.write(
                json.dumps({"prompt": f"What is a {word}? ({i})", "answer": words[word]}) + "\n"
            )
    out = tmp_path / "run"
    result = run_freetx(
        *command, "dataset.val_fraction=0", f"output_dir={out}", "max_steps=2",
        "log_every_n_steps=1", "batch_size=2", "generation.num_generations=4",
        "generation.max_completion_length=12", "eval.every_n_steps=0", "samples.every_n_steps=1",
        "checkpoint.every_n_steps=0", JSONL, cwd=tmp_path, env={"PYTHONPATH": "."},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rewards env x 1" in flat(result.stdout)
    logged = metrics(out)
    assert set(logged) == {1, 2}
    for name in ("episodes/mean_turns", "tools/call_frequency", "tools/failure_frequency",
                 "episodes/cut_max_turns", "time/environment", "rewards/env/mean", "kl"):  # fmt: skip
        assert name in logged[2], name
    assert logged[1]["episodes/mean_turns"] > 1  # a random model is told to try again
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["messages"][0]["role"] == "assistant" and samples[0]["turns"] >= 1
    adapter = json.loads((out / "export" / "peft" / "adapter_config.json").read_text())
    assert adapter["r"] == 16


def test_the_users_reward_without_trust_is_refused_before_launch(tmp_path, hf_prompts):
    folder, prompts, user = hf_prompts
    command = docs_command(folder, prompts, trust=False)
    text = one_paragraph(
        run_freetx(*command, f"output_dir={tmp_path / 'out'}", cwd=user, env={"PYTHONPATH": "."})
    )
    assert "rewards[0]._component_: 'my_rewards.count_words' is refused" in text
    assert "freetx run --trust my_rewards" in text and not (tmp_path / "out").exists()


@pytest.mark.parametrize("reward, says", [("boom", "failed: KeyError: 'score'"),
                                          ("stuck", "did not return within reward_timeout_s=1 s")])  # fmt: skip
def test_a_reward_that_raises_or_blocks_is_named_with_its_row(tmp_path, hf_prompts, reward, says):
    _, _, user = hf_prompts
    out, result = grpo(tmp_path, reward, "max_steps=1", "reward_timeout_s=1",
                       f"rewards=[{{_component_: my_rewards.{reward}}}]", env=user_env(user))  # fmt: skip
    text = one_paragraph(result)
    assert f"reward {reward} on builtin prompt" in text and "(prompt '" in text and says in text


def test_a_sigterm_while_a_reward_blocks_saves_the_step_and_stops(tmp_path, hf_prompts):
    _, _, user = hf_prompts
    out, result = grpo(tmp_path, "term", "max_steps=3",
                       "rewards=[{_component_: my_rewards.sigterm_in_step_2}]", env=user_env(user))  # fmt: skip
    assert result.returncode == 75, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "stopped by SIGTERM at step 1" in flat(result.stderr) and "Traceback" not in result.stderr
    )
    assert (out / "checkpoints" / "LATEST").read_text().strip() == "step_000001"


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["distributed.cp=2"], "the KV cache holds no context shard"),
        (["distributed.pp=2"], "a pipeline would generate one token per pass"),
        (
            ["generation.steps_per_generation=3"],
            "not a multiple of generation.steps_per_generation",
        ),
        (
            ["dataset._component_=freetx.data.InstructDataset", "~dataset.tasks"],
            "generates from prompts",
        ),
        (["loss.aggregation=dapo"], "did you mean 'token'"),
        (["generation.top_p=1.5"], "top_p"),
        (
            ["generation.engine.kv_blocks=1", "generation.engine.block_size=2"],
            "generation.engine.kv_blocks=1 blocks of 2 tokens hold 2 tokens",
        ),
        (["generation.engine.slots=0"], "'generation.engine.slots' must be at least 1"),
        (["dataset.val_fraction=0", "eval.every_n_steps=5"], "Set eval.every_n_steps=0"),
        (["rewards=[{_component_: freetx.objectives.ExactMatch, weight: 1, wieght: 2}]"], "wieght"),
        (["rewards=[]"], "at least one reward"),
        (["env={_component_: freetx.envs.GuessingGame, max_turns: 0}"], "env.max_turns=0"),
        (["env={_component_: freetx.envs.GuessingGame, max_turn: 3}"], "max_turn"),
        (["env={_component_: freetx.data.ByteTokenizer}"], "no language environment"),
        (["env={_component_: freetx.envs.GuessingGame}"], "ByteTokenizer has no chat template"),
        (
            [
                "env={_component_: freetx.envs.GuessingGame, max_tokens: 512}",
                "generation.engine.kv_blocks=8",
                "tokenizer.chat_template=turns",
            ],
            "one episode may hold env.max_tokens=512",
        ),  # fmt: skip
    ],
)
def test_validate_refuses_what_the_run_refuses(overrides, says):
    result = run_freetx_here("validate", "llm/grpo_tiny", "model_dir=null", *overrides)
    assert result.returncode != 0
    assert says in flat(result.stdout + result.stderr)


def test_validate_warns_that_greedy_rollouts_cannot_learn():
    result = run_freetx_here(
        "validate", "llm/grpo_tiny", "model_dir=null", "generation.temperature=0"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning: generation.temperature=0 samples greedily" in flat(result.stdout)
    assert "every advantage is 0" in flat(result.stdout)


def test_estimate_counts_a_judges_weights_whole(hf_prompts):
    folder = hf_prompts[0]
    judge = f"rewards=[{{_component_: freetx.objectives.Judge, model: {folder}, template: '{{completion}}'}}]"
    result = run_freetx_here("estimate", "llm/grpo_tiny", "model_dir=null", judge,
                             "--world-size", "2", "--device", "cpu")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        "judge rewards: their models' weights 0.00 GiB, gathered whole while they score "
        f"(sharded like the policy between scorings under FSDP2), within the peak: {folder}"
        in flat(result.stdout)
    )


def test_estimate_counts_the_generation_phase():
    result = run_freetx_here("estimate", "llm/grpo_tiny", "model_dir=null", "dataset.max_prompt_len=48",
                             "generation.engine.slots=16", "generation.engine.kv_blocks=40",
                             "--world-size", "2", "--device", "cpu")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "generation" in result.stdout.splitlines()[1]
    assert "8 prompts x 8 completions x 52 tokens" in result.stdout
    pool = "the KV cache's pool of 40 blocks of 16 tokens for 64 completions per rank in 16 slots"
    assert pool in flat(result.stdout)


@pytest.mark.slow  # 5 runs of 3 steps on 1, 2, 2 processes; multi-turn on 1 and 2
def test_two_processes_fsdp_and_tp2_give_one_process_rollouts_and_losses(tmp_path):
    """And the generation engine's slot count and blocks change nothing (tp 2: 3 slots,
    blocks of 4 tokens, a pool that makes rows give their blocks back), nor does the
    static batch of today's generator (fsdp: generation.engine.paged=false); multi-turn
    episodes (the guessing game) too: rewards, turns and losses."""
    one = metrics(ran(grpo(tmp_path, "one", "max_steps=3")))
    fsdp = metrics(ran(grpo(tmp_path, "fsdp", "max_steps=3", "generation.engine.paged=false",
                            nproc=2)))  # fmt: skip
    slots = ["generation.engine.slots=3", "generation.engine.block_size=4",
             "generation.engine.kv_blocks=20"]  # fmt: skip
    tp = metrics(ran(grpo(tmp_path, "tp", "max_steps=3", "distributed.tp=2", *slots, nproc=2)))
    assert 0 < one[1]["frac_reward_zero_std"] < 1 or 0 < one[2]["frac_reward_zero_std"] < 1
    for step in (1, 2, 3):
        for name, other in (("fsdp, static batch", fsdp), ("tp 2, 3 slots", tp)):
            for key in ("reward", "completions/mean_length", "loss"):
                assert abs(other[step][key] - one[step][key]) <= 1e-5, (name, step, key)
    game = ["max_steps=3", "env.max_turns=3"]
    turns = metrics(ran(grpo(tmp_path, "turns", *game, config=GUESS)))
    turns2 = metrics(ran(grpo(tmp_path, "turns2", *game, nproc=2, config=GUESS)))
    assert turns[1]["episodes/mean_turns"] > 1
    for step in (1, 2, 3):
        for key in ("reward", "episodes/mean_turns", "completions/mean_length", "loss"):
            assert abs(turns2[step][key] - turns[step][key]) <= 1e-5, (step, key)


@pytest.mark.slow  # 3 runs: 4 steps straight, 2 + a resume to 4 on 1 process
def test_a_resume_at_another_world_size_repeats_the_uninterrupted_run(tmp_path):
    """Of multi-turn episodes (the guessing game: turns keyed by the step, the prompt, the
    completion and the turn), with everything else a resume must restore: two optimizer
    steps per generation (the ratio to the generation's log-probs) and a KL term to a
    frozen copy of the initial weights."""
    more = ["generation.steps_per_generation=2", "loss.beta=0.1", "checkpoint.every_n_steps=2",
            "env.max_turns=3"]  # fmt: skip
    straight = metrics(ran(grpo(tmp_path, "straight", "max_steps=4", *more, nproc=2, config=GUESS)))
    ran(grpo(tmp_path, "resumed", "max_steps=2", *more, nproc=2, config=GUESS))
    resumed = metrics(ran(grpo(tmp_path, "resumed", "max_steps=4", *more, config=GUESS)))
    assert set(resumed) >= {3, 4}
    for step in (3, 4):
        for key in ("reward", "loss", "kl", "clip_ratio/region_mean", "episodes/mean_turns"):
            assert abs(resumed[step][key] - straight[step][key]) <= 1e-5, (step, key)
    assert straight[2]["kl"] > 0  # the policy moved from its reference
    assert straight[3]["episodes/mean_turns"] > 1


ESTIMATES = {
    "rloo": ["advantage={_component_: freetx.objectives.LeaveOneOut}", "loss.scale_rewards=none"],
    "reinforce++": ["advantage={_component_: freetx.objectives.ReinforcePlusPlus, baseline: group,"
                    " kl_coef: 0.05, kl_estimator: k3}"],
}  # fmt: skip


@pytest.mark.slow  # 3 runs each: 4 steps on 1 process; 2 steps on 2, resumed to 4 on 2
@pytest.mark.parametrize("estimate", sorted(ESTIMATES))
def test_rloo_and_reinforce_plus_plus_on_two_processes_and_resumed_repeat_one_process(
    tmp_path, estimate
):
    """REINFORCE++ with its KL folded into the reward (a frozen copy of the initial weights
    as reference, the returns normalized over both ranks' tokens) and RLOO: 2 processes
    give 1 process's rewards, losses and gradient norms, and so does a resume."""
    more = [*ESTIMATES[estimate], "checkpoint.every_n_steps=2"]
    one = metrics(ran(grpo(tmp_path, "one", "max_steps=4", *more)))
    ran(grpo(tmp_path, "two", "max_steps=2", *more, nproc=2))
    two = metrics(ran(grpo(tmp_path, "two", "max_steps=4", *more, nproc=2)))
    assert 0 < one[3]["reward"] and set(two) >= {1, 2, 3, 4}
    for step in (1, 2, 3, 4):
        for key in ("reward", "loss", "grad_norm"):
            assert abs(two[step][key] - one[step][key]) <= 1e-5, (step, key)


def test_a_model_without_a_kv_cache_is_refused_before_any_work(tmp_path):
    out, result = grpo(tmp_path, "latent", "max_steps=1",
                       "model={_component_: freetx.models.free_transformer.free_transformer, "
                       "preset: tiny, vocab_size: 259, max_seq_len: 128}")  # fmt: skip
    text = one_paragraph(result)
    assert "has no KV cache" in text and "freetx.models.transformer.decoder" in text
    assert not list(out.glob("checkpoints/step_*"))
