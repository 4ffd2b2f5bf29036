"""4-process checks of tensor parallelism (run by test_tensor_parallel.py through
torchrun): a (dp 2, tp 2) mesh, FSDP2 over dp, the decoder's attention and MLP sliced
over tp. Against one process on the whole global batch: the initial weights, the
gradients (tied and untied heads, an MoE decoder with its router loss; the loss whole
or in chunks, with gradient accumulation), the clipped update, and which ranks read
which data."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
from freetx.distributed.init import full_tensor, materialize
from freetx.models.transformer import decoder
from freetx.training import CrossEntropyLoss, build_lr_scheduler, optimizer_step
from freetx.training.config import LRScheduleConfig
from freetx.training.step import count_over_ranks
from tests.distributed.launcher import write_results

SEED = 7
FIELDS = dict(vocab_size=96, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
              ffn_hidden_dim=48, max_seq_len=32, qkv_bias=True)  # fmt: skip
# Qwen3-MoE's shape of block: 4 experts, 2 per token, layer 1 a dense MLP
MOE = dict(num_experts=4, experts_per_token=2, moe_ffn_hidden_dim=24, mlp_only_layers=[1],
           router_aux_loss_coef=0.05, qk_norm="head")  # fmt: skip
MODELS = {"untied": dict(tie_embeddings=False), "tied": dict(tie_embeddings=True),
          "moe": dict(tie_embeddings=False, **MOE)}  # fmt: skip
GLOBAL_BATCH = 8
DATA_RANKS = 2  # of the (dp 2, tp 2) mesh


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (GLOBAL_BATCH, 17), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100  # a prompt
    return ids[:, :-1], labels


def optimizer_cfg():
    return OmegaConf.create({"_component_": "torch.optim.SGD", "lr": 0.5})


def step(model, plan, groups, chunks: int | None, accumulation: int):
    """One clipped SGD step (Adam's first step divides by |g|, so it would amplify the
    last bits of near-zero gradients); (initial weights, grads, updated weights), whole."""
    inputs, labels = batch()
    if groups is not None:  # this dp rank's rows
        per_rank = GLOBAL_BATCH // groups.dp_size
        rows = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
        inputs, labels = inputs[rows], labels[rows]
    else:  # the same micro-batches, one after another: an MoE's router loss is per batch
        accumulation *= DATA_RANKS
    init = {n: full_tensor(p).clone() for n, p in model.named_parameters()}
    counts = [(y != -100).sum() for y in labels.chunk(accumulation)]
    total = count_over_ranks(groups, counts) if groups is not None else sum(counts)
    dp = 1 if groups is None else groups.dp_size
    loss_fn = CrossEntropyLoss(num_chunks=chunks)
    for x, y in zip(inputs.chunk(accumulation), labels.chunk(accumulation)):
        loss, _ = loss_fn(model, x, y)
        (loss * dp / total).backward()
    grads = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    if plan is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
    else:
        optimizer = plan.build_optimizer(optimizer_cfg())
        scheduler = build_lr_scheduler(optimizer, 10, OmegaConf.structured(LRScheduleConfig()))
        optimizer_step(plan, optimizer, scheduler, 0.05)  # clipped: the norm is ~1
    return init, grads, {n: full_tensor(p).clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main() -> None:
    runtime = init_distributed("cpu")
    results: dict = {"world_size": runtime.world_size}
    cfg = OmegaConf.structured(DistributedConfig(strategy="fsdp", tp=2))
    groups = build_groups(runtime, cfg)
    results["axes"] = [groups.dp_rank, groups.dp_size, groups.rank("tp"), groups.size("tp")]
    for name, fields in MODELS.items():
        for chunks, accumulation in ((1, 1), (3, 2)):
            with torch.device("meta"):
                reference = decoder(**FIELDS, **fields)
            materialize(reference, torch.device("cpu"), SEED)
            want = step(reference.train(), None, None, chunks, accumulation)
            with torch.device("meta"):
                model = decoder(**FIELDS, **fields)
            plan = parallelize(model, groups, cfg, seed=SEED)
            got = step(plan.model.train(), plan, groups, chunks, accumulation)
            key = f"{name}/chunks{chunks}/accumulation{accumulation}"
            for i, part in enumerate(("init", "grad", "param")):
                results[f"{key}/{part}"] = max_diff(got[i], want[i])
    write_results(results)


if __name__ == "__main__":
    main()
