"""A crosscoder's source models, for `freetx estimate`: the rows' shape and the bytes its
frozen source models hold on every rank (built on the meta device from their recorded
config, never their weights): their weights in the source dtype and one harvesting
forward (logits, hooked outputs)."""

from __future__ import annotations

from dataclasses import dataclass

from freetx.checkpoint import source_model_on_meta
from freetx.config import instantiate
from freetx.errors import ConfigError, FreetxError


@dataclass
class ActivationSources:
    """What a crosscoder config's `activations:` read: the rows' shape, and the bytes its
    frozen source models hold on every rank (loaded for the whole run: evaluation splices
    reconstructions back into them)."""

    num_sources: int
    source_dim: int
    weights: float  # the source models' parameters in activations.source_dtype
    harvest: float  # one harvesting forward: its logits and the hooked outputs (float32)
    unread: list[str]  # sources whose shape could not be read: not counted

    @property
    def bytes(self) -> float:
        return self.weights + self.harvest


def activation_sources(acfg, device: str, source_dim: int | None = None) -> ActivationSources:
    """The rows and source models of `acfg` (an `ActivationsConfig`) on `device` (a key of
    DEVICES), without loading a weight: synthetic rows' shape from their config; each
    source model's hidden size, parameters and vocabulary from its recorded config
    (`source_model_on_meta`). `source_dim`: the hooked width, for sources that cannot be
    read or hooks on a module narrower or wider than the residual stream."""
    if acfg.kind == "synthetic":
        if source_dim is not None:
            raise ConfigError(
                "--source-dim is for activations of models: synthetic rows have their own "
                "shape (activations.synthetic.source_dim).",
                fix="Leave out --source-dim, or override activations.synthetic.source_dim.",
            )
        rows = instantiate(acfg.synthetic, split="train", rows=1)
        return ActivationSources(rows.num_sources, rows.source_dim, 0.0, 0.0, [])
    dtype = acfg.source_dtype
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    element = 4 if dtype == "float32" else 2
    num_sources = sum(len(s.hooks) for s in acfg.sources)
    widths, weights, vocab, unread = set(), 0.0, 0, []
    for source in acfg.sources:
        try:
            model = source_model_on_meta(source.model)
        except (FreetxError, OSError, ValueError, KeyError):
            unread.append(source.model)
            continue
        c = model.config  # freetx's decoder's, or the generic transformers path's
        widths.add(c.hidden_dim)
        weights += sum(p.numel() for p in model.parameters()) * element
        vocab = max(vocab, c.vocab_size)
    if source_dim is None and unread:
        raise ConfigError(
            f"freetx estimate cannot read the shape of the source model(s) "
            f"{', '.join(unread)} (no run, checkpoint or HF config.json there yet), and a "
            "crosscoder's width is theirs.",
            fix="Give --source-dim D (the hooked modules' width, e.g. the hidden size), or "
            "make the source run first.",
        )
    if source_dim is None and len(widths) > 1:
        raise ConfigError(
            f"the source models have different hidden sizes {sorted(widths)}; a crosscoder "
            "reads one width from every source.",
            fix="Hook sites of one width, or give --source-dim D for the hooked width.",
        )
    width = source_dim or widths.pop()
    tokens = acfg.sequences_per_forward() * int(acfg.text.get("seq_len", 2048))
    harvest = tokens * (vocab * element + 2 * num_sources * width * 4)  # + stacked copy
    return ActivationSources(num_sources, width, weights, float(harvest), unread)
