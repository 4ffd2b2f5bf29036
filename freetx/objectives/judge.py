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
else whole on every rank (`freetx.objectives.held_model.HeldModel`, which a reward
model's reward shares). `freetx estimate` counts it whole within the peak. Its completions
are scored in batches of `batch_size`. It is TRL's batched form of a reward, so its call sees the
rank's completions of a step at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from freetx.data.chat import chat_prompt_ids
from freetx.data.tokenizers import leading_bos
from freetx.envs import last_reply
from freetx.errors import ConfigError
from freetx.models import DecodesIncrementally
from freetx.models.generation import Draws, Sampling, generate
from freetx.models.protocol import refuse_scorer
from freetx.objectives.held_model import HeldModel

MODES = ("verdict", "score")
_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")


class Judge(HeldModel):
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
        super().__init__(model, tokenizer)
        self.template, self.mode = template, mode
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.verdicts = list(verdicts)
        if mode == "verdict" and (len(self.verdicts) != 2 or len(set(self.verdicts)) != 2):
            raise ValueError(f"verdicts={self.verdicts!r}: give two verdicts, yes first")

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

    what = "the judge"

    def check(self, model: torch.nn.Module) -> None:
        """Refuse a judge that is no decoder LM with a KV cache."""
        refuse_scorer(model, f"the judge {self.path}")
        if not isinstance(model, DecodesIncrementally):
            raise ConfigError(
                f"the judge {self.path} is a {type(model).__name__}, which has no KV cache "
                "(DecodesIncrementally); a judge is a decoder LM."
            )

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
        if verdicts:
            return self.scored(inputs, self.batch_size, lambda part: self._verdicts(part, verdicts))
        return self.scored(inputs, self.batch_size, self._scores)

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
