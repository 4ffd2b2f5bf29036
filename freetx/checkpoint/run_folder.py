"""A run's output_dir: one run at a time, and a resume that cannot be fooled.

The rule (docs/checkpoints.md): freetx never deletes, truncates or overwrites a
checkpoint, an export or a config that it did not write in the current run,
unless the user says so (`checkpoint.overwrite: true` for runs, `--overwrite`
for conversions). This module decides, before anything is built, what a run
may do with the folder it was given:

- `RunLock`: an exclusive lock on `<output_dir>/.freetx.lock`, held by rank 0
  for the whole run, so two runs never write one folder.
- `survey`: every `step_*` folder, each either complete (DCP index, every data
  file long enough, meta.json with its step: read once, kept as its `DCPSource`)
  or with the reason it is not.
- `plan_resume`: which checkpoint to continue from (`resume: auto | never |
  PATH`), what the run would replace, which settings changed since the save.
  Anything that would lose saved work or give a silently different result is
  refused with the list of what was found and the fix.
- `RecipeMark`, `check_recipe`: which recipe a folder's run belongs to
  (`<output_dir>/recipe.json`, written when a run claims it); another recipe's run
  on it is refused with the fix.
- `check_output_dir`: a run writes only into a folder that is missing, empty or a freetx
  run folder (its recipe.json), never a parent of the current folder or of its config,
  never over the config it was given (`claim_output_dir`: that check, the recipe's, the
  mark: for a command that writes a folder without a checkpointer: generate, eval).
- `newest_checkpoint`, `resolve_checkpoint`: the checkpoint a path means (a
  run's output_dir: its newest complete one, found as a resume finds it).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetx.checkpoint.dcp_folder import (
    FROZEN_FROM,
    META_FILE,
    NotDCPMetadata,
    has_checksums,
    missing_data,
    read_dcp_metadata,
    read_meta,
    step_of,
    unverifiable,
)
from freetx.checkpoint.formats import DCPSource
from freetx.config.compare import resume_changes
from freetx.errors import CheckpointError, first_line

LATEST_FILE = "LATEST"
LOCK_FILE = ".freetx.lock"
RECIPE_FILE = "recipe.json"
TMP_PREFIX = ".tmp_"


class RunLock:
    """An exclusive claim on an output_dir, held by one process (rank 0) of one run.

    A `flock` on `<output_dir>/.freetx.lock`: released by the kernel when the
    process ends, however it ends, so a crashed run never leaves a stale lock.
    The file names the holder (pid, host, start time) for the message another
    run gets.
    """

    def __init__(self, output_dir: Path) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self._file = None

    def acquire(self) -> str | None:
        """Take the lock; a notice when the filesystem cannot lock, an error when taken."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a process that did not say who it is"
            handle.close()
            raise CheckpointError(
                f"output_dir {self.path.parent} is in use by another run ({holder}). Two runs "
                "writing one folder would replace each other's checkpoints. Wait for it to "
                "end or stop it, or give this run another output_dir."
            ) from None
        except OSError as e:  # a filesystem without locks (some NFS mounts)
            handle.close()
            return (
                f"the filesystem of {self.path.parent} does not support file locks "
                f"({e.strerror}); freetx cannot tell whether another run writes there."
            )
        handle.seek(0)
        handle.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        handle.flush()
        self._file = handle
        return None

    def release(self) -> None:
        if self._file is None:
            return
        import fcntl

        self._file.seek(0)
        self._file.truncate()  # the file stays: unlinking a lock file races with a waiter
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None


@dataclass(frozen=True)
class RecipeMark:
    """The recipe a run folder belongs to: a built-in recipe by its name, or a recipe
    file of the user's (a copy they edit) by its path, with the name it gives its runs."""

    name: str
    file: str | None = None  # a recipe file outside the built-in ones (resolved); None: built-in

    def describe(self) -> str:
        if self.file is None:
            return self.name
        try:
            shown = f"./{Path(self.file).relative_to(Path.cwd())}"
        except ValueError:
            shown = self.file
        return f"{shown} (a recipe file, its runs named {self.name})"

    def as_dict(self) -> dict[str, str | None]:
        return {"recipe": self.name, "file": self.file}

    @classmethod
    def read(cls, output_dir: Path) -> RecipeMark | None:
        """The mark `output_dir` holds; None without one (a new folder, an older freetx)."""
        try:
            data = json.loads((Path(output_dir) / RECIPE_FILE).read_text(encoding="utf-8"))
            return cls(str(data["recipe"]), data.get("file"))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, output_dir: Path) -> None:
        path = Path(output_dir) / RECIPE_FILE
        tmp = path.with_name(f"{TMP_PREFIX}{RECIPE_FILE}")
        tmp.write_text(json.dumps(self.as_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)


# what a run leaves in its folder before its mark (recipe.json): a claim that stopped there
CLAIM_LEFTOVERS = frozenset({LOCK_FILE, "checkpoints", f"{TMP_PREFIX}{RECIPE_FILE}"})


def is_run_folder(folder: Path) -> bool:
    """Whether `folder` is a freetx run's: its mark (recipe.json); a claim that stopped
    before the mark; or, from a freetx older than the mark, a run's checkpoints."""
    if (folder / RECIPE_FILE).is_file():
        return True
    names = {p.name for p in folder.iterdir()}
    checkpoints = folder / "checkpoints"
    return names <= CLAIM_LEFTOVERS or any(checkpoints.glob("step_*/meta.json"))


def check_output_dir(output_dir: str | Path, config_file: Path | None = None) -> None:
    """Refuse, before anything is written, an output_dir a run would take over: a folder
    holding files that are not a freetx run's; the filesystem root, the home folder or a
    parent of the current folder or of the config (`output_dir=..`); the folder of the
    config the run was given (its config.yaml would be written over)."""
    given = f"output_dir={output_dir}"
    path = Path(output_dir).expanduser().resolve()
    own_folder = (
        f"Give the run its own folder: output_dir={Path(output_dir) / 'run'} or a new path."
    )
    parents = [("the filesystem root", Path(path.anchor)), ("your home folder", Path.home())]
    parents += [("a parent of the current folder", p) for p in Path.cwd().resolve().parents]
    if config_file is not None:
        config = Path(config_file).resolve()
        parents += [(f"a parent of the config {config_file}", p) for p in config.parent.parents]
        if path / "config.yaml" == config:
            raise CheckpointError(
                f"{given} holds the config this run was given ({config_file}), and a run "
                "writes its resolved config there as config.yaml; freetx never writes over the "
                f"config it reads. Copy the config elsewhere and pass the copy (cp {config_file} "
                "my.yaml), or give the run another output_dir."
            )
    for what, parent in parents:
        if path == parent.resolve():
            raise CheckpointError(
                f"{given} is {path}, {what}: a run would make it a run folder (config.yaml, "
                f"recipe.json, metrics.jsonl, checkpoints/ beside what is there). {own_folder}"
            )
    if not path.is_dir() or not any(path.iterdir()) or is_run_folder(path):
        return
    names = sorted(p.name for p in path.iterdir())
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise CheckpointError(
        f"{given} is a folder holding files that are not a freetx run's ({shown}) and no "
        f"{RECIPE_FILE}, the mark of a run folder: a run there would replace its config.yaml "
        f"and {RECIPE_FILE} and append to its metrics.jsonl; nothing was written. {own_folder}"
    )


def claim_output_dir(
    output_dir: str | Path, recipe: RecipeMark, config_file: Path | None, mark: bool = True
) -> None:
    """Take `output_dir` for a command that writes a folder without a checkpointer
    (generate, eval): `check_output_dir`, no other recipe's run there, then (`mark`: the
    rank that writes) the folder and its mark."""
    check_output_dir(output_dir, config_file)
    check_recipe(Path(output_dir), recipe, "never", False)
    if mark and RecipeMark.read(Path(output_dir)) is None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        recipe.write(Path(output_dir))


def check_recipe(output_dir: Path, recipe: RecipeMark, resume: str, overwrite: bool) -> None:
    """Refuse a run of `recipe` on a folder another recipe's run holds (its recipe.json):
    it would resume or write over that run's checkpoints, config.yaml and metrics. Starting
    over there (resume=never checkpoint.overwrite=true) is allowed."""
    made_by = RecipeMark.read(output_dir)
    if made_by is None or made_by == recipe or (resume == "never" and overwrite):
        return
    own = f"{output_dir}_{Path(recipe.file).stem if recipe.file else recipe.name}"
    raise CheckpointError(
        f"output_dir {output_dir} holds a run of {made_by.describe()}, and this run's recipe is "
        f"{recipe.describe()}. One folder holds one recipe's run: this one would resume or "
        f"write over that run's checkpoints, config.yaml and metrics. Give this run its own "
        f"folder (output_dir={own}), or run the recipe that made it ({made_by.describe()}) to "
        "continue that run; to start over in that folder, resume=never "
        "checkpoint.overwrite=true."
    )


@dataclass(frozen=True)
class StepFolder:
    """A `step_*` folder of a checkpoints directory."""

    path: Path
    step: int
    problem: str | None = None  # why it is not a complete checkpoint; None when it is
    # a complete one's index and meta.json, as read when it was checked
    source: DCPSource | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.path.name

    def describe(self) -> str:
        return f"{self.name} ({self.problem or 'complete'})"


def check_step_folder(path: Path, step: int) -> StepFolder:
    """A step folder, complete or with the reason it is not.

    Complete: DCP's index reads, every data file it points into is there and
    long enough, and meta.json (written last, before the folder got its final
    name) is valid and names the same step.
    """
    if not path.is_dir():
        return StepFolder(path, step, "not a folder")
    if not (path / ".metadata").is_file():
        return StepFolder(
            path, step, "no .metadata: the save did not finish or the file was deleted"
        )
    try:
        metadata = read_dcp_metadata(path)
    except NotDCPMetadata as e:  # planted: never unpickled
        return StepFolder(path, step, f".metadata is not a DCP metadata file ({e.reason})")
    except CheckpointError:
        return StepFolder(path, step, ".metadata cannot be read")
    problem = missing_data(path, metadata)
    if problem:
        return StepFolder(path, step, problem)
    if not (path / META_FILE).is_file():
        return StepFolder(
            path, step, "no meta.json: the save did not finish or the file was deleted"
        )
    try:
        meta = read_meta(path)
    except CheckpointError:
        return StepFolder(path, step, "meta.json is not valid JSON")
    if meta.get("step") != step:
        return StepFolder(path, step, f"its meta.json says step {meta.get('step')!r}")
    return StepFolder(path, step, source=DCPSource(path, metadata, meta))


def survey(checkpoints: Path) -> list[StepFolder]:
    """Every `step_*` folder in `checkpoints`, oldest first, each checked."""
    if not checkpoints.is_dir():
        return []
    found = []
    for path in checkpoints.iterdir():
        step = step_of(path.name)
        if step is not None:
            found.append(check_step_folder(path, step))
    return sorted(found, key=lambda f: f.step)


def read_latest(checkpoints: Path) -> tuple[str | None, str | None]:
    """(the name LATEST holds, None) or (None, what is wrong with LATEST)."""
    pointer = checkpoints / LATEST_FILE
    if not pointer.exists():
        return None, "there is no LATEST file"
    try:
        text = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"LATEST cannot be read as text ({first_line(e)})"
    if step_of(text) is None:
        return None, f"LATEST holds {text[:40]!r}, not a checkpoint name"
    return text, None


def is_complete_fast(path: Path) -> bool:
    """The cheap test the pruner uses: both files a finished save writes are there."""
    return (path / ".metadata").is_file() and (path / META_FILE).is_file()


@dataclass
class ResumePlan:
    """What a run does with its output_dir: the checkpoint it continues (or none)."""

    # the checkpoint to resume from, its index and meta.json read and checked (every data
    # file there and long enough); None: start fresh
    source: DCPSource | None = None
    step: int = 0
    reason: str | None = None  # how it was found, when LATEST could not say
    notices: list[str] = field(default_factory=list)  # what the run log says before training
    finished: bool = False  # the checkpoint is at max_steps: nothing left to train

    @property
    def path(self) -> Path | None:
        return self.source.path if self.source is not None else None

    @property
    def saved_meta(self) -> dict[str, Any]:
        return self.source.meta if self.source is not None else {}


def _listing(folders: list[StepFolder]) -> str:
    return "\n".join(f"  - {f.describe()}" for f in folders)


def choose_checkpoint(
    checkpoints: Path, resume: str, overwrite: bool, folders: list[StepFolder]
) -> ResumePlan:
    """The checkpoint `resume` (auto | never | a path) points at, checked, or a refusal
    (`folders`: the `survey` of `checkpoints`)."""
    if resume == "never":
        if folders and not overwrite:
            raise CheckpointError(
                f"resume=never, but {checkpoints} already holds checkpoints that this run's "
                f"saves would replace:\n{_listing(folders)}\nContinue them with resume=auto, give "
                "this run another output_dir, or set checkpoint.overwrite=true to let it "
                "replace them."
            )
        plan = ResumePlan()
        if folders:
            names = ", ".join(f.name for f in folders)
            plan.notices.append(f"checkpoint.overwrite=true: this run may replace {names}")
        return plan
    if resume != "auto":
        return _explicit(Path(resume).expanduser())

    complete = [f for f in folders if f.problem is None]
    name, problem = read_latest(checkpoints)
    if name is not None:
        named = next((f for f in folders if f.name == name), None)
        if named is not None and named.problem is None:
            return ResumePlan(named.source, named.step)
        problem = f"LATEST names {name}, " + (
            f"which is incomplete ({named.problem})" if named else "which does not exist"
        )
    elif not folders:
        return ResumePlan()  # a new run: nothing saved yet
    if complete:
        newest = complete[-1]
        plan = ResumePlan(newest.source, newest.step)
        skipped = [f for f in folders if f.problem is not None]
        plan.reason = f"{problem}; the newest complete checkpoint is {newest.name}"
        plan.notices += [f"not a complete checkpoint: {f.describe()}" for f in skipped]
        return plan
    if not folders:
        raise CheckpointError(
            f"{problem}, and {checkpoints} holds no checkpoint folders. If they were deleted on "
            "purpose, delete LATEST too (or run with resume=never); if they live on a disk that "
            "is not mounted, mount it first."
        )
    raise CheckpointError(
        f"{problem}, and no checkpoint in {checkpoints} is complete:\n{_listing(folders)}\n"
        "freetx does not start over on top of them. Restore the missing files, or move the "
        "folders away, or start over explicitly with resume=never checkpoint.overwrite=true "
        "(or another output_dir)."
    )


def _explicit(path: Path) -> ResumePlan:
    """resume=PATH: a checkpoint folder (of this run or another), its files checked."""
    source = DCPSource(path)
    return ResumePlan(source, int(source.meta.get("step", step_of(path.name) or 0)))


def newest_checkpoint(path: str | Path) -> DCPSource | None:
    """The newest complete checkpoint of a run's output_dir or checkpoints/ folder (found
    as a resume finds it), its index and meta.json read; None when `path` is neither."""
    path = Path(path).expanduser()
    for checkpoints in (path / "checkpoints", path):
        folders = survey(checkpoints)
        if (checkpoints / LATEST_FILE).exists() or folders:
            plan = choose_checkpoint(checkpoints, "auto", overwrite=False, folders=folders)
            if plan.source is not None:
                return plan.source
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A run's output_dir or checkpoints/ folder (its newest complete checkpoint, found as
    a resume finds it), or a checkpoint itself."""
    found = newest_checkpoint(path)
    return found.path if found is not None else Path(path).expanduser()


def _start_anew_from(plan: ResumePlan) -> str:
    """How to start a new run from a refused checkpoint's weights; an adapter-only one
    (a LoRA run's) is not a whole model: its adapters are merged into its base first."""
    base = plan.saved_meta.get(FROZEN_FROM)
    if not base:
        return f"start a new run from its weights: output_dir=NEW checkpoint.initial_weights={plan.path}"
    return (
        f"start a new run in another output_dir: from the same base (output_dir=NEW), or "
        f"from what this one learned: it holds only adapters, so merge them into its base "
        f"first (freetx checkpoint merge {plan.path} --base {base} MERGED) and start from "
        f"that: output_dir=NEW checkpoint.initial_weights=MERGED"
    )


def nothing_left_to_train(output_dir: str | Path, max_steps: int) -> str:
    """The last line of a run that resumed a checkpoint at max_steps: what to pass to
    train on, or to start a new run."""
    return (
        f"{output_dir} is at max_steps={max_steps}: nothing left to train; raise max_steps "
        f"(e.g. max_steps={2 * max_steps}) to train on, or pass output_dir={output_dir}_2 "
        "(another folder) for a new run"
    )


def plan_resume(
    checkpoints: Path,
    resume: str,
    overwrite: bool,
    max_steps: int,
    run_config: dict[str, Any],
    fixed: tuple[str, ...],
    defaults: dict[str, Any] | None = None,
    unverified: bool = False,
) -> ResumePlan:
    """The checkpoint a run continues from, after every check that protects saved work.

    Refused first: a file that is not what was saved, and a checkpoint without checksums
    (unless `unverified`: checkpoint.resume_unverified). Then, all reasons at once: later
    checkpoints the run's saves would replace (unless overwrite), settings a resume may
    not change, a max_steps below the checkpoint's step. Changed settings that may change
    are listed.
    """
    folders = survey(checkpoints)
    plan = choose_checkpoint(checkpoints, resume, overwrite, folders)
    if plan.source is None:
        return plan
    if not has_checksums(plan.saved_meta):
        if not unverified:
            raise unverifiable(plan.path)
        plan.notices.append(
            f"checkpoint.resume_unverified=true: resuming from {plan.path}, whose files have "
            "no checksums to verify"
        )
    plan.source.verify()  # its files are what was saved
    problems = []
    here = plan.path.resolve()
    later = [f for f in folders if f.step > plan.step and f.path.resolve() != here]
    if later and not overwrite:
        newest = next((f for f in reversed(later) if f.problem is None), None)
        hint = f"Continue the newest with resume={newest.path}, or move" if newest else "Move"
        problems.append(
            f"this run starts at step {plan.step} ({plan.path.name}), but {checkpoints} holds "
            f"later checkpoints that its saves would replace:\n{_listing(later)}\n{hint} them "
            f"out of {checkpoints}, or set checkpoint.overwrite=true to let this run replace them."
        )
    saved_config = plan.saved_meta.get("config")
    if saved_config is None:
        plan.notices.append(
            f"{plan.path} does not record the settings it was saved with; they were not compared"
        )
    else:
        allowed, refused = resume_changes(saved_config, run_config, fixed, defaults)
        if refused:
            problems.append(
                f"{plan.path} was saved with other settings that a resume may not change (they "
                "decide what its weights and optimizer state mean, or the order of the data):\n"
                + "\n".join(f"  - {line}" for line in refused)
                + f"\nSet them back (the saved ones are in {plan.path / META_FILE}), or "
                + _start_anew_from(plan)
            )
        if allowed:
            plan.notices.append(
                f"settings changed since {plan.path.name} was saved, applied from here on: "
                + "; ".join(allowed)
            )
    if max_steps < plan.step:
        problems.append(
            f"max_steps={max_steps} is below the step of {plan.path} ({plan.step}), which this "
            f"run resumes. Raise max_steps above {plan.step} to train further, or use another "
            "output_dir to start over."
        )
    elif max_steps == plan.step:
        plan.finished = True  # said last, by `nothing_left_to_train`, when the run ends
    if problems:
        raise CheckpointError("\n".join(([plan.reason + "."] if plan.reason else []) + problems))
    if plan.reason:
        plan.notices.insert(0, f"{plan.reason}: resuming from it")
    return plan
