"""The generation engine: continuous batching over a paged KV cache
(`freetx.models.paged_cache`), one prefill per prompt group, for models that decode in
blocks (`DecodesInBlocks`: the native decoder, its MoE and MLA layers included).
`freetx.models.generation.generate` calls it; its rows and their keyed draws are
`generate`'s.

    engine = EngineConfig(slots=64, kv_blocks=512)          # a config's `engine:` keys
    out = run_engine(model, prompts, 256, sampling, end_ids, draws, engine)

The story of one call:

1. The requests are the rows, in order; consecutive rows with the same prompt form a
   group (GRPO's `num_generations` completions of one prompt, `generate`'s samples).
2. `slots` rows decode at once. A free slot takes the next request at once: its group's
   prompt is read once (one prefill per group, its blocks kept while members wait), the
   row holds the prompt's full blocks (shared) and its own copy of the last, partly
   filled one, and its first token is drawn from the prefill's logits.
3. Each step runs one forward over the occupied slots, one token each; a row ends at an
   end token or at `max_new_tokens`, its blocks go back to the pool and its slot to the
   next request. The call returns when every request is done.
4. A row that needs a new block when none is free takes one from the row admitted last,
   which starts again later (its tokens are the same: its draws are its own).

Requests may also come while others decode (`open`, then `add` and `step` in turn: a
multi-turn rollout's next turns, admitted as their environments answer): each `step`
admits what waits and decodes one token, and says which requests ended.

A row's tokens depend on its prompt and its draws alone (`Draws`: row r's uniform at
step t), not on its slot, its neighbours or the slot count: its attention reads its own
blocks only.

The one-token step runs eagerly, or compiled (`compile`; None: on CUDA, outside FSDP2):
on CUDA with static shapes (every slot, the table width rounded up to a power of two) and
CUDA graphs (`torch.compile(mode="reduce-overhead")`), on the CPU with dynamic sizes (the
occupied slots, the widest row). Prefills run eagerly.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from freetx.errors import ConfigError
from freetx.fields import at_least
from freetx.models.paged_cache import SCRATCH, BlockPool, PagedRows
from freetx.models.protocol import DecodesInBlocks
from freetx.models.sampling import Draws, Generated, Sampling, entropy_of


@dataclass
class EngineConfig:
    """How the generation engine decodes (`freetx.models.engine`): a config's `engine:`."""

    paged: bool = True  # false: the static batch (every row at once, a dense cache)
    slots: Optional[int] = at_least(1, default=None)  # rows decoded at once; None: every row
    block_size: int = at_least(1, default=16)  # tokens per block of the KV cache
    # blocks in the pool; None: enough for every slot's longest row (no row ever waits)
    kv_blocks: Optional[int] = at_least(1, default=None)
    compile: Optional[bool] = None  # the one-token step compiled; None: on CUDA

    def serves(self, model) -> bool:
        """Whether this engine decodes `model` (else the static batch does)."""
        return (
            self.paged
            and isinstance(model, DecodesInBlocks)
            and model.block_cache_layers() is not None
        )


@dataclass
class EngineStats:
    """What one call did: forwards run, prefills (one per group read), rows started again
    for lack of blocks, the most blocks held at once and the bytes per cached token."""

    decode_steps: int = 0
    prefills: int = 0
    prefill_tokens: int = 0
    restarted: int = 0
    most_blocks: int = 0
    block_bytes: int = 0  # of one block over every layer

    @property
    def most_kv_bytes(self) -> int:
        return self.most_blocks * self.block_bytes


@dataclass(eq=False)
class _Group:
    """Rows with one prompt: its blocks and last logits, kept while members wait."""

    prompt: list[int]
    waiting: int = 0
    blocks: list[int] | None = None
    logits: torch.Tensor | None = None


@dataclass(eq=False)
class _Row:
    """A slot's request: its blocks, the tokens it holds, those it generated, its last."""

    request: int
    order: int  # when it was admitted
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    step: int = 0
    last: int = 0


def check_context(tokens: int, context: int) -> None:
    """Refuse rows of up to `tokens` tokens (the longest prompt and the new tokens) past a
    model's `context` (max_seq_len)."""
    if tokens > context:
        raise ConfigError(
            f"generating up to {tokens} tokens (the longest prompt and max_new_tokens) "
            f"goes past the model's max_seq_len={context}, the positions it has RoPE tables "
            "for. Lower max_new_tokens or shorten the prompts."
        )


def check_pool(engine: EngineConfig, max_new_tokens: int, path: str = "engine.") -> None:
    """Refuse a pool too small for one row of a prompt's token and `max_new_tokens`
    (`path`: where the config keeps the engine's keys), before any work: what the prompts'
    lengths are is not known yet (`check_request` says it again with them)."""
    blocks, size, row = engine.kv_blocks, engine.block_size, max_new_tokens + 1
    if blocks is not None and blocks * size < row:
        raise ConfigError(
            f"{path}kv_blocks={blocks} blocks of {size} tokens hold {blocks * size} tokens, "
            f"and one row holds its prompt and up to {max_new_tokens} new tokens. Raise "
            f"{path}kv_blocks to {math.ceil(row / size)} or more (more than the prompts' "
            "length too), or null: enough for every slot."
        )


def device_of(model: torch.nn.Module) -> torch.device:
    """Where a model's parameters are (the CPU for a model without any)."""
    return next(iter(model.parameters()), torch.zeros(0)).device


def check_request(longest: int, max_new_tokens: int, context: int, config: EngineConfig):
    """The refusals before any work: rows past the model's context, a pool too small for
    one row. Returns the blocks in the pool (scratch aside) and the table width."""
    check_context(longest + max_new_tokens, context)
    bs = config.block_size
    width = math.ceil((longest + max_new_tokens) / bs)
    if config.kv_blocks is not None and config.kv_blocks < width:
        raise ConfigError(
            f"engine.kv_blocks={config.kv_blocks} blocks of {bs} tokens hold "
            f"{config.kv_blocks * bs} tokens, and one row may hold {longest + max_new_tokens} "
            f"(a prompt of {longest} and {max_new_tokens} new tokens): {width} blocks. Raise "
            f"engine.kv_blocks to {width} or more (or null: enough for every slot)."
        )
    return width


class Engine:
    """One `generate` call over a paged cache (the module's docstring)."""

    def __init__(
        self,
        model,
        config: EngineConfig,
        sampling: Sampling,
        end_ids: Sequence[int],
        max_new_tokens: int,
    ) -> None:
        self.model, self.config, self.sampling = model, config, sampling
        self.ends, self.max_new = set(end_ids), max_new_tokens
        self.device = device_of(model)
        self.stats = EngineStats()
        use = config.compile if config.compile is not None else _compiles_by_default(model)
        # CUDA: static shapes (every slot, widths bucketed) for CUDA graphs; the CPU: shapes
        # as they come, compiled once with dynamic sizes
        self.static = use and self.device.type == "cuda"
        self.step_forward = _compiled_forward(model, self.static) if use else model

    def run(self, prompts: Sequence[Sequence[int]], uniforms: torch.Tensor) -> Generated:
        """Every row's tokens [R, steps], lengths, ended and entropies (`Generated`'s)."""
        rows = len(prompts)
        self.open(rows, max(map(len, prompts)))
        for prompt, row in zip(prompts, uniforms):
            self.add(prompt, row)
        while self.busy:
            self.step()
        steps = max(self.lengths)
        return Generated(
            self.tokens[:rows, :steps],
            torch.tensor(self.lengths, device=self.device),
            torch.tensor(self.ended, device=self.device),
            self.entropy[:rows, :steps],
        )

    # -- requests as they come (`Decoder`: a multi-turn rollout's) ---------------------
    joins_running = True  # a request added between steps is admitted at the next

    def open(self, rows: int, longest: int) -> None:
        """Ready for requests: up to `rows` of them at once (`slots` of them decoding; None:
        all), prompts of up to `longest` tokens (the pool, unless `kv_blocks` says, enough
        for every slot's longest row)."""
        cfg = self.config
        slots = min(cfg.slots or rows, rows)
        width = check_request(longest, self.max_new, self.model.context_length(), cfg)
        self.longest = longest
        blocks = cfg.kv_blocks or slots * width
        self.pool = BlockPool(self.model.block_cache_layers(), blocks + 1, cfg.block_size)
        self.uniforms = torch.zeros(0, self.max_new, device=self.device)
        self.tokens = torch.zeros(0, self.max_new, dtype=torch.long, device=self.device)
        self.entropy = torch.zeros(0, self.max_new, device=self.device)
        self.lengths: list[int] = []
        self.ended: list[bool] = []
        self.groups: list[_Group] = []
        self.group_of: list[_Group] = []
        self.queue: deque[int] = deque()
        self.slots: list[_Row | None] = [None] * slots
        self.admitted = 0
        self.finished: list[int] = []

    def add(self, prompt: Sequence[int], uniforms: torch.Tensor) -> int:
        """Request a reply to `prompt` drawn with `uniforms` [max_new_tokens]; its number.
        A request with the prompt of the one added before it, while that one's group
        waits, joins its group (one prefill)."""
        if len(prompt) > self.longest:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens; the engine opened for {self.longest}"
            )
        request = len(self.lengths)
        if request == len(self.tokens):  # room for twice as many requests
            more = max(request, 8)
            self.uniforms, self.tokens, self.entropy = (
                torch.cat([t, t.new_zeros(more, self.max_new)])
                for t in (self.uniforms, self.tokens, self.entropy)
            )
        self.uniforms[request] = uniforms.to(self.device)
        self.lengths.append(0)
        self.ended.append(False)
        last = self.groups[-1] if self.groups else None
        if last is None or last.waiting == 0 or last.prompt != list(prompt):
            last = _Group(list(prompt))
            self.groups.append(last)
        last.waiting += 1
        self.group_of.append(last)
        self.queue.append(request)
        return request

    @property
    def busy(self) -> bool:
        """Whether a request waits or decodes."""
        return bool(self.queue) or any(self.slots)

    @torch.no_grad()
    def step(self) -> list[int]:
        """Free slots take waiting requests, then one token for every occupied slot; the
        requests that ended, in the order they did."""
        self.finished = []
        self.admit()
        assert any(self.slots) or not self.queue, "the engine stopped with rows waiting"
        self.decode()
        self.stats.most_blocks = self.pool.most_held
        self.stats.block_bytes = self.pool.bytes_per_token() * self.pool.block_size
        return self.finished

    def reply(self, request: int) -> tuple[list[int], bool, float]:
        """An ended request's reply ids (its end token included), whether it reached an end
        token, and its tokens' summed entropy."""
        n = self.lengths[request]
        entropy = float(self.entropy[request, :n].sum())
        return self.tokens[request, :n].tolist(), self.ended[request], entropy

    # -- admission ------------------------------------------------------------------
    def admit(self) -> None:
        """Free slots take the next requests, while the pool has their blocks; their first
        tokens are drawn together, and the slots of rows that end with it taken again."""
        while self.queue and None in self.slots:
            admitted = []
            while self.queue and None in self.slots:
                request = self.queue[0]
                group = self.group_of[request]
                if group.blocks is None and not self.prefill(group):
                    break
                logits = group.logits
                blocks = self.member_blocks(group)
                if blocks is None:
                    break
                self.queue.popleft()
                row = _Row(request, self.admitted, blocks, len(group.prompt))
                self.admitted += 1
                self.slots[self.slots.index(None)] = row
                admitted.append((row, logits))
                group.waiting -= 1
                if group.waiting == 0 and group.blocks is not None:  # the group's hold ends
                    self.pool.release(group.blocks)
                    group.blocks, group.logits = None, None
            if not admitted or not self.first_tokens(admitted):
                return

    def member_blocks(self, group: _Group) -> list[int] | None:
        """A new member's blocks: the group's full prompt blocks (shared) and its own copy
        of the partly filled last one; the group's blocks themselves for its last member,
        or when the pool has no block for a copy and no row runs (the group reads its
        prompt again for the next). None: wait for a row to end."""
        assert group.blocks is not None
        bs, blocks = self.pool.block_size, group.blocks
        shared = blocks[: len(group.prompt) // bs]
        taken: list[int] | None = []
        if group.waiting > 1 and len(shared) < len(blocks):
            taken = self.pool.take(1)
            if taken is None and any(self.slots):
                return None
        if group.waiting == 1 or taken is None:  # the group's blocks pass to the member
            group.blocks, group.logits = None, None
            return blocks
        if taken:
            self.pool.copy(blocks[-1], taken[0])
        self.pool.hold(shared)
        return shared + taken

    def prefill(self, group: _Group) -> bool:
        """The group's prompt read once into blocks of its own; False when the pool lacks
        them now (a slot frees some)."""
        bs, length = self.pool.block_size, len(group.prompt)
        blocks = self.pool.take(math.ceil(length / bs))
        if blocks is None:
            if not any(self.slots):  # nothing holds blocks but other groups' prompts
                self.drop_waiting_prompts(group)
                blocks = self.pool.take(math.ceil(length / bs))
            if blocks is None:
                return False
        ids = torch.tensor([group.prompt], device=self.device)
        rows = PagedRows(
            self.pool,
            torch.tensor([blocks], device=self.device),
            torch.zeros(1, dtype=torch.long, device=self.device),
        )
        group.logits = self.model(ids, cache=rows)[0, -1:]
        group.blocks = blocks
        self.stats.prefills += 1
        self.stats.prefill_tokens += length
        return True

    def drop_waiting_prompts(self, keep: _Group | None) -> None:
        """Release the blocks other groups keep for their waiting members (read again when
        their turn comes)."""
        for group in self.groups:
            if group is not keep and group.blocks is not None:
                self.pool.release(group.blocks)
                group.blocks, group.logits = None, None

    def first_tokens(self, admitted: list[tuple[_Row, torch.Tensor]]) -> bool:
        """The admitted rows' first tokens, each drawn from its group's prefill logits [1,
        vocab] with its own draw; True when one ended with it (its slot is free again)."""
        rows = [row for row, _ in admitted]
        logits = torch.cat([logits for _, logits in admitted])
        return self.take_tokens(rows, logits)

    # -- decoding -------------------------------------------------------------------
    def decode(self) -> None:
        """One token for every occupied slot (a forward over them), then the rows ended."""
        self.grow()
        live = [row for row in self.slots if row is not None]
        if not live:  # every row gave its blocks to an older one, which then ended
            return
        width, idle = max(len(row.blocks) for row in live), 0
        if self.static:  # every slot (idle ones on scratch), widths in powers of two
            width, idle = 1 << (width - 1).bit_length(), len(self.slots) - len(live)
        tables = torch.tensor(
            [row.blocks + [SCRATCH] * (width - len(row.blocks)) for row in live]
            + [[SCRATCH] * width] * idle,
            device=self.device,
        )
        cached = torch.tensor([row.length for row in live] + [0] * idle, device=self.device)
        last = torch.tensor([[row.last] for row in live] + [[0]] * idle, device=self.device)
        rows = PagedRows(self.pool, tables, cached)
        logits = self.step_forward(last, cache=rows)[: len(live), -1]
        self.stats.decode_steps += 1
        for row in live:
            row.length += 1  # the token it read is cached
        self.take_tokens(live, logits)

    def take_tokens(self, rows: list[_Row], logits: torch.Tensor) -> bool:
        """Each row's next token from its logits [rows, vocab] and its own draw at its
        step; True when some row ended with it (its blocks and slot freed)."""
        requests = torch.tensor([row.request for row in rows], device=self.device)
        steps = torch.tensor([row.step for row in rows], device=self.device)
        new = self.sampling.next_tokens(logits, self.uniforms[requests, steps])
        self.tokens[requests, steps] = new
        self.entropy[requests, steps] = entropy_of(logits, self.sampling)
        ended = False
        for row, token in zip(rows, new.tolist()):
            if self.record(row, token):
                self.slots[self.slots.index(row)] = None
                ended = True
        return ended

    def record(self, row: _Row, token: int) -> bool:
        """The row's next token taken (already in `tokens`); True when the row ends with it
        (its blocks freed)."""
        row.step, row.last = row.step + 1, token
        ended = token in self.ends
        if not ended and row.step < self.max_new:
            return False
        self.lengths[row.request], self.ended[row.request] = row.step, ended
        self.pool.release(row.blocks)
        self.finished.append(row.request)
        return True

    def grow(self) -> None:
        """A block for every row whose blocks are full, taken from the rows admitted last
        when the pool has none free (they start again later)."""
        bs = self.pool.block_size
        for row in sorted(filter(None, self.slots), key=lambda r: r.order):
            if row.length < len(row.blocks) * bs or row not in self.slots:
                continue
            while (taken := self.pool.take(1)) is None:
                if any(group.blocks for group in self.groups):  # prompts kept for waiting rows
                    self.drop_waiting_prompts(None)
                    continue
                self.restart(max(filter(None, self.slots), key=lambda r: r.order))
                if row not in self.slots:
                    break
            if taken is not None:
                row.blocks += taken

    def restart(self, row: _Row) -> None:
        """Row `row` gives its blocks back and waits at the head of the queue; its tokens
        are drawn again, the same."""
        self.pool.release(row.blocks)
        self.slots[self.slots.index(row)] = None
        self.tokens[row.request].zero_()
        self.entropy[row.request].zero_()
        self.queue.appendleft(row.request)
        self.group_of[row.request].waiting += 1
        self.stats.restarted += 1


def _compiles_by_default(model) -> bool:
    """`compile` None: on CUDA, for a model outside FSDP2 (a training run's gathered model
    decodes eagerly: its hooks stay out of a compiled graph)."""
    from torch.distributed.fsdp import FSDPModule

    return device_of(model).type == "cuda" and not isinstance(model, FSDPModule)


def _compiled_forward(model, static: bool):
    """The model's one-token step compiled: static shapes with CUDA graphs
    (`reduce-overhead`), or dynamic sizes (the CPU)."""
    if static:
        return torch.compile(model, mode="reduce-overhead", dynamic=False)
    return torch.compile(model, dynamic=True)


def run_engine(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling,
    end_ids: Sequence[int],
    draws: Draws,
    config: EngineConfig,
) -> tuple[Generated, EngineStats]:
    """`generate` over the engine: (`Generated`, the call's `EngineStats`)."""
    engine = Engine(model, config, sampling, end_ids, max_new_tokens)
    return engine.run(prompts, draws.uniforms), engine.stats
