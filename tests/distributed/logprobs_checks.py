"""Checks of the chunked log-probabilities under parallelism (run by
tests/unit/test_chunked_logprobs.py through torchrun, `--tp N`): FSDP2 over the dp
ranks, tensor parallelism slicing an untied head by vocabulary (its parameters
DTensors, each rank making its slice of the logits). A DPO loss of each sequence's
summed log-probabilities (`sequence_logps`, `PreferenceLoss`: nonlinear in them, so the
gradient reaches each token with its own weight) against one process on the global
batch, the log-probabilities taken from its whole logits: each row's log-probability
and every parameter's gradient."""

from __future__ import annotations

import argparse

import torch
from omegaconf import OmegaConf

from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
from freetx.distributed.parameters import full_tensor, materialize
from freetx.objectives import PreferenceLoss, SequenceLogProbs, sequence_logps
from tests.distributed.launcher import write_results
from tests.distributed.mesh_checks import GLOBAL_BATCH, SEED, batch, build, max_diff

MODELS = {"untied": dict(tie_embeddings=False), "tied": dict(tie_embeddings=True)}


def step(model, plan, rows: slice):
    """Each row's summed log-probs of `rows` and the gradients of the DPO loss of the
    global batch's pairs (whole tensors)."""
    inputs, labels, _ = batch(False)
    reference = SequenceLogProbs(
        torch.linspace(-60.0, -40.0, GLOBAL_BATCH), (labels != -100).sum(-1).float()
    )
    if plan is None:  # the obvious way: the whole logits' log_softmax, gathered
        picked = model(inputs).float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])
        tokens = (labels != -100).sum(-1).float()
        logps = SequenceLogProbs((picked[..., 0] * (labels != -100)).sum(-1), tokens)
    else:
        logps, _ = sequence_logps(model, inputs[rows], labels[rows], num_chunks=3)
    loss, _ = PreferenceLoss("sigmoid", beta=0.05)(
        logps, SequenceLogProbs(reference.sum[rows], reference.tokens[rows])
    )
    ranks = 1 if plan is None else plan.gradient_ranks  # FSDP2 averages over them
    (loss * ranks / (GLOBAL_BATCH // 2)).backward()
    grads = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    return logps.sum.detach(), grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    runtime = init_distributed("cpu")
    cfg = OmegaConf.structured(DistributedConfig(strategy="fsdp", tp=args.tp))
    groups = build_groups(runtime, cfg)
    per_rank = GLOBAL_BATCH // groups.dp_size  # whole pairs: chosen and rejected together
    rows = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    results: dict = {}
    for name, fields in MODELS.items():
        with torch.device("meta"):
            single = build(name, fields)
        materialize(single, torch.device("cpu"), SEED)
        want_logps, want_grads = step(single.train(), None, slice(None))
        with torch.device("meta"):
            model = build(name, fields)
        plan = parallelize(model, groups, cfg, seed=SEED)
        got_logps, got_grads = step(plan.model.train(), plan, rows)
        results[f"{name}/logps"] = (got_logps - want_logps[rows]).abs().max().item()
        results[f"{name}/grad"] = max_diff(got_grads, want_grads)
        results[f"{name}/grad_scale"] = max(g.abs().max().item() for g in want_grads.values())
        results[f"{name}/sliced"] = plan.model.output_layer().vocab is not None
    write_results(results)


if __name__ == "__main__":
    main()
