"""Tokenizers: bytes (no files needed) and Hugging Face tokenizers through `tokenizers`.

Every tokenizer has `vocab_size`, `bos_id`, `eos_id`, `pad_id`, `add_bos_token`,
`encode(text) -> list[int]` and `decode(ids) -> str`. `encode` adds no special
tokens: a caller that starts a text with BOS prepends `bos_id` itself, and only
when `add_bos_token` is true (`leading_bos`; a model without a BOS, like Qwen2.5, has
`bos_id=None` and `add_bos_token=False`). `add_eos_token` (false when absent) says
whether the tokenizer also ends a text with EOS; `encoded_text` is a text as
transformers' `tokenizer(text).input_ids` gives it. An HF folder's tokenizer adds
what its `tokenizer.json` post-processor adds, as transformers 5 does (`HFTokenizer`).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from freetx.errors import ConfigError, DataError

# The special tokens transformers hands to a chat template (as `bos_token`, ...).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# What a bare tokenizer.json uses when no tokens are named (Llama 3's).
# what a tokenizer folder holds that freetx reads (the identity a run records of it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_FILE_DEFAULTS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}


@runtime_checkable
class Tokenizer(Protocol):
    """What a `tokenizer:` node must build (the attributes above are set by its
    constructor, so only the methods can be checked on a class)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


def tokenizer_problem(built: Any, node: str = "tokenizer") -> str | None:
    """Why `built` (a class a node names, or the object it built) is no tokenizer, as one
    paragraph naming the node and what it built; None when it is one."""
    if isinstance(built, Tokenizer):
        return None
    what = built.__module__ + "." + built.__qualname__ if isinstance(built, type) else None
    what = what or f"a {type(built).__module__}.{type(built).__qualname__}"
    return (
        f"the `{node}` node builds {what}, which is not a tokenizer (it has no encode and "
        f"decode methods). Set {node}._component_ to freetx.data.ByteTokenizer, or to "
        f"freetx.data.HFTokenizer with {node}.path=MODEL_FOLDER (docs/data.md)."
    )


def checked_tokenizer(built: Any, node: str = "tokenizer") -> Tokenizer:
    """`built` (what the `node` node built), refused with one paragraph when it is no
    tokenizer."""
    problem = tokenizer_problem(built, node)
    if problem:
        raise ConfigError(problem)
    return built


def leading_bos(tokenizer) -> list[int]:
    """What a sequence starts with: [BOS] for tokenizers that add one, else nothing."""
    return [tokenizer.bos_id] if getattr(tokenizer, "add_bos_token", True) else []


def encoded_text(tokenizer, text: str) -> list[int]:
    """`text` as one whole input, as transformers' `tokenizer(text).input_ids` gives it:
    BOS before it and EOS after it where the tokenizer adds them (a prompt to continue,
    a text lm-eval scores)."""
    closing = [tokenizer.eos_id] if getattr(tokenizer, "add_eos_token", False) else []
    return [*leading_bos(tokenizer), *tokenizer.encode(text), *closing]


@runtime_checkable
class HasHFForm(Protocol):
    """A tokenizer that can write itself as transformers' tokenizer files (an HF export of
    a model trained with it then loads with AutoTokenizer)."""

    def hf_files(self) -> dict[str, str]:
        """File name -> text: tokenizer.json, tokenizer_config.json."""
        ...

    def special_ids(self) -> dict[str, int]:
        """bos_token_id, eos_token_id, pad_token_id (for config.json and
        generation_config.json)."""
        ...


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what a ByteLevel pre-tokenizer maps to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# freetx's chat template for byte models (`ByteTokenizer(chat_template="turns")`): a
# line per message, `Q:` the user, `A:` the assistant (its turn closed by EOS), `R:` a
# tool's result; tools listed on the first line, calls as Hermes's <tool_call> JSON
TURNS_TEMPLATE = (
    "{% if tools %}Tools: {% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties | join(', ') }}){% if not loop.last %}; {% endif %}"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content + '\\n' }}"
    "{% elif m.role == 'user' %}{{ 'Q: ' + m.content + '\\n' }}"
    "{% elif m.role == 'tool' %}{{ 'R: ' + m.content + '\\n' }}"
    "{% elif m.role == 'assistant' %}{{ 'A: ' + (m.content or '') }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{{ eos_token + '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)
BUILTIN_TEMPLATES = {"turns": TURNS_TEMPLATE}


class ByteTokenizer:
    """UTF-8 bytes 0..255, then BOS=256, EOS=257, PAD=258 (vocabulary 259). A text holding
    a special token's spelling (`<|eos|>`) encodes it as that token, as transformers does.
    `chat_template`: a Jinja template, or `turns` (freetx's, for byte models: a line per
    message; tools and Hermes-style calls), for chat data and multi-turn episodes."""

    SPECIAL = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}

    def __init__(self, chat_template: str | None = None) -> None:
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259
        self.add_bos_token, self.add_eos_token = True, False
        self.chat_template = BUILTIN_TEMPLATES.get(chat_template or "", chat_template)
        self.special_tokens = dict(self.SPECIAL)
        self._ids = {token: 256 + i for i, token in enumerate(self.SPECIAL.values())}
        self._split = re.compile("(" + "|".join(map(re.escape, self._ids)) + ")")

    def encode(self, text: str) -> list[int]:
        if "<|" not in text:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for part in self._split.split(text):
            ids.extend([self._ids[part]] if part in self._ids else part.encode("utf-8"))
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` and each token's (start, end) character offsets in it (a
        character's bytes share its offsets)."""
        ids, offsets, at = [], [], 0
        for part in self._split.split(text):
            if part in self._ids:
                ids.append(self._ids[part])
                offsets.append((at, at + len(part)))
            else:
                for i, char in enumerate(part):
                    encoded = char.encode("utf-8")
                    ids.extend(encoded)
                    offsets.extend([(at + i, at + i + 1)] * len(encoded))
            at += len(part)
        return ids, offsets

    def decode(self, ids, keep_special: bool = False) -> str:
        """The text of `ids`; the special tokens left out, or spelled (`keep_special`)."""
        spelled = {i: token.encode() for token, i in self._ids.items()} if keep_special else {}
        parts = (bytes([int(i)]) if int(i) < 256 else spelled.get(int(i), b"") for i in ids)
        return b"".join(parts).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """`messages` rendered with `chat_template` (`HFTokenizer.apply_chat_template`)."""
        return render_chat(
            self.chat_template, messages, add_generation_prompt, tools, self.special_tokens, "bytes"
        )

    def special_ids(self) -> dict[str, int]:
        return {
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
        }

    def hf_files(self) -> dict[str, str]:
        """This tokenizer in the `tokenizers` library's format: a byte-level BPE without
        merges (each byte one token, its id the byte), the three special tokens, and BOS
        added before a text as freetx's training does (`AutoTokenizer(text).input_ids` =
        [256, *utf-8 bytes]). Only a text holding the special tokens' own spelling
        (`<|eos|>`) encodes differently: transformers reads it as the token."""
        ids = {"<|bos|>": self.bos_id, "<|eos|>": self.eos_id, "<|pad|>": self.pad_id}
        bos = [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}]
        byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
        tokenizer = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {
                    "id": i,
                    "content": token,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
                for token, i in ids.items()
            ],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", **byte_level},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [*bos, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [
                    *bos,
                    {"Sequence": {"id": "A", "type_id": 0}},
                    *bos,
                    {"Sequence": {"id": "B", "type_id": 0}},
                ],
                "special_tokens": {
                    "<|bos|>": {"id": "<|bos|>", "ids": [self.bos_id], "tokens": ["<|bos|>"]}
                },
            },
            "decoder": {"type": "ByteLevel", **byte_level},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {char: b for b, char in _bytes_to_unicode().items()},
                "merges": [],
            },
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.SPECIAL,
            "add_bos_token": True,
            "clean_up_tokenization_spaces": False,
            **({"chat_template": self.chat_template} if self.chat_template else {}),
        }
        return {
            "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False, indent=1),
            "tokenizer_config.json": json.dumps(config, indent=2),
        }


class HFTokenizer:
    """A Hugging Face tokenizer read locally: a model folder or a bare `tokenizer.json`.

    A folder is what transformers' `save_pretrained` writes: `tokenizer.json`
    (required), `tokenizer_config.json` (special tokens, and the chat template in
    older folders) and `chat_template.jinja` (where transformers 5 keeps the template;
    it wins over the config's). A bare `tokenizer.json` carries none of that, so its
    BOS/EOS default to Llama 3's tokens. `bos_token`/`eos_token`/`pad_token` given
    here override the folder; a missing pad token falls back to EOS (padding is
    masked out of the loss).

    Whether a text starts with BOS (`add_bos_token`) and ends with EOS
    (`add_eos_token`) is what `tokenizer.json`'s post-processor adds, as in
    transformers 5, which drops `add_bos_token`/`add_eos_token` of
    tokenizer_config.json when a folder has a tokenizer.json (SmolLM2's ByteLevel
    post-processor adds nothing, Llama 3's template adds BOS). Giving either argument
    here decides both instead, the other false, as
    `AutoTokenizer.from_pretrained(path, add_bos_token=...)` does.
    Needs the optional `tokenizers` package (`pip install freetx[tokenizers]`).
    """

    def __init__(
        self,
        path: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ) -> None:
        tokenizer_class = _tokenizer_class()
        location = Path(path).expanduser()
        self.chat_template: str | None = None
        if location.is_dir():
            file = _tokenizer_file(location, path)
            read = [location / name for name in TOKENIZER_FILES if (location / name).is_file()]
            read_config = location / "tokenizer_config.json" in read
            config = _read_config(location / "tokenizer_config.json")
            tokens = _config_tokens(config, path)
            self.chat_template = _read_chat_template(location, config)
        elif location.is_file():
            file, tokens = location, dict(_FILE_DEFAULTS)
            read = [location]
        else:
            raise DataError(
                f"tokenizer path {path} does not exist; point tokenizer.path at a model folder "
                "(with tokenizer.json) or at a tokenizer.json file."
            )
        given = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        tokens.update({name: token for name, token in given.items() if token is not None})
        try:
            self._tok = tokenizer_class.from_file(str(file))
        except Exception as e:
            raise DataError(f"cannot read tokenizer file {file}: {e}") from None
        self.path = path
        self.files_read = read  # recorded by identity in a run's checkpoints (ReadsFiles)
        # the special tokens by name, as the chat template sees them
        self.special_tokens: dict[str, str] = tokens
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        if "eos_token" not in tokens and location.is_dir() and not read_config:
            raise DataError(
                f"tokenizer folder {path} has no tokenizer_config.json, the file that names "
                "the special tokens (eos_token, bos_token) and the chat template; copy it from "
                "the model's original folder beside tokenizer.json, or set "
                "tokenizer.eos_token to the token that ends a text."
            )
        if "eos_token" not in tokens:
            raise DataError(
                f"tokenizer {path} names no EOS token (tokenizer_config.json has no eos_token); "
                "set tokenizer.eos_token to the token that ends a text."
            )
        self.eos_id = self._special("eos_token")
        self.bos_id = self._special("bos_token") if "bos_token" in tokens else None
        self.pad_id = self._special("pad_token") if "pad_token" in tokens else self.eos_id
        if add_bos_token is None and add_eos_token is None:
            self.add_bos_token, self.add_eos_token = self._post_processor_adds()
        else:
            self.add_bos_token, self.add_eos_token = bool(add_bos_token), bool(add_eos_token)
        if self.add_bos_token and self.bos_id is None:
            raise DataError(
                f"tokenizer {path} names no BOS token, so it cannot start a text with one "
                "(add_bos_token); set tokenizer.bos_token, or leave add_bos_token unset."
            )

    def _special(self, name: str) -> int:
        token = self.special_tokens[name]
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise DataError(
                f"tokenizer {self.path} has no token {token!r} (its {name}); set "
                f"tokenizer.{name} to a token it has."
            )
        return token_id

    def _post_processor_adds(self) -> tuple[bool, bool]:
        """Whether tokenizer.json's post-processor puts BOS before a text and EOS after
        it (what transformers' `tokenizer(text)` adds); refused when it adds other
        tokens, which freetx's datasets would not put there."""
        encoding = self._tok.encode(self.special_tokens["eos_token"])  # one token
        inside = [i for i, sequence in enumerate(encoding.sequence_ids) if sequence is not None]
        before, after = encoding.ids[: inside[0]], encoding.ids[inside[-1] + 1 :]
        if before not in ([], [self.bos_id]) or after not in ([], [self.eos_id]):
            tokens = self.special_tokens
            raise DataError(
                f"tokenizer {self.path}: the post-processor of its tokenizer.json puts "
                f"{[self._tok.id_to_token(i) for i in before]} before a text and "
                f"{[self._tok.id_to_token(i) for i in after]} after it, but its BOS is "
                f"{tokens.get('bos_token')!r} and its EOS {tokens['eos_token']!r} (freetx "
                "adds only BOS before a text and EOS after it). Set tokenizer.bos_token / "
                "tokenizer.eos_token to the tokens it adds, or tokenizer.add_bos_token / "
                "tokenizer.add_eos_token to choose."
            )
        return before == [self.bos_id], after == [self.eos_id]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` and each token's (start, end) character offsets in it."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids, keep_special: bool = False) -> str:
        """The text of `ids`; the special tokens left out, or spelled (`keep_special`)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=not keep_special)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """`messages` rendered with the folder's chat template, as transformers renders it.

        With `add_generation_prompt` the text ends with the header that opens
        an assistant turn (what a model is given before it replies); `tools`: the JSON
        schemas of the tools the model may call (`freetx.envs.tools.tool_schema`).
        """
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt,
            tools,
            self.special_tokens,
            self.path,
        )


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    special_tokens: dict[str, str],
    path: str,
) -> str:
    """`messages` rendered with `template` as transformers renders them (keys set to None
    count as absent); a DataError naming tokenizer `path` when there is no template or it
    fails on them."""
    if template is None:
        raise DataError(
            f"tokenizer {path} has no chat template, so it cannot render chat "
            "messages; give the folder one (a chat_template.jinja file, or chat_template "
            "in tokenizer_config.json, e.g. from the instruct model's folder), use "
            "freetx.data.ByteTokenizer with chat_template: turns for a byte model, or train on "
            "prompt/response data with freetx.data.InstructDataset."
        )
    # like transformers: keys set to None count as absent (OpenAI-style content=None)
    chat = [{k: v for k, v in message.items() if v is not None} for message in messages]
    try:
        return _compile_chat_template(template).render(
            messages=chat,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=None,
            **special_tokens,
        )
    except Exception as e:
        raise DataError(
            f"the chat template of tokenizer {path} failed on a conversation: "
            f"{type(e).__name__}: {e}. Check that the messages fit the model's chat format "
            "(roles, their order), or fix the template."
        ) from None


def _tokenizer_class():
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            "HFTokenizer needs the `tokenizers` package: pip install tokenizers "
            "(or pip install freetx[tokenizers])."
        ) from None
    return Tokenizer


def _tokenizer_file(folder: Path, path: str) -> Path:
    file = folder / "tokenizer.json"
    if not file.is_file():
        found = (
            " (it has a sentencepiece tokenizer.model)"
            if (folder / "tokenizer.model").exists()
            else ""
        )
        if not found:  # a run's output_dir, a checkpoint: weights without their tokenizer
            raise DataError(
                f"tokenizer.path {path} holds no tokenizer (no tokenizer.json, no "
                "tokenizer.model): a run's output_dir or a checkpoint holds weights only. Set "
                "tokenizer.path=FOLDER to the folder the model's tokenizer is in (the HF "
                "model folder the run started from), or to a tokenizer.json file."
            )
        raise DataError(
            f"model folder {path} has no tokenizer.json{found}; freetx reads fast-tokenizer "
            "folders (tokenizer.json), not sentencepiece-only tokenizer.model. Convert it once "
            "with transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)."
        )
    return file


def _read_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{file} is not valid JSON ({e}); fix or delete it.") from None
    if not isinstance(config, dict):
        raise DataError(f"{file} must hold a JSON object; fix or delete it.")
    return config


def _config_tokens(config: dict[str, Any], path: str) -> dict[str, str]:
    """The special tokens a tokenizer_config.json names: `*_token` keys, given as a
    string or as {"content": ...}; null means the model has none."""
    tokens = {}
    extra = config.get("extra_special_tokens")  # transformers 5: model-specific tokens by name
    named = {**config, **extra} if isinstance(extra, dict) else config
    for name, value in named.items():
        if not name.endswith("_token") or value is None:
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if not isinstance(value, str):
            if name in SPECIAL_TOKEN_NAMES:
                raise DataError(
                    f"tokenizer_config.json of {path} gives {name} as {named[name]!r}; it must be "
                    f'a string or {{"content": "..."}}. Fix the file or set tokenizer.{name}.'
                )
            continue  # e.g. a model-specific flag that happens to end in _token
        tokens[name] = value
    return tokens


def _read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja if present (transformers 5), else the config's `chat_template`:
    a string, or a list of {"name", "template"} of which the "default" one is used."""
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str):
    """A chat template compiled as transformers compiles it: a sandbox (templates come
    from model folders, so they are untrusted), trimmed blocks, `raise_exception`,
    `strftime_now` and a `tojson` that keeps non-ASCII and HTML characters as they are."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
