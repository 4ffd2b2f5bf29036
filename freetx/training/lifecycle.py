"""`TrainingRun`: what every training recipe does besides its loop.

A recipe owns its loop, top to bottom, in its own file; this is the
bookkeeping around it, written once:

    groups = build_groups(runtime, cfg.distributed)  # the ranks by axis (dp, world)
    run = TrainingRun(cfg, groups, "my_recipe")  # claims output_dir, plans the resume
    ... build the model (parallelize), optimizer, scheduler, data ...
    run.start(plan, optimizer, lr_scheduler, train_loader, tokens_per_sample=seq_len)
    while run.step < cfg.max_steps and not run.stopping:   # stopping: SIGTERM / SIGUSR1 / ^C
        ... accumulate_gradients, grad_norm = optimizer_step(...) ...
        run.advance(grad_norm)                     # step, epoch, tokens seen, NaN guard,
                                                   # and the ranks agree on a stop signal
        if run.log_due():
            run.log_train(sums, count, grad_norm)
        if run.due(cfg.eval.every_n_steps):
            run.evaluate(self.evaluate)            # evaluate() -> metrics to log
        if run.due(cfg.checkpoint.every_n_steps):
            run.save()
    run.finish(self.evaluate)                      # final evaluation and save (or, when
    run.close()                                    # stopping, the save and PREEMPTED)

`start` prints the banner, resumes from a checkpoint (or loads initial
weights) and writes config.yaml; `save` writes the model, optimizer,
scheduler, progress, every rank's data position and RNG. Every method that
takes part in a collective (log_train, evaluate, save, finish) is called by
every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from freetx.checkpoint import (
    Checkpointer,
    ModelState,
    OptimizerState,
    PerRankState,
    ScalerState,
    TrainState,
    step_name,
)
from freetx.checkpoint.checkpointer import build_meta
from freetx.checkpoint.run_folder import RecipeMark, claim_output_dir, nothing_left_to_train
from freetx.checkpoint.state import LRSchedulerState
from freetx.config.run_config import loaded_config_file
from freetx.config.schema import config_as_dict
from freetx.distributed import (
    FrozenBase,
    HostGroup,
    ParallelGroups,
    ParallelPlan,
    Processes,
    frozen_base,
)
from freetx.distributed.optimizer import check_optimizer, steps_in_backward
from freetx.entry import at_step, running_recipe_file
from freetx.errors import TrainingError
from freetx.loggers import build_metric_loggers, training_banner
from freetx.models import num_active_parameters, num_parameters, training_flops_per_token
from freetx.models.protocol import DescribesItself
from freetx.training.config import check_per_rank_forwards
from freetx.training.export import check_final_export, export_final
from freetx.training.meters import ThroughputMeter, peak_flops, train_step_metrics
from freetx.training.profiling import StepProfiler
from freetx.training.seed import rng_state, set_rng_state
from freetx.training.signals import PREEMPTED_FILE, StopRequest


def training_state(
    plan: ParallelPlan,
    optimizer,
    lr_scheduler,
    progress: TrainState,
    loader,
    rank: int,
    frozen: FrozenBase | None = None,
) -> dict[str, Stateful]:
    """Everything a training checkpoint holds, under the names DCP saves them by.

    When the frozen-base decision reads the frozen parameters from a file
    (`frozen.read_from`: the initial weights of a LoRA / QLoRA / Spectrum run), only
    the trainable ones are saved; a resume reads the base from there again.
    """
    include = frozen.saved if frozen is not None and frozen.read_from else None
    state: dict[str, Stateful] = {
        "model": ModelState(plan.model, include=include),
        "optimizer": OptimizerState(plan.model, optimizer),
        "lr_scheduler": LRSchedulerState(lr_scheduler),
        "train": progress,
        "dataloader": PerRankState(rank, loader.state_dict, loader.load_state_dict),
        "rng": PerRankState(rank, rng_state, set_rng_state),
    }
    if plan.scaler.is_enabled():  # float16: the loss scale a resume continues with
        state["scaler"] = ScalerState(plan.scaler)
    return state


def recipe_mark(name: str, file: Path | None) -> RecipeMark:
    """The recipe a run belongs to, for its folder: `name` (what the recipe calls its
    runs) and its file, unless that is a built-in recipe's (whose path is this
    installation's)."""
    from freetx.registry import recipes_dir

    if file is None or Path(file).resolve().parent == recipes_dir().resolve():
        return RecipeMark(name)
    return RecipeMark(name, str(Path(file).resolve()))


def claim_folder(output_dir: str | Path, recipe: str, mark: bool = True) -> None:
    """For a recipe that writes its output_dir without a checkpointer (generate, eval):
    refuse a folder it would take over, then mark it as this recipe's (`claim_output_dir`;
    `mark`: the rank that writes)."""
    claim_output_dir(
        output_dir, recipe_mark(recipe, running_recipe_file()), loaded_config_file(), mark
    )


class TrainingRun:
    """A run's progress, checkpoints, loggers and meters (see the module docstring)."""

    def __init__(self, cfg, groups: ParallelGroups, recipe: str) -> None:
        self.cfg = cfg
        self.groups = groups
        self.runtime = runtime = groups.runtime
        self.recipe = recipe
        # first: a run that would lose saved work is refused before anything is built
        self.checkpointer = Checkpointer(
            cfg, runtime.rank, groups.host(), recipe=recipe_mark(recipe, running_recipe_file())
        )
        # the optimizer's memory rungs a run cannot take (validate and run refuse alike)
        check_optimizer(
            cfg.optimizer,
            cfg.distributed,
            Processes.of(runtime),
            cfg.gradient_accumulation_steps,
            cfg.max_grad_norm,
        )
        check_per_rank_forwards(cfg, groups.size("ep"))  # and the forwards ep cannot run
        self.progress = TrainState()  # step, epoch, tokens seen: saved with every checkpoint
        self.loggers = build_metric_loggers(
            cfg.metric_loggers,
            cfg.output_dir,
            cfg.max_steps,
            runtime.rank,
            named=cfg.loggers,
            hyperparameters=config_as_dict(cfg),
        )
        self.saved_step: int | None = None
        self.evaluated_step: int | None = None
        self.nonfinite_in_a_row = 0
        self.stop = StopRequest()
        self.stop.install()
        # its own gloo group: the agreement must not queue behind an asynchronous save on
        # the checkpointer's group, nor wait for the device's work
        self.stop_group = HostGroup.new()
        self.step_hooks: list[Callable[[int], None]] = []

    @property
    def loads_weights(self) -> bool:
        """Whether `start` will load every model weight (a resume, or
        `checkpoint.initial_weights`), so that random initialization can be skipped."""
        return self.checkpointer.loads_weights

    @property
    def step(self) -> int:
        """Optimizer steps taken (resumed runs start at the checkpoint's step)."""
        return self.progress.step

    frozen: FrozenBase | None = None  # the frozen-base decision, once made

    def decide_frozen_base(self, model) -> FrozenBase:
        """The frozen-base decision for `model` (before `parallelize`, which takes it):
        what trains, and where the frozen base is read from (the initial weights). `start`
        gives the same decision to the checkpoints; made there when not made here."""
        self.frozen = frozen_base(model, self.cfg.checkpoint.initial_weights)
        return self.frozen

    def start(
        self,
        plan: ParallelPlan,
        optimizer,
        lr_scheduler,
        train_loader,
        tokens_per_sample: int,
        inputs: dict[str, str | list[Path]] | None = None,
        flops_seq_len: int | None = None,
        **facts: Any,
    ) -> None:
        """Everything is built: print the banner, then resume from a checkpoint (or load
        the initial weights) and write config.yaml. `tokens_per_sample` is what a sample
        counts for in throughput and FLOPs (its sequence length; a pair's two, a group's
        several); `flops_seq_len`, where a sample holds several sequences, one sequence's
        length, which attention's FLOPs count (None: tokens_per_sample); `inputs`: models the
        run reads besides its initial weights (name -> path) and the files its data and
        tokenizer read (name -> files, `freetx.checkpoint.files_read_by`), recorded by
        identity and checked on resume; `facts` go into the banner."""
        cfg, module = self.cfg, plan.module
        self.train_loader = train_loader
        self.tokens_per_step = cfg.batch_size * tokens_per_sample
        self.meter = ThroughputMeter(
            training_flops_per_token(module, flops_seq_len or tokens_per_sample),
            self.runtime.world_size,
            peak_flops(self.runtime.device, cfg.peak_flops),
        )
        self.lr_scheduler = lr_scheduler
        self.scaler = plan.scaler
        # optimizer.in_backward: the parameters change in backward, before the norm is known
        self.updates_in_backward = steps_in_backward(optimizer)
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if trainable < sum(p.numel() for p in module.parameters()):
            facts = {"trainable parameters": trainable, **facts}
        if num_active_parameters(module) < num_parameters(module):  # a mixture of experts
            facts = {"active parameters per token": num_active_parameters(module), **facts}
        self.loggers.write(
            training_banner(
                self.recipe,
                self.runtime,
                plan.groups.shape,
                cfg,
                model=module.describe() if isinstance(module, DescribesItself) else None,
                weights=self.checkpointer.weights_origin(cfg.seed),
                parameters=num_parameters(module),
                **facts,
            )
        )
        planned = cfg.planned()
        notice = random_weights_notice(
            planned.model if planned is not None else None,
            self.checkpointer.loads_weights,
            cfg.seed,
        )
        if notice:
            self.loggers.write(notice)
        for caution in cfg.cautions():  # legal, and pointless
            self.loggers.write(f"warning: {caution}")
        self.final_export = check_final_export(cfg, type(module))  # the class is known now
        frozen = self.frozen or self.decide_frozen_base(module)
        self.state = training_state(
            plan,
            optimizer,
            lr_scheduler,
            self.progress,
            train_loader,
            self.runtime.rank,
            frozen,
        )
        meta = build_meta(module, self.runtime.world_size, plan.groups.shape.describe())
        message = self.checkpointer.restore(
            self.state, plan.model, meta, frozen.read_from, inputs=inputs
        )
        if message:
            self.loggers.write(message)
        self.saved_step = self.progress.step
        self.loggers.resume_at(self.progress.step)  # logged steps after it are redone
        self.profiler = None
        if cfg.profiler.enabled:
            self.profiler = StepProfiler(
                cfg.profiler, cfg.output_dir, self.runtime.rank, self.runtime.device_type
            )
        if self.runtime.is_rank_zero:
            (Path(cfg.output_dir) / PREEMPTED_FILE).unlink(missing_ok=True)
        self.meter.reset()  # the first step's time starts now, after the restore

    # -- the loop's bookkeeping ----------------------------------------------
    @property
    def stopping(self) -> bool:
        """A rank was asked to stop (SIGTERM, SIGUSR1, Ctrl-C): every rank stops now."""
        return self.stop.agreed

    def stop_requested(self) -> bool:
        """This process got a stop signal (no collective: `StopAgreement`)."""
        return self.stop.requested is not None

    def agree_to_stop(self) -> bool:
        """Whether any rank got a stop signal: one collective over the world, which every
        rank calls at the same point (each step, in `advance`; inside a step where a
        recipe waits long: `StopAgreement`); `stopping` from then on."""
        self.stop.agree(self.stop_group.any(self.stop_requested()))
        return self.stopping

    def advance(self, grad_norm: float, real_tokens: float | None = None, loss_tokens=None) -> int:
        """Count one optimizer step: step, data epoch, tokens seen, throughput (of
        `real_tokens`, this rank's positions that are not padding, and `loss_tokens`, over
        all ranks, where the recipe counts them: `freetx.training.real_tokens`); the NaN
        guard: a non-finite gradient norm means the update was skipped (`optimizer_step`),
        which is logged, and ends the run under `on_nonfinite: stop` (not for a float16
        overflow: the loss scaler lowers the scale) or after `max_nonfinite_skips` in a
        row; and the stop agreement: every rank learns whether any rank got a stop signal
        (one collective over the world), so `stopping` is the same on every rank after
        this step."""
        if not math.isfinite(grad_norm):
            self.nonfinite_in_a_row += 1
            if self.updates_in_backward:
                raise TrainingError(
                    f"the gradients are not finite at step {self.progress.step + 1}, and "
                    "optimizer.in_backward=true updated each parameter as its gradient was "
                    "ready, so the update could not be skipped. "
                    + after_nonfinite(self.cfg.max_grad_norm, self.saved_step)
                )
            # float16: an overflow of the scaled gradients is the loss scaler at work (it
            # lowers the scale); only max_nonfinite_skips in a row end the run
            overflow = self.scaler.is_enabled()
            why = f"float16 overflow, the loss scale is now {self.scaler.get_scale():g}; "
            self.write(
                f"step {self.progress.step + 1}: the gradient norm is {grad_norm}; "
                f"{why if overflow else ''}the update was skipped "
                f"({self.nonfinite_in_a_row} in a row)"
            )
            limit = self.cfg.max_nonfinite_skips
            stop = self.cfg.on_nonfinite == "stop" and not overflow
            if stop or self.nonfinite_in_a_row >= limit:
                raise TrainingError(
                    f"the loss or the gradients are not finite at step {self.progress.step + 1} "
                    f"({self.nonfinite_in_a_row} step(s) in a row; on_nonfinite="
                    f"{self.cfg.on_nonfinite}, max_nonfinite_skips={limit}). "
                    + after_nonfinite(self.cfg.max_grad_norm, self.saved_step)
                )
        else:
            self.nonfinite_in_a_row = 0
        self.progress.step += 1
        at_step(self.progress.step + 1)  # the next one starts (named if a collective hangs)
        self.agree_to_stop()
        if self.profiler is not None:
            self.profiler.step()
        sampler = getattr(self.train_loader, "batch_sampler", self.train_loader)
        self.progress.epoch = getattr(sampler, "epoch", 0)
        self.progress.tokens_seen += self.tokens_per_step
        self.meter.update(self.tokens_per_step, real_tokens, loss_tokens)
        for hook in self.step_hooks:
            hook(self.progress.step)
        return self.progress.step

    def each_step(self, hook: Callable[[int], None]) -> None:
        """Call `hook(step)` now and after every step: what the next step does by its number
        (QAT's fake quantization from `qat.start_step` on), a resumed run's included."""
        self.step_hooks.append(hook)
        hook(self.progress.step)

    def due(self, every_n_steps: int | None) -> bool:
        """Whether something done every n steps (0: never) is due at this step."""
        return bool(every_n_steps) and self.step % every_n_steps == 0

    def log_due(self) -> bool:
        return self.due(self.cfg.log_every_n_steps) or self.step == self.cfg.max_steps

    def log_train(
        self, sums, count, grad_norm: float, more: dict[str, float] | None = None
    ) -> None:
        """Log a step: loss and sums per unit over all ranks (a collective), lr, grad norm,
        throughput, peak memory, tokens seen, epoch; and the recipe's `more` metrics."""
        metrics = train_step_metrics(
            self.groups, sums, count, grad_norm, self.lr_scheduler, self.meter
        )
        metrics.update(more or {})
        metrics["tokens_seen"] = self.progress.tokens_seen
        metrics["epoch"] = self.progress.epoch
        self.loggers.log(self.step, metrics)

    def log(self, metrics: dict[str, float]) -> None:
        self.loggers.log(self.step, metrics)

    def write(self, text: str) -> None:
        """A line on the console (rank 0)."""
        self.loggers.write(text)

    def evaluate(self, evaluate: Callable[[], dict[str, float]]) -> None:
        """Run the recipe's evaluation (every rank) and log what it returns; its time is
        not the steps' (logged as `time/eval` with the next step's throughput)."""
        with self.meter.apart("eval"):
            metrics = evaluate()
        self.log(metrics)
        self.evaluated_step = self.step

    def save(self) -> None:
        """A sharded DCP save of everything needed to resume (every rank takes part); its
        time is not the steps' (logged as `time/checkpoint` with the next step's)."""
        with self.meter.apart("checkpoint"):
            self.checkpointer.save(
                self.step, self.state, {"tokens_seen": self.progress.tokens_seen}
            )
        self.saved_step = self.step

    def finish(self, evaluate: Callable[[], dict[str, float]] | None) -> None:
        """After the loop: evaluate (None: a run without validation) and save the last step,
        unless already done (a resume at max_steps trains, evaluates and logs nothing, and
        says so last), then write `checkpoint.final_export`. When stopping on a signal:
        save this step and leave PREEMPTED in output_dir (`freetx run` then exits for a
        requeue)."""
        if self.stopping:
            if self.saved_step != self.step:
                self.save()
            self.checkpointer.wait()
            if self.runtime.is_rank_zero:
                reason = self.stop.requested_by
                note = f"{reason} at step {self.step}: saved {step_name(self.step)}\n"
                (Path(self.cfg.output_dir) / PREEMPTED_FILE).write_text(note)
            self.write(
                f"stopped by {self.stop.requested_by} at step {self.step}, checkpoint "
                f"{step_name(self.step)} saved; the same command continues from it"
            )
            return
        # a resume at max_steps trains nothing: its step was evaluated and logged already
        nothing_trained = self.checkpointer.plan.finished and self.step == self.saved_step
        if evaluate is not None and self.evaluated_step != self.step and not nothing_trained:
            self.evaluate(evaluate)
        if self.cfg.checkpoint.save_final and self.saved_step != self.step:
            self.save()
        fmt = self.final_export
        if fmt is not None:
            self.checkpointer.wait()  # an asynchronous final save is complete
            if self.runtime.is_rank_zero:  # streamed from the files: no rank gathers
                path = self.checkpointer.dir / step_name(self.step)
                written = export_final(path, self.cfg.output_dir, fmt)
                self.write(
                    f"exported {path.name} as {fmt} to {written['path']} "
                    f"({written['bytes'] / 2**20:.1f} MiB)"
                )
                for note in written["notes"]:  # what the export is, what was not read
                    self.write(note)
        if nothing_trained:  # the last line: what to pass to train on
            self.write(nothing_left_to_train(self.cfg.output_dir, self.cfg.max_steps))

    def close(self) -> None:
        if getattr(self, "profiler", None) is not None:
            self.profiler.stop()
        self.checkpointer.close()  # waits for an asynchronous save to finish
        self.stop_group.destroy()
        self.loggers.close()


def after_nonfinite(max_grad_norm: float | None, saved_step: int | None) -> str:
    """What a stop on non-finite values leaves on disk (`saved_step`: the last checkpoint),
    and what to change."""
    fix = (
        "lower optimizer.lr (or lengthen lr_schedule.warmup_steps), clip gradients "
        f"(max_grad_norm=1.0; it is {max_grad_norm}), compute in a wider dtype "
        "(distributed.mixed_precision.param_dtype=bfloat16 or float32, not float16) or "
        "check the data"
    )
    if not saved_step:
        return (
            "No checkpoint of this run exists yet (none was saved before the stop), so "
            f"there is nothing to resume from: {fix}, then start the run again."
        )
    return (
        f"No checkpoint holds them: the last one is step {saved_step}. To go on, "
        f"{fix}; the same command then resumes from step {saved_step}."
    )


def random_weights_notice(model_node: Any, loads_weights: bool, seed: int) -> str | None:
    """A config that takes its model's shape from an HF folder (the model node's `path`)
    and loads no weights (`loads_weights`: no resume, no `checkpoint.initial_weights`)
    trains that shape from random weights: said loudly, with the fix, since the folder's
    weights were likely meant. None otherwise."""
    path = model_node.get("path") if hasattr(model_node, "get") else None
    if loads_weights or not isinstance(path, str):
        return None
    if not (Path(path).expanduser() / "config.json").is_file():
        return None
    return (
        f"NOTICE: the model's shape comes from the HF folder {path}, but its weights do "
        f"not: this run trains from random weights (seed {seed}). To start from the "
        f"folder's weights, set checkpoint.initial_weights={path} (as llm/hf_tiny_full "
        "does: initial_weights: ${model_dir}); to train from scratch on purpose, ignore this."
    )
