"""`freetx doctor [--nproc-per-node N] [--output-dir DIR] [--device auto|cpu|cuda]`: is this
machine ready for a run? The torch build, the device and backend, the GPUs, NCCL, the
collectives' bus bandwidth across N launched processes, and the output folder. One line
per finding (OK / WARN / FAIL); exit 1 when a finding would fail a run."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from freetx.cli.common import at_least_one, number

POSITIVE = number(float, above=0)  # sizes and seconds
# below this, torch's store times out while the processes start and prints its C++ frames
MIN_TIMEOUT_S = 1.0

# Free space below one checkpoint of a 1B-parameter model is a WARN: fp32 weights and
# AdamW's two moments are 12 bytes per parameter (4 + 8), 12 GB for 1e9 parameters.
CHECKPOINT_BYTES_PER_PARAMETER = 12
WARN_BELOW_PARAMETERS = 1e9
BANDWIDTH_MODULE = "freetx.distributed.bandwidth"

DESCRIPTION = """Check this machine before a long run: the torch build, the device and
backend (nccl on CUDA, gloo on CPU), the GPUs visible, NCCL's version, an all-reduce and
an all-gather across N processes launched as `freetx run` launches them (algorithm and
bus bandwidth as nccl-tests defines them), and the output folder (writable, free space).
Each finding is one line: OK, WARN or FAIL. Exit 1 when a finding would fail a run.

examples:
  freetx doctor
  freetx doctor --nproc-per-node 8 --output-dir /scratch/runs
"""


@dataclass(frozen=True)
class Finding:
    status: str  # OK | WARN | FAIL
    topic: str
    text: str

    def line(self) -> str:
        return f"{self.status:<4} {self.topic}: {self.text}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freetx doctor",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nproc-per-node",
        type=at_least_one,
        default=None,
        help="processes for the collectives test (default: the GPUs visible, or 2 on CPU)",
    )
    parser.add_argument(
        "--output-dir", default=".", help="where runs will write (default: this folder)"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="the device runs will ask for, as a config's device: (default auto)",
    )
    parser.add_argument(
        "--size-mib",
        type=POSITIVE,
        default=None,
        help="the collectives' buffer in MiB (default 256 on CUDA, 16 on CPU)",
    )
    parser.add_argument(
        "--iterations", type=at_least_one, default=10, help="timed calls per collective"
    )
    parser.add_argument(
        "--timeout-s",
        type=number(float, at_least=MIN_TIMEOUT_S),
        default=120.0,
        help="a collective not done within this fails the check (default 120; at least "
        f"{MIN_TIMEOUT_S:g}: the processes' start-up and first collective take that long)",
    )
    return parser


def torch_build() -> Finding:
    import torch

    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda} build"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip} build"
    else:
        build = "CPU build (no CUDA or ROCm)"
    return Finding("OK", "torch", f"{torch.__version__}, {build}")


def device_findings(device: str, processes: int) -> tuple[list[Finding], str | None]:
    """The device and backend runs will use, the GPUs and NCCL; and the device type the
    collectives test runs on (None: a run would fail here, nothing to test)."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset (every GPU)" if visible is None else repr(visible)
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        why = "this torch is a CPU build" if not torch.version.cuda else "no GPU is visible"
        return [
            Finding(
                "FAIL",
                "device",
                f"cuda asked for, but {why} (CUDA_VISIBLE_DEVICES {shown}); install a CUDA "
                "build of torch, fix CUDA_VISIBLE_DEVICES, or run with device=cpu",
            )
        ], None
    if device == "cpu" or not has_cuda:
        return [Finding("OK", "device", "cpu, backend gloo (no usable GPU)")], "cpu"
    found = [Finding("OK", "device", "cuda, backend nccl (gloo beside it for host objects)")]
    count = torch.cuda.device_count()
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        memory = f"{props.total_memory / 2**30:.1f} GiB"
        found.append(Finding("OK", f"gpu {index}", f"{props.name}, {memory}"))
    found.append(Finding("OK", "CUDA_VISIBLE_DEVICES", shown))
    if count < processes:
        found.append(
            Finding(
                "FAIL",
                "gpus",
                f"{processes} processes asked for but {count} GPUs visible: a run launches "
                f"at most one process per GPU (--nproc-per-node {count})",
            )
        )
        return found, None
    version = torch.cuda.nccl.version()  # (2, 21, 5); an int in old builds
    shown_version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    found.append(Finding("OK", "nccl", shown_version))
    return found, "cuda"


def existing_ancestor(path: Path) -> Path:
    """The path itself or its nearest parent that exists."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def output_dir_findings(output_dir: str) -> list[Finding]:
    """Whether a run can create and write `output_dir`, and the free space there."""
    path = Path(output_dir).expanduser()
    base = existing_ancestor(path)
    if not base.is_dir():
        return [
            Finding(
                "FAIL",
                "output_dir",
                f"{output_dir} cannot be created: {base} is a file, not a folder; pick "
                "another output_dir",
            )
        ]
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".freetx_doctor_"):
            pass
    except OSError as e:
        return [
            Finding(
                "FAIL",
                "output_dir",
                f"{output_dir} is not writable ({base}: {e.strerror}); pick a folder you "
                "can write, or fix its permissions",
            )
        ]
    where = "exists" if base == path.absolute() else f"will be created in {base}"
    found = [Finding("OK", "output_dir", f"{output_dir} {where}, writable")]
    free = shutil.disk_usage(base).free
    fits = free / CHECKPOINT_BYTES_PER_PARAMETER
    text = (
        f"{free / 1e9:.1f} GB free in {base}: one checkpoint of a model of up to "
        f"{fits / 1e9:.1f}B parameters ({CHECKPOINT_BYTES_PER_PARAMETER} bytes per parameter: "
        "fp32 weights and AdamW's two moments)"
    )
    status = "WARN" if fits < WARN_BELOW_PARAMETERS else "OK"
    if status == "WARN":
        text += "; free space or pick another output_dir before saving checkpoints"
    found.append(Finding(status, "disk", text))
    return found


def collectives(device: str, processes: int, args) -> list[Finding]:
    """All-reduce and all-gather on `processes` processes launched as `freetx run` does."""
    import json

    from freetx.cli.run import launch_module

    if processes < 2:
        return [Finding("WARN", "collectives", "1 process: nothing to test (--nproc-per-node 2)")]
    mebibytes = args.size_mib or (256.0 if device == "cuda" else 16.0)
    with tempfile.TemporaryDirectory(prefix="freetx_doctor_") as folder:
        result = Path(folder) / "bandwidth.json"
        worker_args = [str(result), str(mebibytes), str(args.iterations), device]
        code = launch_module(BANDWIDTH_MODULE, [*worker_args, str(args.timeout_s)], processes)
        record = json.loads(result.read_text()) if code == 0 and result.is_file() else None
    if record is None:
        return [
            Finding(
                "FAIL",
                "collectives",
                f"the all-reduce / all-gather test on {processes} processes failed (the "
                f"ranks' messages are above; a collective waits at most {args.timeout_s:g} "
                "s); see docs/troubleshooting.md, NCCL errors and hangs",
            )
        ]
    found = []
    for r in record["results"]:
        found.append(
            Finding(
                "OK",
                r["collective"].replace("_", "-"),
                f"{r['ranks']} ranks on {record['device']}, {r['bytes'] / 2**20:.0f} MiB: "
                f"{r['seconds'] * 1e3:.2f} ms, algbw {r['algbw_gbs']:.2f} GB/s, "
                f"busbw {r['busbw_gbs']:.2f} GB/s",
            )
        )
    return found


def main(args: argparse.Namespace) -> int:
    import torch

    processes = args.nproc_per_node or (
        torch.cuda.device_count() if torch.cuda.is_available() else 2
    )
    found = [torch_build()]
    device_found, device = device_findings(args.device, processes)
    found += device_found
    found += output_dir_findings(args.output_dir)
    for finding in found:
        print(finding.line(), flush=True)
    if device is not None:
        for finding in collectives(device, processes, args):
            found.append(finding)
            print(finding.line(), flush=True)
    failed = [f.topic for f in found if f.status == "FAIL"]
    if failed:
        print(f"freetx doctor: {len(failed)} FAIL ({', '.join(failed)}): a run would fail here.")
        return 1
    return 0
