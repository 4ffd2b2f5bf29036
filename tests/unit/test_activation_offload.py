"""distributed.activation_offloading on the CPU: the same saved-tensor hooks as on CUDA
(the tensor kept, or copied with `copy_on_cpu`), so losses and gradients equal the run
without them exactly; what is offloaded with and without activation checkpointing; the
recipe's run with the key equal to the run without; the refusal with pipelines."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freetx.distributed import (
    DistributedConfig,
    DistributedRuntime,
    build_groups,
    check_distributed,
    fake_world,
    materialize,
    parallelize,
)
from freetx.distributed.activation_offload import OffloadActivations
from freetx.distributed.parallelize import apply_activation_checkpointing, find_blocks
from freetx.errors import ConfigError
from freetx.models.transformer import decoder
from freetx.training.step import accumulate_gradients, optimizer_step
from tests.conftest import flat, run_freetx


def tiny_decoder(checkpointing: str) -> nn.Module:
    with torch.device("meta"):
        model = decoder(vocab_size=64, hidden_dim=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, ffn_hidden_dim=128, max_seq_len=32)  # fmt: skip
    apply_activation_checkpointing(find_blocks(model), checkpointing, 1)
    materialize(model, torch.device("cpu"), seed=0)
    return model


def loss_and_gradients(model: nn.Module, ids: torch.Tensor, hooks=None):
    model.zero_grad(set_to_none=True)
    if hooks is None:
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    else:
        with hooks:
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("copy", [False, True], ids=["kept", "copied"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_offloading_keeps_losses_and_gradients_exactly(checkpointing, copy):
    model = tiny_decoder(checkpointing)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    loss, grads = loss_and_gradients(model, ids)
    hooks = OffloadActivations(torch.device("cpu"), keep=model.buffers(), copy_on_cpu=copy)
    offloaded_loss, offloaded_grads = loss_and_gradients(model, ids, hooks)
    assert hooks.offloaded > 0
    assert torch.equal(offloaded_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(offloaded_grads[name], grad), name


class Recording(OffloadActivations):
    """Offloading that records what it packs (the tensors themselves, held) and, for each
    unpack, the tensor packed beside the one returned."""

    def __init__(self, **options):
        super().__init__(torch.device("cpu"), **options)
        self.packed, self.pairs, self.originals = [], [], {}

    def pack(self, tensor):
        saved = super().pack(tensor)
        if saved is not tensor:
            self.packed.append(tensor)
            self.originals[id(saved)] = (saved, tensor)
        return saved

    def unpack(self, saved):
        tensor = super().unpack(saved)
        if id(saved) in self.originals:
            self.pairs.append((self.originals[id(saved)][1], tensor))
        return tensor


class Blocks(nn.Module):
    """Three blocks of Linear -> GELU -> Linear with a residual: each saves 3 distinct
    tensors (its input, the first Linear's output, GELU's output)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)
        )
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def packed_with(checkpointing: str) -> tuple[Recording, list[int]]:
    torch.manual_seed(0)
    model = Blocks()
    apply_activation_checkpointing(list(model.blocks), checkpointing, 1)
    inputs = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    x = torch.randn(16, 32, requires_grad=True)
    with Recording() as hooks:
        out = model(x).square().sum()
    forward_inputs = list(inputs)  # the backward's recomputation runs the blocks again
    out.backward()
    return hooks, forward_inputs


def test_with_checkpointing_only_block_inputs_are_offloaded():
    """Non-reentrant checkpointing saves a block's inputs through the outer hooks and
    recomputes the rest under its own: 1 tensor per block offloaded instead of 3, and
    the block inputs are among them; what is outside the blocks is the same."""
    plain, _ = packed_with("none")
    checkpointed, block_inputs = packed_with("full")
    assert checkpointed.offloaded == plain.offloaded - 2 * 3
    assert all(any(x is packed for packed in checkpointed.packed) for x in block_inputs)


def test_a_copy_restores_views_strides_and_dtypes():
    """copy_on_cpu: every restored tensor is a copy (not the saved tensor) with its shape
    and dtype, and its strides where they were dense (a transposed view's; a strided
    slice comes back contiguous); gradients equal."""
    weight = nn.Parameter(torch.randn(96, 80))

    def forward(x):
        wide = x.t() @ weight  # saves x's transposed view
        half = wide.to(torch.bfloat16)[:, ::2]  # a strided bf16 view, saved by the product
        return (half * half).float().sum() + (x.exp()[1:] ** 2).sum()  # a view at an offset

    x = torch.randn(96, 32, requires_grad=True)
    forward(x).backward()
    expected = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    with Recording(copy_on_cpu=True) as hooks:
        out = forward(x)
    out.backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(weight.grad, expected[1])
    assert {saved.dtype for saved, _ in hooks.pairs} == {torch.float32, torch.bfloat16}
    transposed = [r for s, r in hooks.pairs if s.stride() == (1, 32)]
    assert transposed and transposed[0].stride() == (1, 32)
    for saved, restored in hooks.pairs:
        assert restored is not saved and restored.data_ptr() != saved.data_ptr()
        assert (restored.shape, restored.dtype) == (saved.shape, saved.dtype)
        assert restored.stride() == saved.stride() or restored.is_contiguous()
        assert torch.equal(restored, saved)


def test_parameters_buffers_and_tiny_tensors_stay():
    buffer = torch.randn(64, 64)
    weight = nn.Parameter(torch.randn(64, 64))
    a = torch.randn(4, 64, requires_grad=True)  # 1 KiB: offloaded
    small = torch.randn(3, 4, requires_grad=True)  # 48 bytes: stays
    with OffloadActivations(torch.device("cpu"), keep=[buffer], copy_on_cpu=True) as hooks:
        outputs = [a @ weight, a * a, small * buffer[:3, :4], small * small]
    sum(out.sum() for out in outputs).backward()
    assert hooks.offloaded == 1  # `a`: saved 3 times (by the product and twice by a * a)
    assert hooks.kept == 4  # the weight, the buffer's view, `small` twice


def test_activation_offloading_with_pipeline_parallelism_is_refused():
    cfg = DistributedConfig(pp=2, activation_offloading=True)
    with pytest.raises(ConfigError) as refused:
        check_distributed(cfg)
    message = flat(str(refused.value))
    assert "distributed.activation_offloading" in message and "pp=2" in message
    assert "activation_offloading=false" in message


class Copying(OffloadActivations):
    """The plan's offloading made to copy on the CPU too, counting what it offloaded."""

    offloaded_in_all = 0

    def __init__(self, device, keep=()):
        super().__init__(device, keep=keep, copy_on_cpu=True)

    def __exit__(self, *exc):
        super().__exit__(*exc)
        Copying.offloaded_in_all += self.offloaded


def train_steps(offloading: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """3 optimizer steps of 2 micro-batches through `accumulate_gradients` and
    `optimizer_step` (every recipe's), full activation checkpointing, 1 process."""
    cfg = DistributedConfig(activation_checkpointing="full", activation_offloading=offloading)
    with fake_world(1):
        groups = build_groups(DistributedRuntime(0, 0, 1, torch.device("cpu")), cfg)
        with torch.device("meta"):
            model = decoder(vocab_size=64, hidden_dim=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, ffn_hidden_dim=128, max_seq_len=32)  # fmt: skip
        plan = parallelize(model, groups, cfg, seed=0)
        optimizer = torch.optim.AdamW(plan.model.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        ids = torch.randint(0, 64, (6, 2, 17), generator=torch.Generator().manual_seed(0))

        def compute_loss(batch):
            logits = plan.model(batch[:, :-1])
            return F.cross_entropy(
                logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"
            ), {}

        losses = []
        for step in range(3):
            batches = [ids[2 * step], ids[2 * step + 1]]
            sums, _ = accumulate_gradients(plan, batches, compute_loss, lambda b: b[:, 1:].numel())
            optimizer_step(plan, optimizer, schedule, max_grad_norm=1.0)
            optimizer.zero_grad(set_to_none=True)
            losses.append(sums["loss"])
    return losses, [p.detach() for p in plan.model.parameters()]


def test_training_steps_with_activation_offloading_equal_the_steps_without(monkeypatch):
    """The key through the plan (`ParallelPlan.offloaded_activations`, which every
    recipe's `accumulate_gradients` enters), the tensors really copied: the same losses
    and weights after 3 steps, exactly."""
    module = sys.modules["freetx.distributed.parallelize"]  # the package names the function
    monkeypatch.setattr(module, "OffloadActivations", Copying)
    losses, weights = train_steps(offloading=False)
    assert Copying.offloaded_in_all == 0
    offloaded_losses, offloaded_weights = train_steps(offloading=True)
    assert Copying.offloaded_in_all > 0
    assert all(torch.equal(a, b) for a, b in zip(offloaded_losses, losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(offloaded_weights, weights, strict=True))


@pytest.mark.slow  # two runs through the CLI: ~10 s alone, ~50 s beside the suite
def test_full_finetune_with_activation_offloading_equals_the_run_without(tmp_path):
    """full_finetune_fsdp2 on llm/tiny, 1 process, full activation checkpointing: the
    same losses and gradient norms, step by step, with the key as without (CPU: the hooks
    keep every tensor)."""
    losses = {}
    for offloading in ("false", "true"):
        out = tmp_path / offloading
        result = run_freetx(
            "run", "full_finetune_fsdp2", "--config", "llm/tiny", "device=cpu",
            f"output_dir={out}", "max_steps=3", "log_every_n_steps=1", "batch_size=4",
            "eval.every_n_steps=0", "checkpoint.every_n_steps=0", "checkpoint.save_final=false",
            "distributed.activation_checkpointing=full",
            f"distributed.activation_offloading={offloading}",
            "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[offloading] = [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]
    assert len(losses["true"]) == 3
    assert losses["true"] == losses["false"]
