"""Dark Room (Laskin et al., 2022), vectorized over environments.

A 9x9 grid, the agent sees only its own position, 5 actions (0: +x, 1: -x,
2: +y, 3: -y, 4: stay; moves are clipped at the walls), 20-step episodes that
start at the centre, and +1 for every step that ends on the invisible goal. A
task is a goal cell; the 81 goals are split into training and held-out test
goals by a seed. Plain numpy; imports nothing of freetx but its errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetx.errors import ConfigError
from freetx.fields import at_least

# action -> (dx, dy)
MOVES = np.array([[1, 0], [-1, 0], [0, 1], [0, -1], [0, 0]], dtype=np.int64)
NUM_ACTIONS = 5
STAY = 4  # the action that keeps the agent where it is


@dataclass
class DarkRoomConfig:
    """The `env:` section."""

    grid_size: int = at_least(2, default=9)
    horizon: int = at_least(1, default=20)
    train_fraction: float = 0.9  # the rest are the held-out test goals
    split_seed: int = 0
    # of the training goals, these many are held out of the histories for validation:
    # model selection (sampling temperature) looks at them, never at the test goals
    val_goals: int = at_least(0, default=8)


def centre(grid_size: int) -> np.ndarray:
    return np.array([grid_size // 2, grid_size // 2], dtype=np.int64)


def state_index(position: np.ndarray, grid_size: int) -> np.ndarray:
    """(x, y) -> x * grid_size + y (works on [..., 2] arrays)."""
    return position[..., 0] * grid_size + position[..., 1]


@dataclass
class GoalSplit:
    """The goals of a split, each [n, 2]: `train` (the histories), `val` (model
    selection) and `test` (reported once, at the end)."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


def goal_split(cfg: DarkRoomConfig) -> GoalSplit:
    """The cells shuffled by `split_seed`: the first `train_fraction` are training goals,
    the rest test goals; the last `val_goals` training goals are set aside for validation.
    The test goals depend only on (grid_size, train_fraction, split_seed)."""
    if not 0 < cfg.train_fraction < 1:
        raise ConfigError(f"env.train_fraction must be in (0, 1), got {cfg.train_fraction}.")
    cells = np.array([(x, y) for x in range(cfg.grid_size) for y in range(cfg.grid_size)])
    order = np.random.default_rng(cfg.split_seed).permutation(len(cells))
    cut = int(round(len(cells) * cfg.train_fraction))
    if not 0 < cut < len(cells):
        raise ConfigError(
            f"env.train_fraction={cfg.train_fraction} leaves no training or no test goal of the "
            f"{len(cells)} cells; pick a fraction between {1 / len(cells):.3f} and "
            f"{1 - 1 / len(cells):.3f}."
        )
    if cfg.val_goals >= cut:
        raise ConfigError(
            f"env.val_goals={cfg.val_goals} would leave none of the {cut} training goals for "
            f"the histories. Use env.val_goals < {cut} (0: no validation goals)."
        )
    train = cells[order[: cut - cfg.val_goals]]
    return GoalSplit(train, cells[order[cut - cfg.val_goals : cut]], cells[order[cut:]])


def optimal_return(
    goals: np.ndarray, cfg: DarkRoomConfig, starts: np.ndarray | None = None
) -> np.ndarray:
    """Walk straight to the goal from the centre (or `starts`, cells like `goals`), then
    stay: one reward per step from arrival on."""
    distance = np.abs(goals - (centre(cfg.grid_size) if starts is None else starts)).sum(-1)
    return np.clip(cfg.horizon + 1 - distance, 0, cfg.horizon).astype(np.float64)


class DarkRoom:
    """A batch of Dark Room environments, one goal each, stepped together."""

    def __init__(self, goals: np.ndarray, cfg: DarkRoomConfig) -> None:
        self.goals = np.asarray(goals, dtype=np.int64).reshape(-1, 2)
        self.cfg = cfg
        self.positions = np.zeros_like(self.goals)
        self.t = 0

    def reset(self, starts: np.ndarray | None = None) -> np.ndarray:
        """Every environment back to the centre, or to `starts` ([n, 2] cells) where given;
        returns the state indices."""
        if starts is None:
            starts = np.tile(centre(self.cfg.grid_size), (len(self.goals), 1))
        self.positions = np.array(starts, dtype=np.int64)
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
