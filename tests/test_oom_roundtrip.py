"""The virtual GPU's OOM message parses back, through the shared classifier, to the simulator's own
numbers (to the 2-decimal precision of c10's format_size), and is classified by its cause."""

from __future__ import annotations

import pytest
import torch

from oomtune.alloc.sim import CachingAllocatorSim, SimulatedOutOfMemoryError
from oomtune.classify import classify_exception, parse_oom_message
from oomtune.outcome import Outcome
from oomtune.units import GiB, MiB


def _close(parsed: int, exact: int) -> bool:
    # format_size prints 2 decimals of the largest unit that keeps the number small (MiB or GiB):
    # the parsed value is within half a unit of the last printed digit.
    return abs(parsed - exact) <= 0.005 * GiB


def test_plain_oom_message_round_trips():
    sim = CachingAllocatorSim(None, total_memory_bytes=1 * GiB)
    sim.malloc(600 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as info:
        sim.malloc(600 * MiB)
    err = info.value
    assert isinstance(err, SimulatedOutOfMemoryError)
    oom = parse_oom_message(str(err))
    assert oom is not None
    # Hand-calculated: 600 MiB requests round to 600 MiB (multiple of 2 MiB), one 600 MiB segment
    # is reserved and allocated; the device (1 GiB, no context) has 424 MiB free.
    assert oom.requested_bytes == 600 * MiB == err.requested_bytes
    assert oom.total_bytes == 1 * GiB and oom.free_bytes == 424 * MiB
    assert oom.allocated_bytes == 600 * MiB and oom.reserved_bytes == 600 * MiB
    assert oom.allowed_bytes is None
    assert classify_exception(err).outcome is Outcome.OOM


def test_fraction_cap_message_round_trips_and_is_a_cap():
    sim = CachingAllocatorSim(None, total_memory_bytes=4 * GiB, memory_fraction=0.25)
    with pytest.raises(torch.OutOfMemoryError) as info:
        sim.malloc(1536 * MiB)  # 1.5 GiB > the 1 GiB allowed
    oom = parse_oom_message(str(info.value))
    assert oom.allowed_bytes == 1 * GiB and oom.total_bytes == 4 * GiB
    assert _close(oom.requested_bytes, 1536 * MiB)
    assert classify_exception(info.value).outcome is Outcome.FRACTION_CAP


def test_field_case_c8_default_settings_is_fragmentation():
    # C8 (pytorch#35901): 23.65 GiB; a 10.84 GiB block is freed, ~30 small tensors split it, then
    # 10.84 GiB again fails although free + cached would hold it: a fragmentation OOM.
    # Memory outside the allocator is set so that 10.26 GiB are free after the 11102 MiB segment,
    # as in the report.
    big, total = int(10.84 * GiB), int(23.65 * GiB)
    sim = CachingAllocatorSim(None, total_memory_bytes=total,
                              non_allocator_bytes=total - 11102 * MiB - int(10.26 * GiB))
    sim.free(sim.malloc(big))
    for i in range(30):
        sim.malloc((16 + (i % 3)) * 1_000_000)
    with pytest.raises(torch.OutOfMemoryError) as info:
        sim.malloc(big)
    oom = parse_oom_message(str(info.value))
    assert _close(oom.reserved_bytes, sim.reserved_bytes) and _close(oom.allocated_bytes, sim.allocated_bytes)
    # cached but unallocated (10.37 GiB by hand: 11102 MiB - 30 small blocks) < the 10.84 GiB request,
    # yet free + cached >= request: the request failed only because the cached block is split.
    assert oom.free_bytes + oom.cached_free_bytes >= oom.requested_bytes
    assert classify_exception(info.value).outcome is Outcome.OOM_FRAGMENTATION
