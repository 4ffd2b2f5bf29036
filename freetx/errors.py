"""Errors a user can cause, and how they are shown.

A `FreetxError` carries a message written for the person at the keyboard: what
is wrong and how to fix it. The CLI and the recipe entry point print it as one
paragraph without a traceback (set FREETX_DEBUG=1 or pass --debug to see it)
and exit with `exit_code`.
"""

from __future__ import annotations

import errno
import os
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

# The exit code of a rank that stopped only because another rank failed first
# (its collective broke); `freetx run` leaves such ranks out of its summary.
STOPPED_BY_PEER_EXIT_CODE = 3
# A run that stopped on SIGTERM / SIGUSR1 after saving at a step boundary: sysexits'
# EX_TEMPFAIL, "try again later"; the SLURM script freetx writes requeues the job on it.
PREEMPTED_EXIT_CODE = 75
# `freetx run` sets this for the ranks it launches: a rank records its user error
# (in torchrun's error file, marked with USER_ERROR_KEY) instead of printing it,
# and `freetx run` prints each distinct message once, naming the ranks.
LAUNCHER_REPORTS_ERRORS = "FREETX_LAUNCHER_REPORTS_ERRORS"
USER_ERROR_KEY = "freetx_user_error"


class FreetxError(Exception):
    """A mistake the user can fix (config, paths, checkpoints, shapes)."""

    exit_code = 1


class ConfigError(FreetxError):
    """A config that cannot be loaded, validated or instantiated.

    Holds one problem or a list of them, so that `freetx validate` can report
    every problem at once.
    """

    def __init__(self, problems: str | list[str], fix: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.fix = fix
        super().__init__(self._message())

    def _message(self) -> str:
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"the config has {len(self.problems)} problems:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        if self.fix:
            text += ("\n" if len(self.problems) > 1 else " ") + self.fix
        return text


class UsageError(FreetxError):
    """Wrong command-line usage (exit code 2, like argparse)."""

    exit_code = 2


class CheckpointError(FreetxError):
    """A checkpoint that is missing, corrupt or does not match the model."""


class TrainingError(FreetxError):
    """Training cannot go on as configured (e.g. non-finite losses past the limit)."""


class DataError(FreetxError):
    """Data files that are missing, empty or do not fit the config."""


def lost_a_peer(error: BaseException | str) -> bool:
    """A collective (or a save's) failure because another rank's process ended: gloo's
    and NCCL's words for a connection the other side dropped."""
    text = str(error)
    return "closed by peer" in text or "reset by peer" in text or "remote worker" in text


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (or its type when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def debug_enabled() -> bool:
    """True when tracebacks should be shown (FREETX_DEBUG=1 or --debug)."""
    return os.environ.get("FREETX_DEBUG", "").lower() not in ("", "0", "false", "no")


def format_error(error: BaseException, prefix: str = "freetx") -> str:
    """One paragraph: `prefix: error: message`, long lines wrapped, lists kept."""
    lines = []
    for i, line in enumerate(str(error).splitlines() or [type(error).__name__]):
        head = f"{prefix}: error: " if i == 0 else ""
        indent = " " * 4 if line.startswith("  ") else ""
        lines.append(
            textwrap.fill(
                head + line.strip() if not indent else line.rstrip(),
                width=100,
                subsequent_indent=indent + "  " if indent else "  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
    return "\n".join(lines)


def rank_list(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0, 1`, `ranks 0-7`: the ranks a message came from."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def report_error(error: FreetxError, prefix: str = "freetx") -> int:
    """Print a user error to stderr and return its exit code."""
    print(format_error(error, prefix), file=sys.stderr, flush=True)
    return error.exit_code


# OS errors of a file or folder (not of a socket: a peer's failure is told apart elsewhere)
FILE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
    errno.ENAMETOOLONG,
    errno.EIO,
    errno.EFBIG,
    errno.ENOENT,
}


def os_error_in(error: BaseException | None) -> OSError | None:
    """The first file OSError in an exception's chain (its cause or the exception it was
    raised while handling: torch.save's "unexpected pos" hides the full disk there)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FILE_ERRNOS:
            return error
        error = error.__cause__ or error.__context__
    return None


def file_error(error: OSError, path: object = None) -> FreetxError:
    """One paragraph for an OS error on a path: the path, the cause (strerror), the fix."""
    where = error.filename if error.filename is not None else path
    cause = error.strerror or str(error)
    fixes = {
        errno.ENOSPC: "free space on that disk or point the path elsewhere",
        errno.EDQUOT: "free space within your quota or point the path elsewhere",
        errno.EROFS: "point the path at a writable disk",
        errno.EACCES: "make it writable for this user or point the path elsewhere",
        errno.EPERM: "make it writable for this user or point the path elsewhere",
    }
    fix = fixes.get(error.errno, "fix the path or point it elsewhere")
    return FreetxError(
        f"{where if where is not None else 'a file'}: {cause} (errno {errno.errorcode.get(error.errno, error.errno)}). "
        f"freetx stopped there; {fix}, then run the same command again (saved checkpoints "
        "are only replaced by complete ones, so a resume continues from the newest)."
    )


@contextmanager
def files_errors_explained() -> Iterator[None]:
    """Turn an error caused by a file's OS error (a full disk, a read-only folder, no
    permission), also one raised while handling it, into one paragraph (`file_error`);
    other errors, and every error under --debug, pass as they are."""
    try:
        yield
    except FreetxError:
        raise
    except Exception as e:
        found = os_error_in(e)
        if found is None or debug_enabled():
            raise
        raise file_error(found) from e
