"""Crosscoders' activation rows held in memory (`ActivationRows`: rows x [n_sources, d],
a batch is {"x": [rows, n_sources, d]}), and synthetic ones with known features
(`PlantedFeatures`), for tests and benchmarks."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from freetx.errors import DataError


class ActivationRows(Dataset):
    """Rows of activations held in memory: item i is {"x": rows[i] as float32}."""

    def __init__(self, rows: torch.Tensor) -> None:
        if rows.dim() != 3 or len(rows) == 0:
            raise DataError(
                f"activation rows must be [rows, sources, d] and not empty, got {list(rows.shape)}."
            )
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.rows[index].float()}

    @property
    def num_sources(self) -> int:
        return self.rows.shape[1]

    @property
    def source_dim(self) -> int:
        return self.rows.shape[2]


class PlantedFeatures(ActivationRows):
    """Synthetic activations with `num_features` known features (a fixed function of the
    seed): each feature has a unit direction per source; `exclusive_fraction` of them live
    in one source only (alternately the first and the last), the rest in every source
    with scales in [0.5, 1.5]. A row fires each feature with probability
    `firing_probability`, with an Exp(1) magnitude, plus Gaussian noise of std `noise`."""

    def __init__(
        self,
        num_sources: int = 2,
        source_dim: int = 32,
        num_features: int = 128,
        firing_probability: float = 0.02,
        exclusive_fraction: float = 0.25,
        noise: float = 0.01,
        rows: int = 100_000,
        seed: int = 0,
        split: str = "train",
    ) -> None:
        if split not in ("train", "validation"):
            raise DataError(f"split must be 'train' or 'validation', got {split!r}.")
        g = torch.Generator().manual_seed(seed)
        directions = torch.randn(num_features, num_sources, source_dim, generator=g)
        directions /= directions.norm(dim=-1, keepdim=True)
        scales = 0.5 + torch.rand(num_features, num_sources, generator=g)
        exclusive = int(round(exclusive_fraction * num_features))
        owner = torch.full((num_features,), -1)  # -1: shared
        owner[:exclusive] = torch.tensor([0, num_sources - 1]).repeat(exclusive)[:exclusive]
        for i in range(exclusive):
            keep = torch.zeros(num_sources)
            keep[owner[i]] = 1.0
            scales[i] = keep
        self.directions = directions * scales[..., None]  # [K, n, d]
        self.owner = owner
        self.firing_probability = firing_probability
        # validation rows come from another stream of the same features
        g = torch.Generator().manual_seed(seed * 7919 + (1 if split == "validation" else 2))
        out = torch.empty(rows, num_sources, source_dim)
        for start in range(0, rows, 8192):
            n = min(8192, rows - start)
            fires = torch.rand(n, num_features, generator=g) < firing_probability
            magnitude = torch.empty(n, num_features).exponential_(1.0, generator=g)
            f = fires * magnitude
            x = torch.einsum("bk,ksd->bsd", f, self.directions)
            out[start : start + n] = x + noise * torch.randn(x.shape, generator=g)
        super().__init__(out)

    @property
    def expected_l0(self) -> float:
        return self.firing_probability * len(self.owner)

    @torch.no_grad()
    def recovery(self, decoder: torch.Tensor) -> dict[str, float]:
        """How well a decoder [m, n, d] found the planted features: the mean over true
        features of the best cosine with a learned one; and, among the learned features
        that best match a true one, the fraction that is exclusive (relative decoder norm
        below 0.1 or above 0.9, first vs last source) against the true fraction."""
        learned = decoder.float().flatten(1)
        truth = self.directions.flatten(1)
        cos = (truth / truth.norm(dim=1, keepdim=True)) @ (
            learned / learned.norm(dim=1, keepdim=True).clamp_min(1e-12)
        ).T
        best_cos, best = cos.max(dim=1)
        norms = decoder.float().norm(dim=-1)
        relative = norms[:, -1] / (norms[:, 0] + norms[:, -1]).clamp_min(1e-12)
        matched = torch.unique(best)
        exclusive = ((relative[matched] < 0.1) | (relative[matched] > 0.9)).float().mean()
        return {
            "planted/mean_max_cosine": float(best_cos.mean()),
            "planted/exclusive_fraction": float(exclusive),
            "planted/true_exclusive_fraction": float((self.owner >= 0).float().mean()),
            "planted/expected_l0": self.expected_l0,
        }
