"""Reading weights into a model, in three steps: the survey (`weight_source`: what a
path means and holds, read once), the check (`check_weights`, `check_checkpoint`: names
and shapes against the model, every refusal before a weight is touched) and the load
(`load_weights`). `load_initial_weights` is the three in a row; `load_model` rebuilds a
whole model from a checkpoint.

Every format `open_tensors` reads works here: DCP folders (resharded through DCP),
safetensors files and HF folders (each rank reads only the rows of its own shard).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from freetx.checkpoint.adapters import refuse_adapters
from freetx.checkpoint.dcp_folder import (
    FROZEN_FROM,
    MODEL_PREFIX,
    DCPReader,
    SafeLoadPlanner,
    quiet_single_process,
    read_json,
)
from freetx.checkpoint.formats import (
    DCPSource,
    TensorSource,
    hf_weight_files,
    open_tensors,
    skipped_note,
)
from freetx.checkpoint.identity import input_identity
from freetx.checkpoint.run_folder import newest_checkpoint, resolve_checkpoint
from freetx.checkpoint.state import ModelState
from freetx.distributed import dtype_named, unwrap
from freetx.distributed.parameters import (
    canonical_name,
    init_from_weights,
    load_parameters,
    self_initialized,
    self_stored,
    set_full_parameter,
)
from freetx.errors import CheckpointError
from freetx.models.protocol import ReplacesLanguageHead, SplitsIntoStages

if TYPE_CHECKING:
    from freetx.models.peft import PEFTConfig


@dataclass
class WeightSource:
    """Weights read from files besides a run's own checkpoint (`checkpoint.initial_weights`,
    a frozen base), surveyed once: the path as given, the checkpoint it means now (a run
    folder: its newest complete one), its tensors (kind, names, shapes, meta; read when
    first asked, or already by the run folder's survey) and its identity (recorded in the
    run's checkpoints)."""

    given: str
    path: Path
    opened: TensorSource | None = None

    @property
    def tensors(self) -> TensorSource:
        if self.opened is None:
            self.opened = open_tensors(self.path)
        return self.opened

    @cached_property
    def identity(self) -> dict[str, Any]:
        return input_identity(self.given, resolved=self.path)

    def describe(self) -> str:
        """The path as given and what it holds, for the banner: `DIR (HF safetensors)`, a
        run folder's `DIR (DCP checkpoint step_000040)`."""
        words = _KIND_WORDS.get(self.tensors.kind, self.tensors.kind)
        at = f" {self.path.name}" if self.path != Path(self.given).expanduser() else ""
        return f"{self.given} ({words}{at})"


_KIND_WORDS = {
    "hf": "HF safetensors",
    "dcp": "DCP checkpoint",
    "safetensors": "safetensors file",
    "torch": "torch file",
}


def weight_source(path: str | Path) -> WeightSource:
    """The weights `path` means (a run's output_dir: its newest complete checkpoint)."""
    found = newest_checkpoint(path)
    if found is not None:
        found.verify()  # its files are what was saved
        return WeightSource(str(path), found.path, found)
    return WeightSource(str(path), Path(path).expanduser())


def adapters_base(
    source: TensorSource, given: str | None = None, key: str | None = None
) -> str | None:
    """The base an adapter-only checkpoint (a LoRA run's: the trained part only) is read
    over: `given` (a config's `key`, for a base that moved), else the one the run recorded
    (`frozen_from` in its meta.json); None for a checkpoint that records none. A base that
    is not there is refused saying which it is and how to point at where it is now."""
    recorded = source.meta.get(FROZEN_FROM)
    if given or recorded is None or Path(recorded).expanduser().exists():
        return given or recorded
    elsewhere = (
        f"set {key}=PATH to read it from there"
        if key
        else "merge the adapters over it "
        f"(freetx checkpoint merge {source.path} --base PATH MERGED) and use MERGED"
    )
    raise CheckpointError(
        f"{source.path} holds a LoRA run's adapters only, and the base they were trained "
        f"over, as the run recorded it ({source.path / 'meta.json'}: {FROZEN_FROM}), is "
        f"{recorded}, which does not exist now. If the base moved, {elsewhere}; else put "
        f"it back at {recorded}."
    )


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Model tensor name -> global shape, as DCP would save them."""
    return {k: tuple(v.shape) for k, v in get_model_state_dict(model).items() if torch.is_tensor(v)}


def held_here(model: nn.Module, found: dict[str, tuple]) -> dict[str, tuple]:
    """`found` (a file's or checkpoint's tensors) less those another pipeline stage holds
    (`SplitsIntoStages.held_elsewhere`): what a stage's model must match."""
    inner = unwrap(model)  # under a DDP wrapper
    if not isinstance(inner, SplitsIntoStages):
        return found
    return {name: shape for name, shape in found.items() if not inner.held_elsewhere(name)}


def mismatch_report(
    expected: dict[str, tuple], found: dict[str, tuple], limit: int = 12
) -> list[str]:
    """Lines describing missing, unexpected and mis-shaped tensors."""
    lines = []
    for name in sorted(set(expected) - set(found)):
        lines.append(f"missing {name} {list(expected[name])}")
    for name in sorted(set(found) - set(expected)):
        lines.append(f"unexpected {name} {list(found[name])}")
    for name in sorted(set(expected) & set(found)):
        if expected[name] != found[name]:
            lines.append(
                f"shape of {name}: model {list(expected[name])}, checkpoint {list(found[name])}"
            )
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


def head_not_read(model: nn.Module, found: Iterable[str]) -> tuple[set[str], set[str]]:
    """For a model whose head replaces a language model's (`ReplacesLanguageHead`: a
    sequence scorer), given the names the weights hold: its head's names they lack (drawn
    from the seed, not read) and the language model's head's they hold (not read)."""
    inner, found = unwrap(model), set(found)
    if not isinstance(inner, ReplacesLanguageHead):
        return set(), set()
    return set(inner.NEW_HEAD) - found, set(inner.LANGUAGE_HEAD) & found


def _differences(model: nn.Module, source: TensorSource, expected: Callable[[str], bool]):
    """The lines of `mismatch_report` between the model's tensors that `expected` accepts
    and the ones `source` holds for this pipeline stage. A parameter its module keeps in
    its own form may have another shape of the same size (an NF4 expert base [E * rows,
    cols] of a grouped tensor [E, rows, cols]: its module reshapes what it is given). A
    scorer's head and a language model's are not compared (`head_not_read`)."""
    found = held_here(model, source.model_shapes())
    new, language = head_not_read(model, found)
    wanted = {n: s for n, s in model_shapes(model).items() if expected(n) and n not in new}
    found = {n: s for n, s in found.items() if n not in language}
    for name in self_stored(unwrap(model)) & wanted.keys() & found.keys():
        if math.prod(wanted[name]) == math.prod(found[name]):
            wanted[name] = found[name]
    return mismatch_report(wanted, found)


def check_weights(model: nn.Module, weights: WeightSource, with_adapters: bool = False) -> None:
    """Refuse weights that do not fit `model`, listing every difference. Adapters
    (parameters a module initializes itself) are not expected in the files, unless
    `with_adapters` (a LoRA run's checkpoint of the whole model, its adapters in it)."""
    adapters = set(self_initialized(unwrap(model)))
    expected = (lambda name: True) if with_adapters else (lambda name: name not in adapters)
    problems = _differences(model, weights.tensors, expected)
    if problems:
        raise CheckpointError(
            f"initial weights {weights.given} do not fit this model ({len(problems)} "
            "difference(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nUse weights of this model shape, or change the model config to match them."
        )
    refuse_non_float(model, weights.tensors, skip=adapters | self_stored(unwrap(model)))


def refuse_non_float(model: nn.Module, source: TensorSource, skip: set[str]) -> None:
    """Refuse a stored tensor that is not floating-point (int32, uint8, bool) where the
    model's is: loaded, it would be cast silently into meaningless weights (an int32
    embedding of whole numbers). `skip`: names the model keeps in its own form (adapters,
    NF4 bases)."""
    for name, tensor in get_model_state_dict(model).items():
        info = source.infos.get(MODEL_PREFIX + name)
        if name in skip or info is None or not torch.is_tensor(tensor):
            continue
        if tensor.is_floating_point() and not info.dtype.is_floating_point:
            raise CheckpointError(
                f"{source.where(MODEL_PREFIX + name)} is {info.dtype}, where the model's "
                f"{name} is {tensor.dtype}: whole numbers or flags are not weights, and "
                "loading them would cast them silently. The file is damaged or holds a "
                "quantized model freetx does not read; use a folder with floating-point "
                "weights (float32, bfloat16 or float16), e.g. the original download."
            )


def check_checkpoint(model: nn.Module, source: DCPSource, include=None) -> None:
    """Refuse a checkpoint whose model tensors differ from `model`'s, listing every
    difference (`include`: the names a partial checkpoint holds)."""
    problems = _differences(model, source, include or (lambda name: True))
    if problems:
        raise CheckpointError(
            f"checkpoint {source.path} does not fit this model ({len(problems)} difference(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nIt was saved from another model or shape; use a checkpoint of this model, "
            "or change the model config to the one it was saved with (see its meta.json)."
        )


def load_weights(model: nn.Module, weights: WeightSource, alone: bool = False) -> list[str]:
    """Set a (parallelized) model's weights from checked `weights` (`check_weights`).

    Every rank calls it. Adapters keep their values. DCP checkpoints reshard
    through DCP; from safetensors files (one, or an HF folder's shards) each rank
    reads only the rows of its own shard, a tensor at a time. Afterwards, values
    that follow from the weights (DoRA's magnitudes) are set. Returns lines naming
    what of the files is not read (a multimodal folder's vision tower), for the
    run's output. `alone`: one rank of a process group loads an unsharded model by itself
    (an export at the end of a run), so a DCP checkpoint is read without collectives.
    """
    source, inner = weights.tensors, unwrap(model)
    new_head = head_not_read(model, source.model_shapes())[0]  # drawn from the seed
    skipped = set(self_initialized(inner)) | self_stored(inner) | new_head
    if isinstance(source, DCPSource):
        state = ModelState(model, include=lambda name: name not in skipped)
        with quiet_single_process():  # a run always has a process group; tests may not
            dcp.load(
                {"model": state},
                storage_reader=DCPReader(str(source.path)),
                planner=SafeLoadPlanner(),
                no_dist=alone,
            )
    else:
        load_parameters(
            inner,
            lambda name, rows, out: source.read_into(MODEL_PREFIX + name, rows, out),
            only=lambda name: name not in skipped,
        )
        load_buffers(inner, source)
    for name in sorted(self_stored(inner)):  # e.g. NF4 bases: from the full weight as stored
        set_full_parameter(inner, name, source.get(MODEL_PREFIX + name))
    init_from_weights(inner)
    return skipped_note(source)


@torch.no_grad()
def load_buffers(model: nn.Module, source: TensorSource) -> None:
    """Set the model's buffers that `source` holds (persistent ones a folder stores beside
    the weights: DeepSeek-V3's `e_score_correction_bias`), whole on every rank, as FSDP2
    keeps them; the others keep what the model computed (`init_buffers`)."""
    for name, buffer in model.named_buffers():
        key = MODEL_PREFIX + canonical_name(name)
        if key in source.infos:
            host = torch.empty(buffer.shape, dtype=buffer.dtype)
            source.read_into(key, None, host)
            buffer.copy_(host)


def load_initial_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Set a (parallelized) model's weights from a safetensors file, DCP folder, HF folder
    or a run's output_dir (its newest checkpoint): surveyed, checked, loaded
    (`load_weights`: what it returns)."""
    weights = weight_source(path)
    check_weights(model, weights)
    return load_weights(model, weights)


def model_from_checkpoint(path: str | Path):
    """(model class path, model config) that a checkpoint recorded, for building its model."""
    return recorded_model(open_tensors(path), path)


def recorded_model(source: TensorSource, path: str | Path):
    model_class = source.meta.get("model_class")
    if model_class is None or source.model_config is None:
        raise CheckpointError(
            f"{path} does not record which model it holds (no meta.json / freetx metadata); "
            "give the model in the config instead."
        )
    return model_class, source.model_config


def load_model(
    path: str | Path,
    device,
    seed: int = 0,
    adapters: PEFTConfig | None = None,
    base: str | None = None,
    base_key: str | None = None,
) -> nn.Module:
    """The model a checkpoint holds (a run's output_dir, a DCP folder, a .safetensors file
    freetx wrote, or an HF folder of the decoder family), rebuilt from what it recorded,
    its weights loaded, on `device`, in eval mode. Not sharded: for sampling, evaluation
    and reading activations.

    `adapters`: the `peft:` section of the run that saved a LoRA / DoRA / Spectrum
    checkpoint (`freetx.training.export.recorded_peft`): the model is rebuilt with its
    adapters, unmerged, and the checkpoint's tensors set over its base: the base's own
    weights where the checkpoint holds the trained part only (it records the base it was
    read from, `frozen_from`), else the checkpoint's. Without it a LoRA checkpoint is
    refused, naming the merge. `base`: the base to read such a checkpoint over where it
    moved (the config's `base_key`; None: the recorded one, `adapters_base`). An HF folder of torchao-quantized weights (`freetx
    checkpoint convert --quantize`, transformers' TorchAoConfig) gives the model with
    torchao's quantized tensors in its Linears (`freetx.checkpoint.quantized`); a folder
    quantized otherwise (bitsandbytes, GPTQ ...) is refused before a weight is read."""
    if quantization_method(path) is not None:
        return load_quantized(path, device, seed)
    weights = weight_source(path)
    if adapters is None or adapters.method == "none":
        refuse_adapters(weights.tensors, "loaded as a model")
        return model_from_weights(weights, device, seed)
    from freetx.distributed.parameters import materialize
    from freetx.models import build_model
    from freetx.models.peft import apply_peft

    with torch.device("meta"):
        model = build_model(*recorded_model(weights.tensors, weights.path))
        apply_peft(model, adapters)
    materialize(model, device, seed=seed, init_weights=False)
    base = adapters_base(weights.tensors, base, base_key)
    if base is None:  # the whole model saved, its adapters with it (a random base's run)
        check_weights(model, weights, with_adapters=True)
        load_weights(model, weights)
        saved = set(self_initialized(model))
    else:  # the trained part only: over the base it was trained on
        load_initial_weights(model, base)
        saved = {n for n in model_shapes(model) if MODEL_PREFIX + n in weights.tensors.infos}
    if saved:
        load_only(model, weights.tensors, saved)
    return model.eval()


def load_only(model: nn.Module, source: TensorSource, names: set[str]) -> None:
    """Set the (unsharded) model's parameters `names` from `source` (which may hold more:
    a whole model's checkpoint), checked first."""
    problems = mismatch_report(
        {n: s for n, s in model_shapes(model).items() if n in names},
        {n: s for n, s in source.model_shapes().items() if n in names},
    )
    if problems:
        raise CheckpointError(
            f"{source.path} does not fit this model's adapters:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nUse the peft: settings of the run that saved it."
        )
    if isinstance(source, DCPSource):
        with quiet_single_process():
            dcp.load(
                {"model": ModelState(model, include=lambda name: name in names)},
                storage_reader=DCPReader(str(source.path)),
                planner=SafeLoadPlanner(),
            )
        return
    load_parameters(
        model,
        lambda name, rows, out: source.read_into(MODEL_PREFIX + name, rows, out),
        only=lambda name: name in names,
    )


def model_from_weights(
    weights: WeightSource, device, seed: int = 0, alone: bool = False
) -> nn.Module:
    """The model `weights` hold (the class and config they recorded), built unsharded on
    `device`, its weights checked and loaded, in eval mode (`alone`: as `load_weights`)."""
    from freetx.distributed.parameters import materialize
    from freetx.models import build_model

    with torch.device("meta"):
        model = build_model(*recorded_model(weights.tensors, weights.path))
    materialize(model, device, seed=seed, init_weights=False)
    check_weights(model, weights)
    load_weights(model, weights, alone)
    return model.eval()


def quantization_method(path: str | Path) -> str | None:
    """The `quant_method` of an HF folder's quantization_config (torchao, bitsandbytes,
    gptq ...); None when `path` is no HF folder or its weights are not quantized."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return None
    hf = read_json(config, "HF model config")
    quantization = hf.get("quantization_config") if isinstance(hf, dict) else None
    if not isinstance(quantization, dict):
        return None
    return str(quantization.get("quant_method", "unnamed"))


def load_quantized(path: str | Path, device, seed: int = 0) -> nn.Module:
    """freetx's model of an HF folder of torchao-quantized weights (`export_quantized`, or
    transformers' save of a TorchAoConfig model): built from config.json, each stored tensor
    set as it is (`load_state_dict(assign=True)`: a quantized Linear holds torchao's tensor,
    as the export's model did), on `device`, in eval mode. Another quantization method is
    refused before a weight is read."""
    from safetensors import safe_open
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    from freetx.distributed.parameters import materialize
    from freetx.models import build_model
    from freetx.models.hf import layout_for_hf_config

    folder = Path(path).expanduser()
    method = quantization_method(folder)
    if method != "torchao":
        raise CheckpointError(
            f"{folder} holds a model quantized by {method} (config.json's quantization_config), "
            "which freetx does not read: it reads torchao's quantized folders (freetx "
            "checkpoint convert SRC DST --quantize SCHEME writes them) and unquantized ones. "
            "Use the unquantized model's folder (e.g. the original download) instead."
        )
    hf = read_json(folder / "config.json", "HF model config")
    hf = {k: v for k, v in hf.items() if k != "quantization_config"}  # the model itself
    layout = layout_for_hf_config(hf)
    with torch.device("meta"):
        model = build_model(layout.model_class, layout.from_hf_config(hf))
    materialize(model, torch.device("cpu"), seed=seed, init_weights=False)
    tied = bool(hf.get("tie_word_embeddings", False))
    state: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for file in hf_weight_files(folder):
        with safe_open(str(file), "pt") as f:
            stored = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata() or {}
        tensors, _ = unflatten_tensor_state_dict(stored, metadata)
        for hf_name, tensor in tensors.items():
            name = None if tied and hf_name == "lm_head.weight" else layout.from_hf_name(hf_name)
            index = None if name is None else layout.stack_index(hf_name)
            if name is not None and index is None:
                state[name] = tensor
            elif name is not None:
                stacks.setdefault(name, {})[index] = tensor
    state |= {name: torch.stack([p[i] for i in sorted(p)]) for name, p in stacks.items()}
    held = dict(model.named_parameters(remove_duplicate=False))
    for name, parameter in held.items():  # a tied weight: the one it shares storage with
        twin = [n for n, p in held.items() if p is parameter and n in state]
        if name not in state and twin:
            state[name] = state[twin[0]]
    problems = mismatch_report(model_shapes(model), {n: tuple(t.shape) for n, t in state.items()})
    if problems:
        raise CheckpointError(
            f"the quantized weights of {folder} do not fit the model its config.json "
            f"describes ({len(problems)} difference(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nThe folder is incomplete or was edited; export it again."
        )
    model.load_state_dict(state, strict=False, assign=True)
    return model.to(device).eval()


def load_source_model(
    path: str, device: torch.device, dtype: str = "auto", adapters: PEFTConfig | None = None
) -> nn.Module:
    """A frozen model to read activations from: the model of a run, a checkpoint or an HF
    folder (`load_model`: freetx's own where it reads the folder's model_type natively,
    else transformers' through the generic path, as `freetx.models.hf_model` chooses;
    `adapters`: a LoRA run's, unmerged over its base). `dtype`: float32, bfloat16, or auto
    (bf16 on CUDA)."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return load_model(path, device, adapters=adapters).to(dtype_named(dtype))


def source_parameters(path: str) -> int:
    """How many parameters the model `load_source_model` reads from `path` has (its shapes
    alone: `source_model_on_meta`)."""
    return sum(p.numel() for p in source_model_on_meta(path).parameters())


def source_model_on_meta(path: str) -> nn.Module:
    """The model `load_source_model` reads from `path`, on the meta device: its shapes and
    parameter count from what the checkpoint recorded or the HF folder's config.json,
    without reading a weight (`freetx estimate`)."""
    from freetx.models import build_model, hf_model

    with torch.device("meta"):
        if (Path(path).expanduser() / "config.json").is_file():  # an HF folder, weights or not
            return hf_model(str(Path(path).expanduser()))
        return build_model(*model_from_checkpoint(resolve_checkpoint(path)))
