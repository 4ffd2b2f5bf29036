"""`freetx estimate`: memory per rank and step time of a config, for each strategy, before
renting GPUs. Analytic, from the model's exact parameter counts (it is built on the
meta device, adapters and all) and its shape:

model states (exact): parameters (fp32 masters; frozen LoRA bases in the compute
dtype; NF4 bases at 0.516 bytes), gradients of what trains (fp32), AdamW's two
moments (fp32; 8-bit optimizers: 2 bytes), each divided by the ranks that shard it:

    | strategy | parameters | gradients | optimizer |
    | ddp      | 1          | 1         | 1         |
    | zero1    | 1          | 1         | 1/N       |
    | zero2    | 1/N        | 1/N       | 1/N       |  + every block gathered (fwd to bwd)
    | fsdp     | 1/N        | 1/N       | 1/N       |  + two blocks gathered at a time
    | hsdp     | 1/S        | 1/S       | 1/S       |  S = N / replicas

activations per micro-batch, counted per token and block for the decoder (compute
dtype): the norm inputs and outputs, q, k, v and the attention output kept by SDPA,
the input of wo, and the four MLP tensors (gate, up, silu(gate), their product):
7h + 2 h_kv + 4 f elements; full checkpointing keeps a block's input (h) instead,
selective every n-th; and the loss: bf16 logits, their fp32 copy and log-softmax
(10 bytes per token per vocabulary entry), which dominate small models with large
vocabularies. Step time: training FLOPs per token x tokens per rank / (peak x MFU),
and the FSDP traffic (gathers in forward and backward, a reduce-scatter) over the
interconnect, assumed overlapped: the step takes the longer of the two.

What it leaves out: the allocator's fragmentation and caching (5-10% on CUDA),
communication buffers beyond the gathered blocks, compile's saved memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from freetx.distributed import shard_layouts

# device -> (peak dense bf16 FLOP/s, intra-node GB/s per GPU, HBM GiB)
DEVICES = {
    "h100": (989e12, 450e9, 80),
    "a100": (312e12, 240e9, 80),
    "cpu": (0.155e12, 10e9, 24),  # this machine's fp32 matmul peak on 2 threads
}
GIB = 2**30


@dataclass
class Estimate:
    strategy: str
    parameters: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float
    loss: float
    step_s: float
    compute_s: float
    comm_s: float

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def peak(self) -> float:
        return self.states + self.gathered + self.activations + self.loss


def parameter_bytes(model: nn.Module, compute_bytes: int) -> tuple[float, float]:
    """(bytes of all parameters as stored, trainable elements)."""
    stored = trainable = 0.0
    for name, p in model.named_parameters():
        if type(p.data).__name__ == "NF4Tensor":
            stored += p.numel() * 0.516
        elif not p.requires_grad and getattr(_owner(model, name), "frozen_in_compute_dtype", False):
            stored += p.numel() * compute_bytes
        else:
            stored += p.numel() * 4
        trainable += p.numel() if p.requires_grad else 0
    return stored, trainable


def _owner(model: nn.Module, name: str) -> nn.Module:
    module_name = name.rpartition(".")[0]
    return model.get_submodule(module_name) if module_name else model


def estimate(
    model: nn.Module,
    world_size: int,
    tokens_per_rank: int,
    seq_len: int,
    compute_dtype: str,
    activation_checkpointing: str,
    ac_every_n_blocks: int,
    device: str,
    mfu: float,
    replicas: int = 1,
    optimizer_bytes: float = 8.0,
) -> list[Estimate]:
    """The estimate of each strategy for a (meta) model at `world_size` ranks."""
    cfg = model.config
    compute = 2 if compute_dtype in ("bfloat16", "float16") else 4
    stored, trainable = parameter_bytes(model, compute)
    blocks = [m for m in model.modules() if isinstance(m, tuple(getattr(model, "block_types", ())))]
    block_params = sum(p.numel() for p in blocks[0].parameters()) if blocks else 0
    layers = max(1, len(blocks))
    h, f = cfg.hidden_dim, getattr(cfg, "ffn_hidden_dim", 4 * cfg.hidden_dim)
    kv = getattr(cfg, "num_kv_heads", cfg.num_heads) * getattr(cfg, "head_dim", h // cfg.num_heads)
    per_token = (7 * h + 2 * kv + 4 * f) * compute  # a block's saved activations
    if activation_checkpointing == "full":
        kept = layers * h * compute + per_token  # inputs, and one block being recomputed
    elif activation_checkpointing == "selective":
        checkpointed = math.ceil(layers / ac_every_n_blocks)
        kept = (layers - checkpointed) * per_token + checkpointed * h * compute + per_token
    else:
        kept = layers * per_token
    activations = tokens_per_rank * kept
    vocab = getattr(cfg, "vocab_size", 0)
    loss = tokens_per_rank * vocab * (compute + 4 + 4)
    peak, bandwidth, _ = DEVICES[device]
    flops = getattr(model, "flops_per_token", lambda s: 6 * trainable)(seq_len)
    compute_s = flops * tokens_per_rank / (peak * mfu)
    out = []
    for layout in shard_layouts(world_size, replicas):
        shards = layout.parameter_shards
        if layout.blocks_stay_gathered:
            gathered = stored / 4 * compute  # every block kept unsharded, forward to backward
        elif layout.gathers_per_block:
            gathered = 2 * block_params * compute + block_params * 4  # 2 blocks + a block's grads
        else:
            gathered = 0.0
        traffic = 0.0 if shards == 1 else 3 * stored / 4 * compute * (shards - 1) / shards
        if layout.all_reduce and world_size > 1:
            traffic = 2 * trainable * 4 * (world_size - 1) / world_size  # an all-reduce
        comm_s = traffic / bandwidth
        out.append(Estimate(
            layout.strategy, stored / shards, trainable * 4 / layout.gradient_shards,
            trainable * optimizer_bytes / layout.optimizer_shards,
            gathered if world_size > 1 else 0.0, activations, loss, max(compute_s, comm_s),
            compute_s, comm_s,
        ))  # fmt: skip
    return out


def meta_model(model_node, peft_cfg=None):
    """The config's model on the meta device (with its adapters when it has `peft`)."""
    from freetx.config import instantiate

    with torch.device("meta"):
        model = instantiate(model_node)
        if peft_cfg is not None:
            from freetx.models.peft import apply_peft

            apply_peft(model, peft_cfg)
    return model
