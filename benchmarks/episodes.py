"""Multi-turn episodes (`freetx.objectives.episodes`): the environment's calls overlapping
decoding against a turn of every episode at a time, measured side by side in one run.

One process, the tiny native decoder (random weights, vocabulary 259, the byte
tokenizer's `turns` template), 16 prompts x 4 episodes = 64 episodes of up to 4 turns (`--prompts`),
replies of up to 32 tokens sampled at temperature 1. The environment answers every reply
with "go on" after a delay of its row's (0, 0.02, 0.05, 0.1 or 0.2 s: a tool or a
sandbox of uneven speed; `--delays`), and ends the episode at the fourth reply.

- overlap: today's rollout. A reply goes to the thread pool as soon as it ends, the
  episode's next turn joins the engine's slots as soon as its environment answers.
- turns: the same episodes a turn at a time (every episode's reply, then every call at
  once, then the next turn: the rollout before the engine took requests as they come,
  `BatchDecoder` over the engine).

Figures, for those delays and again for an instant environment (every delay 0): the
rollout's seconds (the best of `--repeats`, alternating), the ratio, the time the
rollout waited on the environment with nothing to decode (`time/environment`), and
whether both made the same episodes token for token (keyed draws: they must).

    OMP_NUM_THREADS=2 python benchmarks/episodes.py            # ~40 s on 2 cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402
from freetx.data import ByteTokenizer, PromptBatch  # noqa: E402
from freetx.envs import Turn  # noqa: E402
from freetx.models.engine import EngineConfig  # noqa: E402
from freetx.models.generation import BatchDecoder, Sampling  # noqa: E402
from freetx.models.transformer import decoder  # noqa: E402
from freetx.objectives import episodes  # noqa: E402
from freetx.objectives.episodes import EpisodeLimits, EpisodeRunner  # noqa: E402

TURNS, MAX_NEW, PER_PROMPT = 4, 32, 4


class Waits:
    """Answers each reply after its row's delay; the fourth reply ends the episode."""

    def reset(self, messages, row):
        return messages

    def step(self, messages, row):
        time.sleep(row["delay"])
        replies = sum(m["role"] == "assistant" for m in messages)
        return Turn([{"role": "user", "content": "go on"}], 0.0, replies >= TURNS)


def rollout(model, tok, batch, turn_at_a_time: bool, prompts: int):
    """(seconds, the episodes' tokens, the time waited on the environment)."""
    limits = EpisodeLimits(max_turns=TURNS, max_tokens=512)
    run = EpisodeRunner(tok, Waits(), {}, limits, [], [tok.eos_id], MAX_NEW)
    keys = [f"k{i}" for i in range(prompts * PER_PROMPT)]
    chosen = episodes.decoder
    if turn_at_a_time:  # every request of a turn in one engine call
        episodes.decoder = lambda model, n, s, ends, engine, *_: BatchDecoder(
            model, n, s, ends, engine or EngineConfig()
        )
    try:
        started = time.perf_counter()
        with torch.no_grad():
            out = run.generate(model, batch, PER_PROMPT, Sampling(1.0), keys)
        seconds = time.perf_counter() - started
    finally:
        episodes.decoder = chosen
    return seconds, [(e.tokens, e.turns) for e in out], out.environment_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--delays", default="0,0.02,0.05,0.1,0.2")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = decoder(preset=args.preset, vocab_size=259, max_seq_len=512).eval()
    tok = ByteTokenizer(chat_template="turns")
    for delays in ([float(d) for d in args.delays.split(",")], [0.0]):
        compare(model, tok, args.prompts, delays, args.repeats)


def compare(model, tok, prompts: int, delays: list[float], repeats: int) -> None:
    """Both rollouts of the same episodes, alternating `repeats` times; the table."""
    rows = [{"delay": delays[i % len(delays)]} for i in range(prompts)]
    batch = PromptBatch(
        [[1]] * prompts,
        [f"Task {i}: go." for i in range(prompts)],
        rows,
        [f"row {i}" for i in range(prompts)],
        [False] * prompts,
        [None] * prompts,
    )
    best: dict[str, tuple] = {}
    for _ in range(repeats):
        for name, turns in (("turns", True), ("overlap", False)):
            made = rollout(model, tok, batch, turns, prompts)
            if name not in best or made[0] < best[name][0]:
                best[name] = made
    same = best["turns"][1] == best["overlap"][1]
    print(
        f"\n{prompts} prompts x {PER_PROMPT} episodes, up to {TURNS} turns of {MAX_NEW} tokens, "
        f"environment delays {delays} s by row; best of {repeats}"
    )
    print(
        table(
            [
                [name, f"{best[name][0]:.2f}", f"{best[name][2]:.2f}"]
                for name in ("turns", "overlap")
            ],
            ["rollout", "seconds", "waited on the environment (s)"],
        )
    )
    print(f"overlap / turns: {best['overlap'][0] / best['turns'][0]:.2f}x the time")
    print(f"the same episodes token for token: {same}")


if __name__ == "__main__":
    main()
