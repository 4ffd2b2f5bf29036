"""Quantized exports: a checkpoint's model with torchao's real quantized weights, as an HF
folder transformers loads (config.json's `quantization_config` is its TorchAoConfig), and
the same folder read back into a freetx model (`freetx.checkpoint.loading.load_quantized`).

    freetx checkpoint convert RUN DST --quantize int8_dynamic_act_int4_weight [--group-size 32]
    load_model(DST, device)          # freetx's model, torchao's tensors in its Linears

`export_quantized` loads the whole model a checkpoint holds (a run folder, a DCP step, an HF
folder, a safetensors file; a LoRA run's adapters merged into the base its checkpoint names),
quantizes it by a `freetx.models.qat.QuantScheme`, checked where it was made (`QuantScheme.named`:
--quantize; `QATConfig.quant_scheme`: a QAT run's final export), with
`freetx.models.qat.quantize_ptq` (every Linear of the decoder blocks, the embedding and
output head kept) and writes config.json, the weights as torchao flattens them
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

from freetx.checkpoint.adapters import LoRASettings, MergedSource, adapter_tensors
from freetx.checkpoint.convert import (
    HFTokenizerFiles,
    hf_companion_folder,
    hf_layout,
    hf_pieces,
    user_entry,
    write_hf_files,
)
from freetx.checkpoint.formats import TensorSource, open_tensors, save_tensors
from freetx.checkpoint.loading import (
    WeightSource,
    adapters_base,
    model_from_weights,
    recorded_model,
    weight_source,
)
from freetx.checkpoint.run_folder import resolve_checkpoint
from freetx.errors import CheckpointError, ConfigError
from freetx.models import build_model
from freetx.models.qat import (
    INT4_WEIGHT,
    INT8_DYNAMIC_ACT_INT4_WEIGHT,
    QuantScheme,
    flat_quantized,
    hf_quantization_config,
    qat_targets,
    quantize_ptq,
)
from freetx.user_files import check_destination, staged_output

QUANTIZED_FILE = "model.safetensors"


class ExportNeedsCUDA(ConfigError):
    """An int4_weight export on a machine without CUDA (`export_device`): the final export of
    a QAT run says so and goes on (`freetx.training.export.export_quantized_final`)."""


def export_device(quant: QuantScheme, src: str | Path, dst: str | Path) -> torch.device:
    """Where `quant`'s weights are quantized for an export: int4_weight on CUDA (torchao
    serializes only its CUDA formats; without a CUDA device it is refused, saying where to
    run it), int8_dynamic_act_int4_weight on the CPU (its format is the same everywhere)."""
    if quant.scheme != INT4_WEIGHT:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    raise ExportNeedsCUDA(
        "an int4_weight export holds torchao's CUDA int4 format, which only a CUDA machine "
        "makes (torchao cannot write its CPU int4 format, Int4OpaqueTensor, to safetensors), "
        f"and this machine has no CUDA device. Export it on a CUDA machine: freetx "
        f"checkpoint convert {src} {dst} --quantize {INT4_WEIGHT} --group-size "
        f"{quant.group_size}; or export --quantize {INT8_DYNAMIC_ACT_INT4_WEIGHT} here (any "
        "device)."
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
    base = adapters_base(source)
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
    quant: QuantScheme,
    overwrite: bool = False,
    hf_files_from: str | Path | None = None,
    run_folders: tuple[str | Path, ...] | list[str] = (),
    lora: LoRASettings | None = None,
    tokenizer: HFTokenizerFiles | None = None,
) -> dict[str, Any]:
    """An HF folder of the model `src` holds, quantized by `quant` (its scheme, in groups of
    its group size: the module's docstring), that transformers loads; the other arguments as
    `convert` takes them. Everything a user can get wrong (the scheme and the group size,
    refused where `quant` was made; an int4_weight export without CUDA, a group size that
    does not divide a width, the destination) is refused before a weight is read. Returns
    what was written, as `convert` does."""
    device = export_device(quant, src, dst)
    weights = whole_model_weights(src, lora)
    source: TensorSource = weights.tensors
    dst = Path(dst).expanduser()
    check_destination(source.path, dst, overwrite)
    layout = hf_layout(source)  # a source that records no model class: refused here
    with torch.device("meta"):  # a group size that does not divide a width: before reading
        qat_targets(build_model(*recorded_model(source, src)), quant.group_size, "--group-size")
    model = quantize_ptq(model_from_weights(weights, device, alone=True), quant)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name in source.model_names():
        tensor = state[name]
        for hf_name, piece in hf_pieces(layout, name, tuple(tensor.shape), source.model_config):
            # an MoE block's experts (not quantized): one HF tensor per slice, or its part
            tensors[hf_name] = tensor if piece is None else piece.of(tensor)
    flat, metadata = flat_quantized(tensors)
    companion = hf_companion_folder(source, hf_files_from, run_folders)
    quantization = hf_quantization_config(quant, device)
    dtype = str(next(iter(state.values())).dtype)
    with staged_output(dst, user_entry) as out:
        notes = write_hf_files(source, out, dtype, companion, tokenizer, quantization)
        flat = {k: v.detach().contiguous().cpu() for k, v in flat.items()}
        save_tensors(flat, out / QUANTIZED_FILE, metadata={"format": "pt", **metadata})
    written = sum(v.numel() * v.element_size() for v in flat.values())
    return {
        "format": "hf",
        "scheme": quant.scheme,
        "group_size": quant.group_size,
        "tensors": len(tensors),
        "bytes": written,
        "path": str(dst),
        "notes": notes,
    }
