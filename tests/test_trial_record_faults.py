"""A malformed result record is that trial's failure (outcome ``bad_record``, the line quoted), never
the search's: every field a ``target=cmd`` trial's channel lines and a trial process's ``result.json``
are read for, with a wrong type, NaN/inf, a negative, a missing or a huge value.

The well-formed lines are what :func:`oomtune.report` and :func:`oomtune.capture_hook` write
(oomtune/script_api.py: ``report`` and ``_memory_now``; the keys of ``torch.cuda.memory_stats()``).
"""

from __future__ import annotations

import json
import pytest

from oomtune.outcome import Outcome
from oomtune.targets.cmd import bad_channel_line, result_from_channel
from oomtune.trial.record import TrialResult, TrialSpec

MIB = 1 << 20
STATS = {"reserved_bytes.all.peak": 8 * MIB, "allocated_bytes.all.peak": 6 * MIB,
         "active_bytes.all.peak": 6 * MIB, "num_alloc_retries": 0, "num_ooms": 0}


def _spec() -> TrialSpec:
    return TrialSpec(workload={"name": "mlp", "target": {"name": "cmd", "command": "x", "cwd": None}},
                     batch_size=4, timeout_s=60.0)


def _report(**changes):
    """A report line as oomtune.report() writes it (script_api.report), with ``changes``."""
    line = {"event": "report", "time": 1700000000.0, "rank": None, "world_size": 1, "samples": 40,
            "seconds": 2.0, "steps": 10, "data_wait_seconds": 0.5, "extra": {},
            "memory": {"source": "simulated", "stats": dict(STATS)}}
    line.update(changes)
    return {k: v for k, v in line.items() if v is not _MISSING}


_MISSING = object()


def test_a_well_formed_report_is_read_as_before():
    res = result_from_channel(_spec(), [_report()], returncode=0, stderr="", timed_out=False)
    assert res.outcome is Outcome.OK
    assert res.throughput.samples_per_s == 20.0            # 40 samples / 2.0 s
    assert res.throughput.step_time_s == 0.2               # 2.0 s / 10 steps
    assert res.throughput.data_wait_fraction == 0.25       # 0.5 s / 2.0 s
    assert res.memory.peak_reserved_bytes == 8 * MIB


def test_the_field_report_samples_lots_is_a_bad_record_quoting_the_line():
    line = _report(samples="lots")
    res = result_from_channel(_spec(), [line], returncode=0, stderr="", timed_out=False)
    assert res.outcome is Outcome.BAD_RECORD and res.outcome.is_fault
    assert res.message.startswith("malformed result record (record 1 in OOMTUNE_RESULT_FILE): "
                                  "samples='lots' is not a finite number >= 0: ")
    assert '"samples": "lots"' in res.message                   # the offending line, quoted
    assert res.throughput.samples_per_s is None and "oomtune.report(" in res.advice
    TrialResult.from_dict(json.loads(res.to_json()))            # and the record itself can be stored


@pytest.mark.parametrize("changes, named", [
    ({"samples": float("nan")}, "samples=nan"),                 # NaN (json.dumps writes NaN)
    ({"samples": -5}, "samples=-5"),                            # negative
    ({"samples": True}, "samples=True"),                        # a bool is not a count
    ({"samples": 10 ** 400}, "samples=1000"),                   # too large for a float
    ({"seconds": 0}, "seconds=0 is not a finite number > 0"),   # zero time
    ({"seconds": float("inf")}, "seconds=inf"),
    ({"seconds": _MISSING}, "seconds=None is not a finite number > 0"),   # missing
    ({"steps": 2.5}, "steps=2.5 is not an integer >= 0"),
    ({"data_wait_seconds": "0.1"}, "data_wait_seconds='0.1'"),
    ({"rank": [0]}, "rank=[0] is not an integer >= 0"),         # unhashable: grouped by rank
    ({"rank": -1}, "rank=-1"),
    ({"world_size": 0}, "world_size=0 is not an integer > 0"),
    ({"time": "noon"}, "time='noon'"),
    ({"extra": [1, 2]}, "extra=[1, 2] is not a mapping"),
    ({"memory": "8MiB"}, "memory='8MiB' is not a mapping"),
    ({"memory": {"source": "gpu", "stats": STATS}}, "memory.source='gpu'"),
    ({"memory": {"source": "simulated", "stats": [1]}}, "memory.stats=[1] is not a mapping"),
    ({"memory": {"source": "simulated", "stats": {**STATS, "reserved_bytes.all.peak": -1}}},
     "memory.stats['reserved_bytes.all.peak']=-1"),
    ({"memory": {"source": "simulated", "stats": {**STATS, "num_ooms": 1.5}}}, "memory.stats['num_ooms']=1.5"),
    ({"samples": 1e15, "seconds": 1e-300}, "samples/seconds = inf samples/s"),   # each finite, the rate not
])
def test_every_report_field_with_a_wrong_value_is_a_bad_record(changes, named):
    res = result_from_channel(_spec(), [_report(**changes)], returncode=0, stderr="", timed_out=False)
    assert res.outcome is Outcome.BAD_RECORD, res.message
    assert named in res.message


@pytest.mark.parametrize("line, named", [
    ({"event": "oom", "time": "late", "message": "CUDA out of memory."}, "time='late'"),   # sorted by time
    ({"event": "oom", "time": 1.0, "message": ["CUDA"]}, "message=['CUDA'] is not a string"),
    ({"event": "oom", "time": 1.0, "message": "x", "requested_bytes": -2}, "requested_bytes=-2"),
    ({"event": "memory", "time": 1.0, "memory": None}, "memory=None is not a mapping"),
    ({"event": "memory", "time": 1.0, "rank": "1", "memory": {"stats": STATS}}, "rank='1'"),
])
def test_oom_and_memory_lines_are_checked_too(line, named):
    res = result_from_channel(_spec(), [line, _report()], returncode=0, stderr="", timed_out=False)
    assert res.outcome is Outcome.BAD_RECORD and named in res.message


def test_the_first_bad_line_is_named_by_its_place_and_other_events_are_ignored():
    events = [{"event": "progress", "samples": "many"}, _report(), _report(seconds=-1.0)]
    assert bad_channel_line(events).startswith("malformed result record (record 3 in OOMTUNE_RESULT_FILE): "
                                               "seconds=-1.0 is not a finite number > 0")
    assert bad_channel_line(events[:2]) is None


def test_a_hang_stays_a_timeout_whatever_the_lines_say():
    res = result_from_channel(_spec(), [_report(samples="lots")], returncode=None, stderr="", timed_out=True)
    assert res.outcome is Outcome.TIMEOUT


def test_a_malformed_result_json_of_a_trial_process_is_a_bad_record(tmp_path):
    from oomtune.trial.runner import _read_result

    path = tmp_path / "result.json"
    path.write_text(json.dumps({"outcome": "ok", "batch_size": 4,
                                "throughput": {"samples_per_s": -3.0}, "memory": {}}))
    res = _read_result(_spec(), {"result": path, "stderr": tmp_path / "stderr.txt"}, 0, False)
    assert res.outcome is Outcome.BAD_RECORD
    assert "throughput.samples_per_s must be a number >= 0 or None, got -3.0" in res.message
    assert '"samples_per_s": -3.0' in res.message
    path.write_text(json.dumps({"outcome": "fine"}))
    res = _read_result(_spec(), {"result": path, "stderr": tmp_path / "stderr.txt"}, 0, False)
    assert res.outcome is Outcome.BAD_RECORD and "unknown trial outcome 'fine'" in res.message


# ---------------------------------------------------------------- the cause of a failed trial process
def test_an_integrations_line_on_exit_2_is_the_message_not_status_2_without_a_record():
    from oomtune.classify import classify_failure

    stderr = "Epoch 0: 100%|####| 3/3\noomtune: the LightningModule has no batch_size attribute\n"
    cls = classify_failure(returncode=2, stderr=stderr, timed_out=False)
    assert cls.outcome is Outcome.ERROR
    assert cls.message == "exited with status 2: oomtune: the LightningModule has no batch_size attribute"
    # argparse: ArgumentParser.error -> exit(2, "%(prog)s: error: %(message)s\n") (Lib/argparse.py)
    cls = classify_failure(returncode=2, stderr="usage: t.py [-h] [--bs BS]\nt.py: error: unrecognized arguments: 4\n",
                           timed_out=False)
    assert cls.message == "exited with status 2: t.py: error: unrecognized arguments: 4"
    cls = classify_failure(returncode=1, stderr="", timed_out=False)
    assert cls.message == "exited with status 1 without a result record"


def test_own_error_line_and_what_every_configuration_repeats():
    from oomtune.classify._repeats import own_error_line, repeats_everywhere

    tb = ("Traceback (most recent call last):\n  File \"t.py\", line 3, in <module>\n"
          "oomtune.exceptions.ConfigError: oomtune.report(samples='x'): expected a finite number >= 0\n")
    assert own_error_line(tb) == "ConfigError: oomtune.report(samples='x'): expected a finite number >= 0"
    assert own_error_line("oomtune: first\noomtune: second\n") == "oomtune: first"
    assert own_error_line("RuntimeError: boom\n") is None
    assert repeats_everywhere(returncode=2, message="exited with status 2: t.py: error: x")
    assert repeats_everywhere(returncode=1, message="ModuleNotFoundError: No module named 'x'")
    assert repeats_everywhere(returncode=1, message="SyntaxError: invalid syntax")
    assert not repeats_everywhere(returncode=1, message="RuntimeError: CUDA error: an illegal memory access")
    assert not repeats_everywhere(returncode=None, message=None)


def test_a_ranks_malformed_record_is_that_ranks_bad_record_not_a_missing_one(tmp_path):
    from oomtune.trial.rank_records import merge_rank_files

    spec = TrialSpec(workload={"name": "mlp"}, batch_size=4, ranks=2)
    good = TrialResult(outcome=Outcome.OK, batch_size=4)
    good.write(tmp_path / "result.rank0.json")
    (tmp_path / "result.rank1.json").write_text(json.dumps({"outcome": "ok", "batch_size": 4,
                                                            "memory": {"peak_reserved_bytes": float("nan")}}))
    merged = merge_rank_files(spec, tmp_path / "result.json")
    assert merged.outcome is Outcome.BAD_RECORD and merged.failed_rank == 1
    assert merged.message.startswith("rank 1 of 2: malformed result record (result.rank1.json): "
                                     "memory.peak_reserved_bytes must be a non-negative int number of bytes or None, "
                                     "got nan")
