"""The known-harmless messages of freetx's dependencies, hidden from a user's console.

Each entry names one message exactly (its logger and a regex of its text) and why it
is harmless; anything else, a new warning included, still shows. (torch's FutureWarnings
about `all_gather_into_tensor` and `reduce_scatter_tensor` are not filtered: freetx calls
the new names, `freetx.distributed.groups`.)
`quiet_known_noise()` installs the filters; the CLI (`freetx.cli.main`) and every
recipe process (`freetx.entry`) call it before torch or torchao is imported. Imports
nothing of freetx.
"""

from __future__ import annotations

import logging
import re

# (logger name, regex of the formatted message): records torchao and torch log at import
KNOWN_LOG_RECORDS = (
    # torchao's optional CUDA kernels (MX-FP8, CUTLASS sm90a): freetx uses neither, and
    # a CPU build or another GPU cannot load them
    ("torchao", r"^Failed to load \S*torchao[/\\]_C_(mxfp8|cutlass_90a)\S*: "),
    # torchao registers its KernelPreference and ScaleCalculationMode enums the way torch
    # now deprecates (transformers imports torchao on every generic-path run); freetx
    # passes neither
    (
        "torch.utils._pytree",
        r"^<enum '(KernelPreference|ScaleCalculationMode)'> is an Enum subclass and is now",
    ),
)


class _DropMatching(logging.Filter):
    """Drops a logger's records whose message matches a regex; passes every other one."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


_installed = False


def quiet_known_noise() -> None:
    """Install the filters of KNOWN_LOG_RECORDS (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    for name, pattern in KNOWN_LOG_RECORDS:
        logging.getLogger(name).addFilter(_DropMatching(pattern))
