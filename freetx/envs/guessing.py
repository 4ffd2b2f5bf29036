"""The guessing game: the model guesses a secret number from `low` to `high` and is told
"higher" or "lower" after each wrong guess; a right guess ends the episode with reward 1
(docs/environments.md). Its demonstrations halve the range the answers so far allow in
`bisect_share` of the games and guess at random within it in the rest: a legal player,
fast or slow; RL makes it halve the range."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from freetx.envs.language import Message, Turn


class GuessingGame:
    """Guess the row's `secret` (module docstring); a reply without a number is told so."""

    name = "guess"

    def __init__(
        self, low: int = 1, high: int = 16, max_guesses: int = 6, bisect_share: float = 0.5
    ) -> None:
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.bisect_share = bisect_share

    def question(self, game: int) -> str:
        """The prompt of game `game` (numbered, so that the hashed train/validation split
        tells games apart)."""
        return f"Game {game}: guess my number from {self.low} to {self.high}."

    def reset(self, messages: list[Message], row: Mapping[str, Any]) -> list[Message]:
        return messages

    def step(self, messages: list[Message], row: Mapping[str, Any]) -> Turn:
        found = re.search(r"-?\d+", messages[-1]["content"])
        if found is None:
            return Turn([{"role": "user", "content": "say a number"}])
        guess, secret = int(found[0]), int(row["secret"])
        if guess == secret:
            return Turn(reward=1.0, done=True)
        return Turn([{"role": "user", "content": "higher" if guess < secret else "lower"}])

    def rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [
            {
                "prompt": self.question(i),
                "secret": rng.randint(self.low, self.high),
                "task": self.name,
            }
            for i in range(count)
        ]

    def demonstrations(self, count: int, seed: int) -> list[list[Message]]:
        rng = random.Random(seed + 1)
        talks = []
        for row in self.rows(count, seed):
            low, high, secret = self.low, self.high, row["secret"]
            talk: list[Message] = [{"role": "user", "content": row["prompt"]}]
            bisect = rng.random() < self.bisect_share
            for _ in range(self.max_guesses):
                guess = (low + high) // 2 if bisect else rng.randint(low, high)
                talk.append({"role": "assistant", "content": str(guess)})
                if guess == secret:
                    break
                low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
                talk.append({"role": "user", "content": "higher" if guess < secret else "lower"})
            if talk[-1]["role"] == "user":
                talk.pop()  # a conversation ends with the model's turn
            talks.append(talk)
        return talks
