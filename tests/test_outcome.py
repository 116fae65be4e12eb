"""Outcome groups: memory outcomes, and faults (told to Optuna as FAIL) vs results (COMPLETE)."""

from oomtune.outcome import Outcome


def test_faults_are_error_crash_and_bad_record_only():
    # a malformed result record says nothing about the configuration either: FAIL, like an error
    assert {o for o in Outcome if o.is_fault} == {Outcome.ERROR, Outcome.CRASH, Outcome.BAD_RECORD}


def test_memory_outcomes_are_the_device_memory_ones():
    assert {o for o in Outcome if o.is_memory} == {
        Outcome.OOM, Outcome.OOM_FRAGMENTATION, Outcome.FRACTION_CAP, Outcome.OOM_OUTSIDE_ALLOCATOR}
    # host memory, element-count limits and timeouts are infeasible but not device memory
    assert not Outcome.HOST_OOM.is_memory and not Outcome.LIMIT.is_memory and not Outcome.TIMEOUT.is_memory
