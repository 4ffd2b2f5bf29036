"""The `profiler:` section: torch.profiler around a few training steps, for any recipe.

    profiler:
      enabled: true
      wait: 5        # steps skipped first (start-up, warm caches)
      warmup: 2      # steps traced but thrown away (the profiler's own start-up)
      active: 3      # steps recorded
      repeat: 1      # cycles of wait + warmup + active (0: until the end)

Each rank writes, under `<output_dir>/profile/`, a Chrome trace per cycle
(`rank<R>_step<S>.json`: chrome://tracing or https://ui.perfetto.dev open it; the
collectives show as gloo / nccl kernels beside the compute) and a table of the
ops by self time (`rank<R>_step<S>_ops.txt`); on CUDA also the memory timeline
(`..._memory.html`; `.json` where matplotlib is missing) when `profile_memory` is on.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from freetx.fields import at_least


@dataclass
class ProfilerConfig:
    enabled: bool = False
    wait: int = at_least(0, default=5)
    warmup: int = at_least(0, default=2)
    active: int = at_least(1, default=3)
    repeat: int = at_least(0, default=1)
    record_shapes: bool = True
    profile_memory: bool = False
    with_stack: bool = False


class StepProfiler:
    """torch.profiler with the section's schedule; `step()` after every optimizer step."""

    def __init__(self, cfg: ProfilerConfig, output_dir: str, rank: int, device_type: str):
        import torch

        self.folder = Path(output_dir) / "profile"
        self.rank = rank
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.sort_by = "self_cuda_time_total" if device_type == "cuda" else "self_cpu_time_total"
        self.profile_memory = cfg.profile_memory and device_type == "cuda"
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat
            ),
            on_trace_ready=self._write,
            # the memory timeline needs shapes and stacks to sort tensors by kind
            record_shapes=cfg.record_shapes or self.profile_memory,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack or self.profile_memory,
        )
        self.profiler.start()

    def _write(self, profiler) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"rank{self.rank}_step{profiler.step_num}"
        profiler.export_chrome_trace(f"{stem}.json")
        table = profiler.key_averages().table(sort_by=self.sort_by, row_limit=40)
        Path(f"{stem}_ops.txt").write_text(table + "\n")
        if self.profile_memory:  # a plot when matplotlib is there, else the raw timeline
            plot = importlib.util.find_spec("matplotlib") is not None
            profiler.export_memory_timeline(f"{stem}_memory.{'html' if plot else 'json'}")

    def step(self) -> None:
        self.profiler.step()

    def stop(self) -> None:
        self.profiler.stop()
