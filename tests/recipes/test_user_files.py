"""Files a command writes outside a run folder are never replaced unasked: each command
refuses an existing destination with one paragraph naming it and the fix (exit 1),
before its costly work, and leaves it byte-identical; `--overwrite` replaces it
(freetx/user_files.py). `freetx cp` and `checkpoint convert` are tried in test_cli.py and
test_saved_work.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import flat, one_paragraph, run_freetx_here

MINE = "# my hand-edited file\n"


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A tiny decoder's weights, for `spectrum scan`."""
    from freetx.distributed import materialize
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model = decoder("tiny", vocab_size=259, max_seq_len=64)
    materialize(model, torch.device("cpu"), seed=0)
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def crosscoder(tmp_path_factory) -> Path:
    """A crosscoder's tensors (8 features, 2 sources, width 4), for `crosscoder analyze`."""
    g = torch.Generator().manual_seed(0)
    m, n, d = 8, 2, 4
    tensors = {
        "W_dec": torch.randn(m, n, d, generator=g),
        "W_enc": torch.randn(m, n, d, generator=g),
        "b_enc": torch.zeros(m),
        "b_dec": torch.zeros(n, d),
    }
    path = tmp_path_factory.mktemp("crosscoder") / "crosscoder.safetensors"
    save_file(tensors, str(path))
    return path


def spectrum(tmp_path, weights):
    out = tmp_path / "selection.yaml"
    return out, ["spectrum", "scan", str(weights), "--rescan", "-o", str(out)], "-o"


def spectrum_default(tmp_path, weights):  # the default name beside the model
    model = tmp_path / "model.safetensors"
    model.symlink_to(weights)
    return tmp_path / "spectrum_top25.yaml", ["spectrum", "scan", str(model), "--rescan"], "-o"


def analyze(tmp_path, crosscoder):
    out = tmp_path / "analysis"
    return out / "analysis.json", ["crosscoder", "analyze", str(crosscoder), "-o", str(out)], "-o"


def slurm(tmp_path, _):
    out = tmp_path / "job.sbatch"
    args = ["launch", "slurm", "-o", str(out), "full_finetune_fsdp2", "--config", "llm/tiny"]
    return out, args, "-o"


def estimate(tmp_path, _):
    out = tmp_path / "figures.json"
    args = ["estimate", "llm/tiny", "--world-size", "1", "--device", "cpu", "--json", str(out)]
    return out, args, "--json"


CASES = {"spectrum": spectrum, "spectrum_default": spectrum_default, "analyze": analyze,
         "slurm": slurm, "estimate": estimate}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_an_existing_file_is_refused_then_replaced_with_overwrite(
    case, tmp_path, weights, crosscoder
):
    source = crosscoder if case == "analyze" else weights
    out, args, flag = CASES[case](tmp_path, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(MINE)
    refused = run_freetx_here(*args)
    message = flat(refused.stderr)
    one_paragraph(refused)  # exit 1, no traceback, one paragraph however long the paths
    assert str(out) in message and "already exists" in message, message
    assert "--overwrite" in message and flag in message, message
    assert out.read_text() == MINE  # untouched
    assert not (tmp_path / "spectrum_scores.json").exists()  # refused before the scan
    replaced = run_freetx_here(*args[:2], "--overwrite", *args[2:])  # before a recipe's args
    assert replaced.returncode == 0, replaced.stderr
    assert out.read_text() != MINE
    assert not [p for p in out.parent.iterdir() if ".freetx-tmp-" in p.name]


def test_crosscoder_export_refuses_an_existing_folder(tmp_path, crosscoder):
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text(MINE)
    refused = run_freetx_here("crosscoder", "export", str(crosscoder), str(out))
    assert refused.returncode == 1 and "--overwrite" in flat(refused.stderr)
    assert (out / "notes.txt").read_text() == MINE
    replaced = run_freetx_here("crosscoder", "export", str(crosscoder), str(out), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert (out / "crosscoder.safetensors").is_file() and not (out / "notes.txt").exists()


def test_a_folder_where_a_file_goes_is_refused_even_with_overwrite(tmp_path):
    folder = tmp_path / "job.sbatch"
    (folder / "keep").mkdir(parents=True)
    refused = run_freetx_here("launch", "slurm", "--overwrite", "-o", str(folder),
                              "full_finetune_fsdp2", "--config", "llm/tiny")  # fmt: skip
    assert refused.returncode == 1 and "is a folder" in flat(refused.stderr), refused.stderr
    assert (folder / "keep").is_dir()
