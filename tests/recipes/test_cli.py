"""The `freetx` CLI end to end, on the small recipe in tests/assets (1 and 2 processes)."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import ASSETS, REPO, flat, run_freetx, run_freetx_here, run_refused_here

REPO_CONFIGS = REPO / "recipe_configs"

RECIPE = str(ASSETS / "echo_recipe.py")
CONFIG = str(ASSETS / "echo.yaml")


def test_help_and_version_are_fast():
    start = time.perf_counter()
    result = run_freetx("--help")
    assert result.returncode == 0 and "validate" in result.stdout
    assert all(name in result.stdout for name in ("doctor", "import"))
    # the whole interpreter start-up included; torch must not be imported
    assert time.perf_counter() - start < 5
    assert run_freetx("--version").stdout.startswith("freetx ")


def test_ls_does_not_import_torch():
    result = run_freetx("ls")
    assert result.returncode == 0 and result.stdout.startswith("RECIPE")
    import subprocess
    import sys

    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from freetx.cli.main import main; main(['ls']); "
            "print('torch' in sys.modules, 'omegaconf' in sys.modules)",
        ],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip().endswith("False False")


def test_unknown_command_is_a_usage_error():
    assert run_freetx("bogus").returncode == 2


def test_cat_applies_overrides_and_resolves(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: 3\ntotal: ${steps}\nname: x\n")
    result = run_freetx("cat", str(cfg), "steps=7", "~name")
    assert result.returncode == 0
    assert result.stdout == "steps: 7\ntotal: 7\n"


def test_cat_missing_config_is_one_paragraph(tmp_path):
    result = run_freetx("cat", str(tmp_path / "nope.yaml"))
    assert result.returncode == 1
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_validate_clean_and_with_problems():
    ok = run_freetx_here("validate", CONFIG, "--recipe", RECIPE, "steps=4")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = run_freetx_here(
        "validate", CONFIG, "steps=abc", "--recipe", RECIPE, "optimizer.lrr=1", "stepz=3"
    )
    assert bad.returncode == 1
    assert "3 problems" in bad.stdout
    assert "did you mean 'steps'" in bad.stdout and "did you mean 'lr'" in bad.stdout


def test_validate_a_path_needs_the_recipe():
    result = run_freetx_here("validate", CONFIG)
    assert result.returncode == 1 and "--recipe" in result.stderr


def test_run_in_process(tmp_path):
    result = run_freetx("run", RECIPE, "--config", CONFIG, f"output_dir={tmp_path}", "steps=2")
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["world_size"] == 1
    assert "steps: 2" in (tmp_path / "config.yaml").read_text()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_run_two_processes_both_ranks_run(tmp_path):
    result = run_freetx(
        "run", "--nproc-per-node", "2", RECIPE, "--config", CONFIG, f"output_dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in records] == [2, 2]
    # the all-reduced loss is the same on both ranks
    assert records[0]["loss"] == records[1]["loss"]
    # rank 0 alone writes the metrics
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("kind", ["user", "crash"])
def test_a_raising_rank_ends_the_job(tmp_path, kind):
    start = time.perf_counter()
    result = run_freetx(
        "run",
        "--nproc_per_node",
        "2",
        RECIPE,
        "--config",
        CONFIG,
        f"output_dir={tmp_path}",
        "fail_on_rank=1",
        f"fail_kind={kind}",
        timeout=120,
    )
    assert result.returncode == 1
    assert time.perf_counter() - start < 120  # ended, did not hang
    if kind == "user":  # one paragraph, printed once by `freetx run`, naming the rank
        assert result.stderr.count("rank 1 was told to fail") == 1, result.stderr
        assert "freetx [rank 1]: error: rank 1 was told to fail" in result.stderr
        assert "Traceback" not in result.stderr and "rank 0" not in result.stderr
    else:
        assert "freetx run: rank 1 failed (" in result.stderr
        assert "RuntimeError: a crash that is not a user error" in result.stderr
    assert not (tmp_path / "rank0.json").exists()


def test_debug_shows_the_traceback(tmp_path):
    result = run_freetx(
        "--debug",
        "run",
        RECIPE,
        "--config",
        CONFIG,
        f"output_dir={tmp_path}",
        "fail_on_rank=0",
        "steps=1",
    )
    assert result.returncode == 1 and "Traceback" in result.stderr


def test_run_rejects_a_bad_config_before_launching(tmp_path):
    result = run_refused_here(
        "--nproc-per-node",
        "2",
        RECIPE,
        "--config",
        CONFIG,
        f"output_dir={tmp_path}",
        "stpes=3",
    )
    assert result.returncode == 1
    assert result.stderr.count("did you mean 'steps'") == 1  # once
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize(
    "args,fragment,code",
    [
        (["nope_recipe", "--config", CONFIG], "not a built-in recipe", 1),
        (["./missing.py", "--config", CONFIG], "does not exist", 1),
        ([RECIPE], "no config given", 2),
        ([RECIPE, "--config", CONFIG, "steps"], "not an override", 2),
        ([RECIPE, "--config", "no/such/config"], "not a built-in config name", 1),
    ],
)
def test_run_usage_errors(args, fragment, code):
    result = run_refused_here(*args)
    assert result.returncode == code, result.stderr
    assert fragment in flat(result.stderr) and "Traceback" not in result.stderr


def test_recipe_without_distributed_refuses_launch_options(tmp_path):
    single = tmp_path / "single.py"
    single.write_text(
        (ASSETS / "echo_recipe.py")
        .read_text()
        .replace("@parse(EchoConfig)", "@parse(EchoConfig, supports_distributed=False)")
    )
    result = run_refused_here(
        "--nproc-per-node", "2", str(single), "--config", CONFIG, f"output_dir={tmp_path}"
    )
    assert result.returncode == 1 and "one process only" in flat(result.stderr)


def test_ls_lists_recipes_and_configs():
    result = run_freetx("ls")
    assert "full_finetune_fsdp2" in result.stdout and "llm/tiny" in result.stdout


def test_cp_recipe_and_config(tmp_path):
    assert run_freetx("cp", "full_finetune_fsdp2", str(tmp_path / "my_ft")).returncode == 0
    assert (tmp_path / "my_ft.py").read_text().startswith('"""Train a decoder LM')
    assert run_freetx("cp", "llm/tiny", str(tmp_path)).returncode == 0
    assert (tmp_path / "tiny.yaml").exists()
    (tmp_path / "tiny.yaml").write_text("# my edits\n")
    for flags in ([], ["--no-clobber"]):  # an existing file is kept unless --overwrite
        again = run_freetx("cp", "llm/tiny", str(tmp_path / "tiny.yaml"), *flags)
        assert again.returncode == 1 and "already exists" in flat(again.stderr)
    assert (tmp_path / "tiny.yaml").read_text() == "# my edits\n"
    assert run_freetx("cp", "llm/tiny", str(tmp_path / "tiny.yaml"), "--overwrite").returncode == 0
    assert "output_dir" in (tmp_path / "tiny.yaml").read_text()
    deep = tmp_path / "a" / "b" / "c.yaml"
    assert run_freetx("cp", "llm/tiny", str(deep)).returncode == 1
    assert run_freetx("cp", "llm/tiny", str(deep), "--make-parents").returncode == 0
    wrong = run_freetx("cp", "llm/tiny", str(tmp_path / "x.py"))
    assert wrong.returncode == 1 and ".yaml" in wrong.stderr


def test_validate_builtin_config_with_a_typo_names_max_steps():
    result = run_freetx_here("validate", "llm/tiny", "max_stpes=10")
    assert result.returncode == 1 and "did you mean 'max_steps'" in result.stdout


def test_validate_typo_in_a_config_file(tmp_path):
    cfg = tmp_path / "typo.yaml"
    cfg.write_text(
        (REPO_CONFIGS / "llm" / "tiny.yaml").read_text().replace("max_steps:", "max_stpes:")
    )
    result = run_freetx_here("validate", str(cfg), "--recipe", "full_finetune_fsdp2")
    assert result.returncode == 1
    assert "unknown key 'max_stpes': did you mean 'max_steps'?" in result.stdout
    assert "missing required key 'max_steps'" in result.stdout


def test_copied_recipe_runs_by_path(tmp_path):
    run_freetx("cp", "full_finetune_fsdp2", str(tmp_path / "mine.py"))
    result = run_freetx(
        "run", str(tmp_path / "mine.py"), "--config", "llm/tiny", f"output_dir={tmp_path / 'out'}",
        "max_steps=2", "eval.max_batches=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "metrics.jsonl").exists()
