"""The paged (block) KV cache of the generation engine (`freetx.models.engine`): every
layer's cached entries per token (keys and values; multi-head latent attention's
compressed latent and rope key) in one pool of fixed-size blocks of `block_size` tokens,
and for each row a list of blocks (its block table). Memory grows with the tokens the
rows hold, a block at a time, not with rows x the longest possible row; rows that share
a prompt share its full blocks (a count of holders per block), each with its own copy of
a partly filled last block (copy on write: `copy`).

    pool = BlockPool(layers=4, blocks=64, block_size=16)
    blocks = pool.take(3)                       # None when fewer are free
    rows = PagedRows(pool, tables, cached)      # one forward's rows: `model(ids, cache=rows)`
    pool.release(blocks)

Block 0 is scratch: a table's unused entries point at it, and an idle row of a fixed
slot count writes there; no row reads it (`PagedRows.mask`).

A forward's rows (`PagedRows`, the `cache=` of `DecodesInBlocks.forward`) store each
new token's entries at its row's next position (`PagedLayer.store`), read every block of
the row back in order (`read`: [rows, keys, ...], keys = table width x block_size), and
say which of those keys each query sees (`mask`: causal at the row's own length, within
a sliding window where the layer has one; keys past the row's length never).
"""

from __future__ import annotations

import torch

from freetx.models.attention import AttentionMask, AttentionSpec, attend

SCRATCH = 0  # the block no row reads


class BlockPool:
    """`blocks` blocks of `block_size` tokens for `layers` layers; each layer's entries
    are made at their first store, in the shape and dtype of the first tensors stored
    (this rank's heads under tensor parallelism; the compute dtype under autocast)."""

    def __init__(self, layers: int, blocks: int, block_size: int) -> None:
        self.block_size, self.blocks = block_size, blocks
        self.entries: list[list[torch.Tensor] | None] = [None] * layers
        self.holders = [0] * blocks
        self.free = list(range(blocks - 1, SCRATCH, -1))  # taken from the end: 1, 2, 3, ...
        self.most_held = 0

    @property
    def held(self) -> int:
        """Blocks held by some row now."""
        return self.blocks - 1 - len(self.free)

    def take(self, count: int) -> list[int] | None:
        """`count` free blocks, each held once; None when fewer are free."""
        if count > len(self.free):
            return None
        taken = [self.free.pop() for _ in range(count)]
        for block in taken:
            self.holders[block] = 1
        self.most_held = max(self.most_held, self.held)
        return taken

    def hold(self, blocks: list[int]) -> None:
        """Another row reads `blocks` (a shared prompt's)."""
        for block in blocks:
            self.holders[block] += 1

    def release(self, blocks: list[int]) -> None:
        """A row lets go of `blocks`: each is free once no row holds it."""
        for block in blocks:
            self.holders[block] -= 1
            if self.holders[block] == 0:
                self.free.append(block)

    def copy(self, source: int, target: int) -> None:
        """Every layer's entries of block `source` into block `target` (a row's own copy of
        a shared, partly filled block, before it writes there)."""
        bs = self.block_size
        for entries in self.entries:
            for pool in entries or ():
                pool[target * bs : (target + 1) * bs] = pool[source * bs : (source + 1) * bs]

    def layer_entries(self, layer: int, new: list[torch.Tensor]) -> list[torch.Tensor]:
        """Layer `layer`'s pools, [blocks x block_size, *entry shape] each, made like `new`
        (each [N, *entry shape]) when first stored."""
        entries = self.entries[layer]
        if entries is None:
            size = self.blocks * self.block_size
            entries = [x.new_zeros((size, *x.shape[1:])) for x in new]
            self.entries[layer] = entries
        return entries

    def bytes_per_token(self) -> int:
        """The bytes one cached token takes over every layer (0 before the first store)."""
        return sum(
            x[0].numel() * x.element_size() for entries in self.entries for x in entries or ()
        )


class PagedRows:
    """The rows of one forward over the pool (`cache=` of `DecodesInBlocks.forward`):
    `tables` [B, width] each row's blocks in order (scratch past its own), `cached` [B]
    the tokens each row holds before this forward. New tokens follow each row's cached
    ones, at positions cached .. cached + T - 1 (a row has no padding)."""

    def __init__(self, pool: BlockPool, tables: torch.Tensor, cached: torch.Tensor) -> None:
        self.pool, self.tables, self.cached = pool, tables, cached
        self.layers = [PagedLayer(self, i) for i in range(len(pool.entries))]
        self.new = 0
        self._masks: dict[int | None, torch.Tensor] = {}
        self._slots: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None

    def positions(self, new: int) -> torch.Tensor:
        """[B, new]: the positions of the next `new` tokens of each row (the forward asks
        first: `new` is then this forward's count, which `slots` and `mask` read)."""
        self.new = new
        return self.cached[:, None] + torch.arange(new, device=self.cached.device)

    def lengths(self) -> torch.Tensor:
        return self.cached

    def advance(self, ids: torch.Tensor) -> None:
        """The engine counts what each row holds; nothing to keep here."""

    def slots(self) -> torch.Tensor:
        """[B * T]: where in a layer's pool each new token's entries go, row after row
        (the same for every layer: computed once)."""
        if self._slots is None:
            bs = self.pool.block_size
            at = self.positions(self.new)
            block = self.tables.gather(1, at // bs)
            self._slots = (block * bs + at % bs).reshape(-1)
        return self._slots

    def keys(self) -> torch.Tensor:
        """[B, width x block_size]: the pool index of each row's every key, in order
        (computed once)."""
        if self._keys is None:
            bs = self.pool.block_size
            offsets = torch.arange(bs, device=self.tables.device)
            self._keys = (self.tables[:, :, None] * bs + offsets).flatten(1)
        return self._keys

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, T, keys]: True where a new token (query) sees a key: one at or before its
        own position, and within `window` keys of it where the layer has one."""
        if window not in self._masks:
            width = self.tables.shape[1] * self.pool.block_size
            key = torch.arange(width, device=self.tables.device)
            query = self.positions(self.new)  # [B, T]
            distance = query[:, :, None] - key[None, None, :]
            seen = distance >= 0
            if window is not None:
                seen = seen & (distance < window)
            self._masks[window] = seen[:, None]
        return self._masks[window]


class PagedLayer:
    """One layer's view of a forward's rows: `store` the new tokens' entries, `read` every
    cached one back, `attend` (both, then attention over them) for grouped-query layers."""

    def __init__(self, rows: PagedRows, layer: int) -> None:
        self.rows, self.layer = rows, layer

    def store(self, *new: torch.Tensor) -> None:
        """Each of `new` [B, T, *entry shape]: the new tokens' entries, kept in the pool."""
        flat = [x.reshape(-1, *x.shape[2:]) for x in new]
        slots = self.rows.slots()
        for pool, x in zip(self.rows.pool.layer_entries(self.layer, flat), flat):
            pool.index_copy_(0, slots, x.to(pool.dtype))

    def read(self) -> list[torch.Tensor]:
        """Each entry of every key of the rows, [B, keys, *entry shape] (keys past a row's
        length: whatever its blocks hold; `mask` hides them)."""
        keys = self.rows.keys()
        flat = keys.reshape(-1)  # index_select: 4x faster than indexing by a 2-D tensor
        return [
            pool.index_select(0, flat).view(*keys.shape, *pool.shape[1:])
            for pool in self.rows.pool.entries[self.layer] or ()
        ]

    def mask(self, spec: AttentionSpec) -> AttentionMask:
        """The rows' mask for a layer of `spec` (`attend`'s `mask=`): SDPA with the boolean
        mask, or the explicit kernel for soft-capping."""
        kernel = "explicit" if spec.softcap is not None else "sdpa_mask"
        return AttentionMask(kernel, self.rows.mask(spec.window), None)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec):
        """The new tokens' keys and values [B, kv_heads, T, D] stored; the queries [B, heads,
        T, D] attend over every key of their row (`mask`)."""
        self.store(k.transpose(1, 2), v.transpose(1, 2))
        keys, values = self.read()
        return attend(q, keys.transpose(1, 2), values.transpose(1, 2), spec, mask=self.mask(spec))
