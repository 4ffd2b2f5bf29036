"""Shared test helpers: run the real `freetx` CLI in a subprocess or in this process."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Under pytest-xdist (`make test`: 2 workers) each worker's processes take their share of the
# cores: torch's OpenMP threads outnumbering the cores spin against each other's (a 1-process
# run of 2 threads beside another worker's 2-process run crawls). The processes a test
# launches inherit it; `freetx run` keeps an OMP_NUM_THREADS it is given.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))
REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tests" / "assets"
# the token cache of the datasets tests build (and of the runs they launch, which inherit
# it), in a folder of this session rather than the user's ~/.cache
os.environ["FREETX_CACHE"] = tempfile.mkdtemp(prefix="freetx_tokens_")
atexit.register(shutil.rmtree, os.environ["FREETX_CACHE"], True)


def run_freetx(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run `python -m freetx ARGS` and return the CompletedProcess (text, both streams)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("FREETX_DEBUG", None) if env is None or "FREETX_DEBUG" not in env else None
    return subprocess.run(
        [sys.executable, "-m", "freetx", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_freetx_here(*args: str) -> subprocess.CompletedProcess:
    """Run a freetx command that launches nothing (validate, checkpoint ...) in this process.

    Same result object as `run_freetx`, without paying Python's and torch's start-up
    (about 3 s) per call; `run` and tracebacks are tested through the subprocess.
    """
    assert args and args[0] != "run" and "--debug" not in args, "use run_freetx"
    return _main_here(list(args))


def _main_here(args: list[str]) -> subprocess.CompletedProcess:
    from freetx.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    # what a command sets for its own processes (`--trust`, `run`'s deterministic_env) is
    # the command's only, as it is in a process of its own
    environment = dict(os.environ)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:  # argparse usage errors
            code = e.code
        finally:
            os.environ.clear()
            os.environ.update(environment)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def run_refused_here(*args: str) -> subprocess.CompletedProcess:
    """`freetx run ARGS` in this process, for a run that must be refused before it launches
    anything (its checks are the CLI's own); launching at all fails the test.

    The refusals of the ranks, of torchrun and of a user's traceback are tested through
    `run_freetx`, which pays a process's start-up (about 4 s with torch's) per call.
    """
    from unittest import mock

    from freetx.cli import run

    def launched(*_args, **_kwargs):
        raise AssertionError(f"`freetx run {' '.join(args)}` launched instead of refusing")

    with mock.patch.object(run, "_run_in_process", launched), \
            mock.patch.object(run, "_run_with_torchrun", launched):  # fmt: skip
        return _main_here(["run", *args])


def flat(text: str) -> str:
    """Text with line wrapping undone (error paragraphs wrap at 100 columns)."""
    return " ".join(text.split())


def one_paragraph(result, code: int = 1) -> str:
    """The error paragraph of a failed command, flattened: the exit code, no traceback (of
    the main thread or another), no blank line."""
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "Exception in thread" not in result.stderr, result.stderr
    assert "\n\n" not in result.stderr.strip(), result.stderr
    return flat(result.stderr)


def hashes(folder: Path) -> dict[str, str]:
    """Every file under `folder` (the lock file aside) -> sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".freetx.lock"
    }


def flip_byte(file: Path, at: int | None = None) -> None:
    """Invert one byte of `file` (its middle one by default), as a disk's error would."""
    data = bytearray(file.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.fixture
def freetx():
    return run_freetx
