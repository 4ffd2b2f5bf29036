"""4-process checks of the (pp, dp, cp, tp) mesh (run by test_mesh_layouts.py through
torchrun, one launch per layout: `--cp N --tp N --pp N`, and `--replicas N` for hsdp's
replicas as the dp axis). FSDP2 over dp x cp (hsdp: within each replica); tp slices the
decoder's attention and MLP; cp gives each rank a load-balanced part of every sequence
and gathers the keys and values. Against one process on the whole global batch: the
initial weights, the gradients (tied and untied heads, an MoE decoder with its router
loss, sliding-window layers; packed documents; the loss whole or in chunks, with
gradient accumulation), the clipped update, and which ranks read which data."""

from __future__ import annotations

import argparse

import torch
from omegaconf import OmegaConf

from freetx.data import TokenBatch
from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
from freetx.distributed.parameters import full_tensor, materialize
from freetx.models.peft import apply_lora
from freetx.models.transformer import decoder
from freetx.objectives import CrossEntropyLoss
from freetx.training import build_lr_scheduler, optimizer_step
from freetx.training.config import LRScheduleConfig
from freetx.training.step import count_over_ranks
from tests.distributed.launcher import write_results

SEED = 7
SEQ = 16
FIELDS = dict(vocab_size=96, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
              ffn_hidden_dim=48, max_seq_len=32, qkv_bias=True)  # fmt: skip
# Qwen3-MoE's shape of block: 4 experts, 2 per token, layer 1 a dense MLP
MOE = dict(num_experts=4, experts_per_token=2, moe_ffn_hidden_dim=24, mlp_only_layers=[1],
           router_aux_loss_coef=0.05, qk_norm="head")  # fmt: skip
# Gemma 2's attention: a window of 5 keys on layer 0, soft-capped scores
SLIDING = dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"],
               attn_logit_softcap=30.0)  # fmt: skip
MODELS = {"untied": dict(tie_embeddings=False), "tied": dict(tie_embeddings=True),
          "moe": dict(tie_embeddings=False, **MOE)}  # fmt: skip
# DeepSeek-V3's block: latent attention, sigmoid router in 2 groups (1 kept), a shared
# expert, layer 0 dense (tp slices no latent attention)
MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=12,
           rope_interleave=True, num_experts=4, experts_per_token=2, moe_ffn_hidden_dim=24,
           mlp_only_layers=[0], router_scores="sigmoid", router_bias=True, router_fp32=True,
           expert_groups=2, groups_per_token=1, routed_scaling_factor=2.5,
           shared_expert_ffn_dim=24, router_aux_loss_coef=0.05)  # fmt: skip
CONTEXT_MODELS = {
    "sliding": dict(tie_embeddings=False, **SLIDING),  # cp only: tp slices no
    "mla": dict(tie_embeddings=False, **MLA),
}  # window, no latent attention
# LoRA on every projection (colwise and rowwise under tp), trained for two steps: B starts
# at zero, so A's gradient is zero until the first update
LORA_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
GLOBAL_BATCH = 8


def batch(packed: bool):
    """The global batch: (input_ids, labels, documents or None)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (GLOBAL_BATCH, SEQ + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100  # a prompt
    if not packed:
        return ids[:, :-1], labels, None
    # three documents per row at row-dependent cuts, the last one padding
    documents = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    for row in range(GLOBAL_BATCH):
        cut1, cut2 = 3 + row % 4, 10 + row % 3
        documents[row, cut1:cut2], documents[row, cut2:] = 1, 2
        if row % 2:
            documents[row, SEQ - 2 :] = -1
    labels[documents == -1] = -100
    return ids[:, :-1], labels, documents


def optimizer_cfg():
    return OmegaConf.create({"_component_": "torch.optim.SGD", "lr": 0.5})


def step(model, plan, chunks: int | None, accumulation: int, packed: bool, data_ranks: int,
         steps: int = 1):  # fmt: skip
    """`steps` clipped SGD steps (Adam's first step divides by |g|, so it would amplify the
    last bits of near-zero gradients); (initial weights, the last step's gradients,
    updated weights), whole, of what trains."""
    inputs, labels, documents = batch(packed)
    if plan is not None:  # this dp rank's rows
        groups = plan.groups
        per_rank = GLOBAL_BATCH // groups.dp_size
        rows = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
        inputs, labels = inputs[rows], labels[rows]
        documents = None if documents is None else documents[rows]
    else:  # the same micro-batches, one after another: an MoE's router loss is per batch
        accumulation *= data_ranks
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    init = {n: full_tensor(p).clone() for n, p in trained.items()}
    parts = list(zip(inputs.chunk(accumulation), labels.chunk(accumulation)))
    context = None if plan is None else plan.context
    if context is not None:  # this rank's part of each sequence
        parts = [(context.split(x), context.split(y)) for x, y in parts]
    counts = [(y != -100).sum() for _, y in parts]
    total = sum(counts) if plan is None else count_over_ranks(plan.groups, counts)
    ranks = 1 if plan is None else plan.gradient_ranks
    loss_fn = CrossEntropyLoss(num_chunks=chunks)
    docs = [None] * accumulation if documents is None else documents.chunk(accumulation)
    if plan is None:
        optimizer = torch.optim.SGD(trained.values(), lr=0.5)
    else:
        optimizer = plan.build_optimizer(optimizer_cfg())
    scheduler = build_lr_scheduler(optimizer, 10, OmegaConf.structured(LRScheduleConfig()))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        summed = torch.zeros((), dtype=torch.float64)  # the loss of the step, all tokens
        if plan is not None and plan.pipeline is not None:  # micro-batches through the stages
            joined = TokenBatch(torch.cat([x for x, _ in parts]),
                                   torch.cat([y for _, y in parts]), documents)  # fmt: skip
            summed += plan.pipeline.step(joined, loss_fn, torch.as_tensor(ranks / total))["loss"]
        else:
            for (x, y), d in zip(parts, docs):
                inputs = {} if d is None else {"documents": d}
                if context is not None:
                    inputs["context"] = context
                loss, _ = loss_fn(model, x, y, **inputs)
                (loss * ranks / total).backward()
                summed += loss.detach()
        if plan is not None:
            summed = plan.groups.all_reduce(summed, over="dp_cp")
        grads = {n: full_tensor(p.grad).clone() for n, p in trained.items()}
        if plan is None:
            torch.nn.utils.clip_grad_norm_(trained.values(), 0.05)
            optimizer.step()
            scheduler.step()
        else:
            optimizer_step(plan, optimizer, scheduler, 0.05)  # clipped: the norm is ~1
    params = {n: full_tensor(p).clone() for n, p in trained.items()}
    return init, grads, params, float(summed / total)


def build(name: str, fields: dict):
    """The decoder of a case; "lora": with LoRA adapters on every projection."""
    model = decoder(**{**FIELDS, **fields})
    if name == "lora":
        apply_lora(model, LORA_TARGETS, rank=2, alpha=4)
    return model


def max_diff(got: dict, want: dict) -> float:
    """Over the parameters `got` holds (a pipeline stage holds some)."""
    assert got.keys() <= want.keys() and got, (sorted(set(got) - set(want)), len(got))
    return max((got[k] - want[k]).abs().max().item() for k in got)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument("--replicas", type=int, default=None, help="hsdp's replicas")
    args = parser.parse_args()
    runtime = init_distributed("cpu")
    results: dict = {"world_size": runtime.world_size}
    per_rank = 2 if args.schedule == "interleaved_1f1b" else 1
    cfg = OmegaConf.structured(DistributedConfig(
        strategy="hsdp" if args.replicas else "fsdp", replicate_degree=args.replicas, tp=args.tp, cp=args.cp, pp=args.pp, pp_schedule=args.schedule,
        pp_stages_per_rank=per_rank, sequence_parallel=not args.no_sequence_parallel))  # fmt: skip
    groups = build_groups(runtime, cfg)
    results["axes"] = [groups.rank(a) for a in ("dp", "cp", "tp")]
    if args.pp > 1:
        results["axes"].append(groups.rank("pp"))
    models = dict(MODELS, **(CONTEXT_MODELS if args.tp == 1 else {"lora": MODELS["untied"]}))
    cases = [(1, 1, False), (3, 2, False)]
    if args.pp > 1:  # a tied head would sit on the first stage and the last; 4 blocks for
        # 2 x 2 interleaved stages; micro-batches (accumulation) at least the stages
        models = {name: dict(MODELS[name], num_layers=4) for name in ("untied", "moe")}
        cases = [(1, 2, False), (3, 4, False), (1, 2, True)]
    if args.cp > 1:
        cases.append((1, 2, True))  # packed documents
    for name, fields in models.items():
        for chunks, accumulation, packed in cases:
            steps = 2 if name == "lora" else 1
            with torch.device("meta"):
                reference = build(name, fields)
            materialize(reference, torch.device("cpu"), SEED)
            want = step(
                reference.train(), None, chunks, accumulation, packed, groups.dp_size, steps
            )
            with torch.device("meta"):
                model = build(name, fields)
            plan = parallelize(model, groups, cfg, seed=SEED, micro_batches=accumulation)
            got = step(
                plan.model.train(), plan, chunks, accumulation, packed, groups.dp_size, steps
            )
            key = f"{name}/chunks{chunks}/accumulation{accumulation}" + ("/packed" * packed)
            for i, part in enumerate(("init", "grad", "param")):
                results[f"{key}/{part}"] = max_diff(got[i], want[i])
            results[f"{key}/loss"] = abs(got[3] - want[3])
            if args.cp == args.pp == 1:  # whole logits (a head sliced by vocabulary gathers)
                ids = batch(False)[0][:2]
                with torch.no_grad():
                    logits = plan.model.eval()(ids), reference.eval()(ids)
                results[f"{key}/logits"] = (logits[0] - logits[1]).abs().max().item()
            results[f"{key}/held"] = sorted(got[0])
            results[f"{key}/all"] = sorted(want[0])
    write_results(results)


if __name__ == "__main__":
    main()
