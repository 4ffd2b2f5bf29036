"""Quantized exports: a checkpoint's model with torchao's real quantized weights, as an HF
folder transformers loads (config.json's `quantization_config` is its TorchAoConfig), and
the same folder read back into a freetx model.

    freetx checkpoint convert RUN DST --quantize int8_dynamic_act_int4_weight [--group-size 32]
    load_model(DST, device)          # freetx's model, torchao's tensors in its Linears

`export_quantized` loads the whole model a checkpoint holds (a run folder, a DCP step, an HF
folder, a safetensors file; a LoRA run's adapters merged into the base its checkpoint names),
quantizes it (`freetx.models.qat.quantize_ptq`: every Linear of the decoder blocks, the
embedding and output head kept) and writes config.json, the weights as torchao flattens them
(one model.safetensors: `a.weight` stored as `a._weight_qdata`, `a._weight_scale` ... and
described in the file's metadata) and the tokenizer files, as `convert --to hf` writes them.
Applied to a QAT run it converts what QAT trained for; to any other run it is post-training
quantization (PTQ). int4_weight exports need a CUDA machine: torchao cannot serialize the CPU
kernel's int4 format (`freetx.models.qat.flat_quantized`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from freetx.checkpoint.adapters import LoRASettings, MergedSource, adapter_tensors
from freetx.checkpoint.convert import (
    HFTokenizerFiles,
    hf_companion_folder,
    hf_layout,
    user_entry,
    write_hf_files,
)
from freetx.checkpoint.dcp_folder import FROZEN_FROM, read_json
from freetx.checkpoint.formats import TensorSource, hf_weight_files, open_tensors
from freetx.checkpoint.loading import (
    WeightSource,
    mismatch_report,
    model_from_weights,
    model_shapes,
    recorded_model,
    weight_source,
)
from freetx.checkpoint.run_folder import resolve_checkpoint
from freetx.errors import CheckpointError, ConfigError
from freetx.models import build_model
from freetx.models.qat import (
    INT4_WEIGHT,
    INT8_DYNAMIC_ACT_INT4_WEIGHT,
    SCHEMES,
    QATConfig,
    flat_quantized,
    hf_quantization_config,
    qat_targets,
    quantize_ptq,
    scheme_named,
)
from freetx.user_files import check_destination, staged_output

QUANTIZED_FILE = "model.safetensors"


def quantize_settings(given: str, group_size: int) -> str:
    """freetx's name of scheme `given` (its own, or torchtune's / torchao's for it), checked
    with `group_size`; a scheme that is none of them, `none`, or a group size its kernels do
    not take is refused with the fix."""
    scheme = scheme_named(given) or given
    if scheme == "none":
        raise ConfigError(
            f"--quantize none quantizes nothing; name a scheme: {', '.join(SCHEMES)}, or "
            "convert without --quantize."
        )
    try:
        QATConfig(scheme=scheme, group_size=group_size)
    except ValueError as error:
        raise ConfigError(f"--quantize {given} --group-size {group_size}: {error}") from None
    return scheme


def export_device(scheme: str, src: str | Path, dst: str | Path, group_size: int) -> torch.device:
    """Where `scheme`'s weights are quantized for an export: int4_weight on CUDA (torchao
    serializes only its CUDA formats; without a CUDA device it is refused, saying where to
    run it), int8_dynamic_act_int4_weight on the CPU (its format is the same everywhere)."""
    if scheme != INT4_WEIGHT:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    raise ConfigError(
        "an int4_weight export holds torchao's CUDA int4 format, which only a CUDA machine "
        "makes (torchao cannot write its CPU int4 format, Int4OpaqueTensor, to safetensors), "
        f"and this machine has no CUDA device. Run the same command on a CUDA machine: freetx "
        f"checkpoint convert {src} {dst} --quantize {INT4_WEIGHT} --group-size {group_size}; "
        f"or export --quantize {INT8_DYNAMIC_ACT_INT4_WEIGHT} here (any device)."
    )


def whole_model_weights(src: str | Path, lora: LoRASettings | None) -> WeightSource:
    """The weights of the whole model checkpoint `src` holds: its own, or for a LoRA run's
    adapter-only checkpoint the base it records (`frozen_from`) with the adapters merged in
    (`lora`: the run's settings)."""
    source = open_tensors(resolve_checkpoint(src))
    try:
        adapter_tensors(source)
    except CheckpointError:  # no adapters: the model itself
        return WeightSource(str(src), source.path, source)
    base = source.meta.get(FROZEN_FROM)
    if base is None:
        raise CheckpointError(
            f"{source.path} holds LoRA adapters and does not record the base they were "
            f"trained on; merge them first (freetx checkpoint merge {source.path} --base BASE "
            "MERGED) and quantize MERGED."
        )
    merged = MergedSource(weight_source(base).tensors, source, lora)
    return WeightSource(str(src), source.path, merged)


def export_quantized(
    src: str | Path,
    dst: str | Path,
    scheme: str,
    group_size: int = 32,
    overwrite: bool = False,
    hf_files_from: str | Path | None = None,
    run_folders: tuple[str | Path, ...] | list[str] = (),
    lora: LoRASettings | None = None,
    tokenizer: HFTokenizerFiles | None = None,
) -> dict[str, Any]:
    """An HF folder of the model `src` holds, quantized by `scheme` in groups of
    `group_size` (the module's docstring), that transformers loads; the other arguments as
    `convert` takes them. Everything a user can get wrong (the scheme, the group size, an
    int4_weight export without CUDA, the destination) is refused before a weight is read.
    Returns what was written, as `convert` does."""
    scheme = quantize_settings(scheme, group_size)
    device = export_device(scheme, src, dst, group_size)
    weights = whole_model_weights(src, lora)
    source: TensorSource = weights.tensors
    dst = Path(dst).expanduser()
    check_destination(source.path, dst, overwrite)
    layout = hf_layout(source)  # a source that records no model class: refused here
    with torch.device("meta"):  # a group size that does not divide a width: before reading
        qat_targets(build_model(*recorded_model(source, src)), group_size, "--group-size")
    model = quantize_ptq(model_from_weights(weights, device), scheme, group_size)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name in source.model_names():
        tensor = state[name]
        hf_names = layout.to_hf_names(name, tensor.shape[0], source.model_config)
        if layout.stack_index(hf_names[0]) is None:
            tensors[hf_names[0]] = tensor
        else:  # an MoE block's experts (not quantized): one HF tensor per slice
            tensors.update({hf_name: tensor[i] for i, hf_name in enumerate(hf_names)})
    flat, metadata = flat_quantized(tensors)
    companion = hf_companion_folder(source, hf_files_from, run_folders)
    quantization = hf_quantization_config(scheme, group_size, device)
    dtype = str(next(iter(state.values())).dtype)
    from safetensors.torch import save_file

    with staged_output(dst, user_entry) as out:
        notes = write_hf_files(source, out, dtype, companion, tokenizer, quantization)
        flat = {k: v.detach().contiguous().cpu() for k, v in flat.items()}
        save_file(flat, out / QUANTIZED_FILE, metadata={"format": "pt", **metadata})
    written = sum(v.numel() * v.element_size() for v in flat.values())
    return {"format": "hf", "scheme": scheme, "group_size": group_size, "tensors": len(tensors),
            "bytes": written, "path": str(dst), "notes": notes}  # fmt: skip


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
