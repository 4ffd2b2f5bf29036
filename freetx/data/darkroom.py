"""Dark Room and the learning histories Algorithm Distillation trains on.

Dark Room (Laskin et al., 2022): a 9x9 grid, the agent sees only its own
position, 5 actions (0: +x, 1: -x, 2: +y, 3: -y, 4: stay; moves are clipped at
the walls), 20-step episodes that start at the centre, and +1 for every step
that ends on the invisible goal. A task is a goal cell; the 81 goals are split
into training and held-out test goals by a seed.

Learning histories come from tabular Q-learning learning each training goal
from scratch (optimistic initial values, epsilon decaying over episodes), with
several independent streams per goal, so a history runs from random behaviour
to a near-optimal policy. The Expert Distillation (ED) control keeps only the
final policy's episodes. Everything is numpy, vectorized over environments,
and a function of (seed, goal, stream): any rank can make any history. Ranks
split the generation, each writing one safetensors shard; a metadata file
marks the set complete, and later runs with the same settings reuse it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from freetx.errors import ConfigError

# action -> (dx, dy)
MOVES = np.array([[1, 0], [-1, 0], [0, 1], [0, -1], [0, 0]], dtype=np.int64)
NUM_ACTIONS = 5


@dataclass
class DarkRoomConfig:
    """The `env:` section."""

    grid_size: int = 9
    horizon: int = 20
    train_fraction: float = 0.9
    split_seed: int = 0


def centre(grid_size: int) -> np.ndarray:
    return np.array([grid_size // 2, grid_size // 2], dtype=np.int64)


def state_index(position: np.ndarray, grid_size: int) -> np.ndarray:
    """(x, y) -> x * grid_size + y (works on [..., 2] arrays)."""
    return position[..., 0] * grid_size + position[..., 1]


def goal_split(cfg: DarkRoomConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train goals, test goals) as [n, 2] arrays, shuffled by `split_seed`."""
    if not 0 < cfg.train_fraction < 1:
        raise ConfigError(f"env.train_fraction must be in (0, 1), got {cfg.train_fraction}.")
    cells = np.array([(x, y) for x in range(cfg.grid_size) for y in range(cfg.grid_size)])
    order = np.random.default_rng(cfg.split_seed).permutation(len(cells))
    cut = int(round(len(cells) * cfg.train_fraction))
    return cells[order[:cut]], cells[order[cut:]]


def optimal_return(goals: np.ndarray, cfg: DarkRoomConfig) -> np.ndarray:
    """Walk straight to the goal, then stay: one reward per step from arrival on."""
    distance = np.abs(goals - centre(cfg.grid_size)).sum(-1)
    return np.clip(cfg.horizon + 1 - distance, 0, cfg.horizon).astype(np.float64)


class DarkRoom:
    """A batch of Dark Room environments, one goal each, stepped together."""

    def __init__(self, goals: np.ndarray, cfg: DarkRoomConfig) -> None:
        self.goals = np.asarray(goals, dtype=np.int64).reshape(-1, 2)
        self.cfg = cfg
        self.positions = np.zeros_like(self.goals)
        self.t = 0

    def reset(self) -> np.ndarray:
        """Every environment back to the centre; returns the state indices."""
        self.positions = np.tile(centre(self.cfg.grid_size), (len(self.goals), 1))
        self.t = 0
        return state_index(self.positions, self.cfg.grid_size)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """Apply one action per environment: (next states, rewards, episode over)."""
        moved = self.positions + MOVES[np.asarray(actions, dtype=np.int64)]
        self.positions = np.clip(moved, 0, self.cfg.grid_size - 1)
        rewards = (self.positions == self.goals).all(-1).astype(np.float64)
        self.t += 1
        return state_index(self.positions, self.cfg.grid_size), rewards, self.t >= self.cfg.horizon


def random_return(
    goals: np.ndarray, cfg: DarkRoomConfig, episodes: int = 200, seed: int = 0
) -> np.ndarray:
    """The mean return of a uniform-random policy on each goal (simulated)."""
    rng = np.random.default_rng(seed)
    env = DarkRoom(np.repeat(goals, episodes, axis=0), cfg)
    env.reset()
    total = np.zeros(len(env.goals))
    done = False
    while not done:
        _, rewards, done = env.step(rng.integers(0, NUM_ACTIONS, len(env.goals)))
        total += rewards
    return total.reshape(len(goals), episodes).mean(1)


@dataclass
class HistoryConfig:
    """The `histories:` section: how the source algorithm learns each goal."""

    streams_per_goal: int = 4
    episodes: int = 100  # per stream: from scratch to near optimal
    learning_rate: float = 0.5
    discount: float = 0.9
    initial_q: float = 1.0  # optimistic: unvisited actions look worth trying
    epsilon_start: float = 1.0
    epsilon_end: float = 0.02
    epsilon_decay_episodes: int = 60  # linear decay over these episodes
    expert: bool = False  # Expert Distillation control: the final policy's episodes only
    subsample: int = 1  # train on every k-th episode: learning looks k times faster in context
    seed: int = 0


def _epsilon(episode: int, cfg: HistoryConfig) -> float:
    progress = min(1.0, episode / max(1, cfg.epsilon_decay_episodes))
    return cfg.epsilon_start + (cfg.epsilon_end - cfg.epsilon_start) * progress


def learning_histories(
    goal_ids: np.ndarray, goals: np.ndarray, env_cfg: DarkRoomConfig, cfg: HistoryConfig
) -> dict[str, np.ndarray]:
    """Q-learning histories for the given goals, `streams_per_goal` each.

    Returns int arrays of shape [n_goals * streams, episodes * horizon]:
    `states` (before the action), `actions`, `rewards`, and `goal_ids` [n].
    Each (goal id, stream) has its own random stream, so the result does not
    depend on which other goals are generated alongside.
    """
    goal_ids = np.asarray(goal_ids, dtype=np.int64)
    streams = cfg.streams_per_goal
    n = len(goal_ids) * streams
    rngs = [np.random.default_rng([cfg.seed, int(g), s]) for g in goal_ids for s in range(streams)]
    env_goals = np.repeat(np.asarray(goals, dtype=np.int64), streams, axis=0)
    num_states = env_cfg.grid_size**2
    q = np.full((n, num_states, NUM_ACTIONS), cfg.initial_q, dtype=np.float64)
    rows = np.arange(n)
    length = cfg.episodes * env_cfg.horizon
    out = {k: np.zeros((n, length), dtype=np.int64) for k in ("states", "actions", "rewards")}
    env = DarkRoom(env_goals, env_cfg)

    def act(states: np.ndarray, epsilon: float) -> np.ndarray:
        values = q[rows, states]
        best = values.max(-1, keepdims=True)
        ties = values >= best - 1e-12
        choices = np.empty(n, dtype=np.int64)
        for i, rng in enumerate(rngs):  # greedy with random tie-breaking, or explore
            if rng.random() < epsilon:
                choices[i] = rng.integers(NUM_ACTIONS)
            else:
                choices[i] = rng.choice(np.flatnonzero(ties[i]))
        return choices

    # learning episodes; for ED, then the final policy acting for as many episodes,
    # written over the learning ones (only the expert's episodes are kept)
    for phase in ("learn", "expert") if cfg.expert else ("learn",):
        t = 0
        for episode in range(cfg.episodes):
            epsilon = cfg.epsilon_end if phase == "expert" else _epsilon(episode, cfg)
            states = env.reset()
            done = False
            while not done:
                actions = act(states, epsilon)
                next_states, rewards, done = env.step(actions)
                if phase == "learn":
                    target = rewards + (0.0 if done else cfg.discount) * q[rows, next_states].max(
                        -1
                    )
                    q[rows, states, actions] += cfg.learning_rate * (
                        target - q[rows, states, actions]
                    )
                out["states"][:, t] = states
                out["actions"][:, t] = actions
                out["rewards"][:, t] = rewards.astype(np.int64)
                states = next_states
                t += 1
    out["goal_ids"] = np.repeat(goal_ids, streams)
    return out


# -- storing histories: one safetensors shard per generating rank, plus metadata ------

METADATA_FILE = "metadata.json"


def histories_folder(data_dir: str | Path, env_cfg: DarkRoomConfig, cfg: HistoryConfig) -> Path:
    """Where histories of these settings live: a folder named by a hash of them."""
    generation = {k: v for k, v in asdict(cfg).items() if k != "subsample"}  # applied on load
    settings = json.dumps({"env": asdict(env_cfg), "histories": generation}, sort_keys=True)
    digest = hashlib.sha256(settings.encode()).hexdigest()[:12]
    return Path(data_dir) / f"darkroom_{'ed' if cfg.expert else 'ad'}_{digest}"


def histories_ready(folder: Path) -> bool:
    return (folder / METADATA_FILE).is_file()


def write_history_shard(
    folder: Path, rank: int, world_size: int, env_cfg: DarkRoomConfig, cfg: HistoryConfig
) -> None:
    """Rank `rank` generates the training goals i with i % world_size == rank."""
    from safetensors.numpy import save_file

    train_goals, _ = goal_split(env_cfg)
    mine = np.arange(rank, len(train_goals), world_size)
    folder.mkdir(parents=True, exist_ok=True)
    data = learning_histories(mine, train_goals[mine], env_cfg, cfg)
    save_file(data, str(folder / f"shard_{rank:05d}.safetensors"))


def write_history_metadata(
    folder: Path, world_size: int, env_cfg: DarkRoomConfig, cfg: HistoryConfig
) -> None:
    """Written once every shard is on disk (by rank 0, after a barrier): marks the set complete."""
    train_goals, test_goals = goal_split(env_cfg)
    meta = {
        "env": asdict(env_cfg),
        "histories": asdict(cfg),
        "shards": [f"shard_{r:05d}.safetensors" for r in range(world_size)],
        "train_goals": train_goals.tolist(),
        "test_goals": test_goals.tolist(),
    }
    tmp = folder / f".{METADATA_FILE}"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(folder / METADATA_FILE)


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


def load_histories(folder: Path) -> dict[str, np.ndarray]:
    """Every shard, in (goal id, stream) order whatever the number of shards."""
    from safetensors.numpy import load_file

    try:
        meta = json.loads((folder / METADATA_FILE).read_text())
        parts = [load_file(str(folder / name)) for name in meta["shards"]]
    except Exception as error:  # a deleted, truncated or hand-edited file
        raise ConfigError(
            f"The learning histories in {folder} cannot be read ({type(error).__name__}: "
            f"{error}). Delete that folder and run again: they are regenerated."
        ) from error
    data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(data["goal_ids"], kind="stable")
    return {k: v[order] for k, v in data.items()}


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
