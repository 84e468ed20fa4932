"""The prefix cache's second tier: KV pages evicted from the device pool, kept in host memory.

transformers' paged cache (5.24) keeps every complete page that no request holds any more as a *cached* page, keyed
by a hash chained over the page's tokens and all the pages before it, and reuses it when a later prompt starts with
the same tokens. When the pool runs short it evicts all of them at once, and their KV is gone. This tier catches
them on the way out: each evicted page's bytes (one block: keys and values of every layer) are copied to host memory
under the same hash, least recently used dropped first past ``capacity_bytes``. When a prompt's leading pages match
on the device and the match stops, the tier continues the hash chain: each further page found in host memory is
copied back into a free device block, registered under its hash and handed to the request as a matched page, so the
request computes only what neither tier holds.

Only models whose layers all use full attention (one page allocator) are supported; others run without this tier.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

log = logging.getLogger("ktorch.serve")

RESTORE_MIN_FREE = 0.25  # restore host pages only while this fraction of the device pool stays free: live requests first


class HostPrefixTier:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = int(capacity_bytes)
        self.pages: OrderedDict[int, torch.Tensor] = OrderedDict()  # chained page hash -> block bytes (host)
        self.bytes = 0
        self.spilled = 0  # pages copied in
        self.restored = 0  # pages copied back to the device
        self.dropped = 0  # pages dropped past the capacity
        self.installed = False

    def install(self, cache) -> bool:
        """Hooks the tier into a transformers ``PagedAttentionCache``; False (and no change) when unsupported."""
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash
        from transformers.generation.continuous_batching.cache_allocators.full_attention import (
            FullAttentionCacheAllocator,
        )

        allocators = list(cache.cache_allocators.values())
        if len(allocators) != 1 or not isinstance(allocators[0], FullAttentionCacheAllocator) or \
                not cache.use_prefix_sharing:
            log.warning("ktorch serve: the host-memory prefix tier needs one full-attention page allocator and prefix "
                        "sharing; running without it")
            return False
        alloc = allocators[0]
        pin = alloc._copy_view.device.type == "cuda"
        evict_all = cache.evict_cached_blocks
        match_on_device = alloc.match_prefix_blocks

        def evict_cached_blocks() -> bool:
            for block_id in list(alloc.ledger.cached_blocks):
                self._put(alloc.ledger.block_to_hash[block_id], alloc._copy_view[block_id], pin)
            return evict_all()

        def match_prefix_blocks(prompt_ids: list[int]) -> list[int]:
            matched = match_on_device(prompt_ids)
            page = alloc.tokens_per_page
            full_pages = (len(prompt_ids) - 1) // page  # as transformers: at least one token is left to compute
            if not self.pages or len(matched) >= full_pages:
                return matched
            h = None
            for b in range(len(matched)):
                h = compute_block_hash(h, prompt_ids[b * page:(b + 1) * page])
            for b in range(len(matched), full_pages):
                h = compute_block_hash(h, prompt_ids[b * page:(b + 1) * page])
                data = self.pages.get(h)
                if data is None or cache.compute_free_capacity() < RESTORE_MIN_FREE:
                    break
                if alloc.pool.count_free_blocks(alloc.index) == 0:
                    if alloc.pool.num_free_sectors == 0:
                        break
                    alloc.pool.allocate_sector(alloc.index)
                block = alloc.pool.get_free_blocks(alloc.index, 1)[0]
                alloc._copy_view[block].copy_(data)  # synchronous: the forward that reads it comes after
                if alloc.ledger.register_new_hash(block, h) is not None:  # cannot happen: the device match stopped
                    alloc.pool.free_blocks(alloc.index, [block])
                    break
                alloc.ledger.cached_blocks[block] = None  # unreferenced and hashed: acquire_prefix_blocks takes it
                self.pages.move_to_end(h)
                self.restored += 1
                matched.append(block)
            return matched

        cache.evict_cached_blocks = evict_cached_blocks
        alloc.match_prefix_blocks = match_prefix_blocks
        self.installed = True
        return True

    def _put(self, page_hash: int, data: torch.Tensor, pin: bool) -> None:
        if self.capacity_bytes < data.nbytes:
            return
        if page_hash in self.pages:
            self.pages.move_to_end(page_hash)
            return
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=pin)
        host.copy_(data)
        self.pages[page_hash] = host
        self.bytes += host.nbytes
        self.spilled += 1
        while self.bytes > self.capacity_bytes:
            _, old = self.pages.popitem(last=False)
            self.bytes -= old.nbytes
            self.dropped += 1

    def stats(self) -> dict:
        return {"host_prefix_pages": len(self.pages), "host_prefix_bytes": self.bytes,
                "host_prefix_spilled": self.spilled, "host_prefix_restored": self.restored,
                "host_prefix_dropped": self.dropped}
