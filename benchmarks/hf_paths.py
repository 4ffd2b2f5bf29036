"""freetx's native decoder vs the generic transformers path, and the native decoder's
attention kernels, on a tiny Gemma 2 and a tiny Qwen3-MoE written as config.json
(`CONFIGS`: 4 layers, hidden 256, 4 heads / 2 KV of 64, vocabulary 2048; Gemma 2 with
both soft-caps and a 128-token window on every other layer; Qwen3-MoE with 8 experts of
128, top 2), at batch 4 x 256 tokens, fp32, one thread, random weights.

- native: `freetx.models.hf_model(folder)` (its layout: freetx's decoder), on CPU with
  the kernel `choose_kernel` picks (Gemma 2: explicit, for the soft-cap; Qwen3-MoE: SDPA).
- generic: `HFGenericModel` of the same config.json (transformers' modules; Gemma 2: eager
  attention, as transformers has no sdpa for it; Qwen3-MoE: its experts fused, as
  transformers converts a folder's per-expert tensors on load).

A training step is forward + cross-entropy (+ the native MoE's router loss) + backward +
AdamW step: the median (and the fastest) of 9 steps after 2 warm-up steps, the native and
generic models' steps taken in turn. Peak memory: the peak of live
tensor bytes over one step after warm-up (parameters, gradients, AdamW state,
activations, temporaries), from torch's MemTracker; process RSS is not used (the CPU
allocator keeps freed memory). Kernels: benchmarks/attention_kernels.py's measure (the
fastest of 5 calls, the kernel forced in every layer; FlexAttention forward only on CPU).

    OMP_NUM_THREADS=1 python benchmarks/hf_paths.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_kernels import kernel_rows  # noqa: E402
from benchmarks.common import table  # noqa: E402
from freetx.distributed import materialize  # noqa: E402
from freetx.models import hf_model  # noqa: E402
from freetx.models.hf_generic import HFGenericConfig, HFGenericModel  # noqa: E402

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=512)  # fmt: skip
# name -> (transformers config class, fields, the kernels that compute its layers)
CONFIGS = {
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=64, sliding_window=128,
                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    pad_token_id=0, eos_token_id=1, bos_token_id=2),
               ["explicit", "flex"]),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=128, norm_topk_prob=True),
                  ["sdpa", "sdpa_mask", "explicit", "flex"]),
}  # fmt: skip
BATCH, SEQ, WARMUP, STEPS = 4, 256, 2, 9
MIB = 2**20


def native(folder: Path):
    with torch.device("meta"):
        model = hf_model(str(folder))
    materialize(model, torch.device("cpu"), seed=0)
    return model, model.describe()


def generic(config):
    """The generic path's model of `config` (transformers' modules)."""
    with torch.device("meta"):
        model = HFGenericModel(HFGenericConfig(config.to_dict()))
    materialize(model, torch.device("cpu"), seed=0)
    return model, model.describe()


def train_step(model, optimizer, ids: torch.Tensor) -> None:
    out = model(ids)
    logits = out if torch.is_tensor(out) else out.logits  # HF output, freetx's LMOutput
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    aux = getattr(out, "aux_loss", None)
    (loss if aux is None else loss + aux).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_times(models: list, ids: torch.Tensor) -> list[list[float]]:
    """Per model, the ms of STEPS training steps after WARMUP, the models' steps taken in
    turn (what else runs on the machine slows each alike)."""
    optimizers = [torch.optim.AdamW(m.train().parameters(), lr=1e-4) for m in models]
    times = [[] for _ in models]
    for _ in range(WARMUP + STEPS):
        for model, optimizer, spent in zip(models, optimizers, times):
            start = time.perf_counter()
            train_step(model, optimizer, ids)
            spent.append((time.perf_counter() - start) * 1000)
    return [spent[WARMUP:] for spent in times]


def peak_mib(model, ids: torch.Tensor) -> float:
    """The peak MiB of live tensors in a training step after a warm-up step (MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    optimizer = torch.optim.AdamW(model.train().parameters(), lr=1e-4)
    train_step(model, optimizer, ids)  # AdamW's state exists from here on, as in training
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        train_step(model, optimizer, ids)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / MIB


def main() -> None:
    import transformers

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # eager FlexAttention says it is not compiled
    ids = torch.randint(3, 2048, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    paths, kernels = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (class_name, fields, names) in CONFIGS.items():
            config = getattr(transformers, class_name)(**{**SHAPE, **fields})
            config.save_pretrained(Path(tmp) / name)
            built = {"native": native(Path(tmp) / name), "generic": generic(config)}
            models = [model for model, _ in built.values()]
            times = step_times(models, ids)
            figures = {}
            for (path, (model, what)), spent in zip(built.items(), times):
                figures[path] = (statistics.median(spent), min(spent), peak_mib(model, ids))
                params = sum(p.numel() for p in model.parameters()) / 1e6
                median, fastest, peak = figures[path]
                paths.append([name, path, what, f"{params:.2f}M", f"{median:.0f}",
                              f"{fastest:.0f}", f"{peak:.0f}"])  # fmt: skip
            ratios = [f"{g / n:.2f}" for n, g in zip(figures["native"], figures["generic"])]
            paths.append([name, "generic / native", "", "", *ratios])
            kernels += kernel_rows(built["native"][0], ids, names, name, repeats=5)
    print(f"training step (forward + backward + AdamW), batch {BATCH} x {SEQ}, fp32, 1 thread; "
          f"the two paths' steps in turn, {STEPS} each after {WARMUP}; peak MiB of live "
          "tensors in a step (MemTracker)")  # fmt: skip
    print(table(paths, ["model", "path", "what", "params", "median ms", "fastest ms",
                        "peak MiB"]))  # fmt: skip
    print("\nnative decoder's attention kernels forced in every layer, same batch: ms per call "
          "(fastest of 5)")  # fmt: skip
    print(table(kernels, ["model", "kernel", "forward ms", "forward + backward ms"]))


if __name__ == "__main__":
    main()
