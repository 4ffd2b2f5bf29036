"""HFTokenizer on model folders (special tokens, chat templates) and ChatDataset, checked
against transformers on tiny tokenizer folders built here (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from freetx.data import IGNORE_INDEX, ByteTokenizer, ChatDataset, HFTokenizer, encoded_text
from freetx.errors import DataError

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
LLAMA3_SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PHI3_SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
GEMMA_SPECIALS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]

# Llama 3.1's template without its tool calling.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Unknown role: " + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen2.5's ChatML template without its tool calling.
CHATML_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Phi-3.5-mini-instruct's (Phi-3-mini's and Phi-4-mini's differ in whitespace): EOS only at
# the end of a conversation, not after every reply
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# Gemma 3's, for text content: the system message prefixes the first user turn, roles
# alternate, the assistant is "model"
GEMMA_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"""

# Qwen3's without its tool calling: a reply's reasoning (<think>...</think> in its content)
# is kept after the last user message and dropped from earlier replies
QWEN3_TEMPLATE = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system
' + messages[0].content + '<|im_end|>
' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '
' + content + '<|im_end|>' + '
' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('
').split('<think>')[-1].lstrip('
') %}
            {%- set content = content.split('</think>')[-1].lstrip('
') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '
<think>
' + reasoning_content.strip('
') + '
</think>

' + content.lstrip('
') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '
' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '
' + content }}
        {%- endif %}
        {{- '<|im_end|>
' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant
' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>

</think>

' }}
    {%- endif %}
{%- endif %}
"""

SYSTEM = {"role": "system", "content": "You are a terse cat."}
CONVERSATIONS = [
    [
        SYSTEM,
        {"role": "user", "content": "Where is the cat?"},
        {"role": "assistant", "content": "On the mat."},
    ],
    [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hello, user!"},
        {"role": "user", "content": "And the dog?"},
        {"role": "assistant", "content": "The dog sat\n\non the log, café <b>ok</b>."},
    ],
    [
        SYSTEM,
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four five"},
    ],
]
STYLES = ["llama3", "chatml", "phi3", "gemma", "qwen3"]
# what closes a reply, for the templates that render a reply the same wherever it is
END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "phi3": "<|end|>",
               "gemma": "<end_of_turn>"}  # fmt: skip


@pytest.fixture(scope="module")
def base_tokenizer():
    """A tiny byte-level BPE with both families' special tokens as added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=LLAMA3_SPECIALS + CHATML_SPECIALS + PHI3_SPECIALS + GEMMA_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [
        "You are a helpful assistant. The cat sat on the mat.",
        "user assistant system: where is the dog? Hello, hello!",
        "Cutting Knowledge Date: December 2023. Today Date:",
    ]
    tok.train_from_iterator(text, trainer)
    tok.add_tokens(["<think>", "</think>"])  # added tokens outside the model's vocabulary
    return tok


@pytest.fixture(scope="module")
def folders(base_tokenizer, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """style -> (folder written by transformers' save_pretrained, the transformers tokenizer)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    settings = {
        "llama3": dict(
            bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>"
        ),
        "chatml": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),  # no BOS, like Qwen2.5
        "phi3": dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>"),
        "gemma": dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
        "qwen3": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    }
    templates = {"llama3": LLAMA3_TEMPLATE, "chatml": CHATML_TEMPLATE, "phi3": PHI3_TEMPLATE,
                 "gemma": GEMMA_TEMPLATE, "qwen3": QWEN3_TEMPLATE}  # fmt: skip
    made = {}
    for style in STYLES:
        copy = Tokenizer.from_str(base_tokenizer.to_str())
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=copy, **settings[style])
        fast.chat_template = templates[style]
        folder = tmp_path_factory.mktemp(style)
        fast.save_pretrained(folder)
        made[style] = (folder, fast)
    return made


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def supervised_runs(sample: dict[str, torch.Tensor]) -> list[list[int]]:
    """The label ids that count in the loss, as runs of consecutive positions."""
    runs, previous = [], False
    for label in sample["labels"].tolist():
        supervised = label != IGNORE_INDEX
        if supervised and not previous:
            runs.append([])
        if supervised:
            runs[-1].append(label)
        previous = supervised
    return runs


def test_transformers_writes_the_template_to_its_own_file(folders):
    folder, _ = folders["llama3"]
    assert (folder / "chat_template.jinja").read_text() == LLAMA3_TEMPLATE
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())


def test_a_tokenizer_records_the_files_it_read(folders):
    """Its identity in a run's checkpoints: the files that give the ids their meaning."""
    folder, _ = folders["llama3"]
    names = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert {p.name for p in HFTokenizer(str(folder)).files_read} == names
    assert HFTokenizer(str(folder / "tokenizer.json")).files_read == [folder / "tokenizer.json"]


@pytest.mark.parametrize("style", STYLES)
def test_folder_special_tokens_match_transformers(folders, style):
    folder, fast = folders[style]
    tok = HFTokenizer(str(folder))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        fast.bos_token_id,
        fast.eos_token_id,
        fast.pad_token_id,
    )
    assert tok.vocab_size == len(fast) == fast.vocab_size + 2  # counts <think> and </think>
    assert tok.chat_template == fast.chat_template
    # the folders' post-processor adds no BOS, even where one is named (llama3, gemma)
    assert not tok.add_bos_token and encoded_text(tok, "the cat") == fast("the cat").input_ids
    if style in ("chatml", "qwen3"):
        assert tok.bos_id is None and "bos_token" not in tok.special_tokens


def test_added_tokens_are_single_ids(folders):
    folder, fast = folders["chatml"]
    tok = HFTokenizer(str(folder))
    for token in LLAMA3_SPECIALS + CHATML_SPECIALS + ["<think>", "</think>"]:
        assert tok.encode(token) == [fast.convert_tokens_to_ids(token)]
    ids = tok.encode("<|im_start|>user\nthe cat<|im_end|>")
    assert ids[0] == fast.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tok.eos_id and ids == fast.encode("<|im_start|>user\nthe cat<|im_end|>")


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["system", "multi-turn", "long"])
def test_rendering_matches_transformers(folders, style, generation_prompt, messages):
    folder, fast = folders[style]
    tok = HFTokenizer(str(folder))
    expected = fast.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True)
    assert expected.startswith(prompt)


def test_tojson_and_raise_exception_behave_like_transformers(folders):
    folder, fast = folders["llama3"]
    template = "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}"
    messages = CONVERSATIONS[1]
    tok = HFTokenizer(str(folder))
    tok.chat_template = template
    expected = fast.apply_chat_template(messages, tokenize=False, chat_template=template)
    assert tok.apply_chat_template(messages) == expected and "café <b>" in expected
    tok = HFTokenizer(str(folder))
    with pytest.raises(DataError, match="Unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def supervised_replies(folders, base_tokenizer, style, conversations, path) -> list[list[str]]:
    """Each conversation's supervised text, reply by reply, checking that its ids are
    transformers' `apply_chat_template(messages, tokenize=True)`."""
    folder, fast = folders[style]
    source = write_jsonl(path, [{"messages": m} for m in conversations])
    # the whole source is training (validation_source: the validation split's own)
    data = ChatDataset(HFTokenizer(str(folder)), source, seq_len=256, validation_source=source)
    assert len(data) == len(conversations)
    replies = []
    for index, messages in enumerate(conversations):
        expected = fast.apply_chat_template(messages, tokenize=True)["input_ids"]
        ids, _ = data.rows[index]
        assert ids == expected
        sample = data[index]
        assert sample["input_ids"][: len(ids) - 1].tolist() == ids[:-1]
        runs = supervised_runs(sample)
        replies.append([base_tokenizer.decode(run, skip_special_tokens=False) for run in runs])
    return replies


@pytest.mark.parametrize("style", list(END_OF_TURN))
def test_chat_ids_match_transformers_and_only_replies_are_supervised(
    folders, base_tokenizer, style, tmp_path
):
    """Each reply and its end of turn, never the header before it nor what follows it
    (Phi-3's template ends a conversation with <|endoftext|>, which is no reply's)."""
    found = supervised_replies(folders, base_tokenizer, style, CONVERSATIONS, tmp_path / "c.jsonl")
    for messages, decoded in zip(CONVERSATIONS, found):
        replies = [m["content"] + END_OF_TURN[style] for m in messages if m["role"] == "assistant"]
        assert decoded == replies


def test_qwen3_replies_are_supervised_as_the_template_renders_them(
    folders, base_tokenizer, tmp_path
):
    """A reply's reasoning is learned where the template keeps it (after the last user
    message); an earlier reply, whose reasoning the template drops, is learned without it."""
    conversations = [
        [{"role": "user", "content": "Where is the cat?"},
         {"role": "assistant", "content": "<think>\nCats sit.\n</think>\n\nOn the mat."}],
        [{"role": "user", "content": "hello"},
         {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello, user!"},
         {"role": "user", "content": "And the dog?"},
         {"role": "assistant", "content": "<think>\nDogs sit too.\n</think>\n\nOn the log."}],
        [SYSTEM, {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
         {"role": "user", "content": "three"}, {"role": "assistant", "content": "four"}],
    ]  # fmt: skip
    found = supervised_replies(
        folders, base_tokenizer, "qwen3", conversations, tmp_path / "q.jsonl"
    )
    assert found == [
        ["<think>\nCats sit.\n</think>\n\nOn the mat.<|im_end|>"],
        ["Hello, user!<|im_end|>", "<think>\nDogs sit too.\n</think>\n\nOn the log.<|im_end|>"],
        ["two<|im_end|>", "<think>\n\n</think>\n\nfour<|im_end|>"],
    ]


def test_truncation_and_padding(folders, tmp_path):
    folder, _ = folders["chatml"]
    tok = HFTokenizer(str(folder))
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    full = ChatDataset(tok, source, seq_len=200, validation_source=source)
    ids, is_reply = full.rows[0]
    sample = full[0]
    n = len(ids)
    assert sample["input_ids"].shape == sample["labels"].shape == (200,)
    assert sample["input_ids"][n:].tolist() == [tok.pad_id] * (200 - n)
    assert sample["labels"][n - 1 :].tolist() == [IGNORE_INDEX] * (201 - n)
    expected = [t if r else IGNORE_INDEX for t, r in zip(ids[1:], is_reply[1:])]
    assert sample["labels"][: n - 1].tolist() == expected

    cut = ChatDataset(tok, source, seq_len=n - 3, validation_source=source)[
        0
    ]  # cuts into the reply
    assert cut["input_ids"].tolist() == ids[: n - 3]
    assert cut["labels"].tolist() == expected[: n - 3]
    assert (cut["labels"] != IGNORE_INDEX).any()


def test_explicit_tokens_override_the_folder_and_a_bare_file_keeps_the_old_defaults(folders):
    folder, fast = folders["chatml"]
    tok = HFTokenizer(str(folder), bos_token="<|im_start|>", pad_token="<|im_end|>")
    assert tok.bos_id == fast.convert_tokens_to_ids("<|im_start|>") == tok.encode("<|im_start|>")[0]
    assert tok.pad_id == tok.eos_id and not tok.add_bos_token  # named, added by no one

    bare = HFTokenizer(path=str(folder / "tokenizer.json"))  # Llama 3's BOS/EOS by default
    assert bare.bos_id == fast.convert_tokens_to_ids("<|begin_of_text|>")
    assert bare.eos_id == bare.pad_id == fast.convert_tokens_to_ids("<|end_of_text|>")
    assert bare.chat_template is None and not bare.add_bos_token  # its post-processor's
    named = HFTokenizer(
        str(folder / "tokenizer.json"), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    assert (named.bos_id, named.eos_id) == (tok.bos_id, tok.eos_id)
    with pytest.raises(DataError, match=r"no token '<\|nope\|>' \(its eos_token\)"):
        HFTokenizer(str(folder), eos_token="<|nope|>")


def test_an_older_folder_with_the_template_in_its_config(base_tokenizer, tmp_path):
    """transformers 4 kept the template in tokenizer_config.json, tokens often as dicts."""
    base_tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(str(tmp_path))
    assert tok.bos_id is None and tok.eos_id == base_tokenizer.token_to_id("<|im_end|>")
    assert tok.pad_id == base_tokenizer.token_to_id("<|endoftext|>")
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.apply_chat_template(CONVERSATIONS[0][1:2], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhere is the cat?<|im_end|>\n<|im_start|>assistant\n"
    )
    transformers = pytest.importorskip("transformers")
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.apply_chat_template(CONVERSATIONS[1]) == fast.apply_chat_template(
        CONVERSATIONS[1], tokenize=False
    )


def test_a_folder_without_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(
        DataError, match=r"no tokenizer.json \(it has a sentencepiece tokenizer.model"
    ):
        HFTokenizer(str(tmp_path))
    with pytest.raises(DataError, match="does not exist"):
        HFTokenizer(str(tmp_path / "missing"))


def test_a_tokenizer_without_a_chat_template_says_how_to_fix_it(base_tokenizer, tmp_path):
    base_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = HFTokenizer(str(tmp_path))
    with pytest.raises(
        DataError, match="has no chat template.*chat_template.jinja.*InstructDataset"
    ):
        tok.apply_chat_template(CONVERSATIONS[0])
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    for tokenizer in (tok, ByteTokenizer()):
        with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
            ChatDataset(tokenizer, source, seq_len=32)


@pytest.fixture
def chatml(base_tokenizer, tmp_path) -> HFTokenizer:
    base_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return HFTokenizer(str(tmp_path))


GOOD = {"messages": CONVERSATIONS[0]}


@pytest.mark.parametrize(
    "lines, error",
    [
        (['{"messages": [', json.dumps(GOOD)], r"chat.jsonl:1 is not valid JSON"),
        ([json.dumps(GOOD), json.dumps({"text": "hi"})], r"chat.jsonl:2 has no 'messages' list"),
        (
            [json.dumps({"messages": [{"role": "user"}]})],
            r"chat.jsonl:1 has a message 0 .* 'content'",
        ),
        ([json.dumps({"messages": CONVERSATIONS[0][:2]})], r"chat.jsonl:1 has no assistant"),
        ([""], r"holds no rows"),
    ],
    ids=["not-json", "no-messages", "no-content", "no-assistant", "empty-file"],
)
def test_bad_records_name_the_line(chatml, tmp_path, lines, error):
    source = tmp_path / "chat.jsonl"
    source.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=error):
        ChatDataset(chatml, str(source), seq_len=32)


def test_a_missing_file_and_an_empty_split(chatml, tmp_path):
    with pytest.raises(DataError, match="data file .*nope.jsonl does not exist"):
        ChatDataset(chatml, str(tmp_path / "nope.jsonl"), seq_len=32)
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(DataError, match="the validation split of .* is empty"):
        ChatDataset(chatml, source, seq_len=32, split="validation")


def test_a_template_that_renders_prefixes_differently_names_the_record(chatml, tmp_path):
    # marks the last message, so a conversation's start renders differently on its own
    chatml.chat_template = (
        "{% for m in messages %}{{ m.role }}{{ '!' if loop.last }}: {{ m.content }}\n{% endfor %}"
    )
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(
        DataError, match=r"chat.jsonl:1 cannot be rendered: the chat template renders .* message 2"
    ):
        ChatDataset(chatml, source, seq_len=32)
