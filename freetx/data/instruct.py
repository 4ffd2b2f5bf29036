"""Instruction data: `prompt`/`response` pairs, loss on the response tokens only.

Each example is BOS + prompt + response + EOS, cut to `seq_len + 1` tokens and
padded with PAD; labels are IGNORE_INDEX on the prompt and the padding, so only
response tokens (and the closing EOS) count in the loss.

Source: a `.jsonl` file with `prompt` and `response` fields, or `builtin`:
string tasks made from the words of the built-in corpus (reverse a word, spell
it in capitals, say its length), deterministic from the seed. They need no
download and have exact answers, so a falling loss is easy to read.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from freetx.data.corpus import builtin_documents
from freetx.data.samples import TokenSamples
from freetx.data.sampling import check_split, split_examples
from freetx.data.text import read_jsonl, source_files
from freetx.data.token_cache import cached_rows, settings_of
from freetx.data.token_rows import Encoded
from freetx.data.tokenizers import leading_bos
from freetx.errors import DataError


def builtin_examples(count: int, seed: int) -> list[dict[str, str]]:
    """`count` string-task examples over words from the built-in corpus."""
    words = sorted({w for doc in builtin_documents() for w in re.findall(r"[a-z]{4,12}", doc)})
    rng = random.Random(seed)
    tasks = [
        ("Reverse the word: {w}\nAnswer: ", lambda w: w[::-1]),
        ("Write the word in capitals: {w}\nAnswer: ", lambda w: w.upper()),
        ("How many letters are in {w}?\nAnswer: ", lambda w: str(len(w))),
    ]
    examples = []
    for _ in range(count):
        word = rng.choice(words)
        prompt, answer = rng.choice(tasks)
        examples.append({"prompt": prompt.format(w=word), "response": answer(word)})
    return examples


def read_examples(path: str) -> list[dict[str, str]]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"instruction file {path} does not exist; fix dataset.source.")
    examples = []
    for line_no, record in read_jsonl(file):
        if "prompt" not in record or "response" not in record:
            raise DataError(f"{path}:{line_no} needs both 'prompt' and 'response' fields.")
        examples.append({"prompt": str(record["prompt"]), "response": str(record["response"])})
    if not examples:
        raise DataError(f"instruction file {path} holds no examples.")
    return examples


def _split(
    source: str, split: str, val_fraction: float, num_builtin_examples: int, seed: int
) -> list[dict[str, str]]:
    """The examples of one split of the source."""
    examples = (
        builtin_examples(num_builtin_examples, seed)
        if source == "builtin"
        else read_examples(source)
    )
    examples = split_examples(examples, split, val_fraction)
    if not examples:
        raise DataError(f"the {split} split of {source} is empty; add examples.")
    return examples


class InstructDataset(TokenSamples):
    """Prompt/response pairs as fixed-length, response-only-loss samples."""

    def __init__(
        self,
        tokenizer,
        source: str = "builtin",
        seq_len: int = 64,
        split: str = "train",
        val_fraction: float = 0.05,
        num_builtin_examples: int = 20000,
        seed: int = 0,
        packed: bool = False,  # several samples per sequence (freetx.data.packing), by seed
        cache: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        settings = settings_of(locals())  # first: every argument, before other names
        check_split(split, val_fraction, seq_len)
        self.files_read = source_files(source)
        self.tokenizer = tokenizer
        rows, self.token_cache = cached_rows(
            "InstructDataset", f"{source} ({split})",
            settings, self.files_read, tokenizer,
            lambda: map(self.encode, _split(source, split, val_fraction, num_builtin_examples, seed)),
            cache, cache_dir,
        )  # fmt: skip
        super().__init__(rows, seq_len, tokenizer.pad_id, split, source, packed, seed)

    def encode(self, example: dict[str, str]) -> Encoded:
        """BOS + prompt + response + EOS, and for each token whether it is a target."""
        tok = self.tokenizer
        prompt = [*leading_bos(tok), *tok.encode(example["prompt"])]
        response = [*tok.encode(example["response"]), tok.eos_id]
        return prompt + response, [False] * len(prompt) + [True] * len(response)
