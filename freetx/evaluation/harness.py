"""lm-evaluation-harness over a freetx model: the `eval` recipe's tasks.

    lm = harness_model(model, tokenizer, device, batch_size=8)   # an lm_eval LM
    scores = evaluate_tasks(lm, ["my_task"], include_path="tasks/")
    scores["my_task"]["acc"]                                     # lm-eval's raw: scores["lm_eval"]

The adapter scores as lm-eval's own Hugging Face backend (`HFLM`) does, so that a
freetx checkpoint and its HF export score alike:

- loglikelihood: a context's trailing spaces move to the continuation and the pair is
  encoded whole, the context's own ids split off (HFLM's `_encode_pair`); an empty
  context is the prefix token (BOS, else EOS). A text is encoded as HFLM's `tok_encode`
  does, `tokenizer(text)`: BOS and EOS where the tokenizer adds them (`encoded_text`),
  none when the text starts with the prefix token's text already. Rows longest first,
  `batch_size` at a time, right-padded: a causal row's log-probs do not read the padding
  after it. The sum of the continuation's log-probs, and whether each of its tokens is
  the argmax.
- loglikelihood_rolling: HFLM's disjoint windows of `max_length` tokens
  (`lm_eval.utils.get_rolling_token_windows`; the text encoded as above, the prefix
  token before it), scored as loglikelihood rows, summed per text.
- generate_until: `freetx.models.generation.generate` (the generation engine, or the
  static batch for a model it does not serve), rows of equal
  generation settings longest first; greedy unless the request samples (`do_sample`,
  `temperature`, `top_k`, `top_p`); a row ends at an end id, at `max_gen_toks`, or at
  the first `until` string, where its text is cut. Generation runs in rounds of 16, 32,
  64 ... tokens, and rows that have reached a stop string leave between rounds.

Data-parallel: with `world_size` > 1 every process runs the whole harness (the same
requests, in the same order) and scores only its strided share of the work (rows
`rank::world_size` of each call's log-likelihood rows, windows or generation requests);
the shares are gathered over a gloo group and put back in order, so every process
returns every result. lm-eval itself sees one process (`rank` 0, `world_size` 1): it
neither splits nor pads the requests.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from freetx.config.trust import check_task_folder
from freetx.data.tokenizers import HFTokenizer, encoded_text
from freetx.distributed.groups import HostGroup
from freetx.errors import ConfigError
from freetx.models.generation import Draws, Sampling, generate
from freetx.models.protocol import DecodesIncrementally, refuse_scorer

# the optional extra that installs lm-eval
EXTRA = "eval"
DEFAULT_MAX_GEN_TOKS = 256  # HFLM's max_gen_toks, when a task names none
FIRST_ROUND = 16  # tokens generated before the first look for stop strings

Gather = Callable[[Any], list[Any]]  # this process's object -> every process's, in rank order


def _lm_eval():
    """The lm_eval package, or one paragraph saying how to install it."""
    try:
        import lm_eval
        import lm_eval.api.model
        import lm_eval.models.utils
        import lm_eval.tasks
        import lm_eval.utils
    except ImportError:
        raise ConfigError(
            "evaluating on lm-evaluation-harness tasks needs the `lm-eval` package, which is "
            f"not installed; install it with pip install 'freetx[{EXTRA}]' (or pip install "
            "lm-eval), or evaluate perplexity on a dataset instead."
        ) from None
    return lm_eval


def share(items: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """The items process `rank` of `world_size` works on: every world_size-th, from its
    rank on."""
    return list(items[rank::world_size])


def reassemble(shares: Sequence[Sequence[Any]]) -> list[Any]:
    """The results of every process's `share` (in rank order), back in the items' order."""
    out: list[Any] = [None] * sum(map(len, shares))
    for rank, part in enumerate(shares):
        out[rank :: len(shares)] = part
    return out


def harness_model(
    model: nn.Module,
    tokenizer,
    device,
    batch_size: int = 8,
    max_length: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    end_ids: Sequence[int] | None = None,
    gather: Gather | None = None,
):
    """An lm_eval `LM` that scores with `model` (a freetx language model in eval mode: the
    native decoder or the generic HF path, as `freetx.checkpoint.load_model` gives one)
    and `tokenizer` (`freetx.data.HFTokenizer`), on `device`.

    `max_length`: the tokens the model reads at most (default: its config's
    `max_seq_len`); longer inputs lose their left end, as in HFLM. `end_ids`: the ids
    that end a generation (default: the tokenizer's EOS; give an HF folder's
    `freetx.models.hf.end_token_ids` where its generation config names more, as
    transformers' `generate` stops at those). With `world_size` > 1, this is process
    `rank` of a data-parallel evaluation: `gather` (default: an all-gather over a new
    gloo group of every process, which every process must reach together) collects each
    process's share."""
    _lm_eval()
    refuse_scorer(model, "lm-evaluation-harness")
    if world_size > 1 and gather is None:
        group = HostGroup.new()
        if group.group is None:
            raise ConfigError(
                f"harness_model was given world_size={world_size} but torch.distributed is "
                "not initialized, so the processes cannot share the work; launch with "
                "`freetx run --nproc-per-node N` (torchrun), or pass world_size=1."
            )
        gather = group.all_gather_object
    limit = int(max_length or model.config.max_seq_len)
    ends = list(end_ids) if end_ids else [tokenizer.eos_id]
    return _freetx_lm_class()(
        model, tokenizer, torch.device(device), batch_size, limit, rank, world_size, ends, gather
    )


@functools.cache
def _freetx_lm_class() -> type:
    """`FreetxLM`, made at the first call (it subclasses lm_eval's `LM`, so importing
    freetx.evaluation needs no lm_eval)."""
    lm_eval = _lm_eval()
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class FreetxLM(lm_eval.api.model.LM):
        """A freetx model as lm-eval's `LM` (see the module docstring)."""

        def __init__(
            self,
            model: nn.Module,
            tokenizer,
            device: torch.device,
            batch_size: int,
            max_length: int,
            rank: int,
            world_size: int,
            end_ids: list[int],
            gather: Gather | None,
        ) -> None:
            super().__init__()  # lm-eval's rank 0 of 1: the work is split here
            self.model, self.tokenizer, self._device = model, tokenizer, device
            self.batch_size, self.max_length = batch_size, max_length
            self.shard_rank, self.shard_world = rank, world_size
            self.end_ids, self.gather = end_ids, gather
            self.prefix_token_id = (
                tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
            )
            special = tokenizer.special_tokens if isinstance(tokenizer, HFTokenizer) else {}
            self.prefix_text = special.get(
                "bos_token" if tokenizer.bos_id is not None else "eos_token"
            )

        # -- the three requests lm-eval makes ----------------------------------------
        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            return self._spread([self._pair(*req.args) for req in requests], self._score)

        def loglikelihood_rolling(self, requests) -> list[float]:
            windows, owner = [], []
            for index, req in enumerate(requests):
                for window in get_rolling_token_windows(
                    token_list=self.encode(req.args[0]),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ):
                    windows.append(make_disjoint_window(window))
                    owner.append(index)
            totals = [0.0] * len(requests)
            for index, (logp, _) in zip(owner, self._spread(windows, self._score)):
                totals[index] += logp
            return totals

        def generate_until(self, requests) -> list[str]:
            return self._spread([req.args for req in requests], self._generate_all)

        # -- tokens ---------------------------------------------------------------------
        def encode(self, text: str) -> list[int]:
            """`text`'s ids as `tokenizer(text)` gives them, with no special tokens added
            when the text spells the prefix token already (HFLM's `tok_encode`)."""
            if self.prefix_text and text.startswith(self.prefix_text):
                return self.tokenizer.encode(text)
            return encoded_text(self.tokenizer, text)

        def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            """(context ids, continuation ids) as lm-eval's `loglikelihood` and HFLM's
            `_encode_pair` split them."""
            if context == "":
                ids = self.tokenizer.encode(continuation)
                if ids[:1] == [self.prefix_token_id]:
                    return ids[:1], ids[1:]
                return [self.prefix_token_id], ids
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, head = self.encode(context + continuation), self.encode(context)
            return head, whole[len(head) :]

        # -- data parallel ----------------------------------------------------------
        def _spread(self, work: list, compute: Callable[[list], list]) -> list:
            """compute(work), each process computing its share."""
            if self.shard_world == 1:
                return compute(work)
            mine = compute(share(work, self.shard_rank, self.shard_world))
            return reassemble(self.gather(mine))

        # -- scoring ----------------------------------------------------------------
        @torch.no_grad()
        def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
            """Each (context, continuation) pair's summed continuation log-prob and whether
            the continuation is the greedy one."""
            order = sorted(range(len(pairs)), key=lambda i: -sum(map(len, pairs[i])))
            out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
            for start in range(0, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                # the last token predicts nothing; beyond max_length the left end goes
                inputs = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1) :][:-1] for i in rows]
                width = max(map(len, inputs))
                batch = torch.tensor(
                    [ids + [0] * (width - len(ids)) for ids in inputs], device=self._device
                )
                logits = self.model(batch)
                for row, i, ids in zip(range(len(rows)), rows, inputs):
                    wanted = torch.tensor(pairs[i][1], device=self._device)
                    scored = logits[row, len(ids) - len(wanted) : len(ids)].float()
                    logps = torch.log_softmax(scored, dim=-1)
                    greedy = bool((scored.argmax(dim=-1) == wanted).all())
                    out[i] = (float(logps.gather(-1, wanted[:, None]).sum()), greedy)
            return out

        # -- generation ---------------------------------------------------------------
        def _generate_all(self, requests: list[tuple[str, dict]]) -> list[str]:
            """Each (context, generation settings) request's text: rows of equal settings
            together, longest prompt first, `batch_size` at a time (one at a time for a
            model without a KV cache: a full forward takes no padding)."""
            prompts = [self.encode(context) for context, _ in requests]
            out = [""] * len(requests)
            groups: dict[str, list[int]] = {}
            for i, (_, settings) in enumerate(requests):
                groups.setdefault(json.dumps(settings, sort_keys=True, default=str), []).append(i)
            rows = self.batch_size if isinstance(self.model, DecodesIncrementally) else 1
            for members in groups.values():
                kwargs = normalize_gen_kwargs(requests[members[0]][1], DEFAULT_MAX_GEN_TOKS)
                until = handle_stop_sequences(kwargs.get("until"), eos=None)
                new_tokens = int(kwargs["max_gen_toks"])
                room = self.max_length - new_tokens
                if room < 1:
                    raise ConfigError(
                        f"a generate_until task asks for max_gen_toks={new_tokens} new tokens, "
                        f"which leaves no room for its prompt within max_length="
                        f"{self.max_length}; raise the evaluation's max_length or lower the "
                        "task's generation_kwargs.max_gen_toks."
                    )
                temperature = float(kwargs.get("temperature") or 0.0)
                sampling = Sampling(
                    temperature=temperature if kwargs.get("do_sample") else 0.0,
                    top_k=kwargs.get("top_k"),
                    top_p=kwargs.get("top_p"),
                )
                members = sorted(members, key=lambda i: -len(prompts[i]))
                for start in range(0, len(members), rows):
                    batch = members[start : start + rows]
                    texts = self._generate(
                        [prompts[i][-room:] for i in batch],
                        [requests[i][0] for i in batch],
                        new_tokens,
                        sampling,
                        until,
                    )
                    for i, text in zip(batch, texts):
                        out[i] = postprocess_generated_text(text, until, None)
            return out

        def _generate(
            self,
            prompts: list[list[int]],
            keys: list[str],
            new_tokens: int,
            sampling: Sampling,
            until: list[str],
        ) -> list[str]:
            """Each prompt's generated text (end token and stop string included), in rounds
            of doubling length; a row leaves at its end token or once its text holds a stop
            string. Sampled rows draw by `keys` (their contexts) and the round's start."""
            replies: list[list[int]] = [[] for _ in prompts]
            running, done, step = list(range(len(prompts))), 0, FIRST_ROUND
            while running:
                steps = min(step, new_tokens - done)
                row_keys = [f"{keys[i]}\x00{done}" for i in running]
                draws = (
                    Draws.keyed(row_keys, steps)
                    if sampling.temperature > 0
                    else Draws(torch.zeros(len(running), steps))
                )
                made = generate(
                    self.model,
                    [prompts[i] + replies[i] for i in running],
                    steps,
                    sampling,
                    self.end_ids,
                    draws,
                )
                still = []
                for i, reply, ended in zip(running, made.replies(), made.ended.tolist()):
                    replies[i] += reply
                    text = self.tokenizer.decode(replies[i])
                    if not ended and not any(stop and stop in text for stop in until):
                        still.append(i)
                done, step = done + steps, step * 2
                running = still if done < new_tokens else []
            return [self.tokenizer.decode(reply) for reply in replies]

    return FreetxLM


def evaluate_tasks(
    lm,
    tasks: list[str],
    include_path: str | None,
    num_fewshot: int | None = None,
    limit: int | None = None,
) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` (lm-eval task names: the harness's own, or
    those the YAML files under `include_path` define) with `lm`: {task: {metric: value}}
    (a metric of a filter other than lm-eval's "none" named `metric,filter`; standard
    errors as `metric_stderr`), and lm-eval's whole result (JSON-safe) under "lm_eval".
    An empty dict on the processes lm-eval returns nothing to (LOCAL_RANK other than 0).
    A task name neither defines is refused before any scoring."""
    _lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable

    manager = check_tasks(tasks, include_path)
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
    )
    if results is None:
        return {}
    raw = json.loads(json.dumps(results, default=handle_non_serializable))
    scores: dict[str, Any] = {}
    for task, values in raw["results"].items():
        scores[task] = {}
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if isinstance(value, (int, float)) and kind:
                scores[task][metric if kind == "none" else key] = value
    return {**scores, "lm_eval": raw}


def check_tasks(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager for `tasks`, refusing a task name that neither the YAMLs
    under `include_path` nor the harness define (and a missing lm-eval), before any
    scoring: the eval recipe checks its tasks before loading weights, a training run
    with `eval.after_training` before training."""
    _lm_eval()
    if include_path is not None and not Path(include_path).expanduser().is_dir():
        raise ConfigError(
            f"include_path={include_path} is not a folder; point it at the folder of your "
            "lm-eval task YAMLs (each with a `task:` name), or leave it out for the harness's "
            "own tasks."
        )
    if include_path is not None:
        check_task_folder(include_path)  # a folder whose YAMLs run Python is code: trusted?
    manager = _task_manager(include_path, tuple(tasks))
    unknown = [task for task in tasks if not manager.match_tasks([task])]
    if unknown:
        where = f"in {include_path} nor " if include_path else ""
        raise ConfigError(
            f"lm-eval knows no task {', '.join(map(repr, unknown))} (defined neither {where}"
            "among the harness's own tasks); check the name against the `task:` line of your "
            "task YAML, and set include_path= to the folder of your task YAMLs."
        )
    return manager


@functools.cache
def _task_manager(include_path: str | None, tasks: tuple[str, ...]):
    """lm-eval's TaskManager for `tasks`: the folder's YAMLs alone where they define every
    task (indexing the harness's own thousands of YAMLs takes seconds), else with them;
    made once per folder and tasks."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([task]) for task in tasks):
            return local
    return TaskManager(include_path=include_path)
