"""The special tokens an HF folder's tokenizer puts around a text: freetx's (`leading_bos`,
`encoded_text`) against transformers' own `AutoTokenizer(text).input_ids`, on folders each
tokenizer class writes with `save_pretrained`, their tokenizer.json's post-processor and
tokenizer_config.json's `add_bos_token` varied as real folders have them."""

from __future__ import annotations

import json

import pytest

from freetx.data import HFTokenizer, encoded_text
from freetx.errors import DataError

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, pre_tokenizers, processors  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>", "<bos>", "<eos>", "<pad>", "<mask>", "<|begin_of_text|>",
            "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]  # fmt: skip
VOCAB = {token: i for i, token in enumerate([*SPECIALS, "▁", *pre_tokenizers.ByteLevel.alphabet()])}
TEXTS = ["hello world", " the cat, sat!", "<|im_start|>a", ""]
# kind -> (the tokenizer class that writes the folder, its special tokens)
KINDS = {
    "llama3": ("PreTrainedTokenizerFast", dict(bos_token="<|begin_of_text|>",
                                               eos_token="<|end_of_text|>")),
    "llama2": ("LlamaTokenizer", dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")),
    "smollm2": ("GPT2Tokenizer", dict(bos_token="<|im_start|>", eos_token="<|im_end|>",
                                      unk_token="<|endoftext|>")),
    "qwen2": ("Qwen2Tokenizer", dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    "gemma": ("GemmaTokenizer", {}),
}  # fmt: skip
# (kind, what tokenizer.json's post-processor adds, tokenizer_config.json's add_bos_token)
CASES = [
    ("llama3", "bos", None), ("llama3", "bos", True), ("llama3", "bos", False),
    ("llama3", "bos+eos", None), ("llama3", "nothing", True),
    ("llama2", "bos", None), ("llama2", "bos", False), ("llama2", "nothing", True),
    ("smollm2", "bytelevel", None), ("smollm2", "bytelevel", True),
    ("qwen2", "bytelevel", None), ("qwen2", "bytelevel", False),
    ("gemma", "bos", None), ("gemma", "bos", False), ("gemma", "nothing", True),
]  # fmt: skip


def post_processor(adds: str, bos: str, eos: str):
    if adds == "bytelevel":  # GPT-2's, SmolLM2's, Qwen2's: offsets only, no tokens
        return processors.ByteLevel(trim_offsets=False)
    single = " ".join(
        [*([f"{bos}:0"] if "bos" in adds else []), "$A:0", *([f"{eos}:0"] if "eos" in adds else [])]
    )
    specials = [(t, VOCAB[t]) for t, kind in [(bos, "bos"), (eos, "eos")] if kind in adds]
    return processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1", special_tokens=specials
    )


def write_folder(folder, kind: str, adds: str, key: bool | None):
    """A folder `kind`'s tokenizer class writes, its post-processor and config key set."""
    class_name, specials = KINDS[kind]
    if class_name == "PreTrainedTokenizerFast":
        from tokenizers import decoders, models

        backend = Tokenizer(models.BPE(VOCAB, []))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        made = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    else:
        made = getattr(transformers, class_name)(vocab=dict(VOCAB), merges=[], **specials)
    made.save_pretrained(folder)
    file = folder / "tokenizer.json"
    backend = Tokenizer.from_file(str(file))
    backend.post_processor = post_processor(adds, made.bos_token, made.eos_token)
    backend.save(str(file))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("add_bos_token", None)
    if key is not None:
        config["add_bos_token"] = key
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("kind, adds, key", CASES)
def test_a_text_encodes_as_transformers_encodes_it(tmp_path, kind, adds, key):
    """transformers 5 follows tokenizer.json's post-processor whatever add_bos_token says
    (SmolLM2: no key, a ByteLevel post-processor, no BOS); so does freetx."""
    folder = write_folder(tmp_path, kind, adds, key)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = HFTokenizer(str(folder))
    assert tok.add_bos_token == ("bos" in adds) and tok.add_eos_token == ("eos" in adds)
    for text in TEXTS:
        assert encoded_text(tok, text) == theirs(text).input_ids, text


@pytest.mark.parametrize("given", [dict(add_bos_token=True), dict(add_eos_token=True),
                                   dict(add_bos_token=False)])  # fmt: skip
def test_an_explicit_add_bos_or_eos_token_decides_both_as_in_transformers(tmp_path, given):
    """`AutoTokenizer.from_pretrained(path, add_bos_token=...)` rebuilds the post-processor
    from the two flags, the one not given false."""
    folder = write_folder(tmp_path, "llama3", "bos+eos", None)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder), **given)
    tok = HFTokenizer(str(folder), **given)
    for text in TEXTS:
        assert encoded_text(tok, text) == theirs(text).input_ids, text


def test_a_post_processor_adding_tokens_that_are_not_bos_and_eos_is_refused(tmp_path):
    folder = write_folder(tmp_path, "qwen2", "bytelevel", None)
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = post_processor("bos", "<|im_start|>", "<|im_end|>")
    backend.save(str(folder / "tokenizer.json"))  # Qwen2 names no BOS token
    with pytest.raises(
        DataError,
        match=r"puts \['<\|im_start\|>'\] before a text and \[\] after it, but its BOS is None",
    ):
        HFTokenizer(str(folder))
    assert HFTokenizer(str(folder), bos_token="<|im_start|>").add_bos_token
    with pytest.raises(DataError, match="names no BOS token"):
        HFTokenizer(
            str(write_folder(tmp_path / "q", "qwen2", "bytelevel", None)), add_bos_token=True
        )


def test_a_chat_template_that_writes_bos_gets_no_second_one(tmp_path):
    """A rendered conversation is encoded with nothing added, as transformers'
    apply_chat_template(tokenize=True): the template's BOS is the only one."""
    folder = write_folder(tmp_path, "llama3", "bos", True)
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = HFTokenizer(str(folder))
    messages = [{"role": "user", "content": "hello world"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == expected["input_ids"]
    assert ids.count(tok.bos_id) == 1 and tok.add_bos_token
