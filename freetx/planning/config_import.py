"""Bring your old config: a DeepSpeed JSON, an accelerate YAML, or the seeds' FSDP JSON /
YAML, read as the freetx overrides they mean (`freetx import`).

    found = import_config("deepspeed", read_config_file(path), world_size=8)
    found.overrides    # {"distributed.strategy": "zero2", "batch_size": 256, ...}
    found.launch       # freetx run's launch options: ["--nnodes", "2", ...]
    found.environment  # {"CUDA_VISIBLE_DEVICES": "0,1"}
    found.unmapped     # [(key, why it has no freetx equivalent), ...]
    found.notes        # where a mapped key means more or less in freetx

Batch sizes: freetx's `batch_size` is global (samples per optimizer step, over all ranks)
and `gradient_accumulation_steps` splits it into micro-batches; a per-GPU micro-batch is
multiplied by the accumulation steps and the GPUs (DeepSpeed's train_batch_size is
already global). "auto" values are filled in by the HF Trainer from arguments the file
does not hold: listed as unmapped.

This module reads the file (`read_config_file`: refusing what is no config) and hands it
to its format's importer, a module each: deepspeed_import.py, accelerate_import.py,
fsdp_import.py (torchtune_import.py, trl_import.py and axolotl_import.py, with their own
entry points); what they share, the `ImportedConfig` they fill and the setters of the keys
every format has, is imported_config.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from freetx.errors import FreetxError
from freetx.planning.accelerate_import import import_accelerate
from freetx.planning.deepspeed_import import import_deepspeed
from freetx.planning.fsdp_import import import_fsdp_config
from freetx.planning.imported_config import CONTROL, ImportedConfig

MAX_FILE_BYTES = 4 * 1024 * 1024  # a config file; anything larger is not one


def read_config_file(path: str) -> dict:
    """A JSON or YAML file's top-level mapping; one paragraph when it is missing, broken,
    binary, a shell script, or a YAML file with aliases (which can expand without bound)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FreetxError(
            f"{path} does not exist (or is not a file); give the path to your old config, "
            "e.g. ds_config.json or ~/.cache/huggingface/accelerate/default_config.yaml."
        )
    if file.stat().st_size > MAX_FILE_BYTES:
        raise FreetxError(
            f"{path} is {file.stat().st_size // 1024 // 1024} MiB, too large for a config "
            "file; give the config file itself (a DeepSpeed JSON, an accelerate or torchtune "
            "YAML)."
        )
    import yaml

    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text or CONTROL.search(text):
        raise FreetxError(
            f"{path} is not a text file (it holds bytes no JSON or YAML file has); give the "
            "config file itself (a DeepSpeed JSON, an accelerate or torchtune YAML)."
        )
    if text.startswith("#!") or re.search(r"^#SBATCH", text, re.MULTILINE):
        raise FreetxError(
            f"{path} is a shell script{' (a SLURM batch script)' if '#SBATCH' in text else ''}"
            ", and freetx import reads config files, not scripts. Its launch settings are "
            "freetx launch's options: `freetx launch slurm --nodes N --gpus-per-node G "
            "--time T --partition P RECIPE --config CFG` writes freetx's SLURM script; give "
            "`freetx import` the config files the script passes (ds_config.json, ...)."
        )
    kind = "JSON" if file.suffix == ".json" else "YAML"
    try:
        if file.suffix == ".json":
            data = json.loads(text)
        else:
            refuse_yaml_aliases(path, text)
            data = yaml.safe_load(text)
    except (ValueError, RecursionError, yaml.YAMLError) as e:
        detail = (
            " ".join(str(e).split()) if not isinstance(e, RecursionError) else "nested too deep"
        )
        raise FreetxError(
            f"{path} is not valid {kind}: {detail}. Fix the file (a .json file is read as "
            "JSON, anything else as YAML)."
        ) from None
    if not isinstance(data, dict):
        raise FreetxError(
            f"{path} holds a {type(data).__name__}, not a mapping of keys to values; give "
            "the config file itself."
        )
    refuse_non_finite(path, data)
    return data


def refuse_yaml_aliases(path: str, text: str) -> None:
    """YAML aliases (`*name`) refused before anything is built: a few lines of them can
    stand for billions of values (an "alias bomb"), and no config freetx imports needs one.
    The event scan is linear in the file's size."""
    import yaml

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            line = event.start_mark.line + 1 if event.start_mark else "?"
            raise FreetxError(
                f"{path} uses a YAML alias (*{event.anchor}, line {line}); freetx import "
                "refuses aliases, since a few of them can stand for billions of values. "
                "Write the values out in full (or give the file `yaml.safe_load` then "
                "`yaml.safe_dump` wrote)."
            )


def refuse_non_finite(path: str, data: Any, key: str = "") -> None:
    """NaN and infinities (JSON's NaN, 1e400) refused, naming the key."""
    if isinstance(data, dict):
        for name, value in data.items():
            refuse_non_finite(path, value, f"{key}{name}" if not key else f"{key}.{name}")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            refuse_non_finite(path, value, f"{key}[{i}]")
    elif isinstance(data, float) and not math.isfinite(data):
        raise FreetxError(
            f"{path}: {key or 'the value'} is {data} (a {'NaN' if data != data else 'number too large for a float'}), "
            "which no setting means; fix the value in the file. Nothing was printed."
        )


def import_config(
    kind: str,
    data: dict,
    world_size: int | None = None,
    source: str = "the file",
) -> ImportedConfig:
    """The freetx overrides a foreign config of `kind` (deepspeed, accelerate, fsdp-config)
    means; one paragraph for a value no setting can mean (`bad_value`). torchtune's:
    freetx.planning.torchtune_import."""
    found = ImportedConfig(source=source)
    {
        "deepspeed": import_deepspeed,
        "accelerate": import_accelerate,
        "fsdp-config": import_fsdp_config,
    }[kind](found, data, world_size)
    return found
