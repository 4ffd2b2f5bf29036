"""benchmarks/ad_splits.py reads what an ad_ddp run writes (config.yaml, metrics.jsonl,
eval/in_context_returns.json) into its tables and its verdict against the goal: every
split's last-5 return >= 80% of its optimum, every test goal's >= 8. The runs themselves
are ad_ddp's (tests/recipes/test_ad.py)."""

from __future__ import annotations

import json

import numpy as np
from omegaconf import OmegaConf

from benchmarks import ad_splits
from freetx.envs import HistoryConfig, learning_histories
from freetx.envs.darkroom import DarkRoomConfig, goal_split


def finished_run(folder, per_goal, compress=None, curve_end=12.0, goals=((4, 5), (8, 8))):
    """A run folder as ad_ddp leaves it: 2 test goals (optima 17 and 13), 30 episodes."""
    (folder / "eval").mkdir(parents=True)
    model = {"n_transit": 83 if compress else 100}
    config = {"env": {"grid_size": 9, "horizon": 20}, "model": model, "compress": compress}
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    records = [{"step": s, "step_time_s": 0.1 * s, "memory/max_rss_gib": 0.5 + s / 100}
               for s in range(1, 6)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    curve = [0.0] * 25 + [curve_end] * 5
    test = {"goals": [list(g) for g in goals], "returns_per_episode": curve, "last5_per_goal": per_goal,
            "optimal_return": 15.0}  # fmt: skip
    (folder / "eval" / "in_context_returns.json").write_text(
        json.dumps({"temperature": 0.5, "test": test})
    )
    return json.loads((folder / "eval" / "in_context_returns.json").read_text())


def test_tables_and_verdict_from_finished_runs(tmp_path):
    plain = {1: finished_run(tmp_path / "ad_s1", [14.0, 10.0])}
    compressed = {
        1: finished_run(tmp_path / "cad_s1", [12.0, 7.5], {"region_episodes": 2, "regions": 2}, 9.0)
    }
    (row,) = ad_splits.split_rows("AD", plain, {1: tmp_path / "ad_s1"})
    assert row[3:] == ["0.00", "12.00", "15.00", "80%", "10.00", "100", "400 ms", "0.55 GiB"]
    (row,) = ad_splits.split_rows("compressed AD", compressed, {1: tmp_path / "cad_s1"})
    assert row[-3] == "83"  # the compressed context's tokens at most
    goals = ad_splits.goal_rows("AD", plain, {1: tmp_path / "ad_s1"})
    assert [r[2:] for r in goals] == [["(4, 5)", "20", "14.00", "70%", "", ""],
                                      ["(8, 8)", "13", "10.00", "77%", "", ""]]  # fmt: skip
    # with each run's curve (goal, seed, episode): who reached the goal, who did not stay
    found_and_left = [0.0] * 10 + [1.0] + [0.0] * 19
    stayed = [0.0] * 10 + [20.0] * 20
    plain[1]["test"]["returns"] = [[stayed, found_and_left, [0.0] * 30], [stayed] * 3]
    goals = ad_splits.goal_rows("AD", plain, {1: tmp_path / "ad_s1"})
    assert [r[-2:] for r in goals] == [["2/3", "1"], ["3/3", "0"]]
    assert "meets the goal" in ad_splits.verdict("AD", plain)
    missed = ad_splits.verdict("compressed AD", compressed)
    assert "misses the goal" in missed and "1 of 2 test goals below 8" in missed
    assert "60% of the optimum" in missed
    start = {2: finished_run(tmp_path / "ad_s2", [0.0, 10.0], goals=((4, 4), (8, 8)))}
    goals = ad_splits.goal_rows("AD", start, {2: tmp_path / "ad_s2"})
    assert [r[2:4] for r in goals] == [["(4, 4) (start)", "20"], ["(8, 8)", "13"]]


def test_the_source_curve_is_the_shipped_histories_or_the_overridden_ones():
    """--source: the share of the optimum per episode of the source's histories, from
    ad/darkroom_tiny's sections checked by the recipe's schema (a mistyped key is an error)."""
    import pytest

    from freetx.errors import ConfigError

    small = ["histories.episodes=5", "histories.streams_per_goal=1", "histories.random_start=0"]
    row = ad_splits.source_rows("small", 0, small)
    assert row[:2] == ["small", "0"] and row[-7:-4] == ["", "", ""]  # no episode 20, 30, 60
    first, fifth = (float(v) for v in row[2:4])  # share of the optimum at episodes 1 and 5
    assert 0 <= first < fifth <= 1 and row[-4].endswith("%")  # streams left on a detour
    assert row[-2].endswith("%")  # back to the goal the episode after finding it
    # the goals 7 or 8 steps from the start (split 0's training goals), 1 stream each: in 5
    # episodes the nearest-first search has not reached most of them
    far = [g for g in goal_split(DarkRoomConfig(split_seed=0)).train if abs(g - 4).sum() >= 7]
    missed, streams = row[-1].split("% of ")
    assert int(streams) == len(far) and int(missed) > 50
    unplanned = ad_splits.source_rows("unplanned", 0, [*small, "histories.planning_sweeps=0",
                                                       "histories.knows_stay=false",
                                                       "histories.epsilon_start=0.5"])  # fmt: skip
    assert float(unplanned[3]) < fifth  # the override reaches the histories: no directed search
    # random starts: each stream's optimum and far goals are from its own start
    moved = ad_splits.source_rows("moved", 0, [*small, "histories.random_start=1.0"])
    env = DarkRoomConfig(split_seed=0)
    goals = goal_split(env).train
    cfg = HistoryConfig(episodes=1, streams_per_goal=1, random_start=1.0, seed=0)
    starts = learning_histories(np.arange(len(goals)), goals, env, cfg)["states"][:, 0]
    distance = np.abs(goals - np.stack([starts // 9, starts % 9], -1)).sum(-1)
    assert moved[-1].endswith(f" of {(distance >= 7).sum()}") and (distance >= 7).sum() > len(far)
    assert all(0 <= float(v) <= 1 for v in moved[2:4])
    with pytest.raises(ConfigError, match="did you mean 'histories'"):
        ad_splits.source_rows("typo", 0, ["history.episodes=5"])
