"""Every command of README.md and docs/quickstart.md runs, in order, as a newcomer types
it on a fresh clone, and the figures the pages quote are the ones printed.

    pytest -m slow tests/slow/test_docs_commands.py   # ~5 min on 2 idle cores, 10 loaded

Each page is followed from its own fresh copy of the repository's working tree (its
tracked files and the untracked files git does not ignore, as `git clone` of a commit of
it would give), with this session's virtual environment as the copy's `.venv` (`make
setup`'s, not made again). Each line of a ```bash block (`\\` continuations joined) runs
with `bash -c` in the copy, the venv's bin/ first on PATH, and must exit 0, print no
traceback, and never print "nothing left to train" (a command that trained nothing
because an earlier one filled its `output_dir`).

- A line whose comment quotes output (`cmd   # -> text`) must print that text; its exit
  status is not checked (such lines show a refusal).
- A fence without a language after a command quotes what that command printed. Each
  quoted line of the form `first | key value | ...` is compared with the printed line
  that has the same first field and keys: every field must be printed as quoted,
  except the throughputs in TIMINGS (their keys only), from a `...` field on, and the
  losses in LOSSES, within LOSS_RTOL of the quoted value: two CPUs' float kernels give the
  same first steps and part ways by ~1% over a 120-step run (llm/tiny's step-120 val/loss:
  2.1531 on one machine kind, 2.1830 on another, from the same code).
- Lines that cannot run here are skipped by SKIPS: a line is skipped only where it
  matches a pattern, each with its reason, and every pattern must still match a line of
  the pages (so that neither a new runnable line nor a stale reason goes unnoticed).
- Shrinking, the one override the test adds: each `freetx run` line gets `max_steps=N`
  appended (N from the environment variable FREETX_DOCS_MAX_STEPS, default 5; 0 runs
  every line as written), except the lines whose output a page quotes and those in
  FULL_RUNS (later lines read their checkpoints at the step the page names).

A failure names the page, the line, the command as run, its exit status and the end of
its output; the captured stdout lists every line run (or skipped) with its seconds.
The losses quoted are those of this CPU build of torch (2.13.0, 2 gloo processes); they
are what a user of the documented set-up sees.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, flat

PAGES = ["README.md", "docs/quickstart.md"]

SKIPS = [
    (
        r"^make (demo|test|test-slow)\b",
        "minutes of training or the whole test suite (CI runs them)",
    ),
    (r"^make setup\b", "this test runs in the virtual environment `make setup` made"),
    (r"^git clone ", "this test runs in a fresh copy of the repository already"),
    (r"/models/", "a pretrained model's folder, not on this machine"),
    (r"--nproc-per-node 8\b", "8 GPUs"),
    (r"--submit\b", "a SLURM cluster (tests/slow/test_slurm.py submits to a real one)"),
    (r"runs/llama3_1_8b/", "the checkpoint of an 8-GPU run above"),
    (r"\b(ds_config\.json|qlora\.yml)\b", "a DeepSpeed or axolotl config of the user's own"),
]
# `freetx run` lines run to the page's max_steps although nothing quotes their output
FULL_RUNS = [
    (r"^freetx run full_finetune_fsdp2 --config llm/tiny$", "README: its step_000120 is read"),
]
TIMINGS = {"tokens_per_s", "loss_tokens_per_s"}
LOSSES, LOSS_RTOL = {"loss", "val/loss"}, 0.03
NOTHING_TRAINED = "nothing left to train"
LINE_TIMEOUT_S = 600


@dataclass
class Command:
    page: str
    line: int  # where it starts on the page
    text: str  # continuations joined, comment kept
    expect: str | None  # the text a `# -> text` comment quotes

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Quote:
    page: str
    line: int
    lines: list[str]


def steps(page: str, text: str) -> list[Command | Quote]:
    """The page's commands (```bash blocks, a line each) and quoted outputs (fences
    without a language), in the order they come."""
    found: list[Command | Quote] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^ {0,3}```\s*(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        start, lang, body = i + 1, fence.group(1), []
        i += 1
        while i < len(lines) and not re.match(r"^ {0,3}```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        if lang == "bash":
            found += _commands(page, start, body)
        elif lang == "":
            found.append(Quote(page, start + 1, body))
    return found


def _commands(page: str, start: int, body: list[str]) -> list[Command]:
    commands, pending, first = [], "", 0
    for number, raw in enumerate(body, start=start + 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        first = first if pending else number
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        text = pending + line
        pending = ""
        quoted = re.search(r"\s#\s*->\s*(.+)$", text)
        commands.append(Command(page, first, text, quoted.group(1).strip() if quoted else None))
    return commands


def skip_reason(command: Command) -> str | None:
    for pattern, reason in SKIPS:
        if re.search(pattern, " ".join(command.words)):  # the command, not its comment
            return reason
    return None


def as_run(command: Command, quoted: bool, max_steps: int) -> str:
    """The command line to run: shrunk to `max_steps` where that is allowed."""
    words = command.words
    is_training = words[:2] == ["freetx", "run"] and "generate" not in words
    full = quoted or any(re.search(p, " ".join(words)) for p, _ in FULL_RUNS)
    if max_steps and is_training and not full:
        return shlex.join([*words, f"max_steps={max_steps}"])
    return command.text


def fields(line: str) -> list[str]:
    return [field.strip() for field in line.split(" | ")]


def same_field(quoted: str, printed: str) -> bool:
    """A printed `key value` field says what the quoted one says: the same text, any
    throughput (TIMINGS), or a loss (LOSSES) within LOSS_RTOL."""
    key, _, value = quoted.partition(" ")
    if quoted == printed or key in TIMINGS:
        return True
    have_key, _, have = printed.partition(" ")
    if key not in LOSSES or have_key != key:
        return False
    try:
        return abs(float(have) - float(value)) <= LOSS_RTOL * abs(float(value))
    except ValueError:
        return False


def figures_differ(quoted: str, printed_lines: list[str]) -> str | None:
    """None where a printed line says what the quoted line says (TIMINGS' values and
    what follows a `...` field aside); else why not."""
    want = fields(quoted)
    if "..." in want:
        want = want[: want.index("...")]
    keys = [field.split(" ")[0] for field in want]
    for printed in printed_lines:
        have = fields(printed)
        if have[0] != want[0] or [f.split(" ")[0] for f in have[: len(want)]] != keys:
            continue
        wrong = [f"{w!r} printed as {h!r}" for w, h in zip(want, have) if not same_field(w, h)]
        return "; ".join(wrong) or None
    return "no printed line has these fields"


def working_tree_copy(dest: Path) -> Path:
    """A fresh copy of the repository's working tree (what `git clone` gives, with the
    uncommitted edits the session's editable install runs), the venv as its .venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    for name in filter(None, listed.stdout.split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    (dest / ".venv").symlink_to(Path(sys.prefix))
    return dest


def run_line(text: str, cwd: Path) -> subprocess.CompletedProcess:
    venv_bin = str(Path(sys.prefix) / "bin")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VIRTUAL_ENV": sys.prefix}
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env.pop("FREETX_DEBUG", None)
    return subprocess.run(
        ["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=LINE_TIMEOUT_S,
    )  # fmt: skip


def page_steps(page: str) -> list[Command | Quote]:
    return steps(page, (REPO / page).read_text())


def what_is_wrong(command: Command, result: subprocess.CompletedProcess) -> str | None:
    """Why a command's run falls short of the page (None: it does what the page says)."""
    output = result.stdout + result.stderr
    if command.expect is not None and flat(command.expect) not in flat(output):
        return f"it does not print what its comment quotes: {command.expect}"
    if command.expect is None and result.returncode != 0:
        return "it failed"
    if "Traceback" in output:
        return "it printed a traceback"
    if NOTHING_TRAINED in output:
        return f"it trained nothing ({NOTHING_TRAINED}): give it an output_dir of its own"
    return None


def fail(command: Command, run: str, result: subprocess.CompletedProcess, why: str):
    """End the test naming the page's line, the command as run and the end of its output."""
    output = (result.stdout + result.stderr)[-6000:]
    pytest.fail(
        f"{command.where}: {why}\n  as run: {run}\n  exit status {result.returncode}; "
        f"the end of its output:\n{output}",
        pytrace=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_command_of_the_page_runs_in_order(page, tmp_path):
    if sys.prefix == sys.base_prefix:
        pytest.skip("runs in a virtual environment (make setup) that the copy uses as .venv")
    max_steps = int(os.environ.get("FREETX_DOCS_MAX_STEPS", "5"))
    copy = working_tree_copy(tmp_path / "freetx")
    found = page_steps(page)
    quoted = {id(found[i - 1]) for i, s in enumerate(found) if isinstance(s, Quote) and i}
    last: tuple[Command, str, subprocess.CompletedProcess] | None = None
    for step in found:
        if isinstance(step, Quote):
            assert last is not None, f"{page}:{step.line}: a quoted output before any command"
            printed = (last[2].stdout + last[2].stderr).splitlines()
            for number, line in enumerate(step.lines, start=step.line):
                why = figures_differ(line, printed) if " | " in line else None
                if why is not None:
                    fail(*last, f"{page}:{number} quotes {line!r}: {why}")
            continue
        reason = skip_reason(step)
        if reason is not None:
            print(f"[{step.where}] skipped ({reason}): {step.text}")
            continue
        run = as_run(step, id(step) in quoted, max_steps)
        began = time.monotonic()
        result = run_line(run, copy)
        print(f"[{step.where}] {time.monotonic() - began:.1f} s: {run}")
        why = what_is_wrong(step, result)
        if why is not None:
            fail(step, run, result, why)
        last = (step, run, result)


def test_every_skip_reason_matches_a_line_of_the_docs():
    commands = [s for page in PAGES for s in page_steps(page) if isinstance(s, Command)]
    assert len(commands) > 20, commands
    for pattern, reason in SKIPS + FULL_RUNS:
        assert any(re.search(pattern, " ".join(c.words)) for c in commands), (
            f"no line of {PAGES} matches {pattern!r} ({reason}): remove it"
        )


def test_a_quoted_figure_that_differs_is_named():
    printed = [
        "step 120/120 | loss 2.1036 | lr 3.00e-04 | tokens_per_s 9,700",
        "step 120/120 | val/loss 2.1531",
    ]
    assert figures_differ("step 120/120 | val/loss 2.1531", printed) is None
    assert figures_differ("step 120/120 | loss 2.1036 | lr 3.00e-04 | ...", printed) is None
    assert figures_differ("step 120/120 | loss 2.1036 | tokens_per_s 5", printed) is not None
    assert (
        figures_differ("step 120/120 | loss 2.1036 | lr 3.00e-04 | tokens_per_s 5", printed) is None
    )
    assert (
        figures_differ("step 120/120 | val/loss 2.5263", printed)
        == "'val/loss 2.5263' printed as 'val/loss 2.1531'"
    )
    assert figures_differ("step 120/120 | val/loss 2.1830", printed) is None  # another CPU's
    assert figures_differ("step 120/120 | loss 2.1036 | lr 3.10e-04", printed) == (
        "'lr 3.10e-04' printed as 'lr 3.00e-04'"  # not a loss: exact
    )
    assert figures_differ("step 60/120 | val/loss 2.1531", printed) is not None


def test_a_page_becomes_commands_and_quotes():
    page = (
        "text\n\n```bash\n# a comment\nfreetx ls   # list\nfreetx run a \\\n"
        "    --config b   # -> it ran\n```\n\n```\nstep 1 | loss 2\n```\n\n```yaml\nx: 1\n```\n"
    )
    found = steps("p.md", page)
    assert found == [
        Command("p.md", 5, "freetx ls   # list", None),
        Command("p.md", 6, "freetx run a --config b   # -> it ran", "it ran"),
        Quote("p.md", 11, ["step 1 | loss 2"]),
    ]
    assert as_run(found[1], quoted=False, max_steps=20) == "freetx run a --config b max_steps=20"
    assert as_run(found[1], quoted=True, max_steps=20) == found[1].text
    assert as_run(found[0], quoted=False, max_steps=20) == found[0].text


def test_a_run_that_trained_nothing_is_named():
    done = subprocess.CompletedProcess(
        [], 0, "runs/x is at max_steps=120: nothing left to train", ""
    )
    refused = subprocess.CompletedProcess([], 1, "", "unknown key 'max_stpes'")
    run = Command("p.md", 1, "freetx run a", None)
    quoting = Command(
        "p.md", 2, "freetx validate a  # -> unknown key 'max_stpes'", "unknown key 'max_stpes'"
    )
    assert "give it an output_dir of its own" in what_is_wrong(run, done)
    assert what_is_wrong(run, refused) == "it failed"
    assert what_is_wrong(quoting, refused) is None
    assert what_is_wrong(quoting, done).startswith("it does not print what its comment quotes")
