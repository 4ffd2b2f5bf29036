"""`freetx doctor`: the machine's findings, one line each, and the collectives test on 2
processes launched as `freetx run` launches them."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import flat, run_freetx, run_freetx_here


def test_doctor_on_two_cpu_processes_reports_bandwidth(tmp_path):
    result = run_freetx(
        "doctor", "--nproc-per-node", "2", "--output-dir", str(tmp_path / "runs"),
        "--size-mib", "4", "--iterations", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("OK   torch: ")
    assert "OK   device: cpu, backend gloo" in result.stdout
    assert f"OK   output_dir: {tmp_path / 'runs'} will be created in {tmp_path}" in result.stdout
    for name in ("all-reduce", "all-gather"):
        line = next(x for x in lines if x.startswith(f"OK   {name}: 2 ranks on cpu, 4 MiB"))
        algbw, busbw = map(float, re.findall(r"(?:alg|bus)bw ([0-9.]+) GB/s", line))
        factor = 2 * (2 - 1) / 2 if name == "all-reduce" else (2 - 1) / 2  # nccl-tests'
        assert algbw > 0 and abs(busbw - algbw * factor) <= 0.01 + 0.01 * algbw
    assert "FAIL" not in result.stdout and "Traceback" not in result.stderr


def test_doctor_fails_collectives_that_cannot_connect(tmp_path):
    """gloo told to use a network interface this machine lacks: every rank fails to join,
    as on a node whose NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME is wrong."""
    result = run_freetx(
        "doctor", "--nproc-per-node", "2", "--output-dir", str(tmp_path), "--size-mib", "1",
        "--timeout-s", "20", env={"GLOO_SOCKET_IFNAME": "no_such_interface0"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "FAIL collectives: the all-reduce / all-gather test on 2 processes failed" in flat(
        result.stdout
    )
    assert "freetx doctor: rank 0: RuntimeError:" in result.stdout
    assert "all-reduce: " not in result.stdout and "Traceback" not in result.stderr


def test_doctor_refuses_a_size_of_zero():
    result = run_freetx_here("doctor", "--size-mib", "0")
    assert result.returncode == 2 and "0 is not above 0" in result.stderr


def test_doctor_fails_an_output_dir_that_cannot_be_made(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = run_freetx_here(
        "doctor", "--nproc-per-node", "1", "--output-dir", str(blocker / "run")
    )
    assert result.returncode == 1
    assert f"FAIL output_dir: {blocker / 'run'} cannot be created: {blocker} is a file" in flat(
        result.stdout
    )
    assert "a run would fail here" in result.stdout and "Traceback" not in result.stderr
    assert blocker.read_text() == "not a folder"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the FAIL needs a machine without a GPU")
def test_doctor_fails_cuda_asked_for_without_a_gpu():
    result = run_freetx_here("doctor", "--device", "cuda", "--output-dir", ".")
    assert result.returncode == 1
    assert "FAIL device: cuda asked for, but" in result.stdout
    assert "all-reduce" not in result.stdout
