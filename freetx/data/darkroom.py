"""The learning histories Algorithm Distillation trains on: stored, reloaded, windowed.

The histories are made by the source algorithm (`freetx.envs.qlearning`), split
across the ranks, into a shard cache (`freetx.data.shard_cache`) named by a
hash of the environment's and the histories' settings, so later runs with the
same settings reuse them. `ADWindows` cuts them into training windows of
`n_transit` transitions that start at episode starts; `subsample_episodes` is
AD's subsampling.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from freetx.data.shard_cache import ShardCache
from freetx.errors import ConfigError


def histories_cache(data_dir: str | Path, env_cfg: Any, cfg: Any) -> ShardCache:
    """Where histories of these settings live (`env_cfg`, `cfg`: the env and histories
    sections as dataclasses); subsampling is applied on load, so it is not part of the key."""
    generation = {k: v for k, v in asdict(cfg).items() if k != "subsample"}
    kind = "ed" if cfg.expert else "ad"
    return ShardCache.for_settings(
        data_dir, f"darkroom_{kind}", {"env": asdict(env_cfg), "histories": generation}
    )


def load_histories(cache: ShardCache) -> dict[str, np.ndarray]:
    """Every shard, in (goal id, stream) order whatever the number of shards."""
    data, _ = cache.load()
    order = np.argsort(data["goal_ids"], kind="stable")
    return {k: v[order] for k, v in data.items()}


def subsample_episodes(
    histories: dict[str, np.ndarray], every: int, horizon: int
) -> dict[str, np.ndarray]:
    """Split each history into `every` histories of every `every`-th episode.

    The AD paper's subsampling: a model trained on them sees k episodes' worth
    of the source's learning between two episodes of its context, so it learns
    to improve faster than the source did.
    """
    if every == 1:
        return histories
    n, length = histories["states"].shape
    episodes = length // horizon
    if episodes < every:
        raise ConfigError(
            f"histories.subsample={every} exceeds the {episodes} episodes per history."
        )
    keep = episodes // every * every  # whole groups of `every` episodes
    out = {}
    for key in ("states", "actions", "rewards"):
        x = histories[key][:, : keep * horizon].reshape(n, keep // every, every, horizon)
        out[key] = x.transpose(0, 2, 1, 3).reshape(n * every, (keep // every) * horizon)
    out["goal_ids"] = np.repeat(histories["goal_ids"], every)
    return out


class ADWindows(Dataset):
    """Windows of `n_transit` transitions from the histories, starting at episode starts.

    Sample: states, prev_actions, prev_rewards (the first token's are "none")
    and labels (the actions taken), each [n_transit].
    """

    def __init__(
        self,
        histories: dict[str, np.ndarray],
        n_transit: int,
        horizon: int,
        no_action: int,
        no_reward: int,
    ) -> None:
        length = histories["states"].shape[1]
        if n_transit > length:
            raise ConfigError(
                f"model.n_transit={n_transit} is longer than a history ({length} transitions); "
                "lower it or raise histories.episodes."
            )
        self.states = torch.from_numpy(histories["states"])
        self.actions = torch.from_numpy(histories["actions"])
        self.rewards = torch.from_numpy(histories["rewards"])
        starts = np.arange(0, length - n_transit + 1, horizon)
        self.index = [(s, int(t)) for s in range(len(self.states)) for t in starts]
        self.n_transit, self.no_action, self.no_reward = n_transit, no_action, no_reward

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        stream, start = self.index[i]
        window = slice(start, start + self.n_transit)
        actions, rewards = self.actions[stream, window], self.rewards[stream, window]
        return {
            "states": self.states[stream, window],
            "prev_actions": torch.cat([torch.tensor([self.no_action]), actions[:-1]]),
            "prev_rewards": torch.cat([torch.tensor([self.no_reward]), rewards[:-1]]),
            "labels": actions,
        }
