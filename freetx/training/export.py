"""`checkpoint.final_export`: the model users deploy, written when training ends.

    checkpoint:
      final_export: auto      # auto | hf | peft | safetensors | null (default: none)

After the final DCP save, rank 0 converts that checkpoint the way `freetx
checkpoint convert --to FORMAT` does (the same function, `convert`), into
`<output_dir>/export/<format>/`: hf (an HF transformers folder: config.json, weights
in shards of 5GB, the tokenizer files of the folder the run started from), peft (a
LoRA / DoRA run's adapter_model.safetensors + adapter_config.json) or safetensors
(`model.safetensors`, freetx's names); auto follows what the run trains (LoRA adapters:
peft; the whole model: hf, or safetensors for a model with no HF layout; Spectrum's
trained part alone: none), resolved once by `final_export_format`. The conversion reads the saved checkpoint
one tensor at a time and writes it straight to the file: no rank gathers the model
and nothing holds more than one tensor. Every recipe goes through `TrainingRun.finish`,
so every recipe exports.

`check_final_export` refuses what cannot be exported (validate, run, launch and the
run itself call it), before anything is trained.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from freetx.checkpoint import convert, open_tensors, resolve_checkpoint
from freetx.checkpoint.adapters import LoRASettings
from freetx.checkpoint.convert import HFTokenizerFiles
from freetx.checkpoint.loading import quantization_method
from freetx.checkpoint.quantized import ExportNeedsCUDA, export_quantized
from freetx.config.instantiate import COMPONENT, import_component, instantiate, node_config_class
from freetx.data import HasHFForm
from freetx.errors import ConfigError, FreetxError
from freetx.models.peft import PEFTConfig
from freetx.models.protocol import HFLayoutModel
from freetx.models.qat import QATConfig
from freetx.user_files import WriteFailed

EXPORT_DIR = "export"
FILE_NAMES = {"safetensors": "model.safetensors"}  # the other formats are folders


def export_path(output_dir: str | Path, fmt: str) -> Path:
    """Where `final_export: fmt` writes: <output_dir>/export/<fmt>/ (a folder; for
    safetensors the file model.safetensors in it)."""
    folder = Path(output_dir) / EXPORT_DIR / fmt
    return folder / FILE_NAMES[fmt] if fmt in FILE_NAMES else folder


def recorded_config(path: str | Path) -> dict[str, Any]:
    """The config the run that saved checkpoint `path` recorded ({} for a checkpoint no
    freetx run saved: an HF folder, a quantized export, which records none)."""
    if quantization_method(path) is not None:
        return {}
    return open_tensors(resolve_checkpoint(path)).meta.get("config") or {}


def recorded_run(path: str | Path) -> dict[str, Any]:
    """What the run that saved checkpoint `path` recorded in its config, as `convert` and
    `merge` take it: the folders it started from (`run_folders`: its model path,
    tokenizer path and initial weights) and its LoRA settings (`lora`, or None)."""
    run = recorded_config(path)
    folders = [
        (run.get("model") or {}).get("path"),
        (run.get("tokenizer") or {}).get("path"),
        (run.get("checkpoint") or {}).get("initial_weights"),
    ]
    peft = run.get("peft") or {}
    lora = None
    if peft.get("method") == "lora" and "alpha" in peft:
        lora = LoRASettings(
            alpha=peft["alpha"],
            rank=int(peft.get("rank", 0)),
            dropout=peft.get("dropout", 0.0),
            use_dora=bool(peft.get("use_dora", False)),
        )
    return {
        "run_folders": [f for f in folders if isinstance(f, str)],
        "lora": lora,
        "tokenizer": hf_tokenizer_files(run.get("tokenizer")),
    }


def recorded_peft(path: str | Path) -> PEFTConfig | None:
    """The `peft:` section of the run that saved checkpoint `path` (None: a whole model,
    or no run of freetx's), for `load_model(..., adapters=)`."""
    run = recorded_config(path)
    peft = run.get("peft") or {}
    if peft.get("method", "none") == "none":
        return None
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PEFTConfig), peft))


def recorded_qat(path: str | Path) -> QATConfig:
    """The `qat:` section the run that saved checkpoint `path` recorded (scheme none and
    group size 32 for a run without one, or a checkpoint that records no run)."""
    run = recorded_config(path)
    qat = run.get("qat") or {}
    return QATConfig(**{k: v for k, v in qat.items() if k in ("scheme", "group_size")})


def export_quantized_final(output_dir: str | Path, qat: QATConfig) -> list[str]:
    """A QAT run's last step: its final checkpoint quantized by `qat.scheme` into
    <output_dir>/export/quantized/ (`export_quantized`, as `freetx checkpoint convert
    --quantize` writes it). Returns the lines to print: what was written, or why it was not
    (an int4_weight run on a machine without CUDA) and the command that writes it."""
    checkpoint = resolve_checkpoint(output_dir)
    dst = Path(output_dir) / EXPORT_DIR / "quantized"
    quant = qat.quant_scheme()
    try:
        written = export_quantized(
            checkpoint, dst, quant, overwrite=True, **recorded_run(checkpoint)
        )
    except ExportNeedsCUDA as e:
        return [
            f"The quantized export was not written: {e} Nothing is lost: the "
            f"checkpoint {checkpoint} is saved, and the command exports it."
        ]
    except (WriteFailed, OSError) as e:
        cause = e.cause if isinstance(e, WriteFailed) else (e.strerror or str(e))
        raise FreetxError(
            f"training finished, and its last checkpoint {checkpoint} is complete; only the "
            f"quantized export to {dst} failed ({cause}). Once there is room (or elsewhere), "
            f"export it: freetx checkpoint convert {checkpoint} {dst} --quantize {quant.scheme} "
            f"--group-size {quant.group_size} --overwrite"
        ) from None
    line = (
        f"exported {checkpoint.name} quantized ({quant.scheme}, groups of {quant.group_size}) to "
        f"{written['path']} ({written['bytes'] / 2**20:.1f} MiB): transformers loads it"
    )
    return [line, *written["notes"]]


def hf_tokenizer_files(node: Any) -> HFTokenizerFiles | None:
    """The HF files of the tokenizer a run's `tokenizer:` node builds, when it has an HF form
    (`HasHFForm`: freetx's byte tokenizer); None otherwise, or when its class no longer
    imports (the export then says it has no tokenizer)."""
    try:
        built = built_class(node, "tokenizer")
    except ConfigError:
        return None
    if built is None or not isinstance(built, HasHFForm):
        return None
    tokenizer = instantiate(OmegaConf.create(node))
    if not isinstance(tokenizer, HasHFForm):
        return None
    return HFTokenizerFiles(tokenizer.hf_files(), tokenizer.special_ids())


def export_final(checkpoint: Path, output_dir: str | Path, fmt: str) -> dict[str, Any]:
    """Convert the final checkpoint into `export_path(output_dir, fmt)`, replacing an
    earlier export of this run (it is made from the checkpoint, which stays); files a user
    added to the export folder stay. When the export cannot be written (a full disk), the
    error says that training and the checkpoint are complete, and how to export later."""
    dst = export_path(output_dir, fmt)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        return convert(checkpoint, dst, to=fmt, overwrite=True, **recorded_run(checkpoint))
    except (WriteFailed, OSError) as e:
        cause = e.cause if isinstance(e, WriteFailed) else (e.strerror or str(e))
        raise FreetxError(
            f"training finished, and its last checkpoint {checkpoint} is complete; only the "
            f"final export to {dst} failed ({cause}), and nothing there was replaced. Once "
            f"there is room (or elsewhere), export it: freetx checkpoint convert {checkpoint} "
            f"{dst} --to {fmt} --overwrite"
        ) from None


def built_class(model_node: Any, name: str = "model") -> type | None:
    """The class a `model:` node (or the node `name`) builds: the `_component_` itself when
    it is a class, the return annotation of a builder function (of a builder that picks its
    config class by its keys, `ChoosesConfig`: the annotated class whose `config_class` it
    picks, an HF folder's generic path); None when neither says (a recipe that builds its
    model otherwise)."""
    if not hasattr(model_node, "get") or not isinstance(model_node.get(COMPONENT), str):
        return None
    target = import_component(model_node[COMPONENT], f"{name}.{COMPONENT}")
    if isinstance(target, type):
        return target
    try:
        built = typing.get_type_hints(target).get("return")
    except (NameError, TypeError):
        return None
    if isinstance(built, type):
        return built
    config_class = node_config_class(model_node, target)
    chosen = [m for m in typing.get_args(built) if getattr(m, "config_class", None) is config_class]
    return chosen[0] if config_class is not None and len(chosen) == 1 else None


def has_hf_layout(model_class: type) -> bool:
    return isinstance(model_class, HFLayoutModel) and model_class.hf_layout is not None


def final_export_format(cfg: Any, model_class: type | None) -> str | None:
    """The format `checkpoint.final_export` writes (None: no export): `auto` resolved by
    what the run trains: LoRA adapters -> peft; the whole model -> hf (safetensors for a
    model class without an HF layout; `model_class` None: not known yet); Spectrum's
    trained modules alone, which no format holds -> none."""
    fmt = cfg.checkpoint.final_export
    if fmt != "auto":
        return fmt
    method = getattr(getattr(cfg, "peft", None), "method", "none")
    if method != "none":
        return "peft" if method == "lora" else None
    return "safetensors" if model_class is not None and not has_hf_layout(model_class) else "hf"


def check_final_export(cfg: Any, model_class: type | None) -> str | None:
    """The format `checkpoint.final_export` writes (`final_export_format`), refused, naming
    the fix, when this run could not write it. `cfg`: a training config; `model_class`:
    what its model is (None: not known yet). peft needs a LoRA run; hf and safetensors a
    run whose checkpoints hold the whole model (not LoRA's or Spectrum's trained part
    only) and, for hf, a model class with an HF layout."""
    fmt = final_export_format(cfg, model_class)
    if fmt is None:
        return None
    if not cfg.checkpoint.save_final:
        raise ConfigError(
            f"checkpoint.final_export={fmt} converts the final checkpoint, and "
            "checkpoint.save_final=false saves none.",
            fix="Set checkpoint.save_final=true, or checkpoint.final_export=null.",
        )
    peft = getattr(cfg, "peft", None)
    method = getattr(peft, "method", "none")
    if fmt == "peft" and method != "lora":
        raise ConfigError(
            "checkpoint.final_export=peft writes LoRA adapters, and this run trains none "
            f"(peft.method={method}).",
            fix="Set peft.method=lora, or export the whole model: checkpoint.final_export=hf "
            "or safetensors.",
        )
    if fmt != "peft" and method != "none":
        raise ConfigError(
            f"checkpoint.final_export={fmt} writes the whole model, and a peft.method={method} "
            "run's checkpoints hold only what it trains.",
            fix="Use checkpoint.final_export=peft (LoRA), or after the run `freetx checkpoint "
            "merge CKPT --base MODEL DST` for a merged HF folder.",
        )
    if fmt == "hf" and model_class is not None and not has_hf_layout(model_class):
        raise ConfigError(
            f"checkpoint.final_export=hf needs a model with an HF transformers layout, and "
            f"{model_class.__qualname__} has none.",
            fix="Use checkpoint.final_export=safetensors (or auto).",
        )
    return fmt
