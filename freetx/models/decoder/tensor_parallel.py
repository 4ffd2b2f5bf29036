"""Tensor parallelism for the decoder (`SlicesLayers`): its plan of which layers are
sliced how over the tp ranks (`freetx.distributed.tensor_parallel` applies it), and the
head's slice of the vocabulary the loss then reduces over."""

from __future__ import annotations

from torch import nn

from freetx.errors import ConfigError
from freetx.models.decoder.config import TransformerConfig
from freetx.models.decoder.core import DecoderCore
from freetx.models.decoder.layers import NORM_NAMES
from freetx.models.protocol import VocabSlice


def check_tensor_parallel(c: TransformerConfig, tp: int) -> None:
    """Refuse a decoder shape that `tp` ranks cannot slice: the heads, the MLP's hidden
    units, and the layouts freetx does not slice (the plan's check when a model is
    parallelized; `freetx.training.check_layout`'s, from a config's model node, before
    anything is launched)."""
    why = None
    if c.num_heads % tp or c.num_kv_heads % tp:
        why = (
            f"tp={tp} does not divide the model's {c.num_heads} attention heads and "
            f"{c.num_kv_heads} key/value heads",
            "Pick a tp that divides both",
        )
    elif c.ffn_hidden_dim % tp:
        why = (
            f"tp={tp} does not divide the MLP's {c.ffn_hidden_dim} hidden units",
            "Pick a tp that divides it",
        )
    elif c.kv_lora_rank is not None:
        why = (
            "freetx does not slice multi-head latent attention (DeepSeek's kv_lora_rank) "
            "over tensor-parallel ranks yet",
            "Set distributed.tp=1 (fsdp alone shards it)",
        )
    elif c.fused_projections or c.qk_norm == "projection":
        kind = (
            "fused q/k/v and gate/up projections (Phi-3)"
            if c.fused_projections
            else "q/k norms over whole projections (OLMo 2)"
        )
        why = (
            f"freetx does not slice {kind} over tensor-parallel ranks yet",
            "Set distributed.tp=1 (fsdp alone shards it)",
        )
    if why is not None:
        raise ConfigError(f"distributed.tp: {why[0]}.", fix=f"{why[1]}, or set tp=1.")


class TensorParallelPlan(DecoderCore):
    """A decoder whose attention and MLP are sliced over tensor-parallel ranks
    (`SlicesLayers`)."""

    def tensor_parallel_plan(self, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
        """Each block's attention sliced by heads and its MLP by hidden units, the
        embedding and an untied head by vocabulary (`SlicesLayers`); a tied embedding
        stays whole on every tp rank (the head reads it), and so do an MoE block's router
        and experts (each tp rank routes the same whole tokens). `sequence_parallel`: the
        residual stream between them, and its norms, sliced by sequence (gathered before
        attention and the MLP, summed and scattered after). Refuses what it cannot
        slice."""
        c = self.config
        check_tensor_parallel(c, tp)
        sp = "_sequence" if sequence_parallel else ""
        plan = {}
        for i in self.held_blocks():
            block = f"layers.{i}"
            for name in ("wq", "wk", "wv"):
                plan[f"{block}.attention.{name}"] = "colwise"
            plan[f"{block}.attention.wo"] = "rowwise" + sp
            if c.qk_norm == "head":  # one weight for every head: its gradient summed over tp
                plan[f"{block}.attention.q_norm"] = "heads_norm"
                plan[f"{block}.attention.k_norm"] = "heads_norm"
            if not c.is_moe_layer(i):  # experts stay whole on every tp rank (its input is)
                plan[f"{block}.feed_forward.w1"] = "colwise"
                plan[f"{block}.feed_forward.w3"] = "colwise"
                plan[f"{block}.feed_forward.w2"] = "rowwise" + sp
            if sequence_parallel:
                plan[f"{block}.attention"] = "gather_sequence"
                moe = c.is_moe_layer(i)
                plan[f"{block}.feed_forward"] = "gather_experts" if moe else "gather_sequence"
                for norm in NORM_NAMES:
                    if not isinstance(getattr(self.layers[i], norm), nn.Identity):
                        plan[f"{block}.{norm}"] = "sequence_norm"
        if self.tok_embeddings is not None:
            if not c.tie_embeddings:
                plan["tok_embeddings"] = "embedding" + sp
            elif sequence_parallel:
                plan["tok_embeddings"] = "split_sequence"
        if sequence_parallel and self.norm is not None:
            plan["norm"] = "gather_sequence"  # the loss reads every token
        if not c.tie_embeddings and self.output is not None:
            plan["output"] = "output"
        return plan

    def slice_vocabulary(self, vocab: VocabSlice) -> None:
        """`SlicesLayers`: the head makes `vocab`'s slice of the logits."""
        self.vocab_slice = vocab
