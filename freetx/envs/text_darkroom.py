"""Dark Room as text: the AD recipe's grid world (`freetx.envs.darkroom`) as a
conversation (docs/environments.md). Each turn the model reads its position (`x,y`, and
`+1` when it is on the goal: the reward, which AD's histories show too) and replies
with a move (right, left, up, down, stay: +x, -x, +y, -y, none; clipped at the
walls); a move that ends on the row's hidden goal earns 1, and the episode lasts
`horizon` moves (5x5 and 10 by default, the seed's 9x9 and 20 as arguments: an episode
of 10 moves is ~250 byte tokens). The bridge between the AD recipe (a transformer that learns to explore
from histories) and language agents: the same task, in words. Its demonstrations move at
random (`random_return`'s policy)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np

from freetx.envs.darkroom import MOVES, DarkRoomConfig, centre, random_return
from freetx.envs.language import Message, Turn

WORDS = ("right", "left", "up", "down", "stay")  # in MOVES' order


class TextDarkRoom:
    """Dark Room in words (module docstring); the row's fields: `goal_x`, `goal_y`."""

    name = "darkroom"

    def __init__(self, grid_size: int = 5, horizon: int = 10, search_share: float = 0.5) -> None:
        self.cfg = DarkRoomConfig(grid_size=grid_size, horizon=horizon)
        self.search_share = search_share

    def _observation(self, position: np.ndarray, reward: float = 0.0) -> Message:
        found = " +1" if reward else ""
        return {"role": "user", "content": f"{position[0]},{position[1]}{found}"}

    def question(self, room: int) -> str:
        """The prompt of room `room` (numbered, so that the hashed train/validation split
        tells rooms apart)."""
        size = self.cfg.grid_size
        return (
            f"Room {room}: find the goal in the dark {size}x{size} room. Moves: {', '.join(WORDS)}."
        )

    def reset(self, messages: list[Message], row: Mapping[str, Any]) -> list[Message]:
        start = self._observation(centre(self.cfg.grid_size))
        return [{**messages[0], "content": messages[0]["content"] + " " + start["content"]}]

    def position(self, messages: list[Message]) -> np.ndarray:
        """Where the moves of the conversation's replies lead (an unknown word: stay)."""
        position = centre(self.cfg.grid_size)
        for message in messages:
            if message["role"] == "assistant":
                word = message["content"].strip().lower()
                move = MOVES[WORDS.index(word)] if word in WORDS else MOVES[4]
                position = np.clip(position + move, 0, self.cfg.grid_size - 1)
        return position

    def step(self, messages: list[Message], row: Mapping[str, Any]) -> Turn:
        position = self.position(messages)
        reward = float(position[0] == row["goal_x"] and position[1] == row["goal_y"])
        moves = sum(m["role"] == "assistant" for m in messages)
        if moves >= self.cfg.horizon:
            return Turn(reward=reward, done=True)
        return Turn([self._observation(position, reward)], reward=reward)

    def rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        size = self.cfg.grid_size
        return [
            {
                "prompt": self.question(i),
                "goal_x": rng.randrange(size),
                "goal_y": rng.randrange(size),
                "task": self.name,
            }
            for i in range(count)
        ]

    def random_return(self, rows: list[Mapping[str, Any]]) -> float:
        """The mean return of a uniform-random policy on these rows' goals (simulated)."""
        goals = np.array([[row["goal_x"], row["goal_y"]] for row in rows])
        return float(random_return(goals, self.cfg).mean())

    def demonstrations(self, count: int, seed: int) -> list[list[Message]]:
        rng = random.Random(seed + 1)
        # a spiral out from the centre: right, up, left 2, down 2, right 3, up 3, ...
        spiral = [w for n in range(1, self.cfg.grid_size + 1) for w in
                  [("right", "left")[n % 2 == 0]] * n + [("up", "down")[n % 2 == 0]] * n]  # fmt: skip
        talks = []
        for row in self.rows(count, seed):
            talk = self.reset([{"role": "user", "content": row["prompt"]}], row)
            search, found = rng.random() < self.search_share, False
            for t in range(self.cfg.horizon):
                if search:
                    move = "stay" if found else spiral[t]
                else:
                    move = rng.choice(WORDS)
                talk.append({"role": "assistant", "content": move})
                turn = self.step(talk, row)
                found = found or turn.reward > 0
                talk.extend(turn.messages)
            talks.append(talk)
        return talks
