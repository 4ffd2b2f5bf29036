"""Values a frozen model computes once per sample before training, kept in a file under
the identity of the data and of the model: DPO's reference log-probs
(`reference.precompute: true`) and distillation's teacher top-k (`teacher.precompute:
top_k`).

    table = stored_or_computed(path, key, lambda: per_sample_table(...), plan, say, what)

`per_sample_table` runs a function over every sample of a dataset, each data-parallel
rank its strided share (`build_eval_loader`: the same batches at any world size), and
gathers the results over the ranks into one table per value, in the dataset's order.
`stored_or_computed` reads the table from its file when the file was made for the same
key (a digest of every sample's tokens, `samples_digest`, and the model's identity),
else has it computed and written by rank 0, whole or not at all.

Beside the table, `<split>.checksums.json` records its sha256 (`freetx.checksums`); every
rank hashes the file before reading it and refuses one whose bytes changed since it was
written, as a checkpoint's are refused. A table without that record (written by an
earlier freetx, or a write cut off before it) is computed again, said on the console: it
is the run's own to remake, one pass of the frozen model, and trusting it unverified is
what the checksums end.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset

from freetx.checksums import check_files, checksums
from freetx.data import build_eval_loader
from freetx.distributed import ParallelPlan
from freetx.errors import DataError
from freetx.training.step import placed
from freetx.user_files import staged_output

INDEX = "index"  # a sample's place in its dataset (on a pair's chosen sample)


class Indexed(Dataset):
    """A dataset's items with their index: on a sample (a dict of tensors), or on the
    first sample of a pair."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        item, tag = self.dataset[index], {INDEX: torch.tensor(index)}
        if isinstance(item, tuple):
            return ({**item[0], **tag}, *item[1:])
        return {**item, **tag}


def _index_of(item) -> int:
    return int((item[0] if isinstance(item, tuple) else item)[INDEX])


def samples_digest(dataset: Dataset) -> str:
    """A digest of every sample's tokens and labels (both of a pair's), in order: what
    decides a frozen model's values on the data's side (source, format, tokenizer,
    seq_len, truncation)."""
    digest = hashlib.sha256()
    for index in range(len(dataset)):
        item = dataset[index]
        for sample in item if isinstance(item, tuple) else (item,):
            digest.update(sample["input_ids"].numpy().tobytes())
            digest.update(sample["labels"].numpy().tobytes())
    return digest.hexdigest()[:32]


def per_sample_table(
    dataset: Dataset,
    compute: Callable[[Any], dict[str, torch.Tensor]],
    collate: Callable[[list], Any],
    plan: ParallelPlan,
    samples_per_pass: int,
) -> dict[str, torch.Tensor]:
    """`compute` (a placed batch -> name -> [rows, ...] tensor, one row per sample) over
    every sample of `dataset`, each data-parallel rank its strided share
    (`samples_per_pass` samples per forward over all ranks), gathered over them: name ->
    [len(dataset), ...] on the CPU, in the dataset's order."""
    groups = plan.groups
    loader = build_eval_loader(
        Indexed(dataset),
        samples_per_pass,
        groups.dp_rank,
        groups.dp_size,
        collate=lambda items: ([_index_of(item) for item in items], collate(items)),
    )
    indices, values = [], {}
    for batch_indices, batch in loader:
        indices.append(torch.tensor(batch_indices))
        for name, value in compute(placed(plan, batch)).items():
            values.setdefault(name, []).append(value.cpu())
    device = plan.runtime.device
    index = groups.all_gather_varying(torch.cat(indices).to(device), over="dp").cpu()
    table = {}
    for name, parts in values.items():
        mine = torch.cat(parts)
        gathered = groups.all_gather_varying(mine.reshape(-1).to(device), over="dp").cpu()
        table[name] = mine.new_zeros(len(dataset), *mine.shape[1:])
        table[name][index] = gathered.view(-1, *mine.shape[1:])  # a shard's repeats: equal
    return table


def stored_or_computed(
    path: Path,
    key: str,
    compute: Callable[[], dict[str, torch.Tensor]],
    plan: ParallelPlan,
    say: Callable[[str], None],
    what: str,
) -> dict[str, torch.Tensor]:
    """The table kept in `path` when it was made for `key` (read by every rank, its
    checksum verified first), else `compute()` (every rank), written there by rank 0 under
    `key`, its checksum beside it. `say`: a line for the console; `what`: the table's
    description in it."""
    record = path.with_name(f"{path.stem}.checksums.json")
    if path.is_file() and not record.is_file():
        say(f"{path} has no checksums (an earlier freetx wrote it); computing {what} again")
    elif path.is_file():
        try:
            recorded = json.loads(record.read_text())
        except ValueError:  # a damaged record: refused as a damaged table
            recorded = None
        check_files(
            path.parent, recorded, [path.name], "cache", record.name, "wrong values to train on",
            f"Delete {path} and run again: it is computed again. If it happens again, check "
            "the disk.",
            DataError,
        )  # fmt: skip
        with safe_open(path, "pt") as f:
            stored_key = (f.metadata() or {}).get("identity")
        if stored_key == key:
            say(f"{what} read from {path}")
            return load_file(path)
        say(f"{path} was made for other data or other weights; computing {what} again")
    started = time.perf_counter()
    table = compute()
    seconds = time.perf_counter() - started
    size = sum(v.numel() * v.element_size() for v in table.values()) / 2**20
    if plan.runtime.is_rank_zero:
        record.unlink(missing_ok=True)  # a table without its record is computed again
        with staged_output(path) as staged:  # whole or not at all
            save_file({k: v.contiguous() for k, v in table.items()}, staged, {"identity": key})
        with staged_output(record) as staged:
            staged.write_text(json.dumps(checksums(path.parent, [path.name])))
    plan.groups.barrier()
    say(f"{what} computed in {seconds:.1f} s, kept in {path} ({size:.1f} MiB)")
    return table
