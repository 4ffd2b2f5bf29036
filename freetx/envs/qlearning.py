"""The source algorithm of Algorithm Distillation: tabular Q-learning on Dark Room.

Each training goal is learnt from scratch (optimistic initial values, epsilon
decaying over episodes; or, with `planning_sweeps`, a model of the room planned
on after every episode, whose optimism explores), with several independent
streams per goal, so a history runs from random behaviour to a near-optimal
policy. The Expert Distillation (ED) control keeps only the final policy's
episodes. Everything is numpy, vectorized over environments, and a function of
(seed, goal, stream): any rank can make any history (`history_shard` is one
rank's share).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from freetx.envs.darkroom import (
    NUM_ACTIONS,
    STAY,
    DarkRoom,
    DarkRoomConfig,
    centre,
    goal_split,
    state_index,
)
from freetx.fields import at_least, refuse_meaningless


@dataclass
class HistoryConfig:
    """The `histories:` section: how the source algorithm learns each goal."""

    streams_per_goal: int = at_least(1, default=4)
    episodes: int = at_least(1, default=100)  # per stream: from scratch to near optimal
    learning_rate: float = 0.5
    discount: float = 0.9
    initial_q: float = 1.0  # optimistic: unvisited actions look worth trying
    epsilon_start: float = 1.0
    epsilon_end: float = 0.02
    epsilon_decay_episodes: int = at_least(0, default=60)  # linear decay over these episodes
    # after each episode, its transitions are learnt again from the last to the first
    # (episodic backward update, Lee et al. 2019): a reward found is propagated along
    # the whole path at once, so the learner goes back to a goal the episode after it
    # found it, and its improvement is visible within a few episodes of context
    backward_replay: bool = False
    # after each episode, this many sweeps of value iteration over every transition seen so
    # far (Dyna-style planning on the learner's model of the room, which is deterministic):
    # with optimistic `initial_q` for the actions never tried, the values lead to the
    # nearest untried action and, once the goal is found, along the shortest known path
    # (directed exploration, as R-max does), not the first path that happened to reach it;
    # the planner treats the room as going on (the horizon is a time limit the state does
    # not show), where the step-by-step update does not bootstrap at an episode's last step
    planning_sweeps: int = at_least(0, default=0)
    # with planning: the learner remembers only its last `memory_episodes` whole episodes
    # (and the current one); after each episode its model of the room is rebuilt from them
    # and its values planned again from the optimistic start (nothing else carries over:
    # backward replay's values are replanned, and the sweeps must span a path). Set to the
    # whole episodes plain AD's context holds (model.n_transit // env.horizon - 1, with
    # subsample 1), every action of the source is a function of what AD sees: the study of
    # what the context bounds (docs/recipes/ad_ddp.md); 0: it remembers all
    memory_episodes: int = at_least(0, default=0)
    # with planning: the learner knows what staying does (the reward is the cell's: +1 for
    # every step on the goal). Entering a cell tells it what staying there gives, so after
    # the episode's planning a goal found once is worth nearly its whole value (up to
    # 1 / (1 - discount)) and the learner goes back to it the next episode, where without
    # this it often went on exploring (the goal reached once was worth 1 + discount x
    # initial_q, about as much as an untried action)
    knows_stay: bool = False
    # the cell the learner starts on is the one cell it is in without having entered it: its
    # reward shows only when a step ends there (a stay, or a way back). With K here, the
    # learner stays on an episode's first step whenever none of its last K episodes had a
    # step end on the start cell. At the whole episodes AD's context holds before the current
    # one (model.n_transit // env.horizon - 1), every window AD trains on shows the start cell
    # tested. A study knob: with the start cell held out, AD then tests it and is rewarded,
    # but does not stay (docs/recipes/ad_ddp.md, "A goal at the start cell"); 0: the learner
    # comes back to it only as its optimism leads it
    start_test_episodes: int = at_least(0, default=0)
    # the share of streams (drawn per stream) whose every episode starts on the stream's own
    # uniformly random cell instead of the centre: the start becomes part of a task, as its
    # goal is. With the centre held out, no history has its goal there, and every history
    # shows AD the start cell left; a stream that starts on its goal shows it stayed on,
    # rewarded, episode after episode, and the others that the cell one starts on is not
    # always the centre (AD's evaluation still starts at the centre). The tiny configs: 1.0
    # with 12 streams a goal (each stream a (start, goal) task of its own), where AD keeps a
    # held-out start cell and the far goals (docs/recipes/ad_ddp.md, "A goal at the start
    # cell"); 0: every episode starts at the centre
    random_start: float = 0.0
    # the share of streams (drawn per stream, before random_start) whose every episode starts
    # on the stream's own goal: a goal at the start cell is then a task every split's
    # histories show, whichever cells it holds out, rewarded only by staying (or coming
    # back). A study knob: AD found a held-out centre then and did not stay
    # (docs/recipes/ad_ddp.md, "A goal at the start cell"); 0: none
    start_on_goal: float = 0.0
    expert: bool = False  # Expert Distillation control: the final policy's episodes only
    subsample: int = at_least(
        1, default=1
    )  # train on every k-th episode: learning looks k times faster in context
    seed: int = 0

    def __post_init__(self) -> None:
        refuse_meaningless(self)

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """The planner's knobs without the planner, a random-start share that is no share
        (freetx.fields: checked by `freetx validate`, before a run, and here), by key: why,
        and the fix."""
        found = {}
        shares = (("random_start", "a random cell", "every episode starts at the centre"),
                  ("start_on_goal", "their goal", "no stream starts on its goal"))  # fmt: skip
        for key, where, none in shares:
            share = values.get(key, 0.0)
            if not (isinstance(share, (int, float)) and 0 <= share <= 1):
                found[key] = (
                    f"it is the share of the source's streams that start on {where}, a "
                    f"probability; set it in [0, 1] (0: {none})."
                )
        if not values.get("planning_sweeps"):
            for key in ("memory_episodes", "knows_stay"):
                if values.get(key):
                    found[key] = (
                        "it shapes the planner's model of the room, and there is no planner "
                        "(histories.planning_sweeps=0). Set planning_sweeps (e.g. 20), or "
                        f"{key}={'0' if key == 'memory_episodes' else 'false'}."
                    )
        return found


def _epsilon(episode: int, cfg: HistoryConfig) -> float:
    progress = min(1.0, episode / max(1, cfg.epsilon_decay_episodes))
    return cfg.epsilon_start + (cfg.epsilon_end - cfg.epsilon_start) * progress


def _starts(
    rngs: list[np.random.Generator], goals: np.ndarray, grid_size: int, cfg: HistoryConfig
) -> np.ndarray:
    """Each stream's start cell: its goal with probability `start_on_goal`, else a uniformly
    random cell with probability `random_start`, else the centre (drawn from the stream's own
    generator, nothing drawn for a share of 0)."""
    starts = np.tile(centre(grid_size), (len(rngs), 1))
    for i, rng in enumerate(rngs):
        if cfg.start_on_goal and rng.random() < cfg.start_on_goal:
            starts[i] = goals[i]
        elif cfg.random_start and rng.random() < cfg.random_start:
            starts[i] = rng.integers(grid_size, size=2)
    return starts


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

    # the learner's model: which (state, action) it has tried, where it led, its reward
    known = np.zeros((n, num_states, NUM_ACTIONS), dtype=bool)
    model_next = np.zeros((n, num_states, NUM_ACTIONS), dtype=np.int64)
    model_reward = np.zeros((n, num_states, NUM_ACTIONS), dtype=np.float64)
    next_states_seen = np.zeros((n, length), dtype=np.int64)  # for the memory's rebuilds

    def remember(row_index, states, actions, next_states, rewards) -> None:
        """Into the model: where each action led and what it earned; with knows_stay,
        also that staying in the cell entered earns what entering it did."""
        tried = [(row_index, states, actions)]
        for where in tried + ([(row_index, next_states, STAY)] if cfg.knows_stay else []):
            known[where] = True
            model_next[where] = next_states
            model_reward[where] = rewards

    def learn(states, actions, rewards, next_states, last: bool) -> None:
        target = rewards + (0.0 if last else cfg.discount) * q[rows, next_states].max(-1)
        q[rows, states, actions] += cfg.learning_rate * (target - q[rows, states, actions])
        remember(rows, states, actions, next_states, rewards)
        if cfg.knows_stay:  # a goal just found is worth staying on
            stay_value = rewards + cfg.discount * q[rows, next_states].max(-1)
            q[rows, next_states, STAY] = stay_value

    def plan() -> None:
        """Value iteration on the transitions seen (`known`); untried actions keep their
        optimistic value."""
        for _ in range(cfg.planning_sweeps):
            values = q.max(-1)  # [n, states]
            after = np.take_along_axis(values, model_next.reshape(n, -1), axis=1)
            target = model_reward + cfg.discount * after.reshape(model_next.shape)
            np.copyto(q, target, where=known)

    def remember_last(episodes_done: int) -> None:
        """The model and values from the last `memory_episodes` episodes only."""
        start = max(0, episodes_done - cfg.memory_episodes) * horizon
        known.fill(False)
        steps = slice(start, episodes_done * horizon)
        remember(rows[:, None], out["states"][:, steps], out["actions"][:, steps],
                 next_states_seen[:, steps], out["rewards"][:, steps])  # fmt: skip
        q.fill(cfg.initial_q)

    # learning episodes; for ED, then the final policy acting for as many episodes,
    # written over the learning ones (only the expert's episodes are kept)
    horizon = env_cfg.horizon
    starts = _starts(rngs, env_goals, env_cfg.grid_size, cfg)  # every episode's, per stream
    start = state_index(starts, env_cfg.grid_size)
    for phase in ("learn", "expert") if cfg.expert else ("learn",):
        t = 0
        start_tested = np.full(n, -(10**9))  # the last episode in which a step ended on it
        for episode in range(cfg.episodes):
            epsilon = cfg.epsilon_end if phase == "expert" else _epsilon(episode, cfg)
            states = env.reset(starts)
            visited = np.zeros((n, horizon + 1), dtype=np.int64)
            retest = episode - start_tested > cfg.start_test_episodes
            done = False
            while not done:
                actions = act(states, epsilon)
                if cfg.start_test_episodes and env.t == 0:
                    actions[retest] = STAY
                next_states, rewards, done = env.step(actions)
                start_tested[next_states == start] = episode
                if phase == "learn":
                    learn(states, actions, rewards, next_states, last=done)
                out["states"][:, t] = states
                out["actions"][:, t] = actions
                out["rewards"][:, t] = rewards.astype(np.int64)
                next_states_seen[:, t] = next_states
                visited[:, env.t - 1], visited[:, env.t] = states, next_states
                states = next_states
                t += 1
            if phase == "learn" and cfg.backward_replay:
                episode_steps = slice(t - horizon, t)
                for k in reversed(range(horizon)):
                    learn(
                        visited[:, k],
                        out["actions"][:, episode_steps][:, k],
                        out["rewards"][:, episode_steps][:, k],
                        visited[:, k + 1],
                        last=k == horizon - 1,
                    )
            if phase == "learn" and cfg.planning_sweeps:
                if cfg.memory_episodes:
                    remember_last(episode + 1)
                plan()
    out["goal_ids"] = np.repeat(goal_ids, streams)
    return out


def history_shard(
    rank: int, world_size: int, env_cfg: DarkRoomConfig, cfg: HistoryConfig
) -> dict[str, np.ndarray]:
    """Rank `rank`'s share of the histories: the training goals i with i % world_size == rank."""
    train_goals = goal_split(env_cfg).train
    mine = np.arange(rank, len(train_goals), world_size)
    return learning_histories(mine, train_goals[mine], env_cfg, cfg)
