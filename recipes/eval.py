"""Evaluate a checkpoint: lm-evaluation-harness tasks, perplexity over a dataset, rewards.

    freetx eval runs/sft --tasks my_task --include-path tasks/     # the short form of
    freetx run eval --config llm/hf_eval checkpoint=runs/sft tasks=[my_task] include_path=tasks/
    freetx run --nproc-per-node 2 eval --config llm/hf_eval checkpoint=DIR dataset.source=FILE

The checkpoint is an HF folder, a run's output_dir (its newest checkpoint), a DCP step or
a .safetensors file; a LoRA / DoRA run's checkpoint is its base with the adapters
beside it, unmerged (`load_model(..., adapters=)`). What is evaluated, any of:

- `tasks`: lm-eval task names (the harness's own, or those of the YAMLs under
  `include_path`), through freetx's adapter (`freetx.evaluation.harness_model`: scores as
  lm-eval's own HF backend does);
- `dataset`: a dataset node of the SFT recipes (`dataset.source=` enables it), its
  `split` (the loss and perplexity over every loss token; `dataset.validation_source=FILE`
  makes a whole file the validation split);
- `rewards` over `prompts` (the GRPO recipe's reward components and prompt dataset):
  one completion per prompt (greedy unless `temperature`), the mean of each reward;
- `pairs` (a reward model's checkpoint: rm_fsdp2's run or an HF sequence classifier):
  a `freetx.data.PreferenceDataset` node (`pairs.source=` enables it), each pair's chosen
  and rejected sequences scored: the accuracy (chosen above rejected), the margin, the
  rewards' mean, std, min and max, the Bradley-Terry loss.

Every process loads the whole model and scores its share: the harness's requests
strided over the ranks, the dataset's and the prompts' samples as a training run's
evaluation splits them; sums over the ranks, so N processes give the scores of one.
Rank 0 writes `<output_dir>/eval.json` and prints the table (`freetx.evaluation`).
A user's mistake (nothing to evaluate, an unknown task, lm-eval missing, a checkpoint
with no tokenizer) is refused before any weight is read.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from omegaconf import MISSING, DictConfig, OmegaConf

from freetx.checkpoint import load_model, resolve_checkpoint
from freetx.config import at_least, instantiate, write_resolved_config
from freetx.data import (
    HFTokenizer,
    TokenBatch,
    build_eval_loader,
    checked_tokenizer,
    collate_pairs,
    collate_prompts,
    source_names,
)
from freetx.distributed import DistributedConfig, build_groups, dtype_named, init_distributed
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.evaluation import (
    check_tasks,
    eval_results,
    evaluate_tasks,
    harness_model,
    results_table,
    write_results,
)
from freetx.evaluation.results import task_settings
from freetx.fields import component_list, read_path, written_folder
from freetx.models.engine import EngineConfig, check_pool
from freetx.models.generation import Sampling
from freetx.models.hf import ending_ids
from freetx.models.protocol import ReplacesLanguageHead
from freetx.models.scorer import check_pad_id, pooled_scores
from freetx.objectives import BradleyTerryLoss, build_rewards
from freetx.objectives.reward_model import PairMetrics
from freetx.objectives.rewards import place_rewards
from freetx.objectives.rollouts import CompletionScorer
from freetx.training import claim_folder, per_source_means
from freetx.training.export import recorded_config, recorded_peft, recorded_run


@dataclass
class EvalConfig:
    """The schema of eval's configs."""

    # an HF folder, a run's output_dir, a DCP step, a .safetensors file
    checkpoint: str = read_path(MISSING)
    # a LoRA run's base where it is now, when it moved (None: the one the run recorded)
    base: Optional[str] = read_path(None)
    output_dir: str = written_folder("runs/eval")  # eval.json
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16"] = "float32"  # the weights, as evaluated
    seed: int = 0
    tokenizer: Any = None  # None: the checkpoint's own (an HF folder's, the run's)
    # lm-evaluation-harness (`pip install 'freetx[eval]'`)
    tasks: list[str] = field(default_factory=list)  # lm-eval task names
    include_path: Optional[str] = None  # a folder of local task YAMLs
    num_fewshot: Optional[int] = at_least(0, default=None)  # None: each task's own
    limit: Optional[int] = at_least(1, default=None)  # documents per task; None: all
    batch_size: int = at_least(1, default=8)  # rows per forward pass, on each process
    max_length: Optional[int] = at_least(1, default=None)  # None: the model's max_seq_len
    # loss and perplexity over a dataset (a node of the SFT recipes; source: null: none)
    dataset: Any = None
    split: Literal["train", "validation"] = "validation"
    loss: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.CrossEntropyLoss"})
    max_batches: Optional[int] = at_least(1, default=None)  # of batch_size x processes
    # rewards over one completion per prompt (the GRPO recipe's components)
    rewards: list[Any] = component_list("weight", "name", default_factory=list)
    prompts: Any = None  # a freetx.data.PromptDataset node (source: null: none)
    # a reward model's accuracy over preference pairs (a PreferenceDataset node; source: null: none)
    pairs: Any = None
    max_new_tokens: int = at_least(1, default=64)
    temperature: float = at_least(0, default=0.0)  # 0: greedy
    # the generation engine: slots, the paged KV cache's blocks, compile (docs/generation.md)
    engine: EngineConfig = field(default_factory=EngineConfig)

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Rewards without prompts, or prompts without rewards, by key: why, and the fix."""
        if bool(values.get("rewards")) != (_source(values.get("prompts")) is not None):
            return {
                "rewards": (
                    "rewards score one completion per prompt, so they need each other: set both "
                    "rewards=[...] and prompts.source=FILE (a freetx.data.PromptDataset), or "
                    "neither."
                )
            }
        return {}


def check_sequence_fits(
    seq_len: int, max_seq_len: int, key: str = "dataset", extra: int = 0
) -> None:
    """The dataset's sequences (`key`.seq_len tokens, and `extra` more: a pair's row and
    its end token) fit the model's positions (its RoPE table, its config)."""
    if seq_len + extra > max_seq_len:
        raise ConfigError(
            f"{key}.seq_len={seq_len} is longer than the model's max_seq_len={max_seq_len}"
            + (f" (with its {extra} end token)" if extra else "")
            + ": its positions stop there, so the longer sequences cannot be scored.",
            fix=f"Set {key}.seq_len={max_seq_len - extra} (or less).",
        )


def refuse_nothing_to_evaluate(cfg: EvalConfig) -> None:
    """A config that names no task, no dataset and no reward, refused with the fix (the
    shipped config names none: the command line does)."""
    if (
        not cfg.tasks
        and _source(cfg.dataset) is None
        and not cfg.rewards
        and _source(cfg.pairs) is None
    ):
        raise ConfigError(
            f"there is nothing to evaluate in {cfg.checkpoint}: no lm-eval task, no "
            "dataset.source, no rewards and no pairs.source.",
            fix="Name tasks (tasks=[TASK, ...], with include_path=DIR for local task YAMLs; "
            "`freetx eval CHECKPOINT --tasks a,b`), a dataset for perplexity "
            "(dataset.source=FILE), rewards with prompts (rewards=[...] "
            "prompts.source=FILE), or a reward model's pairs (pairs.source=FILE).",
        )


def _source(node: Any) -> Any:
    """A dataset node's source (None: the node is not there or evaluates nothing)."""
    return node.get("source") if isinstance(node, (dict, DictConfig)) else None


class EvalRecipe:
    def __init__(self, cfg: EvalConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device)
        self.device = self.runtime.device
        self.groups = build_groups(self.runtime, DistributedConfig())  # data parallel only
        self.rank, self.world = self.groups.dp_rank, self.groups.dp_size

    def setup(self) -> None:
        """Everything a mistake can stop before a weight is read, then the model."""
        cfg = self.cfg
        refuse_nothing_to_evaluate(cfg)
        check_pool(cfg.engine, cfg.max_new_tokens)
        claim_folder(cfg.output_dir, "eval", mark=self.rank == 0)  # no folder taken over
        if cfg.tasks:  # lm-eval installed, every task name known
            check_tasks(list(cfg.tasks), cfg.include_path)
        self.rewards = build_rewards(cfg.rewards) if cfg.rewards else []
        self.checkpoint = str(resolve_checkpoint(cfg.checkpoint))
        self.tokenizer = checked_tokenizer(self.build_tokenizer())
        self.val_loader = self.prompt_loader = self.pair_loader = None
        if _source(cfg.dataset) is not None:
            data = instantiate(cfg.dataset, tokenizer=self.tokenizer, split=cfg.split)
            collate = functools.partial(TokenBatch.collate, source_names=source_names(data))
            self.val_loader = build_eval_loader(
                data, cfg.batch_size * self.world, self.rank, self.world, collate
            )
            self.loss_fn = instantiate(cfg.loss)
        if self.rewards:
            prompts = instantiate(cfg.prompts, tokenizer=self.tokenizer, split=cfg.split)
            self.prompt_loader = build_eval_loader(
                prompts, cfg.batch_size * self.world, self.rank, self.world, collate_prompts
            )
        if _source(cfg.pairs) is not None:
            pairs = instantiate(cfg.pairs, tokenizer=self.tokenizer, split=cfg.split)
            self.pair_loader = build_eval_loader(
                pairs, cfg.batch_size * self.world, self.rank, self.world, collate_pairs
            )
        adapters = recorded_peft(self.checkpoint)  # a LoRA run: its adapters, unmerged
        self.model = load_model(self.checkpoint, self.device, cfg.seed, adapters, cfg.base, "base")
        if self.pair_loader is not None:  # a reward model, reading scores at the tokenizer's pad
            if not isinstance(self.model, ReplacesLanguageHead):
                raise ConfigError(
                    f"pairs.source: {cfg.checkpoint} holds a {type(self.model).__name__}, which "
                    "gives no score per sequence; pairs are scored by a reward model.",
                    fix="Evaluate rm_fsdp2's run or an HF XForSequenceClassification folder "
                    "(num_labels 1) on pairs; a language model's are DPO's (dpo_fsdp2 logs them).",
                )
            self.pad_id = check_pad_id(self.model, self.tokenizer)
            check_sequence_fits(int(cfg.pairs.seq_len), self.model.config.max_seq_len, "pairs", 1)
        place_rewards(self.rewards, self.device)  # a judge's weights
        if cfg.dtype != "float32":  # load_model builds in float32 (QLoRA: NF4 bases)
            self.model.to(dtype_named(cfg.dtype))
        if self.val_loader is not None:  # the model's positions hold the dataset's sequences
            check_sequence_fits(int(cfg.dataset.seq_len), self.model.config.max_seq_len)
        self.end_ids = self.ends()
        if self.rank == 0:
            kind = f" with its {adapters.method} adapters (unmerged)" if adapters else ""
            print(
                f"eval | {type(self.model).__name__} from {cfg.checkpoint}{kind} | "
                f"device {self.device} | {self.world} process(es)",
                flush=True,
            )

    def build_tokenizer(self):
        """The config's tokenizer, else the checkpoint's: an HF folder's own, or the
        tokenizer node of the run that saved it."""
        cfg = self.cfg
        if cfg.tokenizer is not None:
            return instantiate(cfg.tokenizer)
        folder = Path(cfg.checkpoint).expanduser()
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            return HFTokenizer(str(folder))
        recorded = recorded_config(self.checkpoint).get("tokenizer")
        if recorded is None:
            raise ConfigError(
                f"{cfg.checkpoint} holds no tokenizer and records none (not an HF folder "
                "with tokenizer files, nor a checkpoint of a freetx run), so its ids cannot "
                "be read as text.",
                fix="Give one: tokenizer._component_=freetx.data.HFTokenizer "
                "tokenizer.path=MODEL_FOLDER.",
            )
        return instantiate(OmegaConf.create(recorded))

    def ends(self) -> list[int]:
        """The ids a generation ends at: the tokenizer's EOS and the model's own (its HF
        folder's generation config, or that of the folder its run started from)."""
        folders = [self.checkpoint, *recorded_run(self.checkpoint)["run_folders"]]
        return ending_ids(self.tokenizer.eos_id, folders)

    def evaluate(self) -> dict[str, Any]:
        cfg = self.cfg
        evaluated: dict[str, Any] = {}
        scores = dataset = rewards = None
        if cfg.tasks:
            evaluated.update(task_settings(cfg))
            lm = harness_model(
                self.model,
                self.tokenizer,
                self.device,
                cfg.batch_size,
                cfg.max_length,
                self.rank,
                self.world,
                self.end_ids,
                self.groups.host().all_gather_object,
            )
            scores = evaluate_tasks(
                lm, list(cfg.tasks), cfg.include_path, cfg.num_fewshot, cfg.limit
            )
        if self.val_loader is not None:
            evaluated["dataset"] = {
                **OmegaConf.to_container(cfg.dataset, resolve=True),
                "split": cfg.split,
            }
            dataset = self.perplexity()
        if self.prompt_loader is not None:
            evaluated["rewards"] = [r.name for r in self.rewards]
            evaluated["prompts"] = {
                **OmegaConf.to_container(cfg.prompts, resolve=True),
                "split": cfg.split,
            }
            rewards = self.reward_means()
        pairs = None
        if self.pair_loader is not None:
            evaluated["pairs"] = {
                **OmegaConf.to_container(cfg.pairs, resolve=True),
                "split": cfg.split,
            }
            pairs = self.pair_means()
        results = eval_results(cfg.checkpoint, evaluated, scores, dataset, rewards, pairs)
        if self.rank == 0:
            write_resolved_config(cfg)
            write_results(cfg.output_dir, results)
            print(results_table(results), flush=True)
        return results

    @torch.no_grad()
    def perplexity(self) -> dict[str, float]:
        """The loss per loss token over the split (every process its share, summed)."""
        sums, tokens = {}, torch.zeros((), device=self.device)
        for batch in itertools.islice(self.val_loader, self.cfg.max_batches):
            batch = batch.to(self.device).without_padding_rows()
            total, parts = self.loss_fn.evaluate(
                self.model, batch.input_ids, batch.labels, **batch.model_inputs()
            )
            for name, value in {"loss": total, **parts}.items():
                sums[name] = sums.get(name, 0) + value
            tokens += batch.loss_tokens()
        totals = self.groups.sum({**sums, "tokens": tokens}, over="dp")
        count = totals.pop("tokens")
        metrics = per_source_means({k: v / max(count, 1.0) for k, v in totals.items()})
        return {**metrics, "perplexity": math.exp(min(metrics["loss"], 50.0)), "tokens": count}

    @torch.no_grad()
    def pair_means(self) -> dict[str, float]:
        """A reward model over the pairs (every process its share): `PairMetrics`'."""
        metrics = PairMetrics(BradleyTerryLoss())
        for batch in itertools.islice(self.pair_loader, self.cfg.max_batches):
            batch = batch.to(self.device)
            sequences = batch.sequences(self.pad_id)
            scores = pooled_scores(self.model(sequences), sequences, self.pad_id)
            metrics.add(scores, batch)
        return metrics.means(self.groups, over="dp")

    def reward_means(self) -> dict[str, float]:
        """One completion per prompt (greedy unless temperature), scored by every reward:
        the weighted reward's mean, each reward's and the completions' mean length."""
        cfg = self.cfg
        scorer = CompletionScorer(
            self.tokenizer, self.rewards, self.end_ids, cfg.max_new_tokens, engine=cfg.engine
        )
        key = f"seed {cfg.seed} eval"  # each prompt's draws: the seed, its id
        return scorer.validation(
            self.model, self.prompt_loader, Sampling(cfg.temperature), key, self.groups
        )


@parse(EvalConfig)
def recipe_main(cfg: EvalConfig) -> None:
    recipe = EvalRecipe(cfg)
    recipe.setup()
    recipe.evaluate()


if __name__ == "__main__":
    sys.exit(recipe_main())
