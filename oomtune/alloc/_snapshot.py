"""``torch.cuda.memory_snapshot()``-shaped view of the simulator's segments.

After ``DeviceCachingAllocator::snapshot`` (c10/cuda/CUDACachingAllocator.cpp): one segment per
cudaMalloc'd segment, and for expandable segments one per contiguous mapped range; segments sorted
by address; a block is active when allocated (the simulator has no pending cross-stream frees).
Dict keys follow torch/csrc/cuda/memory_snapshot.cpp (frames are always empty).
"""

from __future__ import annotations

from typing import Any

from oomtune.alloc._blocks import Block

__all__ = ["build_snapshot"]


def build_snapshot(blocks: list[Block], device: int) -> list[dict[str, Any]]:
    """Segments (dicts, sizes in bytes) built from all mapped blocks, free and allocated."""
    result = []
    for head in blocks:
        if head.prev is not None and head.prev.mapped:
            continue
        seg: dict[str, Any] = {
            "device": device, "address": head.addr, "total_size": 0, "allocated_size": 0,
            "active_size": 0, "requested_size": 0, "stream": head.stream,
            "segment_type": "small" if head.small else "large", "segment_pool_id": (0, 0),
            "is_expandable": head.es is not None, "frames": [], "blocks": []}
        b: Block | None = head
        while b is not None and b.mapped:
            seg["blocks"].append({"address": b.addr, "size": b.size, "requested_size": b.requested,
                                  "state": "active_allocated" if b.allocated else "inactive",
                                  "frames": []})
            seg["total_size"] += b.size
            if b.allocated:
                seg["allocated_size"] += b.size
                seg["active_size"] += b.size
                seg["requested_size"] += b.requested
            b = b.next
        result.append(seg)
    result.sort(key=lambda s: s["address"])
    return result
