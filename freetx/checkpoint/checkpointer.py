"""The checkpointer every recipe uses: DCP sharded saves, atomic, resumable.

    <output_dir>/checkpoints/
      step_000200/          a complete DCP checkpoint (every rank wrote its shards)
        .metadata           DCP's index of every tensor
        __0_0.distcp ...    one data file per rank
        meta.json           freetx version, step, world size, strategy, model class,
                            model config and its hash, the run's resolved config
      LATEST                the name of the newest complete checkpoint
    <output_dir>/.freetx.lock   held by rank 0 while a run uses the folder

A run first claims its output_dir and decides what it resumes from
(`run_folder.plan_resume`: refusals come before anything is built). A save
writes to `.tmp_step_000200/`; only when every rank has finished (DCP's final
metadata write is collective) does rank 0 add meta.json, rename the folder to
`step_000200/` and then update LATEST. A rank that dies during a save leaves
only a `.tmp_*` folder (removed, and said so, at the next start): LATEST
still names the previous checkpoint, which is untouched. Older complete
checkpoints of the same run beyond `keep_last` are pruned. With `async_save`,
DCP copies the state to CPU memory (a copy kept between saves: one more copy
of the state per rank), training goes on, and a background thread writes;
the next save (or the end of training) waits for it first. The saves are written by
saver.py's `CheckpointSaver`; the checkpointer claims the folder, plans the resume and
restores.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

import freetx
from freetx.checkpoint.dcp_folder import (
    DCP_ERRORS,
    FROZEN_FROM,
    STEP_PREFIX,
    DCPReader,
    SafeLoadPlanner,
    describe_dcp_error,
)
from freetx.checkpoint.formats import DCPSource
from freetx.checkpoint.identity import changed_inputs, input_identity, same_input
from freetx.checkpoint.loading import (
    WeightSource,
    check_checkpoint,
    check_weights,
    load_weights,
    weight_source,
)
from freetx.checkpoint.run_folder import (
    TMP_PREFIX,
    RecipeMark,
    ResumePlan,
    RunLock,
    check_output_dir,
    check_recipe,
    plan_resume,
)
from freetx.checkpoint.saver import CheckpointSaver
from freetx.checkpoint.state import PerRankState, ScalerState
from freetx.config.compare import fixed_on_resume, schema_defaults
from freetx.config.run_config import loaded_config_file, write_resolved_config
from freetx.config.schema import config_as_dict
from freetx.distributed.groups import HostGroup
from freetx.errors import CheckpointError, FreetxError
from freetx.fields import at_least

# the name a run's initial weights are recorded under in meta.json's `inputs`
INITIAL_WEIGHTS = "checkpoint.initial_weights"


@dataclass
class CheckpointConfig:
    """The `checkpoint:` section."""

    every_n_steps: int = at_least(0, default=0)  # 0: no periodic saves (only the final one)
    keep_last: Optional[int] = at_least(1, default=None)  # None: keep every checkpoint
    async_save: bool = False
    save_final: bool = True
    # at the end of training, the final checkpoint converted for deployment into
    # <output_dir>/export/<format>/ (freetx.training.export): hf | peft | safetensors, or
    # auto: what the run trains (LoRA adapters: peft; the whole model: hf)
    final_export: Optional[Literal["hf", "peft", "safetensors", "auto"]] = None
    initial_weights: Optional[str] = None  # safetensors file, DCP folder or HF folder
    # true: this run may replace checkpoints in output_dir that it did not write
    # (resume=never over an old run, or later checkpoints of an abandoned branch)
    overwrite: bool = False
    # true: a resume may continue from a checkpoint whose meta.json records no checksums
    # (saved before freetx recorded them, or edited); false: refused, naming it
    resume_unverified: bool = False


def config_hash(model_config: dict[str, Any]) -> str:
    """A short, stable hash of a model's shape (what decides whether weights fit)."""
    text = json.dumps(model_config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Checkpointer:
    """Saves and loads the Stateful objects of a run; one instance per run, on every rank.

    Made first in a recipe's setup, from the run's config (output_dir, resume,
    max_steps, checkpoint): it claims output_dir and plans the resume, so a run
    that would lose saved work is refused before any model is built.
    """

    def __init__(
        self,
        run_config: Any,
        rank: int,
        host: HostGroup | None = None,
        recipe: RecipeMark | None = None,
    ) -> None:
        self.run_config = run_config
        self.recipe = recipe  # recorded in output_dir (recipe.json) and meta.json
        self.output_dir = Path(run_config.output_dir)
        self.dir = self.output_dir / "checkpoints"
        self.cfg = run_config.checkpoint
        self.rank = rank
        self.meta: dict[str, Any] = {}
        self._lock = RunLock(self.output_dir)
        # a separate gloo group: background (async) writes must not interleave with
        # the training loop's collectives on the default group
        self.host = host or HostGroup.new()
        self.saver = CheckpointSaver(self.dir, self.cfg, rank, self.host)
        self.plan: ResumePlan = self._agree(self._plan if rank == 0 else None)

    # -- claiming output_dir and planning the resume (rank 0 decides) -----------
    def _plan(self) -> ResumePlan:
        notices = []
        check_output_dir(self.output_dir, loaded_config_file())  # no folder taken over
        try:
            lock_notice = self._lock.acquire()  # creates output_dir
            self.dir.mkdir(exist_ok=True)  # a file in its place fails now, not at the save
        except OSError as e:
            raise CheckpointError(
                f"cannot write to output_dir {self.output_dir} ({e.filename}: {e.strerror}). "
                "Pick an output_dir you can write to (output_dir=PATH)."
            ) from None
        if lock_notice:
            notices.append(lock_notice)
        resume, overwrite = str(self.run_config.resume), bool(self.cfg.overwrite)
        if self.recipe is not None:  # another recipe's folder: refused before anything
            check_recipe(self.output_dir, self.recipe, resume, overwrite)
        for stale in sorted(self.dir.glob(f"{TMP_PREFIX}{STEP_PREFIX}*")):
            if stale.is_dir():  # a save that never finished: never a checkpoint
                shutil.rmtree(stale, ignore_errors=True)
                notices.append(f"removed {stale.name}, a save that did not finish")
        plan = plan_resume(
            self.dir,
            resume,
            overwrite,
            int(self.run_config.max_steps),
            config_as_dict(self.run_config),
            fixed_on_resume(self.run_config),
            schema_defaults(self.run_config),  # keys added since a save, at their default
            unverified=bool(self.cfg.resume_unverified),
        )
        if self.recipe is not None:  # the folder is this recipe's run from now on
            self.recipe.write(self.output_dir)
        plan.notices[:0] = notices
        return plan

    def _agree(self, decide) -> ResumePlan:
        """Rank 0 decides; every rank gets the same plan, or raises the same error."""
        outcome: tuple[str, Any] = ("plan", None)
        crash: Exception | None = None
        if decide is not None:
            try:
                outcome = ("plan", decide())
            except FreetxError as e:
                outcome = ("refused", str(e))
            except Exception as e:  # the other ranks must hear of it, or they wait forever
                crash, outcome = e, ("crashed", repr(e))
        kind, value = self.host.broadcast_object(outcome, src=0)
        if kind == "plan":
            return value
        self._lock.release()
        if kind == "refused":
            raise CheckpointError(value)
        if crash is not None:
            raise crash
        raise RuntimeError(f"rank 0 failed while planning the resume: {value}")

    @property
    def loads_weights(self) -> bool:
        """Whether `restore` will set every model weight (a resume or initial weights)."""
        return self.plan.path is not None or bool(self.cfg.initial_weights)

    @functools.cached_property
    def initial_weights(self) -> WeightSource | None:
        """`checkpoint.initial_weights`, surveyed once (the banner's line, then `restore`)."""
        return weight_source(self.cfg.initial_weights) if self.cfg.initial_weights else None

    def weights_origin(self, seed: int) -> str:
        """Where the model's weights come from, for the banner: `resumed from CHECKPOINT`,
        the initial weights (`DIR (HF safetensors)`), or `random init (seed N)`."""
        if self.plan.source is not None:
            return f"resumed from {self.plan.source.path}"
        if self.initial_weights is not None:
            return self.initial_weights.describe()
        return f"random init (seed {seed})"

    def restore(
        self,
        state: dict[str, Stateful],
        model,
        meta: dict[str, Any],
        frozen_from: str | None = None,
        inputs: dict[str, str | list[Path]] | None = None,
    ) -> str | None:
        """Load the planned checkpoint, else the initial weights, else nothing; then write
        `<output_dir>/config.yaml` (training starts). `meta` describes the model for saves.
        `frozen_from`: where the frozen parameters are read from when the checkpoints hold
        only the trainable ones (the frozen-base decision's `read_from`; None: they hold
        the whole model). `inputs`: what else the run reads (name -> path: activation
        sources, say); with the initial weights they are recorded by identity in every
        checkpoint (`identity.py`), and a resume whose inputs changed is refused.

        One pass: the survey (the checkpoint, surveyed when the resume was planned; the
        weights read from files; what every input is now), the check (every refusal,
        before a weight is touched), the load. Returns the lines for the log (how the
        run starts, and every notice), or None.
        """
        self.meta = {**meta, "config": config_as_dict(self.run_config)}
        if self.recipe is not None:
            self.meta["recipe"] = self.recipe.as_dict()
        lines = list(self.plan.notices)
        checkpoint = self.plan.source
        # the survey
        recorded = dict(self.plan.saved_meta.get("inputs", {}))
        weights: WeightSource | None = None
        if checkpoint is None and self.initial_weights is not None:
            weights = self.initial_weights
        elif checkpoint is not None and frozen_from is not None:
            # the checkpoint holds the trainable part; the frozen base is read again
            weights = self._frozen_base(recorded, frozen_from, lines)
        now = {name: input_identity(path) for name, path in (inputs or {}).items()}
        if weights is not None:
            now[INITIAL_WEIGHTS] = weights.identity
        # the check
        if checkpoint is not None:
            changed = changed_inputs(recorded, now)
            if changed:
                raise CheckpointError(
                    f"{checkpoint.path} was trained on other inputs than this resume would "
                    "read:\n" + "\n".join(f"  - {line}" for line in changed) + "\nPoint them "
                    "back at what the run read, or start a new run (another output_dir): one "
                    "run's checkpoints would otherwise mix two inputs."
                )
        if weights is not None:
            check_weights(model, weights)
        if checkpoint is not None and "model" in state:
            check_checkpoint(model, checkpoint, include=state["model"].include)
        # the load
        not_read = load_weights(model, weights) if weights is not None else []
        if checkpoint is not None:
            self._load(checkpoint, state)
            lines.append(
                f"resumed from {checkpoint.path} (step {state['train'].step}, saved at world "
                f"size {checkpoint.meta.get('world_size', '?')} with "
                f"{checkpoint.meta.get('strategy', '?')})"
            )
            recorded.update({k: v for k, v in now.items() if k not in recorded})
        else:
            if weights is not None:
                lines += [f"initial weights from {weights.given}", *not_read]
            recorded = now
        self.meta["inputs"] = recorded
        if frozen_from is not None:
            self.meta[FROZEN_FROM] = weights.given  # only the trainable part
        if self.rank == 0:
            write_resolved_config(self.run_config)
        return "\n".join(lines) or None

    @staticmethod
    def _frozen_base(recorded: dict[str, dict], frozen_from: str, lines: list[str]) -> WeightSource:
        """Where a resume reads its frozen base: the checkpoint the run started from, while
        it is there unchanged (a base run folder may have trained on since), else the
        configured path (then compared with the record)."""
        configured = weight_source(frozen_from)
        before = recorded.get(INITIAL_WEIGHTS)
        if before is None or not Path(before["path"]).exists():
            return configured
        base = weight_source(before["path"])
        if not same_input(before, base.identity):
            return configured
        if str(configured.path.resolve()) != before["path"]:
            lines.append(
                f"the frozen base is read from {before['path']}, the checkpoint this run "
                f"started from ({frozen_from} means another one now)"
            )
        return base

    def _load(self, checkpoint: DCPSource, state: dict[str, Stateful]) -> None:
        """Load `state` in place from a checked checkpoint (`check_checkpoint`)."""
        saved = checkpoint.infos.keys() | checkpoint.extras.keys()
        state = {
            key: value
            for key, value in state.items()
            if not isinstance(value, ScalerState) or any(k.startswith(f"{key}.") for k in saved)
        }
        for key, value in state.items():
            if isinstance(value, PerRankState):
                own = f"{key}.rank_{value.rank}"
                value.source_rank = value.rank if own in saved else 0
        try:
            dcp.load(
                state, storage_reader=DCPReader(str(checkpoint.path)), planner=SafeLoadPlanner()
            )
        except CheckpointError:
            raise
        except DCP_ERRORS as e:
            raise CheckpointError(
                f"loading checkpoint {checkpoint.path} failed: {describe_dcp_error(e)}. Its "
                "files may be truncated or corrupt; resume from an earlier checkpoint "
                "(resume=PATH)."
            ) from e

    # -- saving (CheckpointSaver) ---------------------------------------------------
    def save(self, step: int, state: dict[str, Stateful], extra_meta: dict[str, Any]) -> None:
        """Save `state` as step `step`; asynchronously when configured."""
        self.saver.save(step, state, {**self.meta, **extra_meta})

    def wait(self) -> None:
        """Block until an asynchronous save has finished, then make it visible."""
        self.saver.wait()

    def close(self) -> None:
        self.wait()
        self._lock.release()
        self.host.destroy()


def build_meta(module, world_size: int, strategy: str) -> dict:
    """The fields meta.json records about a run's model (`module`: the model under any
    wrapper, following the model protocol: its `config` rebuilds it)."""
    cls = type(module)
    model_class = getattr(cls, "__wrapped_class__", None) or _original_class(cls)
    model_config = dataclasses.asdict(module.config)
    return {
        "freetx_version": freetx.__version__,
        "world_size": world_size,
        "strategy": strategy,
        "model_class": f"{model_class.__module__}.{model_class.__qualname__}",
        "model_config": model_config,
        "model_config_hash": config_hash(model_config),
    }


def _original_class(cls: type) -> type:
    """FSDP2 makes `FSDP<Class>` subclasses; name the model's own class."""
    for base in cls.__mro__:
        if (
            not base.__name__.startswith("FSDP")
            and base.__module__ != "torch.nn.parallel.distributed"
        ):
            return base
    return cls
