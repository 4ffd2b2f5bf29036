"""The optimizer's memory rungs through the CLI, as a user runs them (full_finetune_fsdp2,
llm/tiny): on 2 processes `optimizer.offload=cpu` (with activation offloading) trains to
the ordinary optimizer's losses, and a run saved with it resumes without it; on 1
process `optimizer.in_backward` does the same (no clipping: it cannot clip)."""

from __future__ import annotations

import pytest

from tests.recipes.test_checkpoint_resume import losses, train

pytestmark = pytest.mark.slow  # 5 runs, ~50 s
EXACT = 1e-6


def close(a: dict, b: dict, steps) -> float:
    return max(abs(a[s] - b[s]) for s in steps)


def test_offload_on_two_processes_trains_and_resumes_as_the_ordinary_optimizer(tmp_path):
    train(tmp_path / "plain", "max_steps=6")
    switched = tmp_path / "switched"  # with activation offloading too (CPU: the same hooks)
    train(
        switched, "max_steps=3", "optimizer.offload=cpu", "distributed.activation_offloading=true"
    )
    result = train(switched, "max_steps=6")  # the rung off on resume
    assert "(step 3," in result.stdout
    assert close(losses(switched), losses(tmp_path / "plain"), range(1, 7)) <= EXACT


def test_in_backward_on_one_process_trains_as_the_ordinary_optimizer(tmp_path):
    train(tmp_path / "plain", "max_steps=4", "max_grad_norm=null", nproc=1)
    train(tmp_path / "in_backward", "max_steps=4", "max_grad_norm=null",
          "optimizer.in_backward=true", nproc=1)  # fmt: skip
    assert close(losses(tmp_path / "in_backward"), losses(tmp_path / "plain"), range(1, 5)) <= EXACT


def test_torchao_8bit_adamw_resumes_on_two_processes_from_a_warm_compile_cache(tmp_path):
    """llm/tiny's embedding (259 rows) is sharded unevenly (130 + 129): torch 2.13's
    AOTAutograd cache keys torchao's compiled step by the global shape, so the resume,
    reading the cache the first run wrote, loaded the other rank's step and failed
    (`avoid_shared_compile_cache`)."""
    import os

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    low_bit = ["optimizer._component_=torchao.optim.AdamW8bit"]
    train(tmp_path / "run", "max_steps=1", *low_bit, env=env)
    result = train(tmp_path / "run", "max_steps=2", *low_bit, env=env)
    assert "(step 1," in result.stdout and sorted(losses(tmp_path / "run")) == [1, 2]
