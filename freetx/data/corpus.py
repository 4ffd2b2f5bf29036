"""The built-in corpus: text that is on every machine with Python, no download.

It is CPython's own reference-manual text, shipped with every CPython in
`pydoc_data.topics` (what `help("assert")` prints): 79 topics of English prose
with code examples, about 466,000 bytes, so about 466,000 tokens with the byte
tokenizer (466,117 bytes + 158 BOS/EOS under CPython 3.11.7; other Python
versions carry slightly different text). Each topic is one document.
"""

from __future__ import annotations

from freetx.errors import DataError


def builtin_documents() -> list[str]:
    """The reference-manual topics, in a fixed (sorted) order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError(
            "this Python has no pydoc_data module (some distributions split it out), so "
            "the built-in corpus is unavailable; install your distribution's full Python "
            "package or point dataset.source at your own text files."
        ) from None
    return [topics[name] for name in sorted(topics)]
