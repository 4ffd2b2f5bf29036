"""Spectrum (Hartford et al., arXiv 2406.06623): train the weight matrices whose singular
values carry the most signal above the noise of a random matrix; freeze the rest.

For a matrix W [n, m] with singular values S (fp32):

    sigma = (q75(S) - q25(S)) / 1.349            a robust estimate of the noise scale
    beta  = min(n, m) / max(n, m)
    tau   = sigma * (1 + sqrt(beta))              the Marchenko-Pastur edge of the noise
    SNR   = sum(S[S > tau]) / sum(S[S <= tau])    (the denominator is 1 if nothing is below)
    score = SNR / max(S)

Matrices are grouped by kind (the same module in every layer: `layers.*.attention.wq`)
and the top `top_percent` of each kind are selected (int(count * p / 100), at
least one); the model's embeddings and output head always train. The score is
the reference code's (cognitivecomputations/spectrum): between matrices of the
same spectral norm the one with more signal above the edge ranks first, and a
larger spectral norm lowers the score. `score_matrix` is the math; `select` the choice;
`freetx spectrum scan` (freetx/cli/spectrum.py) reads a model's matrices, splits
them over ranks, and writes the selection as YAML.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from freetx.errors import ConfigError


def score_matrix(weight: torch.Tensor) -> dict[str, float]:
    """The SNR of a matrix's singular values against the Marchenko-Pastur edge."""
    values = torch.linalg.svdvals(weight.detach().float())
    q25, q75 = torch.quantile(values, torch.tensor([0.25, 0.75])).tolist()
    sigma = (q75 - q25) / 1.349
    n, m = weight.shape
    tau = sigma * (1 + math.sqrt(min(n, m) / max(n, m)))
    signal = float(values[values > tau].sum())
    noise = float(values[values <= tau].sum()) or 1.0
    snr = signal / noise
    return {"snr": snr, "score": snr / float(values.max()), "tau": tau, "sigma": sigma}


def kind_of(name: str) -> str | None:
    """The kind of a block's matrix (`layers.3.attention.wq` -> `layers.*.attention.wq`);
    None for matrices outside the repeated blocks (embeddings, head)."""
    kind, count = re.subn(r"(^|\.)\d+(\.|$)", r"\1*\2", name, count=1)
    return kind if count else None


def select(scores: dict[str, float], top_percent: float) -> list[str]:
    """The top `top_percent` of each kind of matrix by score (at least one of each)."""
    if not 0 < top_percent <= 100:
        raise ConfigError(f"--top-percent {top_percent:g} is not in (0, 100].")
    kinds: dict[str, list[str]] = {}
    for name in scores:
        kinds.setdefault(kind_of(name) or name, []).append(name)
    chosen = []
    for names in kinds.values():
        keep = max(1, int(len(names) * top_percent / 100))  # the reference's count, >= 1
        chosen += sorted(names, key=lambda n: -scores[n])[:keep]
    return sorted(chosen)


def selected_share(modules: list[str], scores: dict[str, float], top_percent: float) -> str:
    """The selection in words: how many matrices of how many, their real share, and, where
    the at-least-one-of-each-kind rule took more than asked, that it did."""
    share = 100 * len(modules) / max(1, len(scores))
    text = f"{len(modules)} of {len(scores)} weight matrices selected ({share:.3g}%"
    if share > top_percent * 1.0001:
        return (
            f"{text}: --top-percent {top_percent:g} keeps fewer than one of some kinds, and "
            "Spectrum keeps at least one of each kind)"
        )
    return f"{text}: the top {top_percent:g}% of each kind)"


def selection_text(
    modules: list[str], top_percent: float, source: str, scores: dict[str, float]
) -> str:
    """The YAML of a selection file (`read_selection` reads it), commented with each score."""
    lines = [
        "# Spectrum selection (Hartford et al. 2024): the modules that train fully; the rest",
        "# stays frozen (the embeddings and output head always train).",
        f"#   freetx spectrum scan {source} --top-percent {top_percent:g}",
        f"source: {source}",
        f"# {selected_share(modules, scores, top_percent)}",
        f"top_percent: {top_percent:g}",
        "modules:",
        *[f"  - {m}  # score {scores[m]:.4g}" for m in modules],
    ]
    return "\n".join(lines) + "\n"


def read_selection(path: str | Path) -> dict[str, Any]:
    """A selection file: {top_percent, modules}; an error names what is wrong."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"Spectrum selection {path} does not exist; make it with `freetx spectrum scan "
            "MODEL --top-percent 25` (it names the file it writes)."
        )
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"Spectrum selection {path} is not YAML ({e}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("modules"), list):
        raise ConfigError(f"Spectrum selection {path} has no list of modules.")
    return {"top_percent": float(data.get("top_percent", 0)), "modules": data["modules"]}
