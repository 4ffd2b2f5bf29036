"""accelerate's YAML (default_config.yaml) read as freetx overrides (`freetx import
accelerate`): distributed_type as a strategy, the processes and machines as freetx run's
launch options, gpu_ids and debug as environment variables, precision, dynamo's compile,
and its fsdp_config and deepspeed_config sections by the FSDP and DeepSpeed importers'
keys; every other key listed with why. The file holds no batch size (a note says how to
set it)."""

from __future__ import annotations

import re

from freetx.distributed.config import DATA_PARALLEL_STRATEGY, FSDP_SHARDING_STRATEGIES
from freetx.planning.deepspeed_import import _deepspeed_key
from freetx.planning.fsdp_import import _fsdp_key
from freetx.planning.imported_config import (
    ALWAYS,
    SHARDED_SAVES,
    ImportedConfig,
    _mapping,
    _number,
    bad_value,
    set_batch,
    set_offload,
    set_precision,
)

# keys with no freetx equivalent, and why
ACCELERATE_UNMAPPED = {
    "compute_environment": "freetx runs on this machine or SLURM (`freetx launch slurm`)",
    "main_training_function": "freetx runs a recipe file's recipe_main",
    "same_network": "torchrun's rendezvous needs no such setting",
    "downcast_bf16": "a TPU setting",
    "enable_cpu_affinity": "no freetx equivalent; bind with numactl or SLURM's --cpu-bind",
    "tpu_env": "freetx runs on CUDA and CPU, not TPU",
    "tpu_use_cluster": "freetx runs on CUDA and CPU, not TPU",
    "tpu_use_sudo": "freetx runs on CUDA and CPU, not TPU",
    "deepspeed_config.zero3_init_flag": ALWAYS,
    "deepspeed_config.zero3_save_16bit_model": SHARDED_SAVES,
    "deepspeed_config.deepspeed_multinode_launcher": "freetx launches with torchrun "
    "(`freetx launch slurm` or `freetx launch torchrun`)",
}


def import_accelerate(found: ImportedConfig, data: dict, world_size: int | None) -> None:
    """An accelerate YAML's keys into `found` (`world_size`: the GPUs, where
    num_processes does not say)."""
    kind = str(data.get("distributed_type", "NO")).upper()
    processes = data.get("num_processes")
    machines = data.get("num_machines", 1)
    processes = None if processes is None else _number(found, "num_processes", processes)
    machines = 1 if machines is None else _number(found, "num_machines", machines)
    fsdp = _mapping(found, "fsdp_config", data.get("fsdp_config"))
    dynamo = _mapping(found, "dynamo_config", data.get("dynamo_config"))
    deepspeed = _mapping(found, "deepspeed_config", data.get("deepspeed_config"))
    if processes is not None and machines is not None:
        if processes > 1 or machines > 1:
            found.launch += [
                "--nnodes",
                str(machines),
                "--nproc-per-node",
                str(max(1, processes // machines)),
            ]
        if processes % machines:
            found.skip(
                "num_processes",
                f"{processes} processes do not split over {machines} machines; freetx launches the "
                "same count on every node",
            )
    if machines != 1:
        for key, flag in (
            ("machine_rank", "--node-rank"),
            ("main_process_ip", "--master-addr"),
            ("main_process_port", "--master-port"),
            ("rdzv_backend", "--rdzv-backend"),
        ):
            value = data.get(key)
            if value is None:
                continue
            if key == "machine_rank":
                value = _number(found, key, value, (True, 0, 10**6))
            elif key == "main_process_port":
                value = _number(found, key, value, (True, 1, 65535))
            found.launch += [flag, str(value)]  # printed quoted
    if kind in ("MULTI_GPU", "MULTI_CPU"):
        found.set("distributed.strategy", DATA_PARALLEL_STRATEGY)
    elif kind not in ("NO", "FSDP", "DEEPSPEED"):
        found.skip(
            "distributed_type", f"{kind}: freetx runs DDP, ZeRO, FSDP2 and HSDP on CUDA and CPU"
        )
    if kind == "MULTI_CPU" or data.get("use_cpu") is True:
        found.set("device", "cpu")
    if data.get("mixed_precision") is not None:
        set_precision(found, "mixed_precision", data["mixed_precision"])
    gpu_ids = data.get("gpu_ids")
    if gpu_ids is not None and str(gpu_ids).lower() != "all":
        ids = str(gpu_ids).replace(" ", "")
        if not re.fullmatch(r"\d+(,\d+)*", ids):
            raise bad_value(found, "gpu_ids", gpu_ids, "all, or GPU numbers such as 0,1,2")
        found.environment["CUDA_VISIBLE_DEVICES"] = ids
    if data.get("debug") is True:
        found.environment["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    backend = str(dynamo.get("dynamo_backend", "NO")).upper()
    if backend == "INDUCTOR":
        found.set("distributed.compile", True)
    elif backend != "NO":
        found.skip(
            "dynamo_config.dynamo_backend",
            f"{backend}: freetx compiles blocks with inductor (distributed.compile=true)",
        )
    world = world_size or processes
    found.notes.append(
        "accelerate's file holds no batch size: set batch_size to your script's per-GPU "
        f"batch x its gradient accumulation steps x {world or 'the GPUs'} (freetx's is global)"
    )
    if kind == "FSDP":
        found.overrides.setdefault("distributed.strategy", FSDP_SHARDING_STRATEGIES["FULL_SHARD"])
        for name, value in fsdp.items():
            if not _fsdp_key(found, f"fsdp_config.{name}", name, value):
                found.skip(f"fsdp_config.{name}", "not an FSDP key freetx maps")
    if kind == "DEEPSPEED":
        _accelerate_deepspeed(found, deepspeed, world)
    handled = {
        "distributed_type",
        "num_processes",
        "num_machines",
        "machine_rank",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "use_cpu",
        "mixed_precision",
        "gpu_ids",
        "debug",
        "dynamo_config",
        "fsdp_config",
        "deepspeed_config",
    }
    for key in data:
        if key in ACCELERATE_UNMAPPED:
            found.skip(key, ACCELERATE_UNMAPPED[key])
        elif key not in handled:
            found.skip(key, "not an accelerate key freetx maps")


def _accelerate_deepspeed(found: ImportedConfig, ds: dict, world_size: int | None) -> None:
    """accelerate's deepspeed_config section (its own key names)."""
    for name, value in ds.items():
        key = f"deepspeed_config.{name}"
        if name == "deepspeed_config_file":
            found.skip(key, f"a DeepSpeed file: run `freetx import deepspeed {value}`")
        elif name == "zero_stage":
            _deepspeed_key(found, "zero_optimization.stage", value)
        elif name in ("offload_optimizer_device", "offload_param_device"):
            set_offload(found, key, value)
        elif name == "gradient_accumulation_steps":
            set_batch(found, None, (key, value), world_size)
        elif name == "gradient_clipping":
            _deepspeed_key(found, "gradient_clipping", value)
        elif key in ACCELERATE_UNMAPPED:
            found.skip(key, ACCELERATE_UNMAPPED[key])
        else:
            found.skip(key, "not an accelerate DeepSpeed key freetx maps")
