"""A judge as a reward (GenRM, "LLM-as-judge"): a frozen local model reads each completion
under a prompt template and gives its verdict (docs/rewards.md#a-judge-as-a-reward).

    rewards:
      - _component_: freetx.objectives.Judge
        model: /models/Qwen2.5-0.5B-Instruct     # an HF folder, or a run / DCP checkpoint
        template: "Question: {prompt}\\nAnswer: {completion}\\nIs the answer right? Say yes or no."
        verdicts: ["Yes", "No"]                  # verdict: P(Yes) / (P(Yes) + P(No))
        weight: 1.0

`verdict` (the default): the score is the probability of the first verdict's first token
against the second's, at the position where the judge starts its reply (each verdict's
token as it is tokenized there, after the prompt: `Yes` right after a chat template's
assistant header, ` yes` after a question's text): the template filled in (`{prompt}`, `{completion}` and the row's fields by name) as one user turn of
the judge's chat template with its generation prompt (or the text itself, with BOS, for
a tokenizer without one). `score`: the judge replies greedily (up to `max_new_tokens`,
through the generation engine) and the first number in its reply is the score; a reply
without one does not apply (None, TRL's meaning).

The judge's weights are read once, when the run places it (`place`), frozen, bfloat16 on
CUDA and float32 on the CPU: under a policy sharded by FSDP2 without tensor parallelism,
sharded like a reference model (per block, each rank reading its rows) and gathered
whole only while it scores (`gathered`: the rollout enters it on every rank at once);
else whole on every rank. `freetx estimate` counts it whole within the peak. Its completions
are scored in batches of `batch_size`. It is TRL's batched form of a reward, so its call sees the
rank's completions of a step at once.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from freetx.checkpoint import load_initial_weights
from freetx.checkpoint.loading import (
    load_source_model,
    quantization_method,
    source_model_on_meta,
    source_parameters,
)
from freetx.data import ByteTokenizer, HFTokenizer
from freetx.data.chat import chat_prompt_ids
from freetx.data.tokenizers import leading_bos
from freetx.distributed import ParallelPlan, gathered_whole, parallelize_frozen
from freetx.envs import last_reply
from freetx.errors import ConfigError
from freetx.models import DecodesIncrementally
from freetx.models.generation import Draws, Sampling, generate
from freetx.models.protocol import refuse_scorer

MODES = ("verdict", "score")
_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")


class Judge:
    """A frozen model's verdict on each completion (module docstring)."""

    def __init__(
        self,
        model: str,
        template: str,
        verdicts: Sequence[str] = ("Yes", "No"),
        mode: str = "verdict",
        max_new_tokens: int = 8,
        batch_size: int = 16,
        tokenizer: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is none of {', '.join(MODES)}")
        if "{completion}" not in template:
            raise ValueError("the template has no {completion}: the judge would not read it")
        self.path, self.template, self.mode = model, template, mode
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        folder = Path(tokenizer or model).expanduser()
        if tokenizer != "bytes" and not (folder / "tokenizer.json").is_file():
            raise ValueError(
                f"{folder} has no tokenizer.json; point tokenizer at the judge's tokenizer "
                "folder (a run of a byte model: tokenizer: bytes)"
            )
        self.tokenizer = ByteTokenizer() if tokenizer == "bytes" else HFTokenizer(str(folder))
        self.verdicts = list(verdicts)
        if mode == "verdict" and (len(self.verdicts) != 2 or len(set(self.verdicts)) != 2):
            raise ValueError(f"verdicts={self.verdicts!r}: give two verdicts, yes first")
        self.model: torch.nn.Module | None = None
        self.sharded = self.whole = False  # sharded by FSDP2; gathered whole now
        self.scoring = threading.Lock()  # a batch being scored

    def verdict_ids(self, text: str) -> list[int]:
        """Each verdict's first token where the judge's reply starts, after `text` (a
        rendered judge prompt): the token the verdict begins with when tokenized after it
        (a word's first token differs at the start of a reply and after a space)."""
        prefix, found = self.tokenizer.encode(text), []
        for verdict in self.verdicts:
            ids = self.tokenizer.encode(text + verdict)
            after = ids[: len(prefix)] == prefix and len(ids) > len(prefix)
            found.append(ids[len(prefix)] if after else self.tokenizer.encode(verdict)[0])
        if len(set(found)) != 2:
            raise ValueError(
                f"the verdicts {self.verdicts!r} begin with the same token after the judge's "
                "prompt; give verdicts whose first tokens differ (e.g. Yes / No)"
            )
        return found

    def parameter_bytes(self) -> int:
        """The judge's weights in bytes as placed on a GPU (bfloat16), from its shapes alone."""
        return source_parameters(self.path) * 2

    def place(self, device: torch.device, plan: ParallelPlan | None = None) -> None:
        """Read the judge's weights onto `device`, frozen, bfloat16 on CUDA and float32 on
        the CPU (the run calls it once, at setup, on every rank): with the `plan` of a
        policy sharded by FSDP2 without tensor parallelism, sharded like a reference model
        (`parallelize_frozen`: per block, each rank reading its rows of the weights), else
        whole (a torchao-quantized folder too)."""
        if device.type == "cuda":  # whole while it scores
            free, _ = torch.cuda.mem_get_info(device)
            need = self.parameter_bytes()
            if need > free:
                raise ConfigError(
                    f"the judge {self.path} needs {need / 2**30:.1f} GiB for its weights, "
                    f"gathered whole while it scores, and {device} has {free / 2**30:.1f} GiB "
                    "free; use a smaller judge (freetx estimate counts it)."
                )
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        self.sharded = (
            plan is not None
            and not plan.replicated
            and plan.groups.size("tp") == 1
            and quantization_method(self.path) is None
        )
        if self.sharded:
            model = source_model_on_meta(self.path)
            _check_decoder(model, self.path)
            cfg = copy.deepcopy(plan.cfg)
            cfg.mixed_precision.param_dtype = dtype  # what a whole judge keeps
            model = parallelize_frozen(model, plan.groups, cfg, seed=0)
            load_initial_weights(model, self.path)
        else:  # read on the CPU, then moved
            model = load_source_model(self.path, torch.device("cpu"), dtype).to(device)
            _check_decoder(model, self.path)
        self.model = model.eval().requires_grad_(False)

    @contextmanager
    def gathered(self):
        """The judge whole for the scoring inside (`gathered_whole`: one all-gather per
        sharded block on entry, every rank entering together; nothing for a whole judge).
        On exit it waits for a batch still being scored (a call its deadline or a stop
        signal abandoned runs on in its thread), and a sharded judge refuses to score
        outside: its forwards would gather its blocks on this rank alone."""
        if self.model is None:
            raise RuntimeError(f"the judge {self.path} was not placed on a device (place())")
        with gathered_whole(self.model):
            self.whole = True
            try:
                yield
            finally:
                with self.scoring:
                    self.whole = False

    def rendered(self, prompt: str, completion: str, row: dict[str, Any]) -> tuple[str, list[int]]:
        """The judge's input for one completion (module docstring): its text as rendered
        (the chat template's, with its generation prompt) and its tokens."""
        text = self.template.format(**{**row, "prompt": prompt, "completion": completion})
        tok = self.tokenizer
        if getattr(tok, "chat_template", None) is not None:
            chat = [{"role": "user", "content": text}]
            return tok.apply_chat_template(chat, add_generation_prompt=True), chat_prompt_ids(
                tok, chat
            )
        return text, [*leading_bos(tok), *tok.encode(text)]

    @torch.no_grad()
    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float | None]:
        if self.model is None:
            raise RuntimeError(f"the judge {self.path} was not placed on a device (place())")
        rows = [{k: v[i] for k, v in columns.items()} for i in range(len(completions))]
        texts = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
        said = [c if isinstance(c, str) else last_reply(c) for c in completions]
        rendered = [self.rendered(p, c, r) for p, c, r in zip(texts, said, rows)]
        inputs = [ids for _, ids in rendered]
        verdicts = self.verdict_ids(rendered[0][0]) if self.mode == "verdict" else []
        scores: list[float | None] = []
        for start in range(0, len(inputs), self.batch_size):
            part = inputs[start : start + self.batch_size]
            with self.scoring:  # one batch at a time, while the judge is whole
                if self.sharded and not self.whole:
                    raise RuntimeError(
                        f"the judge {self.path} scored outside its gathered() (a call left "
                        "running after the rollout moved on): stopped before any collective"
                    )
                scores += self._verdicts(part, verdicts) if verdicts else self._scores(part)
        return scores

    def _verdicts(self, inputs: list[list[int]], verdicts: list[int]) -> list[float]:
        """P(yes) / (P(yes) + P(no)) at each input's last position: one forward of the
        left-padded batch into a KV cache that masks the padding (`DecodesIncrementally`)."""
        device = next(self.model.parameters()).device
        width = max(len(ids) for ids in inputs)
        padding = torch.tensor([width - len(x) for x in inputs], device=device)
        ids = torch.tensor([[0] * (width - len(x)) + x for x in inputs], device=device)
        logits = self.model(ids, cache=self.model.new_cache(padding, width))[:, -1]
        pair = logits[:, verdicts].float().log_softmax(-1)
        return pair[:, 0].exp().tolist()

    def _scores(self, inputs: list[list[int]]) -> list[float | None]:
        """The first number of the judge's greedy reply, None where there is none."""
        draws = Draws.seeded([0] * len(inputs), self.max_new_tokens)  # unread: greedy
        end = [self.tokenizer.eos_id]
        out = generate(self.model, inputs, self.max_new_tokens, Sampling(0.0), end, draws)
        found = [_NUMBER.search(self.tokenizer.decode(r)) for r in out.replies()]
        return [None if f is None else float(f[0]) for f in found]


def _check_decoder(model: torch.nn.Module, path: str) -> None:
    """Refuse a judge that is no decoder LM with a KV cache."""
    refuse_scorer(model, f"the judge {path}")
    if not isinstance(model, DecodesIncrementally):
        raise ConfigError(
            f"the judge {path} is a {type(model).__name__}, which has no KV cache "
            "(DecodesIncrementally); a judge is a decoder LM."
        )
