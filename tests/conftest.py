"""Shared test helpers: run the real `freetx` CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tests" / "assets"


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


def flat(text: str) -> str:
    """Text with line wrapping undone (error paragraphs wrap at 100 columns)."""
    return " ".join(text.split())


@pytest.fixture
def freetx():
    return run_freetx
