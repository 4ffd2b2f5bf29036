"""Tokenizers: bytes (no files needed) and `tokenizer.json` through `tokenizers`.

Every tokenizer has `vocab_size`, `bos_id`, `eos_id`, `pad_id`,
`encode(text) -> list[int]` and `decode(ids) -> str`.
"""

from __future__ import annotations

from pathlib import Path

from freetx.errors import DataError


class ByteTokenizer:
    """UTF-8 bytes 0..255, then BOS=256, EOS=257, PAD=258 (vocabulary 259)."""

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` file (Hugging Face `tokenizers` format), read locally.

    Needs the optional `tokenizers` package (`pip install freetx[tokenizers]`).
    `bos_token`/`eos_token`/`pad_token` name special tokens in the file; a
    missing pad token falls back to EOS (padding is masked out of the loss).
    """

    def __init__(
        self,
        path: str,
        bos_token: str = "<|begin_of_text|>",
        eos_token: str = "<|end_of_text|>",
        pad_token: str | None = None,
    ) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "HFTokenizer needs the `tokenizers` package: pip install tokenizers "
                "(or pip install freetx[tokenizers])."
            ) from None
        file = Path(path).expanduser()
        if not file.is_file():
            raise DataError(
                f"tokenizer file {path} does not exist; point tokenizer.path at a tokenizer.json."
            )
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:
            raise DataError(f"cannot read tokenizer file {path}: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(bos_token, path)
        self.eos_id = self._special(eos_token, path)
        self.pad_id = self._special(pad_token, path) if pad_token else self.eos_id

    def _special(self, token: str, path: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise DataError(
                f"tokenizer {path} has no token {token!r}; set tokenizer.bos_token / "
                "eos_token / pad_token to tokens it has."
            )
        return token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])
