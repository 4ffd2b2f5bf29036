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
    # histories made before the planner's knobs keep their key while the knobs are off
    knobs = ("planning_sweeps", "memory_episodes", "knows_stay", "start_test_episodes",
             "random_start", "start_on_goal")  # fmt: skip
    for knob in knobs:
        if not generation.get(knob):
            generation.pop(knob, None)
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


TRANSITION, OPEN, CLOSE = 0, 1, 2  # a compressed context's token kinds: <compress>, </compress>


def compressed_context(region_starts: list[int], end: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of a compressed AD context (the seed's `ad_dr_compressed` layout): region
    i holds the history's transitions [region_starts[i], region_starts[i + 1]) between a
    <compress> and a </compress> token; the last region, [region_starts[-1], end), is
    opened only (it is still being filled). Returns (positions, kinds), one per token: the
    transition's index in the history (-1 at a marker) and its kind (TRANSITION, OPEN,
    CLOSE). Training windows and the in-context evaluation both lay out their tokens
    here."""
    positions, kinds = [], []
    bounds = [*region_starts, end]
    for i, (first, last) in enumerate(zip(bounds[:-1], bounds[1:])):
        positions += [-1, *range(first, last)]
        kinds += [OPEN] + [TRANSITION] * (last - first)
        if i < len(region_starts) - 1:
            positions.append(-1)
            kinds.append(CLOSE)
    return np.array(positions, dtype=np.int64), np.array(kinds, dtype=np.int64)


def kept_regions(episode: int, region_episodes: int, regions: int, horizon: int) -> list[int]:
    """Where the regions of an in-context run's compressed context start (transition
    indices) during `episode`: the region being filled and up to `regions - 1` before it
    (regions start every `region_episodes` episodes; the oldest is dropped whole)."""
    current = episode // region_episodes
    return [
        k * region_episodes * horizon for k in range(max(0, current - regions + 1), current + 1)
    ]


def compressed_length(region_episodes: int, regions: int, horizon: int) -> int:
    """The tokens of a full compressed context: `regions` regions, the last one filled."""
    region = region_episodes * horizon
    return len(compressed_context([k * region for k in range(regions)], regions * region)[0])


def context_tokens(
    states: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    positions: np.ndarray,
    kinds: np.ndarray,
    no_action: int,
    no_reward: int,
) -> dict[str, torch.Tensor]:
    """The model's inputs for the tokens at `positions` of histories [..., length]:
    states, prev_actions, prev_rewards (the transition before in the history; "none" at
    the history's start and at markers) and markers (the token kinds), each [...,
    tokens]; a marker's state is 0 (the model reads its own embedding there)."""
    index = torch.from_numpy(np.maximum(positions, 0)).to(states.device)
    before = torch.from_numpy(np.maximum(positions - 1, 0)).to(states.device)
    transition = torch.from_numpy(kinds == TRANSITION).to(states.device)
    has_previous = transition & torch.from_numpy(positions > 0).to(states.device)
    picked = states[..., index]
    return {
        "states": torch.where(transition, picked, 0),
        "prev_actions": torch.where(has_previous, actions[..., before], no_action),
        "prev_rewards": torch.where(has_previous, rewards[..., before], no_reward),
        "markers": torch.from_numpy(kinds).to(states.device).expand_as(picked),
    }


def run_inputs(
    states: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    t: int,
    horizon: int,
    keep: int,
    no_action: int,
    no_reward: int,
) -> dict[str, torch.Tensor]:
    """An in-context run's model inputs at its step `t` (its transitions so far [runs,
    steps]): the last `keep` whole episodes and the current one so far, laid out as the
    training windows (`ADWindows`) are: the first token's previous action and reward
    "none"."""
    start = max(0, t // horizon - keep) * horizon
    none = torch.ones_like(states[:, :1])
    return {
        "states": states[:, start : t + 1],
        "prev_actions": torch.cat([none * no_action, actions[:, start:t]], 1),
        "prev_rewards": torch.cat([none * no_reward, rewards[:, start:t]], 1),
    }


def next_transition(
    states: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor, t: int, markers: bool
) -> dict[str, torch.Tensor]:
    """Step `t`'s one token, after a KV cache that holds the run's context at an earlier
    step of the same episode (`run_inputs`, `compressed_run_inputs`: within an episode
    both grow by a transition a step): its state and the transition before it, and with
    `markers` (compressed AD) its kind, a transition."""
    token = {
        "states": states[:, t : t + 1],
        "prev_actions": actions[:, t - 1 : t],
        "prev_rewards": rewards[:, t - 1 : t],
    }
    if markers:
        token["markers"] = torch.full_like(token["states"], TRANSITION)
    return token


def compressed_run_inputs(
    states: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    t: int,
    horizon: int,
    region_episodes: int,
    regions: int,
    no_action: int,
    no_reward: int,
) -> dict[str, torch.Tensor]:
    """An in-context run's model inputs at its step `t` (its transitions so far [runs,
    steps]): the region being filled and up to `regions - 1` whole regions before it,
    laid out as the training windows are."""
    starts = kept_regions(t // horizon, region_episodes, regions, horizon)
    positions, kinds = compressed_context(starts, t + 1)
    return context_tokens(states, actions, rewards, positions, kinds, no_action, no_reward)


class CompressedADWindows(Dataset):
    """Training windows of compressed AD: `regions` regions of `region_episodes` episodes
    each, consecutive in a history, bracketed by <compress> / </compress> tokens (the
    last one opened only), starting at every episode. Sample: states, prev_actions,
    prev_rewards, markers and labels (the action taken at a transition, -100 at a
    marker), each [regions * region_episodes * horizon + 2 * regions - 1]."""

    def __init__(
        self,
        histories: dict[str, np.ndarray],
        region_episodes: int,
        regions: int,
        horizon: int,
        no_action: int,
        no_reward: int,
    ) -> None:
        length = histories["states"].shape[1]  # at least a window: ad_ddp's check_model_fits
        region = region_episodes * horizon
        self.states = torch.from_numpy(histories["states"])
        self.actions = torch.from_numpy(histories["actions"])
        self.rewards = torch.from_numpy(histories["rewards"])
        starts = range(0, length - regions * region + 1, horizon)
        self.index = [(s, t) for s in range(len(self.states)) for t in starts]
        self.region, self.regions = region, regions
        self.no_action, self.no_reward = no_action, no_reward

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        stream, start = self.index[i]
        region_starts = [start + k * self.region for k in range(self.regions)]
        positions, kinds = compressed_context(region_starts, start + self.regions * self.region)
        sample = context_tokens(
            self.states[stream], self.actions[stream], self.rewards[stream],
            positions, kinds, self.no_action, self.no_reward,
        )  # fmt: skip
        labels = self.actions[stream][np.maximum(positions, 0)]
        sample["labels"] = torch.where(torch.from_numpy(kinds == TRANSITION), labels, -100)
        return sample
