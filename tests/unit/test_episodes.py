"""Multi-turn episodes (freetx.objectives.episodes) and what they stand on: tool schemas,
tool calls parsed per template family, the built-in environments, token in / token out
through a history-rewriting template, masks, deadlines, async environments, metrics."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from omegaconf import OmegaConf

from freetx.data import ByteTokenizer, ChatDataset, PromptBatch, PromptDataset, RolloutBatch
from freetx.data.batch import IGNORE_INDEX
from freetx.envs import Calculator, GuessingGame, TextDarkRoom, Turn
from freetx.envs.tools import ToolCall, parse_tool_calls, tool_format, tool_result, tool_schema
from freetx.errors import ConfigError
from freetx.models import generation as generation_module
from freetx.models.engine import EngineConfig
from freetx.models.generation import Generated, Sampling
from freetx.models.transformer import decoder
from freetx.objectives import episodes as episodes_module
from freetx.objectives.episodes import EpisodeError, EpisodeRunner, build_environment
from freetx.objectives.rewards import build_rewards
from freetx.objectives.rollouts import episode_means, episode_sums

# -- tools ------------------------------------------------------------------------------


def lookup(city: str, days: int = 1, units: str | None = None) -> str:
    """Look up the weather of a city.

    Args:
        city: the city's name
        days (int): how many days ahead,
            counted from today
        units: metric or imperial
    """
    return f"{city}: sunny for {days}"


def test_a_tool_schema_comes_from_its_signature_and_docstring():
    schema = tool_schema(lookup)["function"]
    assert schema["name"] == "lookup"
    assert schema["description"] == "Look up the weather of a city."
    properties = schema["parameters"]["properties"]
    assert properties["city"] == {"type": "string", "description": "the city's name"}
    assert properties["days"]["type"] == "integer"
    assert properties["days"]["description"] == "how many days ahead, counted from today"
    assert properties["units"]["nullable"] is True
    assert schema["parameters"]["required"] == ["city"]


def test_a_tool_without_a_docstring_or_a_described_argument_is_refused():
    def bare(x: int) -> int:
        return x

    def undescribed(x: int) -> int:
        """Does a thing.

        Args:
            y: not x
        """
        return x

    with pytest.raises(ConfigError, match="no docstring"):
        tool_schema(bare)
    with pytest.raises(ConfigError, match="argument x is not described"):
        tool_schema(undescribed)


def test_tool_calls_parse_in_each_family_and_malformed_calls_say_why():
    hermes = 'sure <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert parse_tool_calls(hermes, "hermes") == [ToolCall("f", {"a": 1}), ToolCall("g", {})]
    assert parse_tool_calls("no call here", "hermes") == []
    broken = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', "hermes")
    assert broken[0].name is None and "is not JSON" in broken[0].error
    cut = parse_tool_calls('<tool_call>{"name": "f"', "hermes")  # a reply cut mid-call
    assert cut[0].error is not None
    nameless = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', "hermes")
    assert "with a name" in nameless[0].error

    llama = '<|python_tag|>{"name": "f", "parameters": {"a": 2}}'
    assert parse_tool_calls(llama, "llama3") == [ToolCall("f", {"a": 2})]
    assert parse_tool_calls('{"name": "f", "parameters": {}}', "llama3") == [ToolCall("f", {})]
    assert parse_tool_calls("The answer is 4.", "llama3") == []

    mistral = '[TOOL_CALLS][{"name": "f", "arguments": {"a": 3}}, {"name": "g", "arguments": "{}"}]'
    assert parse_tool_calls(mistral, "mistral") == [ToolCall("f", {"a": 3}), ToolCall("g", {})]
    v11 = '[TOOL_CALLS]f[ARGS]{"a": 4}[TOOL_CALLS]g[ARGS]{}'
    assert parse_tool_calls(v11, "mistral") == [ToolCall("f", {"a": 4}), ToolCall("g", {})]
    assert parse_tool_calls("[TOOL_CALLS]f[ARGS]{oops", "mistral")[0].error is not None


def test_the_tool_format_is_the_templates_family_and_others_are_refused_by_name():
    assert tool_format("{{ '<tool_call>' }}") == "hermes"
    assert tool_format("[TOOL_CALLS] {{ x }}") == "mistral"
    assert tool_format("<|python_tag|>") == "llama3"
    assert tool_format("anything", "llama3") == "llama3"
    with pytest.raises(ConfigError, match="DeepSeek"):
        tool_format("<｜tool▁calls▁begin｜>")
    with pytest.raises(ConfigError, match="writes no tool calls"):
        tool_format("{{ messages }}")
    with pytest.raises(ConfigError, match="none of hermes"):
        tool_format("x", "json")


def test_a_failing_call_is_answered_with_an_error_and_counted():
    tools = {"lookup": lookup, "boom": lambda: 1 / 0}

    def run(f, **kw):
        return f(**kw)

    assert tool_result(ToolCall("lookup", {"city": "Oslo"}), tools, run) == (
        "Oslo: sunny for 1",
        False,
    )
    text, failed = tool_result(ToolCall("nope", {}), tools, run)
    assert failed and "no tool 'nope'" in text and "lookup" in text
    text, failed = tool_result(ToolCall("lookup", {"town": "Oslo"}), tools, run)
    assert failed and "cannot take these arguments" in text
    text, failed = tool_result(ToolCall("boom", {}), tools, run)
    assert failed and "ZeroDivisionError" in text
    text, failed = tool_result(ToolCall(None, None, "the tool call 'x' is not JSON"), tools, run)
    assert failed and text.startswith("Error: the tool call")


# -- the built-in environments ----------------------------------------------------------


def test_the_calculator_works_out_expressions_and_nothing_else():
    calc = Calculator()
    assert calc.calculate("37*48") == "1776"
    assert calc.calculate("(1+2)/4") == "0.75"
    with pytest.raises(ValueError, match="only numbers"):
        calc.calculate("__import__('os')")
    row = calc.rows(1, 0)[0]
    a, b = row["prompt"].removeprefix("What is ").removesuffix("?").split("*")
    assert row["answer"] == str(int(a) * int(b))


def test_the_guessing_game_says_higher_or_lower_and_rewards_the_right_guess():
    game, row = GuessingGame(), {"secret": 9}
    talk = [{"role": "user", "content": game.question(0)}]
    assert (
        game.step([*talk, {"role": "assistant", "content": "4"}], row).messages[0]["content"]
        == "higher"
    )
    assert (
        game.step([*talk, {"role": "assistant", "content": "12"}], row).messages[0]["content"]
        == "lower"
    )
    assert game.step([*talk, {"role": "assistant", "content": "pass"}], row).done is False
    assert game.step([*talk, {"role": "assistant", "content": "9"}], row) == Turn([], 1.0, True)
    for talk in game.demonstrations(20, 0):  # legal play: each guess within the bounds said
        assert talk[-1]["role"] == "assistant"


def test_dark_room_as_text_replays_the_moves_and_pays_on_the_goal():
    room = TextDarkRoom(grid_size=5, horizon=3)
    row = {"goal_x": 3, "goal_y": 2}
    talk = room.reset([{"role": "user", "content": room.question(0)}], row)
    assert talk[0]["content"].endswith(" 2,2")
    talk.append({"role": "assistant", "content": "right"})
    turn = room.step(talk, row)
    assert turn.reward == 1.0 and turn.messages == [{"role": "user", "content": "3,2 +1"}]
    talk += [*turn.messages, {"role": "assistant", "content": "stay"}]
    assert room.step(talk, row).reward == 1.0
    talk += [{"role": "user", "content": "3,2"}, {"role": "assistant", "content": "jump"}]
    last = room.step(talk, row)  # an unknown word stays; the horizon ends it
    assert last.done and last.reward == 1.0
    assert 0 < room.random_return(room.rows(50, 0)) < 1


def test_the_builtin_sft_data_renders_tool_calls_and_the_tools_with_the_byte_template():
    tok = ByteTokenizer(chat_template="turns")
    data = ChatDataset(
        tok,
        source="builtin",
        seq_len=160,
        tasks=["calculator"],
        num_builtin_examples=40,
        cache=False,
    )
    texts = [tok.decode(data[i]["input_ids"], keep_special=True) for i in range(len(data))]
    called = [t for t in texts if "<tool_call>" in t]
    assert called and len(called) < len(texts)  # some demonstrations call, some answer
    assert all(t.startswith("Tools: calculate(expression)\nQ: What is ") for t in texts)
    sample = data[texts.index(called[0])]
    target = tok.decode(
        [i for i in sample["labels"].tolist() if i != IGNORE_INDEX], keep_special=True
    )
    assert target.startswith('<tool_call>{"name": "calculate", "arguments": {"expression": ')
    assert "R: " not in target  # the tool's result is not the model's to learn
    prompts = PromptDataset(tok, source="builtin", tasks=["guess"], num_builtin_examples=8)
    assert {"secret", "task"} <= set(prompts[0]["fields"])


def test_byte_tokens_spell_their_special_tokens_as_transformers_reads_them():
    tok = ByteTokenizer()
    assert tok.encode("a<|eos|>b") == [97, tok.eos_id, 98]
    assert tok.decode([97, tok.eos_id]) == "a"
    assert tok.decode([97, tok.eos_id], keep_special=True) == "a<|eos|>"
    ids, offsets = tok.encode_with_offsets("é<|eos|>")
    assert ids == [0xC3, 0xA9, tok.eos_id] and offsets == [(0, 1), (0, 1), (1, 8)]


# -- episodes ---------------------------------------------------------------------------

# a template that rewrites history, as Qwen3's does: an earlier reply loses its reasoning,
# and the conversation's last message, a reply, gets an empty <think> block
REWRITING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.role == 'user' %}{{ 'U: ' + m.content + '\\n' }}"
    "{% elif m.role == 'tool' %}{{ 'T: ' + m.content + '\\n' }}"
    "{% elif m.role == 'assistant' %}{{ 'A: ' }}"
    "{% if loop.last and '<think>' not in m.content %}<think></think>{% endif %}"
    "{% if loop.index0 < ns.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{{ eos_token + '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
)


class Scripted:
    """Stands in for `generate`: each row's reply by the row's text (its prompt and turns so
    far), from `script` (text -> reply text); records what it sampled."""

    def __init__(self, tok, script):
        self.tok, self.script, self.sampled = tok, script, []

    def __call__(self, model, rows, max_new_tokens, sampling, end_ids, draws, engine=None):
        replies = []
        for row in rows:
            text = self.tok.decode(row, keep_special=True)
            reply = next(r for key, r in self.script if text.endswith(key))
            replies.append(self.tok.encode(reply)[:max_new_tokens])
        width = max(len(r) for r in replies)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for i, reply in enumerate(replies):
            tokens[i, : len(reply)] = torch.tensor(reply)
        self.sampled.append(replies)
        lengths = torch.tensor([len(r) for r in replies])
        ended = torch.tensor([r[-1] in end_ids for r in replies])
        return Generated(tokens, lengths, ended, torch.full((len(rows), width), 0.5))


def prompts(*rows):
    """A PromptBatch of (prompt, fields) rows."""
    return PromptBatch(
        [[1]] * len(rows),
        [p for p, _ in rows],
        [f for _, f in rows],
        [f"row {i}" for i in range(len(rows))],
        [False] * len(rows),
        [None] * len(rows),
    )


def runner(tok, env_node, tools=(), rewards=(), max_new=64, **limits):
    env, found, settings = build_environment(OmegaConf.create({**env_node, **limits}), list(tools))
    built = build_rewards(list(rewards), required=False)
    return EpisodeRunner(tok, env, found, settings, built, [tok.eos_id], max_new)


def test_the_trained_tokens_are_the_sampled_ones_through_a_history_rewriting_template(monkeypatch):
    tok = ByteTokenizer(chat_template=REWRITING)
    think = "<think>12*3 is 36</think>"
    script = Scripted(
        tok,
        [
            (
                "U: What is 12*3?\nA: ",
                think
                + '<tool_call>{"name": "calculate", "arguments": {"expression": "12*3"}}</tool_call><|eos|>',
            ),
            ("T: 36\nA: ", "36<|eos|>"),
        ],
    )
    monkeypatch.setattr(generation_module, "generate", script)
    run = runner(
        tok,
        {"_component_": "freetx.envs.Calculator"},
        rewards=[{"_component_": "freetx.objectives.ExactMatch", "answer_field": "answer"}],
        max_new=128,
        max_turns=3,
        tool_format="hermes",
    )
    batch = prompts(("What is 12*3?", {"answer": "36"}))
    out = run.generate(None, batch, 2, Sampling(1.0), ["k0", "k1"])
    done = run.score(out, batch, 2)
    assert done.raw.tolist() == [[1.0, 0.0], [1.0, 0.0]]  # exact_match, env
    episode = out[0]
    assert episode.turns == 2 and episode.tool_calls == 1 and episode.tool_errors == 0
    call_id = episode.messages[1]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()  # Mistral's templates ask 9 of them
    tool = {"role": "tool", "name": "calculate", "tool_call_id": call_id, "content": "36"}
    assert episode.messages[2] == tool

    rows = RolloutBatch.of_rollouts(
        done.prompt_ids, done.tokens, torch.zeros(2), trained=done.trained
    )
    labels = rows.labels[0][rows.labels[0] != IGNORE_INDEX].tolist()
    sampled = [t for turn in script.sampled for t in turn[0]]
    assert labels == sampled  # exactly the sampled ids, the end tokens included
    # the whole conversation re-rendered drops the first reply's reasoning: other tokens
    whole = tok.encode(tok.apply_chat_template(episode.messages, tools=run.schemas))
    assert think not in tok.decode(whole, keep_special=True)
    assert think in tok.decode(episode.prompt_ids + episode.tokens, keep_special=True)
    # the environment's tokens: the tool result and the next header, no loss on them
    between = [t for t, k in zip(episode.tokens, episode.trained) if not k]
    assert tok.decode(between, keep_special=True) == "\nT: 36\nA: "


def test_an_episode_stops_at_max_turns_and_at_max_tokens(monkeypatch):
    tok = ByteTokenizer(chat_template="turns")
    script = Scripted(tok, [("A: ", "8<|eos|>")])  # always 8: never right for secret 3
    monkeypatch.setattr(generation_module, "generate", script)
    run = runner(
        tok, {"_component_": "freetx.envs.GuessingGame"}, max_turns=3, max_new=4, max_tokens=512
    )
    batch = prompts(
        ("Guess my number from 1 to 16.", {"secret": 3}),
        ("Guess my number from 1 to 16.", {"secret": 8}),
    )
    out = run.generate(None, batch, 1, Sampling(1.0), ["a", "b"])
    assert [e.turns for e in out] == [3, 1] and [e.cut for e in out] == ["max_turns", None]
    assert [e.reward for e in out] == [0.0, 1.0]
    means = episode_means(episode_sums(list(out)), len(out))
    assert means["episodes/mean_turns"] == 2.0 and means["episodes/cut_max_turns"] == 0.5

    short = runner(
        tok, {"_component_": "freetx.envs.GuessingGame"}, max_turns=9, max_new=4, max_tokens=60
    )
    one = prompts(("Guess my number from 1 to 16.", {"secret": 3}))
    out = short.generate(None, one, 1, Sampling(1.0), ["a"])
    assert out[0].cut == "max_tokens" and out[0].length <= 60  # no row past max_tokens


class Hangs:
    def reset(self, messages, row):
        return messages

    def step(self, messages, row):
        threading.Event().wait(30)
        return Turn(done=True)


class Forgets(Hangs):
    def reset(self, messages, row):
        messages.append({"role": "user", "content": "go"})  # returns nothing


class Breaks(Hangs):
    def step(self, messages, row):
        raise KeyError("goal")


class Slow(Hangs):
    """An async environment: its steps wait side by side."""

    async def step(self, messages, row):
        await asyncio.sleep(0.3)
        return Turn(reward=float(row["secret"]), done=True)


def test_a_hung_or_broken_environment_is_named_with_its_row_and_turn(monkeypatch):
    monkeypatch.setenv("FREETX_TRUST", "tests.unit.test_episodes")  # the user's own code
    tok = ByteTokenizer(chat_template="turns")
    monkeypatch.setattr(generation_module, "generate", Scripted(tok, [("A: ", "5<|eos|>")]))
    batch = prompts(("Guess.", {"secret": 1}))
    hung = runner(tok, {"_component_": "tests.unit.test_episodes.Hangs"}, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(
        EpisodeError, match=r"env.step on row 0 \(turn 0\) did not return within env.timeout_s=0.3"
    ):
        hung.generate(None, batch, 1, Sampling(1.0), ["a"])
    assert time.monotonic() - started < 10
    forgets = runner(tok, {"_component_": "tests.unit.test_episodes.Forgets"})
    with pytest.raises(EpisodeError, match=r"env.reset on row 0 returned None, not a list"):
        forgets.generate(None, batch, 1, Sampling(1.0), ["a"])
    broken = runner(tok, {"_component_": "tests.unit.test_episodes.Breaks"})
    with pytest.raises(EpisodeError, match=r"env.step on row 0 \(turn 0\) failed: KeyError"):
        broken.generate(None, batch, 1, Sampling(1.0), ["a"])


def test_async_environment_steps_run_side_by_side(monkeypatch):
    monkeypatch.setenv("FREETX_TRUST", "tests.unit.test_episodes")
    tok = ByteTokenizer(chat_template="turns")
    monkeypatch.setattr(generation_module, "generate", Scripted(tok, [("A: ", "5<|eos|>")]))
    run = runner(tok, {"_component_": "tests.unit.test_episodes.Slow"})
    batch = prompts(*[("Guess.", {"secret": i}) for i in range(8)])
    started = time.monotonic()
    out = run.generate(None, batch, 1, Sampling(1.0), [str(i) for i in range(8)])
    assert time.monotonic() - started < 8 * 0.3  # not one after another
    assert [e.reward for e in out] == [float(i) for i in range(8)]
    assert out.environment_s > 0


class Staggered:
    """A `Decoder` that joins requests as they come and ends one request a step, the one
    added first, after waiting (up to 10 s) for the environment to have answered every
    reply it ended before: what it records is the order of its events."""

    joins_running = True

    def __init__(self, tok, env):
        self.tok, self.env, self.waiting, self.replies, self.events = tok, env, [], {}, []
        self.requests = self.ended = 0

    def add(self, prompt, uniforms):
        self.events.append(("add", self.requests, len(self.waiting)))  # how many decode
        self.waiting.append(self.requests)
        self.requests += 1
        return self.requests - 1

    @property
    def busy(self):
        return bool(self.waiting)

    def step(self):
        deadline = time.monotonic() + 10
        while self.env.steps < self.ended and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # the answered call's future is done too
        request = self.waiting.pop(0)
        self.replies[request] = (self.tok.encode("4<|eos|>"), True, 0.0)
        self.ended += 1
        return [request]

    def reply(self, request):
        return self.replies.pop(request)


class Counted(GuessingGame):
    steps = 0

    def step(self, messages, row):
        Counted.steps += 1
        return super().step(messages, row)


def test_a_next_turn_joins_the_engine_while_other_episodes_decode(monkeypatch):
    monkeypatch.setenv("FREETX_TRUST", "tests.unit.test_episodes")
    tok = ByteTokenizer(chat_template="turns")
    run = runner(tok, {"_component_": "tests.unit.test_episodes.Counted"}, max_turns=2)
    Counted.steps = 0
    staggered = Staggered(tok, Counted)
    monkeypatch.setattr(episodes_module, "decoder", lambda *args: staggered)
    batch = prompts(*[("Guess.", {"secret": 9}) for _ in range(4)])
    out = run.generate(None, batch, 1, Sampling(1.0), [str(i) for i in range(4)])
    assert [e.turns for e in out] == [2, 2, 2, 2] and Counted.steps == 8
    # episode 0's second turn was asked for while others still decoded their first (3 or 2
    # of them, as the thread pool is quick; a turn of every episode at a time: none)
    event, request, decoding = staggered.events[4]
    assert (event, request) == ("add", 4) and decoding >= 1, staggered.events


def test_episodes_on_the_engine_are_the_same_at_any_slot_count_and_on_the_static_batch():
    torch.manual_seed(0)
    model = decoder(preset="tiny", vocab_size=259, max_seq_len=256).eval()
    tok = ByteTokenizer(chat_template="turns")
    batch = prompts(*[(f"Game {i}: guess.", {"secret": 3 + i}) for i in range(3)])
    made = []
    for engine in (EngineConfig(), EngineConfig(slots=2, block_size=4), EngineConfig(paged=False)):
        env, found, limits = build_environment(
            OmegaConf.create(
                {"_component_": "freetx.envs.GuessingGame", "max_turns": 3, "max_tokens": 256}
            ),
            [],
        )
        run = EpisodeRunner(tok, env, found, limits, [], [tok.eos_id], 12, engine=engine)
        out = run.generate(model, batch, 2, Sampling(1.0), [f"k{i}" for i in range(6)])
        made.append([(e.tokens, e.trained, e.messages, e.turns) for e in out])
    assert made[0] == made[1] == made[2]
    assert max(turns for *_, turns in made[0]) > 1  # the environment answered, turns went on


def test_environments_and_tools_are_checked_before_a_run():
    with pytest.raises(ConfigError, match="no language environment"):
        build_environment(OmegaConf.create({"_component_": "freetx.data.ByteTokenizer"}), [])
    with pytest.raises(ConfigError, match="env.max_turns=0"):
        build_environment(
            OmegaConf.create({"_component_": "freetx.envs.GuessingGame", "max_turns": 0}), []
        )
    env, tools, limits = build_environment(
        OmegaConf.create({"_component_": "freetx.envs.Calculator"}), []
    )
    assert list(tools) == ["calculate"] and limits.max_turns == 4
    with pytest.raises(ConfigError, match="no chat template"):
        EpisodeRunner(ByteTokenizer(), env, tools, limits, [], [257], 8)


def test_an_hf_templates_tool_turn_follows_the_reply_as_its_suffix(tmp_path):
    """A tool's result after a reply, in an HF folder's template that renders tools (Hermes
    calls with Llama 3's headers): exactly the turn the template writes, then the header
    of the next reply; a reply cut before its end token gets the end token first."""
    from freetx.data import HFTokenizer
    from freetx.data.chat import continuation_ids
    from freetx.data.corpus import builtin_documents
    from tests.hf_folders import TOOLS_TEMPLATE, make_tokenizer

    make_tokenizer(tmp_path, builtin_documents()[:20], TOOLS_TEMPLATE)
    tok = HFTokenizer(str(tmp_path))
    assert tool_format(tok.chat_template) == "hermes"
    schemas = [tool_schema(Calculator().calculate)]
    call = {
        "type": "function",
        "function": {"name": "calculate", "arguments": {"expression": "6*6"}},
    }
    reply = {"role": "assistant", "content": "", "tool_calls": [call]}
    new = [{"role": "tool", "name": "calculate", "content": "36"}]
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    turn = "<|start_header_id|>tool<|end_header_id|>\n\n<tool_response>\n36\n</tool_response><|eot_id|>"
    ended = continuation_ids(tok, reply, new, [5, tok.eos_id], True, schemas)
    assert tok.decode(ended, keep_special=True) == turn + header
    cut = continuation_ids(tok, reply, new, [5, 6], False, schemas)
    assert tok.decode(cut, keep_special=True) == "<|eot_id|>" + turn + header


class Broken:
    """An environment whose tool raises or hangs."""

    def reset(self, messages, row):
        return messages

    def step(self, messages, row):
        return Turn(done=True)

    def tools(self):
        return [self.divide, self.wait]

    def divide(self, a: int) -> str:
        """Divide by zero.

        Args:
            a: a number
        """
        return str(a / 0)

    def wait(self) -> str:
        """Never return."""
        threading.Event().wait(30)
        return ""


def test_a_tool_that_raises_is_the_models_to_read_and_one_that_hangs_stops_the_run(monkeypatch):
    monkeypatch.setenv("FREETX_TRUST", "tests.unit.test_episodes")
    tok = ByteTokenizer(chat_template="turns")
    divide = '<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call><|eos|>'
    script = Scripted(tok, [("Q: Go.\nA: ", divide), ("A: ", "done<|eos|>")])
    monkeypatch.setattr(generation_module, "generate", script)
    run = runner(tok, {"_component_": "tests.unit.test_episodes.Broken"}, max_new=96, timeout_s=0.3)
    out = run.generate(None, prompts(("Go.", {})), 1, Sampling(1.0), ["a"])
    assert out[0].tool_errors == 1 and out[0].turns == 2
    assert (
        out[0].messages[2]["content"] == "Error: divide raised ZeroDivisionError: division by zero"
    )
    wait = '<tool_call>{"name": "wait", "arguments": {}}</tool_call><|eos|>'
    monkeypatch.setattr(generation_module, "generate", Scripted(tok, [("A: ", wait)]))
    with pytest.raises(EpisodeError, match=r"tool wait on row 0 \(turn 0\) did not return"):
        run.generate(None, prompts(("Go.", {})), 1, Sampling(1.0), ["a"])
