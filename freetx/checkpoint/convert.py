"""`freetx checkpoint inspect / convert / merge`: checkpoints between formats.

Conversion streams: tensors are read one at a time from the source and written
straight to the destination (safetensors and HF folders), so converting a
checkpoint holds about one model's worth of memory at most, never model +
optimizer. No process group is needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from freetx.checkpoint.adapters import (
    LoRASettings,
    MergedSource,
    adapter_tensors,
    refuse_adapters,
    write_peft,
)
from freetx.checkpoint.dcp_folder import (
    CHECKSUMS,
    DCP_ERRORS,
    META_FILE,
    MODEL_PREFIX,
    describe_dcp_error,
    quiet_single_process,
    read_json,
)
from freetx.checkpoint.formats import (
    MODEL_CLASS_KEY,
    MODEL_CONFIG_KEY,
    DCPSource,
    SafetensorsStreamWriter,
    TensorInfo,
    TensorSource,
    open_tensors,
    skipped_note,
)
from freetx.checkpoint.run_folder import resolve_checkpoint
from freetx.distributed.config import dtype_named
from freetx.errors import CheckpointError
from freetx.models.hf import TOKENIZER_FILES, HFLayout, layout_of, text_model_config
from freetx.user_files import check_destination, staged_output

FORMATS = ("safetensors", "torch", "dcp", "hf", "peft")
MODEL_ONLY_FORMATS = ("safetensors", "hf", "peft")


def output_format(dst: Path, to: str | None) -> str:
    if to:
        return to
    if dst.suffix == ".safetensors":
        return "safetensors"
    if dst.suffix in (".pt", ".pth", ".bin"):
        return "torch"
    raise CheckpointError(
        f"cannot tell the output format from {dst}: name it *.safetensors or *.pt, or pass "
        "--to safetensors|torch|dcp|hf."
    )


@dataclass(frozen=True)
class HFTokenizerFiles:
    """A run's tokenizer as an HF export writes it when no HF folder gives its files
    (`freetx.data.HasHFForm`: freetx's byte tokenizer)."""

    files: dict[str, str]  # name -> text (tokenizer.json, tokenizer_config.json)
    ids: dict[str, int]  # bos_token_id, eos_token_id, pad_token_id


def convert(
    src: str | Path,
    dst: str | Path,
    to: str | None = None,
    dtype: str | None = None,
    model_only: bool = False,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    hf_files_from: str | Path | None = None,
    run_folders: Sequence[str | Path] = (),
    lora: LoRASettings | None = None,
    tokenizer: HFTokenizerFiles | None = None,
) -> dict[str, Any]:
    """Convert a checkpoint; returns what was written (format, tensors, bytes).

    To an HF folder: weights in shards of `max_shard_size`, config.json,
    generation_config.json and the tokenizer files of the HF folder the model came
    from (`hf_files_from`, else the first of `run_folders`, the folders the run
    started from, that is one); without such a folder, those of `tokenizer` (the run's
    tokenizer in transformers' form). To a PEFT adapter folder: `lora`, the run's settings.

    The destination is written under a temporary name and renamed into place
    (`freetx.user_files`): it may not be, hold or lie inside the source, and an
    existing one is replaced only with `overwrite`, and an HF or PEFT folder keeps the
    entries no export writes (`user_entry`: a README a user added).
    """
    source = open_tensors(resolve_checkpoint(src))  # a run's output_dir: its newest
    dst = Path(dst).expanduser()
    fmt = output_format(dst, to)
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown format {fmt}; use one of {', '.join(FORMATS)}.")
    check_destination(source.path, dst, overwrite)
    if fmt in MODEL_ONLY_FORMATS:
        model_only = True
    if not source.model_names():
        raise CheckpointError(f"{src} holds no model tensors (no `model.*` entries).")
    if fmt == "peft":
        adapter_tensors(source)  # refuses a checkpoint without adapters, before writing
    if fmt == "hf":
        refuse_adapters(source, "converted to an HF folder")
    names = [n for n in source.infos if n.startswith(MODEL_PREFIX) or not model_only]
    target = dtype_named(dtype) if dtype else None

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(target) if target is not None and tensor.is_floating_point() else tensor

    def out_dtype(info: TensorInfo) -> torch.dtype:
        return target if target is not None and info.dtype.is_floating_point else info.dtype

    notes = skipped_note(source)
    with staged_output(dst, user_entry if fmt in ("hf", "peft") else None) as out:
        if fmt == "safetensors":
            strip = lambda n: n[len(MODEL_PREFIX) :]  # noqa: E731
            written = _write_safetensors(source, out, strip, cast, out_dtype)
        elif fmt == "hf":
            companion = hf_companion_folder(source, hf_files_from, run_folders)
            written, written_as = _write_hf(
                source, out, cast, out_dtype, max_shard_size, companion, tokenizer
            )
            notes += written_as
        elif fmt == "peft":
            companion = hf_companion_folder(source, hf_files_from, run_folders)
            text_of = multimodal_type(companion)
            base = None if companion is None or text_of else str(companion)
            written = write_peft(source, out, base, lora)
            if text_of:  # AutoPeftModel would load the multimodal model, which has none
                notes.append(
                    f"The adapters are named for the text model of the {text_of} folder "
                    f"{companion}: PEFT loads them onto the text folder `freetx checkpoint "
                    f"convert {companion} TEXT_DIR --to hf` writes, not onto the multimodal "
                    "model (which has none of their modules), so base_model_name_or_path is "
                    "left empty."
                )
        elif fmt == "torch":
            data = {
                (n[len(MODEL_PREFIX) :] if model_only else n): cast(source.get(n)) for n in names
            }
            if not model_only:
                data.update(_extras(source))
            torch.save(data, out)
            written = sum(v.numel() * v.element_size() for v in data.values() if torch.is_tensor(v))
        else:
            written = _write_dcp(source, out, names, cast, model_only)
    return {
        "format": fmt,
        "tensors": len(names),
        "bytes": written,
        "path": str(dst),
        "notes": notes,
    }


def _write_dcp(source: TensorSource, out: Path, names: list[str], cast, model_only: bool) -> int:
    state: dict[str, Any] = {n: cast(source.get(n)) for n in names}
    if not model_only:
        state.update(_extras(source))
    try:
        with quiet_single_process():
            dcp.save(state, checkpoint_id=str(out), no_dist=True)
    except DCP_ERRORS as e:
        raise OSError(describe_dcp_error(e)) from None
    if source.model_config is not None:
        meta = {k: v for k, v in source.meta.items() if k not in ("step", CHECKSUMS)}
        meta["model_config"] = source.model_config
        (out / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    return sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))


def _extras(source: TensorSource) -> dict[str, Any]:
    if isinstance(source, DCPSource):
        return {name: source.get_extra(name) for name in source.extras}
    return dict(source.extras)


def _write_safetensors(source: TensorSource, dst: Path, rename, cast, out_dtype) -> int:
    infos = {
        rename(MODEL_PREFIX + n): TensorInfo(
            source.infos[MODEL_PREFIX + n].shape, out_dtype(source.infos[MODEL_PREFIX + n])
        )
        for n in source.model_names()
    }
    metadata = {"format": "pt"}
    if source.model_config is not None:
        metadata[MODEL_CONFIG_KEY] = json.dumps(source.model_config)
    if source.meta.get("model_class"):
        metadata[MODEL_CLASS_KEY] = source.meta["model_class"]
    writer = SafetensorsStreamWriter(dst, infos, metadata)
    for name in source.model_names():
        writer.write(rename(MODEL_PREFIX + name), cast(source.get(MODEL_PREFIX + name)))
    writer.close()
    return sum(info.nbytes for info in infos.values())


def parse_size(size: str | int) -> int:
    """Bytes from 5GB, 500MB, 200KB or a plain number (transformers' max_shard_size units)."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, factor in (
        ("GIB", 2**30),
        ("MIB", 2**20),
        ("KIB", 2**10),
        ("GB", 10**9),
        ("MB", 10**6),
        ("KB", 10**3),
        ("B", 1),
    ):
        if text.endswith(unit):
            text, scale = text[: -len(unit)], factor
            break
    else:
        scale = 1
    try:
        value = int(float(text) * scale)
    except ValueError:
        value = 0
    if value < 1:
        raise CheckpointError(f"max shard size {size!r} is not a size; write e.g. 5GB or 500MB.")
    return value


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into shards of at most `max_shard_bytes` (a tensor larger
    than that gets a shard of its own), as transformers cuts them."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def multimodal_type(folder: Path | None) -> str | None:
    """The model_type of an HF folder freetx reads as its text model (Gemma 3's `gemma3`);
    None for any other folder, or none."""
    if folder is None or not (folder / "config.json").is_file():
        return None
    config = read_json(folder / "config.json", "HF model config")
    multimodal = isinstance(config, dict) and text_model_config(config) is not config
    return config["model_type"] if multimodal else None


def hf_companion_folder(
    source: TensorSource, given: str | Path | None, run_folders: Sequence[str | Path] = ()
) -> Path | None:
    """The HF folder whose tokenizer files and generation config go beside an export: the
    one given, the source itself, or the first of the folders the run started from (its
    model, tokenizer or initial weights, as the caller read them) that is one."""
    if given is not None:
        folder = Path(given).expanduser()
        if not folder.is_dir():
            raise CheckpointError(f"--hf-files-from {given} is not a folder.")
        return folder
    if source.kind == "hf":
        return source.path
    for candidate in run_folders:
        if (Path(candidate).expanduser() / "config.json").is_file():
            return Path(candidate).expanduser()
    return None


def _write_hf(
    source: TensorSource,
    dst: Path,
    cast,
    out_dtype,
    max_shard_size,
    companion: Path | None,
    tokenizer: HFTokenizerFiles | None = None,
) -> tuple[int, list[str]]:
    """An HF model folder in the layout the model class names: config.json, weights in
    shards of at most `max_shard_size` (one model.safetensors when they fit, else shards
    and their index), generation_config.json, and the companion folder's tokenizer files
    (else `tokenizer`'s, else a note that the folder has none). Returns the bytes written,
    and lines saying what the folder is (the text model of a multimodal companion; no
    tokenizer)."""
    layout = hf_layout(source)
    # HF name -> (freetx key, its piece: `hf_pieces`): a stacked tensor (an MoE block's
    # experts) is written as one HF tensor per slice, or per part of a slice
    parts: dict[str, tuple[str, Piece | None]] = {}
    infos: dict[str, TensorInfo] = {}
    for name in source.model_names():
        key, info = MODEL_PREFIX + name, source.infos[MODEL_PREFIX + name]
        for hf_name, piece in hf_pieces(layout, name, info.shape, source.model_config):
            parts[hf_name] = (key, piece)
            shape = info.shape if piece is None else piece.shape(info.shape)
            infos[hf_name] = TensorInfo(shape, out_dtype(info))
    shards = plan_shards({n: i.nbytes for n, i in infos.items()}, parse_size(max_shard_size))
    first = next(iter(infos.values()))
    notes = write_hf_files(source, dst, str(first.dtype), companion, tokenizer)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    held: tuple[str, torch.Tensor] | None = None  # the stacked tensor being written out
    for file, shard in zip(files, shards):
        writer = SafetensorsStreamWriter(dst / file, {n: infos[n] for n in shard}, {"format": "pt"})
        for name in shard:
            key, piece = parts[name]
            if piece is None:
                writer.write(name, cast(source.get(key)))
                continue
            if held is None or held[0] != key:
                held = (key, source.get(key))
            writer.write(name, cast(piece.of(held[1])))
        writer.close()
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(i.nbytes for i in infos.values())},
            "weight_map": {name: file for file, shard in zip(files, shards) for name in shard},
        }
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sum(info.nbytes for info in infos.values()), notes


@dataclass(frozen=True)
class Piece:
    """Which stored tensor of a stacked freetx tensor an HF tensor is: slice `row` along
    dim 0, or part `part` of its `parts` equal parts along the slice's first dim."""

    row: int
    part: int = 0
    parts: int = 1

    def shape(self, stacked: tuple[int, ...]) -> tuple[int, ...]:
        row = stacked[1:]
        return row if self.parts == 1 else (row[0] // self.parts, *row[1:])

    def of(self, stacked: torch.Tensor) -> torch.Tensor:
        row = stacked[self.row]
        return row if self.parts == 1 else row.chunk(self.parts)[self.part]


def hf_pieces(
    layout: HFLayout, name: str, shape: tuple[int, ...], model_config: dict[str, Any]
) -> list[tuple[str, Piece | None]]:
    """The HF tensors of freetx tensor `name` (of `shape`), with their pieces of it (None:
    the whole tensor), as `layout` (bound to the model: `layout_of`) names them."""
    hf_names = layout.to_hf_names(name, shape[0] if shape else 1, model_config)
    places = [layout.stack_index(hf_name) for hf_name in hf_names]
    if places[0] is None:
        return [(hf_names[0], None)]
    parts = 1 + max((place[1] for place in places if isinstance(place, tuple)), default=0)
    return [
        (hf_name, Piece(*place, parts) if isinstance(place, tuple) else Piece(place))
        for hf_name, place in zip(hf_names, places)
    ]


def hf_layout(source: TensorSource) -> HFLayout:
    """The HF layout of the model a source holds, which an HF export writes in; a source
    that does not record its model class and config is refused."""
    if source.model_config is None or not source.meta.get("model_class"):
        raise CheckpointError(
            f"{source.path} does not record its model class and config, which config.json "
            "needs; convert from the DCP checkpoint (its meta.json has them) or from a "
            "safetensors file freetx wrote."
        )
    return layout_of(source.meta["model_class"], source.model_config)


def write_hf_files(
    source: TensorSource,
    dst: Path,
    dtype: str,
    companion: Path | None,
    tokenizer: HFTokenizerFiles | None = None,
    quantization_config: dict[str, Any] | None = None,
) -> list[str]:
    """What an HF folder holds besides its weights, into `dst`: config.json (the source
    model's, its weights' `dtype`; `quantization_config` added when given), the companion
    folder's generation_config.json and tokenizer files (else `tokenizer`'s). Returns the
    lines `_write_hf` says about the folder."""
    layout = hf_layout(source)
    dst.mkdir(parents=True, exist_ok=True)
    hf_config = layout.to_hf_config(source.model_config, dtype.removeprefix("torch."))
    companion_config = {}
    if companion is not None and (companion / "config.json").is_file():
        companion_config = read_json(companion / "config.json", "HF model config")
    notes = []
    if isinstance(companion_config, dict):
        if text_model_config(companion_config) is not companion_config:
            notes.append(
                f"It is a {hf_config['model_type']} folder ({hf_config['architectures'][0]}): "
                f"the text model of the {companion_config.get('model_type')} folder "
                f"{companion}, without its vision tower and projector."
            )
            companion_config = text_model_config(companion_config)
        # a sequence classifier's pad_token_id is where its score is read: its own
        kept = ("pad_token_id",) if hf_config.get("num_labels") == 1 else ()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in companion_config and key not in kept:
                hf_config[key] = companion_config[key]
        same = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
        if all(companion_config.get(k) == hf_config.get(k) for k in same) and (
            "max_position_embeddings" in hf_config  # not every architecture has it (GPT-2)
        ):
            # a run builds shorter RoPE tables than the model supports; keep the model's length
            hf_config["max_position_embeddings"] = max(
                hf_config["max_position_embeddings"],
                int(companion_config.get("max_position_embeddings") or 0),
            )
    tokenizer = tokenizer or HFTokenizerFiles({}, {})
    for key, value in tokenizer.ids.items():  # the ids a companion's config did not give
        if hf_config.get(key) is None:
            hf_config[key] = value
    if quantization_config is not None:
        hf_config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2))
    for name in ("generation_config.json", *TOKENIZER_FILES) if companion else ():
        notes += _copy_own_file(companion, name, dst)
    if not (dst / "generation_config.json").is_file():
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        generation = {k: hf_config[k] for k in ids if hf_config.get(k) is not None}
        if "max_position_embeddings" in hf_config:  # generate()'s default length: the model's
            generation["max_length"] = hf_config["max_position_embeddings"]
        (dst / "generation_config.json").write_text(json.dumps(generation, indent=2))
    copied = [n for n in TOKENIZER_FILES if (dst / n).is_file()]
    if not copied:
        for name, text in tokenizer.files.items():
            (dst / name).write_text(text, encoding="utf-8")
    if not copied and not tokenizer.files:
        notes.append(
            "The folder has no tokenizer files: the run's tokenizer has no HF form freetx "
            "writes, and no HF folder it started from holds them. Copy them from the "
            "tokenizer's folder (--hf-files-from FOLDER) before loading it with "
            "AutoTokenizer."
        )
    return notes


def _copy_own_file(folder: Path, name: str, dst: Path) -> list[str]:
    """Copy `folder/name` into `dst` when it is a regular file of that folder: a symbolic
    link (which could point at any file of the machine) is not followed, and a .json file
    that is not JSON is not copied; either way a line says so."""
    src = folder / name
    if src.is_symlink():
        return [
            f"{name} of {folder} is a symbolic link (to {os.readlink(src)}) and was not "
            "copied: an export copies only the folder's own regular files. Copy it by hand "
            "if you trust what it points to."
        ]
    if not src.is_file():
        return []
    if name.endswith(".json"):
        try:
            json.loads(src.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return [f"{name} of {folder} is not valid JSON and was not copied."]
    shutil.copyfile(src, dst / name, follow_symlinks=False)
    return []


# the names of what an export writes into its folder (an HF folder, PEFT adapters); any
# other entry a user put into such a folder is kept when it is written again
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "adapter_config.json",
    *TOKENIZER_FILES,
)


def user_entry(name: str) -> bool:
    """Whether an entry of an HF or PEFT folder is none of what an export writes."""
    return name not in EXPORT_FILES and not _SHARD.match(name)


def merge(
    checkpoint: str | Path,
    base: str | Path,
    dst: str | Path,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    lora: LoRASettings | None = None,
) -> dict[str, Any]:
    """An HF folder of `base` with the LoRA / DoRA adapters of `checkpoint` merged into its
    weights (tokenizer files and generation config from `base` when it is an HF folder);
    `lora`: the settings the adapters were trained with. Streams: one base tensor (and
    its adapter) at a time."""
    adapters = open_tensors(resolve_checkpoint(checkpoint))
    base_source = open_tensors(resolve_checkpoint(base))
    dst = Path(dst).expanduser()
    check_destination(adapters.path, dst, overwrite)
    check_destination(base_source.path, dst, overwrite)
    source = MergedSource(base_source, adapters, lora)
    companion = base_source.path if base_source.kind == "hf" else None
    with staged_output(dst, user_entry) as out:
        written, written_as = _write_hf(
            source, out, lambda t: t, lambda info: info.dtype, max_shard_size, companion
        )
    return {
        "format": "hf",
        "tensors": len(source.infos),
        "bytes": written,
        "path": str(dst),
        "notes": skipped_note(base_source) + written_as,
    }


def inspect_report(path: str | Path) -> str:
    """A readable summary: run facts (DCP), then every tensor, then totals."""
    source = open_tensors(resolve_checkpoint(path))
    lines = [f"{source.path} ({source.kind})"]
    for key in (
        "step",
        "world_size",
        "strategy",
        "model_class",
        "model_config_hash",
        "freetx_version",
    ):
        if key in source.meta:
            lines.append(f"  {key}: {source.meta[key]}")
    if source.model_config:
        lines.append(f"  model_config: {json.dumps(source.model_config)}")
    rows = [("TENSOR", "SHAPE", "DTYPE", "BYTES")]
    totals: dict[str, int] = {}
    for name, info in source.infos.items():
        rows.append(
            (
                name,
                str(list(info.shape)),
                str(info.dtype).removeprefix("torch."),
                f"{info.nbytes:,}",
            )
        )
        group = name.split(".", 1)[0]
        totals[group] = totals.get(group, 0) + info.nbytes
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("totals:")
    for group, size in totals.items():
        count = sum(1 for n in source.infos if n.split(".", 1)[0] == group)
        lines.append(f"  {group}: {count} tensors, {size:,} bytes ({size / 2**20:.1f} MiB)")
    if source.extras:
        lines.append(f"  other entries (not tensors): {', '.join(sorted(source.extras))}")
    return "\n".join(lines)
