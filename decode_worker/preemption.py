"""Preemption bookkeeping: the swap/recompute cost model and a swapped sequence's block record.

Tensor-free: these functions move block *ids* between the device `BlockPool` and the swap
space's pool and return the copies the `Swapper` must perform.

A swapped-out sequence, block by block (block_size 4, 10 computed tokens)::

    table before:   [ d3 (ref 2, shared) | d7 (ref 1) | d9 (ref 1, partial) ]
    SwappedBlocks:    device [ d3,   None, None ]      d3 stays on the device, referenced
                      host   [ None, h0,   h1   ]      d7 → h0, d9 → h1 copied out, d7/d9 freed
                      hashes [ H0,   H1,   None ]      full blocks only
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagedserve.kvstore.block_pool import BlockId, BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import BlockHash


@dataclass(slots=True)
class PreemptionCostModel:
    """A small cost model for choosing a victim's preemption mode (docs/scheduling.md).

        swap_s      = swap_overhead_s + 2 · blocks · bytes_per_block / swap_bytes_per_s
        recompute_s = tokens_to_recompute / prefill_tokens_per_s

    `2 ·`: the blocks are copied out now and back in later. `tokens_to_recompute` excludes the
    leading blocks shared with other sequences (they stay cached, so recompute hits them).
    With `measure=True` the engine feeds measured speeds in (`observe_*`, exponential moving
    average with weight `smoothing`); the defaults are the prior before anything is measured.
    """

    swap_bytes_per_s: float = 10e9  # one direction, pinned host memory over PCIe
    prefill_tokens_per_s: float = 8e3
    swap_overhead_s: float = 2e-4  # per victim: issuing the copies and waiting for them
    measure: bool = True
    smoothing: float = 0.2

    def __post_init__(self) -> None:
        for name in ("swap_bytes_per_s", "prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.swap_overhead_s < 0:
            raise ValueError(f"swap_overhead_s: must be >= 0, got {self.swap_overhead_s}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing: must be in (0, 1], got {self.smoothing}")

    def swap_seconds(self, num_blocks: int, bytes_per_block: int) -> float:
        return self.swap_overhead_s + 2 * num_blocks * bytes_per_block / self.swap_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def prefers_swap(self, num_blocks: int, bytes_per_block: int, num_tokens: int) -> bool:
        """Whether swapping `num_blocks` is estimated cheaper than recomputing `num_tokens`."""
        return self.swap_seconds(num_blocks, bytes_per_block) < self.recompute_seconds(num_tokens)

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        if self.measure and num_bytes > 0 and seconds > 0:
            self.swap_bytes_per_s = self._blend(self.swap_bytes_per_s, num_bytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if self.measure and num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, num_tokens / seconds)

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new


@dataclass(slots=True)
class SwappedBlocks:
    """Where each block of a swapped-out sequence is: `device[i]` or `host[i]`, never both.

    Owns one device-pool reference per non-None `device[i]` and one swap-pool block per
    non-None `host[i]`; exactly one of `swap_in` or `release` returns them.
    """

    device: list[BlockId | None]
    host: list[BlockId | None]
    hashes: list[BlockHash | None]
    num_tokens: int

    @property
    def num_host_blocks(self) -> int:
        return sum(h is not None for h in self.host)

    @property
    def num_device_blocks(self) -> int:
        return sum(d is not None for d in self.device)


def trim_table(table: BlockTable, num_tokens: int) -> None:
    """Drop the table's slots beyond `num_tokens` (never computed), freeing whole blocks."""
    keep = -(-num_tokens // table.block_size)
    extra = table.block_ids[keep:]
    table.pool.free(reversed(extra))
    del table.block_ids[keep:]
    table.num_tokens = min(table.num_tokens, num_tokens)
    table.num_cached_blocks = min(table.num_cached_blocks, keep)


def exclusive_positions(table: BlockTable) -> list[int]:
    """Positions of the table's blocks no other table or record references (ref count 1)."""
    pool = table.pool
    return [i for i, b in enumerate(table.block_ids) if pool.ref_count(b) == 1]


def swap_out(
    table: BlockTable, block_hashes: Seq[BlockHash], host_pool: BlockPool
) -> tuple[SwappedBlocks, list[tuple[BlockId, BlockId]]] | None:
    """Move the table's exclusive blocks to host blocks; shared blocks stay referenced.

    Returns the record and the `(device, host)` copies to perform, and leaves `table` empty; the
    freed device blocks may be reallocated at once, so the copies must finish before anything
    writes them (see `Swapper`). Returns None, changing nothing, when the swap space is short.
    """
    result = swap_out_group([table], [block_hashes], host_pool)
    if result is None:
        return None
    (record,), pairs = result
    return record, pairs


def group_exclusive_blocks(tables: Seq[BlockTable]) -> list[BlockId]:
    """Blocks of `tables` no one else references (the tables hold every reference), in order
    of first appearance: what swapping the tables out together moves, each block once."""
    counts = Counter(b for table in tables for b in table.block_ids)
    pool = tables[0].pool
    return [b for b in counts if pool.ref_count(b) == counts[b]]


def swap_out_group(
    tables: Seq[BlockTable], block_hashes: Seq[Seq[BlockHash]], host_pool: BlockPool
) -> tuple[list[SwappedBlocks], list[tuple[BlockId, BlockId]]] | None:
    """`swap_out` of several tables together (the samples of one request)::

        sample 0: [ p0 p1 | a2 ]      p0, p1: the prompt's blocks, shared by the samples only
        sample 1: [ p0 p1 | b2 ]      -> copied to the host ONCE: h0, h1 (ref 2 each), h2, h3
        records:  [ h0 h1 h2 ], [ h0 h1 h3 ]

    A block only these tables reference is copied to one host block, which every record that
    held it references (one host-pool reference each); a block someone else also holds stays
    on the device, referenced. Returns the records (one per table) and the copies; None,
    changing nothing, when the swap space is short.
    """
    moved = group_exclusive_blocks(tables)
    host_ids = host_pool.allocate(len(moved))
    if host_ids is None:
        return None
    host_of = dict(zip(moved, host_ids, strict=True))
    records = []
    for table, hashes in zip(tables, block_hashes, strict=True):
        num_full = min(len(hashes), table.num_tokens // table.block_size)
        record = SwappedBlocks(
            device=list[BlockId | None](table.block_ids),
            host=[None] * len(table.block_ids),
            hashes=[hashes[i] if i < num_full else None for i in range(len(table.block_ids))],
            num_tokens=table.num_tokens,
        )
        for position, device_id in enumerate(table.block_ids):
            host_id = host_of.get(device_id)
            if host_id is not None:
                record.device[position] = None
                record.host[position] = host_id
        records.append(record)
    # NOTE: a host block held by several records gets one more reference per extra record
    extra = [h for r in records for h in r.host if h is not None]
    for host_id in host_ids:
        extra.remove(host_id)
    host_pool.acquire(extra)
    for table in tables:
        # NOTE: tail first, like BlockTable.free: cached tails are evicted before cached heads.
        table.pool.free(reversed([b for b in table.block_ids if b in host_of]))
        table.block_ids = []
        table.num_tokens = 0
        table.num_cached_blocks = 0
    return records, list(host_of.items())


def swap_in_cost(record: SwappedBlocks, pool: BlockPool) -> int:
    """Device blocks `swap_in` takes from `pool`'s allocatable set. Changes nothing.

    A host block whose hash is still cached on the device is re-acquired, not copied; a CACHED
    one still leaves the allocatable set, so it counts too.
    """
    return swap_in_group_cost([record], pool)


def swap_in_group_cost(records: Seq[SwappedBlocks], pool: BlockPool) -> int:
    """`swap_in_cost` of `swap_in_group(records, ...)`: a host block shared by several records
    costs one device block."""
    cost = 0
    seen: set[BlockId] = set()
    for record in records:
        for position, host_id in enumerate(record.host):
            if host_id is None or host_id in seen:
                continue
            seen.add(host_id)
            hit = _device_hit(record, position, pool)
            cost += hit is None or pool.ref_count(hit) == 0
    return cost


def swap_in(
    record: SwappedBlocks, table: BlockTable, host_pool: BlockPool
) -> tuple[list[tuple[BlockId, BlockId]], int] | None:
    """Rebuild the empty `table` from `record`; return the `(host, device)` copies and hit count.

    Host blocks are freed here; the swapper reads them before any later swap-out can write
    them (one FIFO queue). Returns None, changing nothing, when the device pool is short. The
    table's blocks are offered to the prefix cache again by the next `cache_full_blocks`.
    """
    return swap_in_group([record], [table], host_pool)


def swap_in_group(
    records: Seq[SwappedBlocks], tables: Seq[BlockTable], host_pool: BlockPool
) -> tuple[list[tuple[BlockId, BlockId]], int] | None:
    """`swap_in` of several records together (the samples `swap_out_group` moved): a host
    block they share is copied into ONE device block, which every table references."""
    pool = tables[0].pool
    for table in tables:
        if table.block_ids or table.num_tokens:
            raise RuntimeError(f"swap_in: table already holds {table.num_tokens} tokens")
    if not pool.can_allocate(swap_in_group_cost(records, pool)):
        return None
    # NOTE: hits are taken before anything is allocated: an allocation may evict a CACHED
    # block that a later position would have hit (and then cost more than counted)
    hit_of = _hits(records, pool)
    uses = [h for record in records for h in record.host if h is not None]
    pool.acquire([hit_of[h] for h in uses if h in hit_of])
    misses = list(dict.fromkeys(h for h in uses if h not in hit_of))
    fresh = pool.allocate(len(misses))
    if fresh is None:
        raise RuntimeError("swap_in: pool ran short after its cost said it would not")
    copied = dict(zip(misses, fresh, strict=True))
    # NOTE: a fresh block comes with one reference; each further table takes one more
    extra = [copied[h] for h in uses if h in copied]
    for device_id in fresh:
        extra.remove(device_id)
    pool.acquire(extra)
    placed = hit_of | copied  # host block -> its device block
    for record, table in zip(records, tables, strict=True):
        table.block_ids = [
            d if d is not None else placed[_some(h)]
            for d, h in zip(record.device, record.host, strict=True)
        ]
        host_pool.free([h for h in record.host if h is not None])
        table.num_tokens = record.num_tokens
        table.num_cached_blocks = 0
    return list(copied.items()), len(hit_of)


def _hits(records: Seq[SwappedBlocks], pool: BlockPool) -> dict[BlockId, BlockId]:
    """Host block -> the device block that still holds its hash (no copy needed)."""
    hit_of: dict[BlockId, BlockId] = {}
    for record in records:
        for position, host_id in enumerate(record.host):
            if host_id is not None and host_id not in hit_of:
                hit = _device_hit(record, position, pool)
                if hit is not None:
                    hit_of[host_id] = hit
    return hit_of


def release(record: SwappedBlocks, pool: BlockPool, host_pool: BlockPool) -> None:
    """Drop everything `record` holds (abort, or conversion to recompute)."""
    pool.free(reversed([d for d in record.device if d is not None]))
    host_pool.free([h for h in record.host if h is not None])
    record.device = [None] * len(record.device)
    record.host = [None] * len(record.host)


def _some(block_id: BlockId | None) -> BlockId:
    if block_id is None:
        raise RuntimeError("swapped block is neither on the device nor on the host")
    return block_id


def _device_hit(record: SwappedBlocks, position: int, pool: BlockPool) -> BlockId | None:
    block_hash = record.hashes[position]
    return pool.lookup(block_hash) if block_hash is not None else None
