"""Safe loading and validation of memory snapshot pickles (oomtune.trace.snapshot)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from oomtune.exceptions import SnapshotError
from oomtune.trace.snapshot import load_snapshot, loads_snapshot, validate_snapshot

REAL = Path(__file__).resolve().parent / "data" / "cnn-small-default.pickle"


class _RunsCommand:
    """Pickles to a call of os.system (the classic hostile pickle)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _minimal() -> dict:
    return {"segments": [], "device_traces": [[]]}


def test_real_trace_loads_with_readme_counts():
    snap = load_snapshot(REAL)
    trace = snap["device_traces"][0]
    assert len(trace) == 5803  # README
    actions = [e["action"] for e in trace]
    assert actions.count("alloc") == 1935
    assert actions.count("segment_alloc") == 7
    assert len(snap["segments"]) == 10
    assert sum(s["total_size"] for s in snap["segments"]) == 128 << 20


def test_reduce_to_os_system_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_RunsCommand(marker)]]}))
    with pytest.raises(SnapshotError, match=r"refusing to load .*references (posix|os|nt)\.system"):
        load_snapshot(path)
    assert not marker.exists()


def test_raw_global_builtins_eval_is_refused(tmp_path):
    marker = tmp_path / "pwned2"
    # protocol 0: GLOBAL 'builtins eval', then REDUCE with one string argument.
    code = f"__import__('os').system('touch {marker}')"
    data = b"cbuiltins\neval\n(V" + code.encode() + b"\ntR."
    path = tmp_path / "eval.pickle"
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match=r"builtins\.eval"):
        load_snapshot(path)
    assert not marker.exists()


def test_harmless_looking_global_is_refused_too(tmp_path):
    path = tmp_path / "od.pickle"
    from collections import OrderedDict

    path.write_bytes(pickle.dumps(OrderedDict(segments=[], device_traces=[])))
    with pytest.raises(SnapshotError, match=r"collections\.OrderedDict"):
        load_snapshot(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.pickle"
    path.write_bytes(b"")
    with pytest.raises(SnapshotError, match="is empty"):
        load_snapshot(path)


def test_truncated_real_pickle(tmp_path):
    data = REAL.read_bytes()
    path = tmp_path / "half.pickle"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="truncated|not a valid pickle"):
        load_snapshot(path)


def test_missing_file(tmp_path):
    with pytest.raises(SnapshotError, match="does not exist"):
        load_snapshot(tmp_path / "nope.pickle")


def test_not_a_pickle(tmp_path):
    path = tmp_path / "text.pickle"
    path.write_text("hello, this is not a pickle\n")
    with pytest.raises(SnapshotError):
        load_snapshot(path)


@pytest.mark.parametrize("obj, message", [
    ([1, 2, 3], "holds a list"),
    ({"segments": []}, "lacks 'device_traces'"),
    ({"device_traces": []}, "lacks 'segments'"),
    ({"segments": {}, "device_traces": []}, "'segments' is not a list"),
    ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": "big"}]]}, "size='big'"),
    ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": -1}]]}, "size=-1"),
    ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": True}]]}, "size=True"),
    ({"segments": [], "device_traces": [[{"addr": 0, "size": 1}]]}, "no string 'action'"),
    ({"segments": [{"address": 0, "total_size": 10, "blocks": [{"size": 4, "state": "inactive"}]}],
      "device_traces": []}, "summing to 4 bytes"),
    ({"segments": [{"address": 0, "total_size": 10}], "device_traces": []}, "no 'blocks' list"),
])
def test_structure_errors(obj, message):
    with pytest.raises(SnapshotError, match=message):
        loads_snapshot(pickle.dumps(obj))


def test_minimal_snapshot_accepted_and_dump_snapshot_format(tmp_path):
    # torch.cuda.memory._dump_snapshot is pickle.dump(_snapshot(), f): the same dict, any protocol.
    snap = _minimal() | {"allocator_settings": {"expandable_segments": False}}
    for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
        path = tmp_path / f"p{protocol}.pickle"
        path.write_bytes(pickle.dumps(snap, protocol=protocol))
        assert load_snapshot(path) == snap
    validate_snapshot(snap)
