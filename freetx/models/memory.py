"""What `freetx estimate` tells a model of a training step when the model counts its own
activation memory (`EstimatesActivations.activation_bytes`), and how the model answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple


@dataclass(frozen=True)
class TrainingShape:
    """One training micro-batch on one rank, and what of the run changes its activations."""

    tokens: int  # the micro-batch's tokens per data-parallel rank (a crosscoder's: rows)
    seq_len: int  # tokens per sample
    compute_bytes: int  # bytes per element of the compute dtype
    blocks: int  # the blocks this model (one pipeline stage's) holds, as parallelism finds them
    checkpointing: Literal["none", "full", "selective"] = "none"
    every_n: int = 1  # selective checkpointing: every n-th block
    loss_chunks: int | None = 1  # the loss's logits a chunk of tokens at a time; None: the default
    tp: int = 1  # tensor-parallel ranks
    cp: int = 1  # context-parallel ranks (each holds 1/cp of the tokens)
    sequence_parallel: bool = False  # with tp: the residual stream 1/tp per rank
    device_type: Literal["cpu", "cuda"] = "cuda"  # where the attention kernel is chosen


class ActivationBytes(NamedTuple):
    """A model's answer for one micro-batch on one rank, in bytes."""

    kept: float  # what forward keeps for backward at the peak (and the loss, where not below)
    loss: float = 0.0  # the loss's logits and what the loss holds (the last pipeline stage's)
    exchanged: float = 0.0  # what tensor and context parallelism move per step, unoverlapped
