"""Dark Room dynamics, optimal returns, and learning histories."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetx.data.darkroom import (
    CLOSE,
    OPEN,
    ADWindows,
    CompressedADWindows,
    compressed_context,
    compressed_length,
    compressed_run_inputs,
    kept_regions,
    next_transition,
    run_inputs,
)
from freetx.envs import (
    DarkRoom,
    DarkRoomConfig,
    HistoryConfig,
    goal_split,
    learning_histories,
    optimal_return,
    random_return,
    state_index,
)
from freetx.errors import ConfigError
from tests.conftest import flip_byte

ENV = DarkRoomConfig()


def test_moves_walls_and_rewards_by_hand():
    env = DarkRoom(np.array([[5, 4]]), ENV)
    assert env.reset().tolist() == [4 * 9 + 4]  # the centre
    states, rewards, done = env.step(np.array([0]))  # +x onto the goal
    assert states.tolist() == [5 * 9 + 4] and rewards.tolist() == [1.0] and not done
    _, rewards, _ = env.step(np.array([4]))  # stay: rewarded again
    assert rewards.tolist() == [1.0]
    _, rewards, _ = env.step(np.array([2]))  # +y: off the goal
    assert env.positions.tolist() == [[5, 5]] and rewards.tolist() == [0.0]
    env.positions[:] = [[8, 0]]
    env.step(np.array([0]))  # +x at the wall: clipped
    env.step(np.array([3]))  # -y at the wall: clipped
    assert env.positions.tolist() == [[8, 0]]
    for _ in range(15):
        _, _, done = env.step(np.array([4]))
    assert done and env.t == 20


def test_optimal_return_of_every_goal_by_simulation():
    cells = np.array([(x, y) for x in range(9) for y in range(9)])
    env = DarkRoom(cells, ENV)
    env.reset()
    total = np.zeros(len(cells))
    done = False
    while not done:  # walk along x, then along y, then stay
        delta = cells - env.positions
        actions = np.where(delta[:, 0] > 0, 0, np.where(delta[:, 0] < 0, 1,
                  np.where(delta[:, 1] > 0, 2, np.where(delta[:, 1] < 0, 3, 4))))  # fmt: skip
        _, rewards, done = env.step(actions)
        total += rewards
    assert np.array_equal(total, optimal_return(cells, ENV))
    assert optimal_return(cells, ENV).mean() == pytest.approx(16.54, abs=0.01)
    assert (total.min(), total.max()) == (13.0, 20.0)


def test_random_policy_return_is_about_a_quarter():
    cells = np.array([(x, y) for x in range(9) for y in range(9)])
    assert random_return(cells, ENV, episodes=100).mean() == pytest.approx(0.25, abs=0.1)


def test_goal_split_is_disjoint_and_seeded():
    split = goal_split(ENV)
    train, val, test = (set(map(tuple, g)) for g in (split.train, split.val, split.test))
    assert (len(train), len(val), len(test)) == (65, 8, 8)
    assert not train & val and not train & test and not val & test
    assert len(train | val | test) == 81
    other = goal_split(DarkRoomConfig(split_seed=1)).test
    assert test != set(map(tuple, other))
    # the validation goals come out of the training goals: the test goals stay put
    no_val = goal_split(DarkRoomConfig(val_goals=0))
    assert set(map(tuple, no_val.test)) == test and len(no_val.train) == 73
    assert set(map(tuple, no_val.train)) == train | val


@pytest.mark.parametrize(
    "fields,message",
    [({"val_goals": 73}, "env.val_goals < 73"), ({"train_fraction": 0.001}, "no training")],
)
def test_impossible_goal_splits_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        goal_split(DarkRoomConfig(**fields))


def test_histories_are_deterministic_by_seed_and_independent_of_the_split():
    train = goal_split(ENV).train
    cfg = HistoryConfig(streams_per_goal=2, episodes=10)
    both = learning_histories(np.array([0, 1]), train[:2], ENV, cfg)
    again = learning_histories(np.array([0, 1]), train[:2], ENV, cfg)
    alone = learning_histories(np.array([1]), train[1:2], ENV, cfg)  # another rank's share
    other_seed = learning_histories(
        np.array([0, 1]), train[:2], ENV, HistoryConfig(streams_per_goal=2, episodes=10, seed=1)
    )
    for key in ("states", "actions", "rewards"):
        assert np.array_equal(both[key], again[key])
        assert np.array_equal(both[key][2:], alone[key])
    assert not np.array_equal(both["actions"], other_seed["actions"])
    assert both["states"].shape == (4, 200) and both["goal_ids"].tolist() == [0, 0, 1, 1]


def test_histories_improve_and_expert_histories_do_not():
    train = goal_split(ENV).train
    cfg = HistoryConfig(streams_per_goal=2, episodes=60, epsilon_decay_episodes=30)
    h = learning_histories(np.arange(20), train[:20], ENV, cfg)
    returns = h["rewards"].reshape(40, 60, 20).sum(-1).mean(0)
    assert returns[:5].mean() < 1.5 and returns[-10:].mean() > 10
    expert = learning_histories(np.arange(20), train[:20], ENV,
                                HistoryConfig(streams_per_goal=2, episodes=60, epsilon_decay_episodes=30, expert=True))  # fmt: skip
    expert_returns = expert["rewards"].reshape(40, 60, 20).sum(-1).mean(0)  # the final policy only
    assert (
        expert_returns[:5].mean() > 10
        and abs(expert_returns[:5].mean() - expert_returns[-5:].mean()) < 2
    )


def test_planning_finds_the_shortest_path_not_the_first():
    """Optimistic untried actions with value iteration over the transitions seen (Dyna
    sweeps): every stream ends within 1-2 steps of the shortest path to its goal; without
    the sweeps some streams keep the first path they found, half as good."""
    env = DarkRoomConfig(split_seed=3)
    goals = goal_split(env).train[:12]
    optimal = optimal_return(goals, env)[:, None]

    def last_episode_share(**extra):
        cfg = HistoryConfig(streams_per_goal=2, episodes=40, learning_rate=1.0, initial_q=5,
                            epsilon_start=0.0, epsilon_end=0.0, backward_replay=True, seed=3,
                            **extra)  # fmt: skip
        returns = learning_histories(np.arange(12), goals, env, cfg)["rewards"]
        return returns.reshape(12, 2, 40, 20).sum(-1)[:, :, -1] / optimal

    planned, unplanned = last_episode_share(planning_sweeps=20), last_episode_share()
    assert planned.min() >= 0.85 and (planned == 1).mean() > 0.8
    assert unplanned.min() < 0.6 and planned.mean() > unplanned.mean()


def test_a_planner_that_knows_what_staying_does_goes_back_to_a_goal_it_found():
    """knows_stay: entering a cell tells the planner what staying there gives, so a goal
    found once is worth its whole value and every stream goes back to it the episode
    after; without it, a goal reached once is worth about as much as an untried action,
    and some streams go on exploring instead (what AD then learns: a reward seen is not a
    reason to go back)."""
    env = DarkRoomConfig(split_seed=3)
    goals = goal_split(env).train[:20]

    def back_the_next_episode(**extra):
        cfg = HistoryConfig(streams_per_goal=2, episodes=30, learning_rate=1.0, initial_q=5,
                            epsilon_start=0.0, epsilon_end=0.0, backward_replay=True,
                            planning_sweeps=20, seed=3, **extra)  # fmt: skip
        returns = learning_histories(np.arange(20), goals, env, cfg)["rewards"]
        returns = returns.reshape(40, 30, 20).sum(-1)
        first = (returns > 0).argmax(-1)  # every stream finds its goal
        assert (returns > 0).any(-1).all() and (first < 29).all()
        return returns[np.arange(40), first + 1] > 0

    assert back_the_next_episode(knows_stay=True).all()
    assert back_the_next_episode().mean() < 0.9


def test_the_learner_tests_the_start_cell_within_every_k_episodes():
    """start_test_episodes K: an episode starts with a stay exactly when none of the last K
    episodes had a step end on the start cell (the cell is tested where AD's context shows
    it); a goal at the start cell is then found at the first step of the first episode. Off,
    the histories are the learner's own."""
    env = DarkRoomConfig(split_seed=3)
    centre_id = 4 * 9 + 4
    goals = np.concatenate([goal_split(env).train[:6], [[4, 4]]])

    def histories(**extra):
        cfg = HistoryConfig(streams_per_goal=2, episodes=20, learning_rate=1.0, initial_q=3,
                            epsilon_start=0.05, epsilon_end=0.05, backward_replay=True,
                            planning_sweeps=20, knows_stay=True, seed=3, **extra)  # fmt: skip
        return learning_histories(np.arange(len(goals)), goals, env, cfg)

    k = 3
    tested = histories(start_test_episodes=k)
    actions = tested["actions"].reshape(-1, 20, 20)  # stream, episode, step
    room = DarkRoom(np.repeat(goals, 2, axis=0), env)
    last = np.full(len(actions), -(10**9))  # per stream: the last episode a step ended on it
    must = np.zeros(actions.shape[:2], dtype=bool)
    for episode in range(20):
        room.reset()
        must[:, episode] = episode - last > k
        for step in range(20):
            ends = room.step(actions[:, episode, step])[0]
            last[ends == centre_id] = episode
    assert (actions[must, 0] == 4).all() and must[:, 0].all() and must[:, 1:].any()
    assert (actions[~must, 0] == 4).mean() < 0.2  # the others: the learner's own choice
    at_start = tested["rewards"][-2:].reshape(2, 20, 20)
    assert (at_start[:, 0, 0] == 1).all()  # the goal at the start: found by the first step
    untested = histories()
    assert not np.array_equal(untested["actions"], tested["actions"])
    assert np.array_equal(untested["actions"], histories(start_test_episodes=0)["actions"])


def test_random_starts_are_each_streams_own_and_a_start_on_the_goal_is_stayed_on():
    """random_start p: each stream starts every episode on its own uniformly random cell with
    probability p (else the centre); the histories are the room's own from those cells
    (replayed); a stream's start depends on its (seed, goal id, stream), not on the goals
    made alongside; streams that start on their goal stay on it, rewarded from the first
    step; 0 changes nothing."""
    env = DarkRoomConfig(split_seed=3)
    goals, all_ids = goal_split(env).train[:20], np.arange(20)

    def histories(ids=all_ids, cells=goals, streams=2, **extra):
        cfg = HistoryConfig(streams_per_goal=streams, episodes=30, learning_rate=1.0,
                            initial_q=3, epsilon_start=0.05, epsilon_end=0.05,
                            backward_replay=True, planning_sweeps=20, knows_stay=True, seed=3,
                            **extra)  # fmt: skip
        return learning_histories(ids, cells, env, cfg)

    centre_id = 4 * 9 + 4
    some = histories(random_start=0.25)
    firsts = some["states"][:, ::20]  # [stream, episode]: where each episode starts
    assert (firsts == firsts[:, :1]).all()  # a stream's start is the same every episode
    assert 0.1 < (firsts[:, 0] != centre_id).mean() < 0.45
    fewer = histories(ids=np.arange(5), cells=goals[:5], random_start=0.25)
    assert np.array_equal(fewer["states"], some["states"][:10])
    room = DarkRoom(np.repeat(goals, 2, axis=0), env)
    actions = some["actions"].reshape(40, 30, 20)
    start = np.stack([firsts[:, 0] // 9, firsts[:, 0] % 9], -1)
    for episode in range(30):
        states = room.reset(start)
        for step in range(20):
            t = episode * 20 + step
            assert np.array_equal(states, some["states"][:, t])
            states, rewards, _ = room.step(actions[:, episode, step])
            assert np.array_equal(rewards, some["rewards"][:, t])
    # the starts come from the goal ids' random streams: goals put on them are started on
    starts = histories(streams=1, random_start=1.0)["states"][:, 0]
    assert len(np.unique(starts)) >= 12 and (starts != centre_id).all()
    on_goal = histories(cells=np.stack([starts // 9, starts % 9], -1), streams=1, random_start=1.0)
    assert np.array_equal(on_goal["states"][:, 0], starts)
    returns = on_goal["rewards"].reshape(20, 30, 20).sum(-1)
    stays = on_goal["rewards"][:, ::20][:, -10:]  # the first step of the last 10 episodes
    assert returns[:, 0].mean() > 8 and returns[:, -10:].mean() > 17 and stays.mean() > 0.9
    plain = histories()
    assert np.array_equal(plain["actions"], histories(random_start=0.0)["actions"])
    assert not np.array_equal(plain["actions"], some["actions"])


def test_a_share_of_streams_start_on_their_goal_and_stay_there():
    """start_on_goal q: each stream starts every episode on its own goal with probability q
    (drawn from the stream's own generator: the goals made alongside change nothing), and
    stays there once its first stays are rewarded; the others start at the centre; 0
    changes nothing."""
    env = DarkRoomConfig(split_seed=3)
    goals, ids = goal_split(env).train[:20], np.arange(20)

    def histories(ids=ids, cells=goals, **extra):
        cfg = HistoryConfig(streams_per_goal=2, episodes=30, learning_rate=1.0, initial_q=3,
                            epsilon_start=0.05, epsilon_end=0.05, backward_replay=True,
                            planning_sweeps=20, knows_stay=True, seed=3, **extra)  # fmt: skip
        return learning_histories(ids, cells, env, cfg)

    some = histories(start_on_goal=0.5)
    firsts = some["states"][:, ::20]  # [stream, episode]: where each episode starts
    assert (firsts == firsts[:, :1]).all()
    goal_cells = np.repeat(goals[:, 0] * 9 + goals[:, 1], 2)
    on_goal = firsts[:, 0] == goal_cells
    assert 0.25 < on_goal.mean() < 0.75 and (firsts[~on_goal, 0] == 4 * 9 + 4).all()
    fewer = histories(ids=ids[:5], cells=goals[:5], start_on_goal=0.5)
    assert np.array_equal(fewer["states"], some["states"][:10])
    returns = some["rewards"].reshape(40, 30, 20).sum(-1)
    assert returns[on_goal, -10:].mean() > 17  # every step on the goal, or nearly
    plain = histories()
    assert np.array_equal(plain["actions"], histories(start_on_goal=0.0)["actions"])
    assert not np.array_equal(plain["actions"], some["actions"])


def test_a_planner_that_remembers_less_learns_less():
    """memory_episodes: the planner's model of the room holds only its last K episodes (as
    AD's context does), rebuilt after each episode. The shipped learner (knows_stay)
    remembering every episode learns as the one that keeps everything; remembering 2
    costs: by its last episodes it is further from the optimum. Its first episode, before
    anything is rebuilt, is the same."""
    env = DarkRoomConfig(split_seed=3)
    goals = goal_split(env).train[:12]
    optimal = optimal_return(goals, env)[:, None]

    def histories(**extra):
        cfg = HistoryConfig(streams_per_goal=2, episodes=30, learning_rate=1.0, initial_q=3,
                            epsilon_start=0.0, epsilon_end=0.0, backward_replay=True,
                            planning_sweeps=20, knows_stay=True, seed=3, **extra)  # fmt: skip
        return learning_histories(np.arange(12), goals, env, cfg)

    def last5(h):  # share of the optimum in the last 5 episodes, per stream
        return h["rewards"].reshape(12, 2, 30, 20).sum(-1)[:, :, -5:].mean(-1) / optimal

    everything, two = histories(), histories(memory_episodes=2)
    all_30 = histories(memory_episodes=30)
    assert np.array_equal(everything["actions"][:, :20], two["actions"][:, :20])
    assert abs(last5(all_30).mean() - last5(everything).mean()) < 0.02
    assert last5(everything).mean() > 0.9 and last5(two).mean() < last5(everything).mean() - 0.05
    with pytest.raises(ValueError, match="'memory_episodes' is 2: it shapes the planner's"):
        HistoryConfig(memory_episodes=2)  # no planner to shape


def test_compressed_context_brackets_regions_and_keeps_the_last_ones():
    positions, kinds = compressed_context([0, 4], 7)
    assert positions.tolist() == [-1, 0, 1, 2, 3, -1, -1, 4, 5, 6]
    assert kinds.tolist() == [OPEN, 0, 0, 0, 0, CLOSE, OPEN, 0, 0, 0]
    assert compressed_length(2, 2, 20) == 83 and compressed_length(4, 2, 20) == 163  # the seed's
    # an in-context run keeps the region being filled and the one before: the oldest goes
    assert [kept_regions(e, 2, 2, 20) for e in (0, 1, 2, 3, 4, 7)] == [
        [0], [0], [0, 40], [0, 40], [40, 80], [80, 120],
    ]  # fmt: skip


def test_compressed_windows_are_what_the_evaluation_reads():
    """A training window and the in-context run's context at any step of it lay out the
    same tokens (the run's are a prefix): states, the transition before (across markers
    and regions), markers; actions are labelled at transitions only."""
    rng = np.random.default_rng(0)
    h = {"states": rng.integers(0, 81, (1, 200)), "actions": rng.integers(0, 5, (1, 200)),
         "rewards": rng.integers(0, 2, (1, 200))}  # fmt: skip
    windows = CompressedADWindows(h, 2, 2, 20, no_action=5, no_reward=2)
    assert len(windows) == 7  # windows of 4 episodes start at episodes 0..6 of 10
    sample = windows[2]  # episodes 2-5: regions at transitions 40 and 80
    assert {k: v.shape[0] for k, v in sample.items()} == dict.fromkeys(
        ("states", "prev_actions", "prev_rewards", "markers", "labels"), 83
    )
    assert sample["labels"][[0, 41, 42]].tolist() == [-100, -100, -100]
    assert (
        sample["labels"][1] == h["actions"][0, 40]
        and sample["prev_actions"][1] == h["actions"][0, 39]
    )
    assert sample["prev_actions"][43] == h["actions"][0, 79]  # across the </c> <c> markers
    tensors = {k: torch.from_numpy(v) for k, v in h.items() if k != "goal_ids"}
    for t in (30, 60, 79, 80, 95, 119, 150):  # the run's step: its regions start at 0, 40, ...
        starts = kept_regions(t // 20, 2, 2, 20)
        run = compressed_run_inputs(tensors["states"], tensors["actions"], tensors["rewards"],
                                    t, 20, 2, 2, 5, 2)  # fmt: skip
        window = windows[starts[0] // 20]  # the training window from its first region
        length = run["states"].shape[-1]
        assert length == (t - starts[0] + 1) + 2 * len(starts) - 1
        for key in ("states", "prev_actions", "prev_rewards", "markers"):
            assert torch.equal(run[key][0], window[key][:length]), (t, key)


def test_the_model_reads_markers_only_with_boundary_tokens():
    from freetx.distributed import materialize
    from freetx.models.ad import ad_transformer

    with torch.device("meta"):
        model = ad_transformer(n_transit=83, boundary_tokens=True, dropout=0.0)
    materialize(model, torch.device("cpu"), seed=0)
    states = torch.randint(0, 81, (2, 10))
    actions, rewards = torch.randint(0, 6, (2, 10)), torch.randint(0, 3, (2, 10))
    markers = torch.zeros(2, 10, dtype=torch.long)
    plain = model(states, actions, rewards, markers)
    markers[:, 4] = CLOSE
    marked = model(states, actions, rewards, markers)
    assert torch.equal(plain[:, :4], marked[:, :4]) and not torch.allclose(
        plain[:, 4:], marked[:, 4:]
    )
    other_state = states.clone()
    other_state[:, 4] = (states[:, 4] + 1) % 81  # a marker's state is not read
    assert torch.equal(model(other_state, actions, rewards, markers), marked)
    with pytest.raises(ValueError, match="boundary_tokens"):
        model(states, actions, rewards)


@pytest.mark.parametrize("compressed", [False, True])
def test_a_cached_context_and_the_steps_after_it_are_the_whole_context(compressed):
    """The evaluation computes an episode's context at its first step and then feeds one
    token a step (`next_transition`): at every step, the tokens fed since the episode
    began are the whole context the step would have (`run_inputs`, ADWindows' layout:
    4 past episodes of 20; `compressed_run_inputs`: regions of 2 episodes, 2 kept)."""
    g = torch.Generator().manual_seed(0)
    runs = {"states": torch.randint(0, 81, (3, 200), generator=g),
            "actions": torch.randint(0, 5, (3, 200), generator=g),
            "rewards": torch.randint(0, 2, (3, 200), generator=g)}  # fmt: skip

    def whole(t):
        if compressed:
            return compressed_run_inputs(*runs.values(), t, 20, 2, 2, 5, 2)
        return run_inputs(*runs.values(), t, 20, 4, 5, 2)

    for t in range(200):
        first = t - t % 20  # the episode's first step
        fed = [whole(first)] + [next_transition(*runs.values(), s, compressed)
                                for s in range(first + 1, t + 1)]  # fmt: skip
        expected = whole(t)
        assert sorted(fed[0]) == sorted(expected)
        for key in expected:
            assert torch.equal(torch.cat([f[key] for f in fed], 1), expected[key]), (t, key)
    # the plain layout: 4 whole episodes and the current one, the first token's "none"s
    late = run_inputs(*runs.values(), 130, 20, 4, 5, 2)
    assert torch.equal(late["states"], runs["states"][:, 40:131])
    assert late["prev_actions"][:, 0].tolist() == [5, 5, 5]
    assert torch.equal(late["prev_rewards"][:, 1:], runs["rewards"][:, 40:130])


@pytest.mark.parametrize("boundary_tokens", [False, True])
def test_a_run_that_caches_its_context_acts_as_one_that_computes_it_every_step(boundary_tokens):
    """The evaluation's KV cache: a context computed once, then one transition at a time,
    gives every step the logits of a forward over the whole context (the compressed
    layout's, markers included: within an episode a run's context grows by its
    transitions, `test_compressed_windows_are_what_the_evaluation_reads`)."""
    from freetx.distributed import materialize
    from freetx.models.ad import ad_transformer
    from freetx.models.protocol import DecodesIncrementally

    with torch.device("meta"):
        model = ad_transformer(n_transit=40, boundary_tokens=boundary_tokens, dropout=0.0)
    materialize(model, torch.device("cpu"), seed=0)
    model.eval()
    assert not isinstance(model, DecodesIncrementally)  # the LM generation paths refuse it
    g = torch.Generator().manual_seed(0)
    inputs = {
        "states": torch.randint(0, 81, (3, 30), generator=g),
        "prev_actions": torch.randint(0, 6, (3, 30), generator=g),
        "prev_rewards": torch.randint(0, 3, (3, 30), generator=g),
    }
    if boundary_tokens:
        inputs["markers"] = torch.zeros(3, 30, dtype=torch.long)
        inputs["markers"][:, [0, 11]] = OPEN
        inputs["markers"][:, 10] = CLOSE
    with torch.no_grad():
        whole = model(**inputs)
        cache = model.run_cache(3, torch.device("cpu"))
        steps = [model(**{k: v[:, :12] for k, v in inputs.items()}, cache=cache)]
        steps += [model(**{k: v[:, t : t + 1] for k, v in inputs.items()}, cache=cache)
                  for t in range(12, 30)]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-5, atol=1e-5)
    assert cache.length == 30
    cache.rewind()  # the next episode's context written over this one's
    with torch.no_grad():
        again = model(**{k: v[:, 5:25] for k, v in inputs.items()}, cache=cache)
    torch.testing.assert_close(again, model(**{k: v[:, 5:25] for k, v in inputs.items()}))


def test_planning_histories_have_their_own_cache_and_the_others_keep_theirs(tmp_path):
    """The cache's name hashes the histories' settings: the planner's knobs are in it only
    when set, so histories made before the knobs existed are still found."""
    from dataclasses import asdict

    from freetx.data.darkroom import histories_cache
    from freetx.data.shard_cache import ShardCache

    plain = histories_cache(tmp_path, ENV, HistoryConfig())
    planned = histories_cache(tmp_path, ENV, HistoryConfig(planning_sweeps=20))
    remembering = histories_cache(
        tmp_path, ENV, HistoryConfig(planning_sweeps=20, memory_episodes=4)
    )
    staying = histories_cache(tmp_path, ENV, HistoryConfig(planning_sweeps=20, knows_stay=True))
    testing = histories_cache(tmp_path, ENV, HistoryConfig(start_test_episodes=4))
    moving = histories_cache(tmp_path, ENV, HistoryConfig(random_start=0.25))
    on_goal = histories_cache(tmp_path, ENV, HistoryConfig(start_on_goal=0.25))
    folders = {plain.folder, planned.folder, remembering.folder, staying.folder, testing.folder,
               moving.folder, on_goal.folder}  # fmt: skip
    assert len(folders) == 7
    knobs = ("subsample", "planning_sweeps", "memory_episodes", "knows_stay",
             "start_test_episodes", "random_start", "start_on_goal")  # fmt: skip
    settings = {k: v for k, v in asdict(HistoryConfig()).items() if k not in knobs}
    before = ShardCache.for_settings(
        tmp_path, "darkroom_ad", {"env": asdict(ENV), "histories": settings}
    )
    assert plain.folder == before.folder


def test_windows_start_at_episodes_and_shift_actions():
    h = {"states": np.arange(200).reshape(1, 200) % 81, "actions": (np.arange(200) % 5).reshape(1, 200),
         "rewards": (np.arange(200) % 2).reshape(1, 200)}  # fmt: skip
    windows = ADWindows(h, n_transit=80, horizon=20, no_action=5, no_reward=2)
    assert len(windows) == 7  # starts 0, 20, ..., 120
    w = windows[1]
    assert w["states"][0] == 20 and w["labels"][0] == 0
    assert w["prev_actions"][0] == 5 and w["prev_rewards"][0] == 2  # "none"
    assert w["prev_actions"][1:].tolist() == w["labels"][:-1].tolist()
    assert state_index(np.array([2, 3]), 9) == 21


def test_subsampling_makes_every_kth_episode_a_history():
    from freetx.data.darkroom import subsample_episodes

    h = {"states": np.arange(24).reshape(2, 12), "actions": np.zeros((2, 12), int),
         "rewards": np.zeros((2, 12), int), "goal_ids": np.array([3, 4])}  # fmt: skip
    out = subsample_episodes(h, every=2, horizon=2)  # 6 episodes of 2 steps per history
    assert out["states"].tolist()[:2] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    assert out["goal_ids"].tolist() == [3, 3, 4, 4]
    assert subsample_episodes(h, every=1, horizon=2) is h


def stored_histories(folder, cfg):
    """Histories of `cfg` stored as two ranks store them: each its shard (and checksum),
    then rank 0 the metadata, once every shard is written (the barrier)."""
    from freetx.data.darkroom import histories_cache
    from freetx.envs import history_shard

    cache = histories_cache(folder, ENV, cfg)
    for rank in (1, 0):
        cache.build(rank, 2, lambda r=rank: history_shard(r, 2, ENV, cfg), {"kind": "test"},
                    barrier=lambda: None)  # fmt: skip
        assert cache.complete() == (rank == 0)
    return cache


def test_stored_histories_round_trip_and_a_damaged_shard_is_named(tmp_path):
    from freetx.data.darkroom import load_histories
    from freetx.errors import DataError

    cfg = HistoryConfig(streams_per_goal=1, episodes=2)
    cache = stored_histories(tmp_path, cfg)
    loaded = load_histories(cache)
    assert loaded["goal_ids"].tolist() == list(range(65))
    expected = learning_histories(np.arange(65), goal_split(ENV).train, ENV, cfg)
    assert np.array_equal(loaded["actions"], expected["actions"])
    assert cache.folder.name.startswith("darkroom_ad_")  # named by a hash of the settings

    shard = cache.folder / "shard_00001.safetensors"
    for damage in (lambda: flip_byte(shard), lambda: shard.write_bytes(shard.read_bytes()[:100])):
        damage()
        with pytest.raises(DataError) as error:
            load_histories(cache)
        assert " ".join(str(error.value).split()) == (
            f"data cache {cache.folder}: shard_00001.safetensors is damaged: its bytes differ "
            "from what was saved (its checksum in metadata.json does not match), and reading it "
            "would give corrupted data to train and evaluate on. Delete that folder and run "
            "again: it is made again. If it happens again, check the disk."
        )
    shard.unlink()
    with pytest.raises(DataError, match="cannot be read"):
        load_histories(cache)


def test_histories_stored_without_checksums_are_made_again(tmp_path, capsys):
    import json

    from freetx.data.darkroom import load_histories

    cfg = HistoryConfig(streams_per_goal=1, episodes=2)
    cache = stored_histories(tmp_path, cfg)
    metadata = cache.folder / "metadata.json"
    made = json.loads(metadata.read_text())
    del made["checksums"]  # as an earlier freetx wrote it
    metadata.write_text(json.dumps(made))
    assert not cache.complete()
    capsys.readouterr()
    cache = stored_histories(tmp_path, cfg)
    assert "was made by an earlier freetx, without checksums; making it again" in " ".join(
        capsys.readouterr().err.split()
    )
    assert load_histories(cache)["goal_ids"].tolist() == list(range(65))


def test_an_interrupted_cache_is_not_complete(tmp_path):
    from freetx.data import ShardCache

    cache = ShardCache.for_settings(tmp_path, "x", {"a": 1})
    assert cache.folder != ShardCache.for_settings(tmp_path, "x", {"a": 2}).folder

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.build(0, 1, interrupted, {}, barrier=lambda: None)
    assert not cache.complete()


def test_backward_replay_goes_back_to_a_goal_the_episode_after_finding_it():
    """Episodic backward update: with no exploration noise, an episode that ends on the
    goal is followed by one that reaches it again (the reward propagated along the path)."""
    train = goal_split(ENV).train
    cfg = HistoryConfig(streams_per_goal=2, episodes=30, learning_rate=1.0, initial_q=0.5,
                        epsilon_start=0.0, epsilon_end=0.0, backward_replay=True)  # fmt: skip
    h = learning_histories(np.arange(20), train[:20], ENV, cfg)
    returns = h["rewards"].reshape(40, 30, 20).sum(-1)
    found = returns[:, :-1] > 0
    assert found.sum() > 20
    assert (returns[:, 1:][found] > 0).all()
    plain = learning_histories(
        np.arange(20), train[:20], ENV, HistoryConfig(**{**cfg.__dict__, "backward_replay": False})
    )
    plain_returns = plain["rewards"].reshape(40, 30, 20).sum(-1)
    assert returns[:, 10:20].mean() > 1.3 * plain_returns[:, 10:20].mean()  # 8.3 vs 5.4
