"""2-process checks of the strategies (run by test_parallel.py through torchrun).

For every strategy: the initial weights equal a single-process init with the
same seed; after one step, gradients and updated weights equal a single-process
run on the whole global batch. Also: accumulation equivalence, activation
checkpointing, that ranks read different samples, and the float16 scaler (an Inf in
one rank's shard skips the step on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor, distribute_tensor

from freetx.data import GlobalBatchSampler
from freetx.distributed import (
    DistributedConfig,
    MixedPrecisionConfig,
    ParallelGroups,
    build_groups,
    init_distributed,
    local_parameters,
    materialize,
    parallelize,
    unwrap,
)
from freetx.models.transformer import decoder
from freetx.objectives import CrossEntropyLoss
from freetx.training import count_over_ranks
from tests.distributed.launcher import write_results

SEED = 7
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 64


def make_model(dropout: float = 0.0):
    return decoder(vocab_size=VOCAB, hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
                   ffn_hidden_dim=64, max_seq_len=SEQ, dropout=dropout)  # fmt: skip


def global_batch():
    g = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100  # a masked prefix: token normalization must count right
    return tokens[:, :-1], labels


def full_params(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in unwrap(model).named_parameters():
        out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in unwrap(model).named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def optimizer_cfg():
    # SGD: an update that is a linear function of the gradient, so it is compared tightly
    return OmegaConf.create({"_component_": "torch.optim.SGD", "lr": 0.5, "weight_decay": 0.1})


def train_one_step(
    strategy: str, accumulation: int = 1, num_chunks: int | None = None, **dist_options
):
    """One optimizer step the way the recipe does it; returns (init, grads, params).
    `num_chunks`: the loss's logits a chunk of tokens at a time."""
    runtime = init_distributed("cpu")
    cfg = OmegaConf.structured(DistributedConfig(strategy=strategy, **dist_options))
    with torch.device("meta"):
        model = make_model()
    plan = parallelize(model, build_groups(runtime, cfg), cfg, seed=SEED)
    model = plan.model
    init = full_params(model)
    optimizer = plan.build_optimizer(optimizer_cfg())
    inputs, labels = global_batch()
    per_rank = GLOBAL_BATCH // runtime.world_size
    mine = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
    micro_inputs = inputs[mine].chunk(accumulation)
    micro_labels = labels[mine].chunk(accumulation)
    num_tokens = count_over_ranks(
        ParallelGroups(runtime), [(y != -100).sum() for y in micro_labels]
    )
    loss_fn = CrossEntropyLoss(num_chunks=num_chunks)
    for i, (x, y) in enumerate(zip(micro_inputs, micro_labels)):
        with plan.gradient_sync(enabled=i == accumulation - 1):
            loss, _ = loss_fn(model, x, y)
            (loss * runtime.world_size / num_tokens).backward()
    grads = full_grads(model)
    optimizer.step()
    return init, grads, full_params(model)


def scaler_steps(strategy: str | None) -> dict:
    """Two float16 scaler rounds on hand-made gradients: the first holds an Inf in the
    last element of one weight (under fsdp and hsdp: in rank 1's shard only), the second
    is finite (G times the scale). Returns the scale after each update, whether the first
    round changed a parameter, the unscaled gradients of the second round and the
    parameters after it. `None`: one process, torch's own GradScaler."""
    runtime = init_distributed("cpu")
    with torch.device("meta"):
        model = make_model()
    if strategy is None:
        materialize(model, torch.device("cpu"), SEED)
        scaler = torch.amp.GradScaler("cpu")
    else:
        float16 = MixedPrecisionConfig(param_dtype="float16")
        cfg = OmegaConf.structured(DistributedConfig(strategy=strategy, mixed_precision=float16))
        plan = parallelize(model, build_groups(runtime, cfg), cfg, seed=SEED)
        model, scaler = plan.model, plan.scaler
    named = dict(unwrap(model).named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(SEED)
    wanted = {n: torch.randn(p.shape, generator=generator) for n, p in named.items()}
    inf_in = next(n for n, p in named.items() if p.dim() == 2)
    init = full_params(model)
    result: dict = {"scales": [], "wanted": wanted}
    for finite in (False, True):
        scale = scaler.scale(torch.ones(())).item()  # what a scaled loss of 1 would be
        for name, param in named.items():
            grad = wanted[name] * scale
            poisoned = not finite and name == inf_in
            if isinstance(param, DTensor):
                grad = distribute_tensor(grad, param.device_mesh, param.placements)
                if poisoned and runtime.rank == 1:
                    grad.to_local().view(-1)[-1] = float("inf")  # rank 0's shard is finite
            elif poisoned:
                grad.view(-1)[-1] = float("inf")
            param.grad = grad
        scaler.unscale_(optimizer)
        if finite:
            result["grads"] = full_grads(model)
        scaler.step(optimizer)
        scaler.update()
        result["scales"].append(scaler.get_scale())
        if not finite:
            result["changed_by_skipped"] = max_diff(full_params(model), init)
    result["params"] = full_params(model)
    return result


def reference_step():
    """The single-process, full-batch step every strategy must reproduce."""
    with torch.device("meta"):
        model = make_model()
    materialize(model, torch.device("cpu"), SEED)
    init = full_params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.1)
    inputs, labels = global_batch()
    loss, _ = CrossEntropyLoss()(model, inputs, labels)
    (loss / (labels != -100).sum()).backward()
    grads = full_grads(model)
    optimizer.step()
    return init, grads, full_params(model)


def saved_activation_bytes(activation_checkpointing: str) -> tuple[int, dict]:
    """Bytes autograd keeps for backward (outside checkpointed blocks), and the grads."""
    runtime = init_distributed("cpu")
    cfg = OmegaConf.structured(
        DistributedConfig(strategy="fsdp", activation_checkpointing=activation_checkpointing)
    )
    with torch.device("meta"):
        model = make_model(dropout=0.1)
    model = parallelize(model, build_groups(runtime, cfg), cfg, seed=SEED).model
    inputs, labels = global_batch()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(5)  # dropout on: recomputation must replay the same masks
    with saved_tensors_hooks(pack, lambda t: t):
        loss, _ = CrossEntropyLoss()(model, inputs, labels)
    loss.backward()
    return sum(saved), full_grads(model)


def free_transformer_step(strategy: str | None):
    """Grads of a Free Transformer step, latent path included (None: 1 process, full batch).

    Every weight, the post-sampler included, is set to a deterministic random
    value (so the encoder gets gradient through the codes), and the bit
    sampling uses fixed noise, so both sides see the same latent.
    """
    from freetx.distributed import fill_parameters
    from freetx.models.free_transformer import FreeTransformerLoss, free_transformer

    def weights(name, param):
        g = torch.Generator().manual_seed(sum(map(ord, name)))
        return torch.randn(param.shape, generator=g) * 0.2

    runtime = init_distributed("cpu")
    with torch.device("meta"):
        model = free_transformer(vocab_size=VOCAB, hidden_dim=32, num_layers=4, num_heads=4,
                                 latent_dim=3, ffn_hidden_dim=64, max_seq_len=SEQ)  # fmt: skip
    if strategy is None:
        materialize(model, torch.device("cpu"), SEED)
    else:
        cfg = OmegaConf.structured(DistributedConfig(strategy=strategy))
        model = parallelize(model, build_groups(runtime, cfg), cfg, seed=SEED).model
    fill_parameters(unwrap(model), weights)
    inputs, labels = global_batch()
    noise = torch.rand(GLOBAL_BATCH, SEQ, 3, generator=torch.Generator().manual_seed(4))
    loss_fn = FreeTransformerLoss(kappa_bits=0.0)  # every token's KL is penalized
    if strategy is None:
        loss, _ = loss_fn(model, inputs, labels, noise=noise)
        (loss / (labels != -100).sum()).backward()
    else:
        per_rank = GLOBAL_BATCH // runtime.world_size
        mine = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        num_tokens = count_over_ranks(ParallelGroups(runtime), [(labels[mine] != -100).sum()])
        loss, _ = loss_fn(model, inputs[mine], labels[mine], noise=noise[mine])
        (loss * runtime.world_size / num_tokens).backward()
    return full_grads(model)


def ad_step(strategy: str | None):
    """Grads of one Algorithm Distillation step (None: 1 process, the full batch)."""
    from freetx.models.ad import ad_transformer

    runtime = init_distributed("cpu")
    with torch.device("meta"):
        model = ad_transformer(n_transit=SEQ, hidden_dim=32, num_layers=2, num_heads=4,
                               ffn_hidden_dim=64, dropout=0.0)  # fmt: skip
    if strategy is None:
        materialize(model, torch.device("cpu"), SEED)
    else:
        model = parallelize(
            model,
            build_groups(runtime, DistributedConfig(strategy=strategy)),
            OmegaConf.structured(DistributedConfig(strategy=strategy)),
            SEED,
        ).model
    g = torch.Generator().manual_seed(11)
    states = torch.randint(0, 81, (GLOBAL_BATCH, SEQ), generator=g)
    prev_actions = torch.randint(0, 6, (GLOBAL_BATCH, SEQ), generator=g)
    prev_rewards = torch.randint(0, 3, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, 5, (GLOBAL_BATCH, SEQ), generator=g)
    rows = slice(None)
    scale = 1.0 / labels.numel()
    if strategy is not None:
        per_rank = GLOBAL_BATCH // runtime.world_size
        rows = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        scale = runtime.world_size / float(
            count_over_ranks(ParallelGroups(runtime), [labels[rows].numel()])
        )
    logits = model(states[rows], prev_actions[rows], prev_rewards[rows])
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels[rows].flatten(), reduction="sum"
    )
    (loss * scale).backward()
    return full_grads(model)


class Blockless(torch.nn.Module):
    """A model that names no block classes: sharded and checkpointed as one unit."""

    block_types = ()

    def __init__(self) -> None:
        super().__init__()
        self.config = None
        self.first = torch.nn.Linear(SEQ, 32)
        self.second = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))

    def init_parameter(self, name: str, tensor: torch.Tensor, generator) -> None:
        tensor.normal_(0.0, 0.3, generator=generator)

    def init_buffers(self) -> None:
        pass


def blockless_step(strategy: str | None):
    """Grads of a model without blocks (None: 1 process, the full batch)."""
    runtime = init_distributed("cpu")
    with torch.device("meta"):
        model = Blockless()
    x = torch.randn(GLOBAL_BATCH, SEQ, generator=torch.Generator().manual_seed(3))
    if strategy is None:
        materialize(model, torch.device("cpu"), SEED)
        model(x).pow(2).mean().backward()
    else:
        cfg = DistributedConfig(strategy=strategy, activation_checkpointing="full")
        plan = parallelize(model, build_groups(runtime, cfg), cfg, SEED)
        per_rank = GLOBAL_BATCH // runtime.world_size
        rows = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        plan.model(x[rows]).pow(2).mean().backward()
        model = plan.model
    return full_grads(model)


def peft_step(strategy: str | None, method: str, num_chunks: int | None = None):
    """Grads of the trainable parameters of a LoRA / DoRA / QLoRA / Spectrum step (None:
    1 process, the full batch). Every weight is set to a deterministic random value (B
    included, so A gets gradient too); the base is frozen. `num_chunks`: the loss's."""
    from freetx.distributed import fill_parameters
    from freetx.models.peft import apply_lora, train_only

    runtime = init_distributed("cpu")
    with torch.device("meta"):
        model = make_model()
        if method == "spectrum":
            train_only(model, ["layers.1.attention.wq", "layers.2.feed_forward.w2"],
                       always=["tok_embeddings"])  # fmt: skip
        elif method == "qlora":  # NF4 needs blocks of 64 x 8 per rank: the larger layers
            from freetx.models.peft.nf4 import quantize_bases

            apply_lora(model, ["down", "output"], rank=4, alpha=8)
            quantize_bases(model, world_size=2)  # the same blocks on 1 and 2 processes
        else:
            apply_lora(model, ["q", "v", "down", "output"], rank=4, alpha=8,
                       use_dora=method == "dora")  # fmt: skip

    def weights(name, param):
        g = torch.Generator().manual_seed(sum(map(ord, name)))
        return torch.randn(param.shape, generator=g) * 0.2 + (1.0 if "magnitude" in name else 0)

    if strategy is None:
        materialize(model, torch.device("cpu"), SEED, init_weights=False)
    else:
        cfg = OmegaConf.structured(DistributedConfig(strategy=strategy))
        model = parallelize(
            model, build_groups(runtime, cfg), cfg, seed=SEED, init_weights=False
        ).model
    fill_parameters(unwrap(model), weights)
    inputs, labels = global_batch()
    rows, scale = slice(None), 1.0 / float((labels != -100).sum())
    if strategy is not None:
        per_rank = GLOBAL_BATCH // runtime.world_size
        rows = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        scale = runtime.world_size / float(
            count_over_ranks(ParallelGroups(runtime), [(labels[rows] != -100).sum()])
        )
    loss, _ = CrossEntropyLoss(num_chunks=num_chunks)(model, inputs[rows], labels[rows])
    (loss * scale).backward()
    grads = {}
    for name, p in unwrap(model).named_parameters():
        if p.requires_grad:
            g = p.grad
            grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        else:
            assert p.grad is None, name
    return grads


def crosscoder_step(strategy: str | None, activation: str):
    """Grads of a crosscoder step (None: 1 process, the full batch), and the model's
    per-source scale as each rank set it from its own rows (all-reduced)."""
    from freetx.data.activations import norm_sums, scales_from_norm_sums
    from freetx.models.crosscoder import CrosscoderLoss, LocalReducer, crosscoder

    runtime = init_distributed("cpu")
    with torch.device("meta"):
        model = crosscoder(num_sources=2, source_dim=8, dict_size=32, activation=activation,
                           k=2, dead_after_rows=4, log_threshold_init=-2.0)  # fmt: skip
    x = torch.randn(GLOBAL_BATCH * 4, 2, 8, generator=torch.Generator().manual_seed(2)) * 3
    rows, scale = slice(None), 1.0 / len(x)
    loss_fn = CrosscoderLoss(LocalReducer())  # one process: the whole batch
    if strategy is None:
        materialize(model, torch.device("cpu"), SEED)
        module = model
    else:
        plan = parallelize(
            model, build_groups(runtime, DistributedConfig(strategy=strategy)),
            DistributedConfig(strategy=strategy), SEED,
        )  # fmt: skip
        model, module = plan.model, plan.module
        per_rank = len(x) // runtime.world_size
        rows = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        scale = runtime.world_size / float(count_over_ranks(ParallelGroups(runtime), [per_rank]))
        loss_fn = CrosscoderLoss(plan.groups)  # BatchTopK's threshold over both ranks' rows
    module.tie_encoder(local_parameters(module))
    norms, count = norm_sums(x[rows])
    totals = ParallelGroups(runtime).sum_tensors(
        {"norms": norms, "count": torch.tensor(float(count))}
    )
    module.input_scale.copy_(scales_from_norm_sums(totals["norms"], float(totals["count"]), 8))
    for _ in range(2):  # the second step sees dead features (AuxK) for batchtopk
        for p in model.parameters():
            p.grad = None
        (model(x[rows], loss_fn, 0.5).loss * scale).backward()
    return full_grads(model), module.input_scale.tolist()


def main() -> None:
    runtime = init_distributed("cpu")
    results: dict = {"world_size": runtime.world_size}
    ref_init, ref_grads, ref_params = reference_step()
    for strategy, options in [
        ("fsdp", {}),
        ("zero3", {}),
        ("zero2", {}),
        ("zero1", {}),
        ("ddp", {}),
        ("hsdp", {"replicate_degree": 2}),
        ("hsdp", {"replicate_degree": 1}),
    ]:
        init, grads, params = train_one_step(strategy, **options)
        key = f"{strategy}{options.get('replicate_degree', '')}"
        results[f"{key}/init"] = max_diff(init, ref_init)
        results[f"{key}/grad"] = max_diff(grads, ref_grads)
        results[f"{key}/param"] = max_diff(params, ref_params)
    for strategy in ("fsdp", "ddp"):
        _, grads, params = train_one_step(strategy, accumulation=2)
        results[f"accumulation/{strategy}/grad"] = max_diff(grads, ref_grads)
        results[f"accumulation/{strategy}/param"] = max_diff(params, ref_params)
        # the loss's logits 3 chunks of tokens at a time (tied to no embedding: the head)
        _, grads, params = train_one_step(strategy, accumulation=2, num_chunks=3)
        results[f"chunked/{strategy}/grad"] = max_diff(grads, ref_grads)
        results[f"chunked/{strategy}/param"] = max_diff(params, ref_params)

    base_bytes, base_grads = saved_activation_bytes("none")
    for mode in ("full", "selective"):
        saved, grads = saved_activation_bytes(mode)
        results[f"ac/{mode}/saved_ratio"] = saved / base_bytes
        results[f"ac/{mode}/grad"] = max_diff(grads, base_grads)

    reference = free_transformer_step(None)
    for strategy in ("fsdp", "ddp"):
        grads = free_transformer_step(strategy)
        results[f"free_transformer/{strategy}/grad"] = max_diff(grads, reference)
        latent = ("encoder.", "encoder_readout", "encoder_query", "post_sampler")
        results[f"free_transformer/{strategy}/latent_grad_norm"] = sum(
            g.norm().item() for n, g in grads.items() if n.startswith(latent)
        )

    reference = ad_step(None)
    for strategy in ("ddp", "fsdp"):
        results[f"ad/{strategy}/grad"] = max_diff(ad_step(strategy), reference)

    for method in ("lora", "dora", "spectrum", "qlora"):
        reference = peft_step(None, method)
        for strategy in ("fsdp", "ddp"):
            grads = peft_step(strategy, method)
            results[f"peft/{method}/{strategy}/grad"] = max_diff(grads, reference)
            results[f"peft/{method}/{strategy}/trainable"] = sorted(grads)
        results[f"peft/{method}/reference_trainable"] = sorted(reference)
    for method in ("lora", "qlora"):  # LoRA on the output head, and its NF4 base: chunked
        reference = peft_step(None, method)
        results[f"chunked/{method}/grad"] = max_diff(peft_step("fsdp", method, 3), reference)

    for activation in ("relu", "jumprelu", "batchtopk"):
        reference, ref_scale = crosscoder_step(None, activation)
        for strategy in ("fsdp", "ddp"):
            grads, scale = crosscoder_step(strategy, activation)
            results[f"crosscoder/{activation}/{strategy}/grad"] = max_diff(grads, reference)
            results[f"crosscoder/{activation}/{strategy}/scale"] = scale
        results["crosscoder/reference_scale"] = ref_scale

    reference = blockless_step(None)
    for strategy in ("fsdp", "ddp"):
        results[f"blockless/{strategy}/grad"] = max_diff(blockless_step(strategy), reference)

    reference = scaler_steps(None)
    for strategy in ("fsdp", "hsdp", "ddp"):
        sharded = scaler_steps(strategy)
        results[f"scaler/{strategy}/scales"] = sharded["scales"]
        results[f"scaler/{strategy}/unscaled"] = max_diff(sharded["grads"], sharded["wanted"])
        results[f"scaler/{strategy}/params"] = max_diff(sharded["params"], reference["params"])
        results[f"scaler/{strategy}/changed_by_skipped"] = sharded["changed_by_skipped"]
    results["scaler/reference/scales"] = reference["scales"]
    results["scaler/reference/unscaled"] = max_diff(reference["grads"], reference["wanted"])
    results["scaler/reference/changed_by_skipped"] = reference["changed_by_skipped"]

    sampler = GlobalBatchSampler(64, GLOBAL_BATCH, 2, runtime.rank, runtime.world_size, SEED)
    batches = [b for _, b in zip(range(6), iter(sampler))]
    gathered = [None] * runtime.world_size
    dist.all_gather_object(gathered, batches)
    seen = [set(i for b in rank_batches for i in b) for rank_batches in gathered]
    results["sampler/overlap"] = len(seen[0] & seen[1]) if len(seen) > 1 else -1
    write_results(results)


if __name__ == "__main__":
    main()
