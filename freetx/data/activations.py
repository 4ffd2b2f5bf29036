"""Activations for crosscoders: rows x [n_sources, d], from models or made up.

Three sources behind one shape (a batch is {"x": [rows, n_sources, d]}):

- `PlantedFeatures` (activation_rows.py): synthetic rows with known features (unit directions per
  source, some exclusive to one source, the rest shared with random scales),
  sparse activations and a little noise; for tests and benchmarks.
- `ActivationHarvester`: runs frozen source models (a freetx LM or any
  `transformers` model, built by the recipe) on token sequences and reads the
  outputs of named modules with forward hooks; BOS and padding positions are
  dropped, and the models of a pair see the same tokens.
- Two modes over a harvester: `ActivationBuffer`, a shuffled buffer refilled on
  the fly from this rank's own sequences (no two ranks read the same text), and
  `build_activation_cache`, paired activations written once (bf16 safetensors,
  one shard per rank, through the shard cache) and read as `ActivationRows` by
  later runs.

A recipe builds its data with one of two functions, each returning one
`Activations` (the train loader, validation rows, shape, a normalization
sample, and what evaluation needs): `planted_activations` (synthetic) and
`harvested_activations` (models, through the buffer or the cache, configured by
`ActivationsConfig`). `SpliceProbe` measures the CE loss recovered when a
reconstruction replaces the hooked activations.

Data takes rank and world size as arguments and imports nothing of freetx but
its errors, its fields and the shard cache.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from omegaconf import MISSING
from torch import nn
from torch.utils.data import Dataset

from freetx.data.activation_rows import ActivationRows, PlantedFeatures
from freetx.data.batch import INPUT_IDS
from freetx.data.sampling import build_train_loader, micro_batch_size
from freetx.data.shard_cache import ShardCache
from freetx.errors import ConfigError, DataError
from freetx.fields import at_least, written_folder

CACHE_SEQUENCES_PER_FORWARD = 16  # a rank's sequences per harvest while a cache is built


@dataclass
class SourceConfig:
    """A model to read: a freetx run / checkpoint, or an HF folder (any architecture,
    through transformers), and the modules whose outputs are read."""

    model: str = MISSING
    hooks: list[str] = field(default_factory=list)


@dataclass
class ActivationsConfig:
    """crosscoder_fsdp2's `activations:` section: planted synthetic rows, or the outputs
    of modules of frozen models on text, read on the fly (buffer) or once (cache)."""

    kind: Literal["synthetic", "models"] = "synthetic"
    synthetic: Any = field(default_factory=lambda: {"_component_": "freetx.data.PlantedFeatures"})
    sources: list[SourceConfig] = field(default_factory=list)  # models: in order
    tokenizer: Any = field(default_factory=lambda: {"_component_": "freetx.data.ByteTokenizer"})
    text: Any = field(
        default_factory=lambda: {
            "_component_": "freetx.data.PackedTextDataset",
            "source": "builtin",
            "seq_len": 64,
        }
    )
    mode: Literal["buffer", "cache"] = "buffer"
    sequences_per_refill: int = at_least(1, default=32)  # buffer: per rank, per refill
    cache: Optional[str] = written_folder(None, own=True)  # cache: the folder (written once)
    source_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA
    normalize_rows: int = at_least(1, default=4096)  # per rank, to estimate the scales

    def sequences_per_forward(self) -> int:
        """The sequences a rank's source models read in one forward while harvesting."""
        return CACHE_SEQUENCES_PER_FORWARD if self.mode == "cache" else self.sequences_per_refill


def find_modules(model: nn.Module, names: list[str], what: str) -> list[nn.Module]:
    """The modules called `names`, or an error naming the closest ones that exist."""
    known = dict(model.named_modules())
    found = []
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=5, cutoff=0.5)
            hint = f" Modules with similar names: {', '.join(close)}." if close else ""
            raise ConfigError(
                f"{what} has no module '{name}' to read activations from.{hint} A hook site is "
                "a module name as model.named_modules() lists it (a freetx decoder: "
                "layers.N, or transformers' name of the same module, model.layers.N, for a "
                "model read from an HF folder; GPT-2 through transformers: transformer.h.N)."
            )
        found.append(known[name])
    return found


class ActivationHarvester:
    """Reads the outputs of named modules of frozen models on the same tokens.

    `sources`: (model, [module names]) pairs; every site must have the same width
    (a crosscoder has one d). `__call__(input_ids, keep)` runs each model once and
    returns [kept positions, n_sites, d] (in the models' dtype); `keep` [B, T] marks
    the positions to keep (not BOS, not padding).
    """

    def __init__(self, sources: list[tuple[nn.Module, list[str], str]]) -> None:
        self.sites: list[tuple[nn.Module, list[nn.Module]]] = []
        for model, names, label in sources:
            model.requires_grad_(False)
            self.sites.append((model.eval(), find_modules(model, names, label)))

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        outputs = []
        for model, modules in self.sites:
            outputs += self._read(model, modules, input_ids)
        widths = {o.shape[-1] for o in outputs}
        if len(widths) != 1:
            raise ConfigError(
                f"the hook sites give activations of different widths {sorted(widths)}; a "
                "crosscoder reads one width d from every source (diffing needs two models of "
                "the same shape, or sites of the same width)."
            )
        stacked = torch.stack(outputs, dim=2)  # [B, T, n, d]
        return stacked[keep.to(stacked.device)]

    def _read(self, model: nn.Module, modules: list[nn.Module], input_ids) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}

        def grab(module, _inputs, output):
            seen[id(module)] = output[0] if isinstance(output, (tuple, list)) else output

        handles = [m.register_forward_hook(grab) for m in modules]
        try:
            device = next(model.parameters()).device
            model(input_ids.to(device))
        finally:
            for handle in handles:
                handle.remove()
        return [seen[id(m)].float() for m in modules]

    @torch.no_grad()
    def spliced_loss(
        self,
        input_ids: torch.Tensor,
        keep: torch.Tensor,
        replace: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """Next-token loss (summed over kept targets) of each model when its hooked
        outputs are replaced. `replace` sees every site of every model at once
        ([B, T, n_sites, d]: a crosscoder reconstructs them jointly) and returns the
        same shape; each model then runs with its own sites' replacements."""
        clean = []
        for model, modules in self.sites:
            clean += self._read(model, modules, input_ids)
        new = replace(torch.stack(clean, dim=2))
        losses, first = [], 0
        for model, modules in self.sites:
            swap = {id(m): new[:, :, first + i] for i, m in enumerate(modules)}
            first += len(modules)

            def splice(module, _inputs, output, swap=swap):
                value = swap[id(module)]
                if isinstance(output, (tuple, list)):
                    return (value.to(output[0].dtype), *output[1:])
                return value.to(output.dtype)

            handles = [m.register_forward_hook(splice) for m in modules]
            try:
                device = next(model.parameters()).device
                logits = model(input_ids.to(device))
            finally:
                for handle in handles:
                    handle.remove()
            logits = getattr(logits, "logits", logits)
            logits = logits[0] if isinstance(logits, tuple) else logits
            targets = input_ids[:, 1:].to(logits.device)
            mask = keep[:, 1:].to(logits.device)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="none"
            )
            losses.append((loss * mask.flatten()).sum())
        return losses


def keep_positions(input_ids: torch.Tensor, drop_ids: list[int]) -> torch.Tensor:
    """[B, T] True where the token is neither BOS nor padding (their activations are
    outliers a crosscoder should not spend features on)."""
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    for token in drop_ids:
        keep &= input_ids != token
    return keep


class ActivationBuffer:
    """Rows read on the fly: this rank's sequences (rank, rank + W, ...) are run through
    the sources `sequences_per_refill` at a time, the rows shuffled, and handed out in
    batches of `rows_per_batch`. A refill is a function of (seed, rank, refill index),
    so the state is two numbers and a resume continues exactly."""

    def __init__(
        self,
        harvest: Callable[[torch.Tensor], torch.Tensor],
        sequences: Dataset,
        rows_per_batch: int,
        sequences_per_refill: int,
        rank: int,
        world_size: int,
        seed: int,
    ) -> None:
        self.harvest, self.sequences = harvest, sequences
        self.mine = list(range(rank, len(sequences), world_size))
        if not self.mine:
            raise DataError(
                f"the text has {len(sequences)} sequences, fewer than the {world_size} ranks; "
                "give more text or use fewer processes."
            )
        self.rows_per_batch, self.per_refill = rows_per_batch, sequences_per_refill
        self.rank, self.seed = rank, seed
        self.refill, self.position = 0, 0
        self._rows: torch.Tensor | None = None

    def _fill(self) -> torch.Tensor:
        start = self.refill * self.per_refill
        picks = [self.mine[(start + i) % len(self.mine)] for i in range(self.per_refill)]
        input_ids = torch.stack([self.sequences[i][INPUT_IDS] for i in picks])
        rows = self.harvest(input_ids)
        stream = (self.seed * 1_000_003 + self.rank * 7919 + self.refill) % 2**63
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(stream))
        return rows[order]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            if self._rows is None:
                self._rows = self._fill()
            if self.position + self.rows_per_batch > len(self._rows):
                self.refill, self.position, self._rows = self.refill + 1, 0, None
                continue
            batch = self._rows[self.position : self.position + self.rows_per_batch]
            self.position += self.rows_per_batch
            yield {"x": batch.float()}

    @property
    def epoch(self) -> int:
        """Passes over this rank's sequences so far."""
        return self.refill * self.per_refill // len(self.mine)

    def state_dict(self) -> dict[str, Any]:
        return {"refill": self.refill, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.refill, self.position, self._rows = int(state["refill"]), int(state["position"]), None


def build_activation_cache(
    cache: ShardCache,
    harvest: Callable[[torch.Tensor], torch.Tensor],
    sequences: Dataset,
    rank: int,
    world_size: int,
    settings: dict[str, Any],
    barrier: Callable[[], None],
    dtype: torch.dtype = torch.bfloat16,
) -> ActivationRows:
    """Activations of every sequence (rank r reads r, r + W, ...), written once as one
    shard per rank and read back by every rank; a cache made with other settings is
    refused with the differences."""
    made = cache.made()  # by an earlier freetx too: other settings are refused all the same
    if made is not None:
        made_with = made.get("settings")
        if made_with != settings:
            changed = sorted(
                k
                for k in set(made_with or {}) | set(settings)
                if (made_with or {}).get(k) != settings.get(k)
            )
            raise ConfigError(
                f"the activation cache {cache.folder} was made with other settings "
                f"({', '.join(changed)} differ); its rows are not this run's. Point "
                "activations.cache at another folder, or delete it to make it again."
            )
    if not cache.complete():

        def make() -> dict[str, torch.Tensor]:
            parts = []
            step = world_size * CACHE_SEQUENCES_PER_FORWARD
            for start in range(rank, len(sequences), step):
                picks = list(range(start, min(len(sequences), start + step), world_size))
                parts.append(harvest(torch.stack([sequences[i][INPUT_IDS] for i in picks])))
            return {"rows": torch.cat(parts).to(dtype).contiguous()}

        cache.build(rank, world_size, make, {"settings": settings}, barrier=barrier)
    data, _ = cache.load(framework="pt")
    return ActivationRows(data["rows"])


def norm_sums(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of ||x_s|| per source [n], number of rows): summed over ranks, they give the
    scale sqrt(d) / mean ||x_s|| that brings each source's mean norm to sqrt(d)."""
    return rows.float().norm(dim=-1).sum(0), len(rows)


def scales_from_norm_sums(norms: torch.Tensor, count: float, source_dim: int) -> torch.Tensor:
    return math.sqrt(source_dim) / (norms / max(count, 1.0)).clamp_min(1e-12)


@dataclass
class RowLoading:
    """How this rank reads rows: the global batch (rows over all ranks, split into
    `accumulation` micro-batches), the rank among `world_size`, the seed of the data
    order, and how many rows it keeps for validation and for the normalization."""

    batch_size: int
    accumulation: int
    rank: int
    world_size: int
    seed: int
    eval_rows: int
    normalize_rows: int

    def eval_share(self) -> slice:
        """This rank's validation rows among the first `eval_rows` (contiguous, sizes
        within one of each other): the same rows are evaluated at any world size."""
        rank, world = self.rank, self.world_size
        return slice(self.eval_rows * rank // world, self.eval_rows * (rank + 1) // world)

    def loader(self, rows: ActivationRows) -> Iterable[dict[str, torch.Tensor]]:
        """Rows held in memory, in the global-batch sampler's order (a function of the step)."""
        return build_train_loader(
            rows, self.batch_size, self.accumulation, self.rank, self.world_size, self.seed
        )


class SpliceProbe:
    """The CE loss recovered on validation text: each source model's next-token loss
    with its hooked activations as they are (clean), replaced by a reconstruction
    (splice), and replaced by zeros; `(L_zero - L_splice) / (L_zero - L_clean)`."""

    def __init__(
        self, harvester: ActivationHarvester, text: Dataset, drop_ids: list[int], sequences: int = 8
    ) -> None:
        self.harvester = harvester
        count = min(sequences, len(text))
        self.input_ids = torch.stack([text[i][INPUT_IDS] for i in range(count)])
        self.keep = keep_positions(self.input_ids, drop_ids)

    def __call__(self, reconstruct: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """`reconstruct` maps rows [N, n, d] (float32) to their reconstruction."""

        def splice(x: torch.Tensor) -> torch.Tensor:  # [B, T, n, d]
            return reconstruct(x.flatten(0, 1).float()).reshape(x.shape).to(x.dtype)

        clean, spliced, zero = (
            self.harvester.spliced_loss(self.input_ids, self.keep, replace)
            for replace in (lambda x: x, splice, torch.zeros_like)
        )
        tokens = float(self.keep[:, 1:].sum())
        metrics = {}
        for i, (c, s, z) in enumerate(zip(clean, spliced, zero)):
            metrics[f"val/ce_recovered/model_{i}"] = float((z - s) / (z - c).clamp_min(1e-12))
            metrics[f"val/ce_clean/model_{i}"] = float(c) / tokens
            metrics[f"val/ce_splice/model_{i}"] = float(s) / tokens
        return metrics


@dataclass
class Activations:
    """What a crosscoder trains and evaluates on, from one activation source."""

    train_loader: Iterable[dict[str, torch.Tensor]]  # {"x": [rows, n, d]}; resumable
    val_rows: torch.Tensor  # this rank's validation rows [rows, n, d]
    shape: tuple[int, int]  # (num_sources, source_dim)
    normalize_from: torch.Tensor  # this rank's rows to estimate the input scales from
    description: str  # for the banner
    planted: PlantedFeatures | None = None  # synthetic: the truth, for recovery metrics
    splice: SpliceProbe | None = None  # models: the CE loss recovered

    def metrics(
        self, decoder: torch.Tensor, reconstruct: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[str, float]:
        """This source's own evaluation of a crosscoder, given its whole decoder
        [m, n, d] and its `reconstruct` (rows [N, n, d] in, out): the planted features'
        recovery (synthetic), the CE loss recovered (models)."""
        metrics = {}
        if self.planted is not None:
            metrics.update(self.planted.recovery(decoder.cpu()))
        if self.splice is not None:
            metrics.update(self.splice(reconstruct))
        return metrics


def planted_activations(
    train: PlantedFeatures, validation: PlantedFeatures, loading: RowLoading
) -> Activations:
    """Planted synthetic rows: the training split through the global-batch sampler, this
    rank's share of the first `eval_rows` of the validation split."""
    return Activations(
        train_loader=loading.loader(train),
        val_rows=validation.rows[: loading.eval_rows][loading.eval_share()],
        shape=(train.num_sources, train.source_dim),
        normalize_from=train.rows[: loading.normalize_rows],
        description=f"synthetic ({len(train):,} rows)",
        planted=train,
    )


def harvested_activations(
    cfg: ActivationsConfig,
    models: list[nn.Module],
    hooks: list[list[str]],
    identities: list[dict[str, Any]],
    files: dict[str, dict[str, Any]],
    tokenizer: Any,
    text: Dataset,
    val_text: Dataset,
    loading: RowLoading,
    barrier: Callable[[], None],
) -> Activations:
    """The outputs of `cfg.sources`' hooks (`models`: those sources, loaded, in order;
    `hooks`: each source's module names as the loaded model names them) on `text`, BOS and padding dropped: on the fly (`mode: buffer`) or written once to
    `cfg.cache` by all ranks together (`mode: cache`; `barrier` waits for every rank).
    `identities`: each source's checkpoint and fingerprint (`freetx.checkpoint.
    input_identity`), part of the cache's settings: a cache written before a source
    trained on is refused, never read as this run's activations. `files`: the identities
    of what the text and the tokenizer read (name -> identity), in the key too.
    Validation rows come from this rank's own validation sequences."""
    if not cfg.sources:
        raise ConfigError(
            "activations.kind=models needs activations.sources: a list of {model: PATH, "
            "hooks: [module names]}."
        )
    harvester = ActivationHarvester(
        [(model, names, s.model) for model, names, s in zip(models, hooks, cfg.sources)]
    )
    drop_ids = [t for t in (tokenizer.bos_id, tokenizer.pad_id) if t is not None]

    def harvest(input_ids: torch.Tensor) -> torch.Tensor:
        return harvester(input_ids, keep_positions(input_ids, drop_ids)).cpu()

    rank, world_size = loading.rank, loading.world_size
    sample = harvest(torch.stack([text[0][INPUT_IDS]]))
    if cfg.mode == "cache":
        if not cfg.cache:
            raise ConfigError("activations.mode=cache needs activations.cache: a folder.")
        settings = {
            "sources": [
                {
                    "model": s.model,
                    "hooks": list(s.hooks),
                    "checkpoint": identity["path"],
                    "fingerprint": identity["fingerprint"],
                }
                for s, identity in zip(cfg.sources, identities)
            ],
            "text": repr(cfg.text),
            "tokenizer": repr(cfg.tokenizer),
        }
        if files:  # rewritten text or tokenizer files make another cache
            settings["files"] = {name: [i["path"], i["fingerprint"]] for name, i in files.items()}
        rows = build_activation_cache(
            ShardCache(cfg.cache), harvest, text, rank, world_size, settings, barrier=barrier
        )
        loader = loading.loader(rows)
        normalize_from = rows.rows[rank::world_size]
        description = f"cache {cfg.cache} ({len(rows):,} rows)"
    else:
        rows_per_batch = micro_batch_size(loading.batch_size, world_size, loading.accumulation)
        loader = ActivationBuffer(
            harvest,
            text,
            rows_per_batch,
            cfg.sequences_per_refill,
            rank,
            world_size,
            loading.seed,
        )
        first = loader.mine[: cfg.sequences_per_refill]
        normalize_from = harvest(torch.stack([text[i][INPUT_IDS] for i in first]))
        description = f"buffer ({cfg.sequences_per_refill} sequences a refill)"
    return Activations(
        train_loader=loader,
        val_rows=validation_rows(harvest, drop_ids, val_text, loading),
        shape=(sample.shape[1], sample.shape[2]),
        normalize_from=normalize_from[: loading.normalize_rows],
        description=description,
        splice=SpliceProbe(harvester, val_text, drop_ids),
    )


def validation_rows(
    harvest: Callable[[torch.Tensor], torch.Tensor],
    drop_ids: list[int],
    val_text: Dataset,
    loading: RowLoading,
) -> torch.Tensor:
    """This rank's share (`RowLoading.eval_share`) of the first `eval_rows` rows of the
    validation sequences taken in order; only the sequences that hold it are harvested
    (a sequence's row count is its tokens that are not BOS or padding)."""
    if len(val_text) == 0:
        raise ConfigError("the text's validation split is empty; raise dataset val_fraction.")
    share = loading.eval_share()
    parts, start = [], 0
    for i in range(len(val_text)):
        if start >= share.stop:
            break
        input_ids = torch.stack([val_text[i][INPUT_IDS]])
        count = int(keep_positions(input_ids, drop_ids).sum())
        if start + count > share.start:
            rows = harvest(input_ids)
            parts.append(rows[max(0, share.start - start) : share.stop - start])
        start += count
    if not parts:  # more ranks than rows: this one evaluates none
        parts.append(harvest(torch.stack([val_text[0][INPUT_IDS]]))[:0])
    return torch.cat(parts)
