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


# Hostile or odd values that used to pass validation and then crash the replay with a traceback
# (or, for values of 2**63 and more, crash only the compiled simulator). torch writes addresses,
# sizes and streams as int64_t and never None (torch/csrc/cuda/memory_snapshot.cpp), segment_type
# "small" or "large", frames as lists of {"name": str, ...}.
def _entry(**kw) -> dict:
    return {"action": "alloc", "addr": 4096, "size": 512, "stream": 0} | kw


def _segment(**kw) -> dict:
    return {"device": 0, "address": 1 << 30, "total_size": 2 << 20, "stream": 0, "segment_type": "small",
            "blocks": [{"address": 1 << 30, "size": 2 << 20, "state": "inactive"}]} | kw


def _release(frames) -> dict:
    return {"action": "segment_free", "addr": 1 << 30, "size": 2 << 20, "stream": 0, "frames": frames}


@pytest.mark.parametrize("obj, message", [
    ({"segments": [], "device_traces": [[_entry(stream=None)]]}, r"\[0\]\[0\] has stream=None, expected an integer"),
    ({"segments": [], "device_traces": [[{"action": "oom", "size": 512, "device_free": 0, "stream": None}]]},
     "has stream=None"),
    ({"segments": [], "device_traces": [[_entry(size=1 << 63)]]}, "size=9223372036854775808, beyond the 64-bit"),
    ({"segments": [], "device_traces": [[_entry(addr=1 << 64)]]}, "addr=18446744073709551616, beyond"),
    ({"segments": [], "device_traces": [[_entry(stream=1 << 70)]]}, "stream=1180591620717411303424, beyond"),
    ({"segments": [_segment(device=None)], "device_traces": []}, r"segments\[0\] has device=None"),
    ({"segments": [_segment(stream=None)], "device_traces": []}, r"segments\[0\] has stream=None"),
    ({"segments": [_segment(address=1 << 63)], "device_traces": []}, "address=9223372036854775808, beyond"),
    ({"segments": [_segment(segment_type="huge")], "device_traces": []}, "segment_type='huge', expected 'small'"),
    # a small-pool segment is kSmallBuffer = 2 MiB; replay would rebuild a 2**50-byte one in 2**30 requests
    ({"segments": [_segment(total_size=1 << 50, blocks=[])], "device_traces": []},
     r"segments\[0\] is a small-pool segment of 1125899906842624 bytes, expected 2097152"),
    ({"segments": [_segment(total_size=4 << 20, blocks=[])], "device_traces": []}, "small-pool segment of 4194304"),
    ({"segments": [_segment(blocks=[{"address": None, "size": 2 << 20, "state": "inactive"}])],
      "device_traces": []}, r"blocks\[0\] has address=None"),
    ({"segments": [], "device_traces": [[_release(5)]]}, "frames of type int, expected a list"),
    ({"segments": [], "device_traces": [[_release({"name": "empty_cache"})]]}, "frames of type dict"),
    ({"segments": [], "device_traces": [[_release([[{"name": "x"}]])]]}, r"frames\[0\] of type list"),
    ({"segments": [], "device_traces": [[_release([{"name": None}])]]}, r"frames\[0\] with name=None"),
    ({"segments": [], "device_traces": [[_release([{"name": 5}])]]}, r"frames\[0\] with name=5"),
    (_minimal() | {"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": b"x"}}, "holds a value of type bytes"),
    (_minimal() | {"allocator_settings": {"x": {1, 2}}}, "holds a value of type set"),
    (_minimal() | {"allocator_settings": {("a", 1): 1}}, r"has the key \('a', 1\), expected string keys"),
    (_minimal() | {"allocator_settings": {"garbage_collection_threshold": float("nan")}}, "holds nan, expected a finite"),
    (_minimal() | {"allocator_settings": {"roundup_power2_divisions": {"1": float("inf")}}}, "holds inf"),
    (_minimal() | {"allocator_settings": {"x": [[[[1]]]]}}, "nests deeper than allocator settings do"),
])
def test_values_torch_never_writes_are_refused(obj, message):
    with pytest.raises(SnapshotError, match=message):
        loads_snapshot(pickle.dumps(obj))


def test_cyclic_allocator_settings_refused_without_recursion_error():
    settings: dict = {}
    settings["self"] = settings   # pickle keeps the cycle (memo), json.dumps would raise ValueError
    with pytest.raises(SnapshotError, match="nests deeper than allocator settings do"):
        loads_snapshot(pickle.dumps(_minimal() | {"allocator_settings": settings}))


def test_values_replay_does_not_read_may_be_none_or_absent():
    # an oom entry's addr (device_free instead), time_us, requested_size: never read by replay;
    # frames of entries other than releases are not inspected; stream and device may be absent.
    seg = _segment(blocks=[{"address": 1 << 30, "size": 2 << 20, "requested_size": None, "state": "inactive"}])
    del seg["stream"], seg["device"]
    trace = [{"action": "oom", "addr": None, "size": 512, "device_free": 0, "stream": 0},
             _entry(time_us=None, frames=5), {"action": "free_completed", "addr": 4096, "size": 512},
             _release([{"filename": "no name"}, {"name": "empty_cache"}]), _entry(size=(1 << 63) - 1)]
    # an expandable small-pool range is any number of 2 MiB pages (6 MiB in the DataParallel trace)
    expandable = _segment(is_expandable=True, address=1 << 31, total_size=6 << 20, blocks=[])
    snap = {"segments": [seg, expandable], "device_traces": [trace], "allocator_settings": {
        "roundup_power2_divisions": {"1": 0}, "PYTORCH_CUDA_ALLOC_CONF": "", "garbage_collection_threshold": 0.0}}
    assert loads_snapshot(pickle.dumps(snap)) == snap


def test_one_trace_list_shared_by_many_devices_is_refused():
    # 2,000 memo references to one 1,000-entry list: a 10 kB pickle whose every pass (validation,
    # the per-device oom scan) would cost 2,000 times one trace; torch writes one list per device.
    trace = [{"action": "alloc", "addr": 4096 + 512 * k, "size": 512, "stream": 0} for k in range(1000)]
    with pytest.raises(SnapshotError, match=r"device_traces\[1\] is the same list object as device_traces\[0\]"):
        loads_snapshot(pickle.dumps({"segments": [], "device_traces": [trace] * 2000}))
    # empty traces shared by devices that recorded nothing cost nothing and stay accepted
    snap = {"segments": [], "device_traces": [trace] + [[]] * 3}
    assert loads_snapshot(pickle.dumps(snap)) == snap


@pytest.mark.skipif(not Path("/dev/zero").is_char_device(), reason="no /dev/zero")
def test_a_device_is_refused_before_reading():
    # reading /dev/zero never ends: it used to fill memory and end in a MemoryError traceback
    with pytest.raises(SnapshotError, match="snapshot path /dev/zero is a device, not a pickle file"):
        load_snapshot("/dev/zero")


def test_a_file_too_large_for_memory_is_one_error(tmp_path, monkeypatch):
    path = tmp_path / "huge.pickle"
    path.write_bytes(pickle.dumps(_minimal()))

    def no_memory(self):
        raise MemoryError

    from oomtune.trace import snapshot as module

    monkeypatch.setattr(module._RefusingUnpickler, "load", no_memory)
    with pytest.raises(SnapshotError, match="does not fit in this machine's memory once unpickled"):
        load_snapshot(path)


# ------------------------------------------------------------------ shared frames: work bounded by the file's size
class _CountingList(list):
    """A list that counts the walks over it (each ``for`` over it is one)."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def _shared_frames_snapshot(entries: int, frames: list) -> dict:
    """``entries`` segment_alloc/segment_free pairs, every entry holding the same ``frames`` object
    (what a pickle's memo makes of one list referenced everywhere)."""
    trace = []
    for k in range(entries):
        addr = (1 << 30) + k * (2 << 20)
        trace.append({"action": "segment_alloc", "addr": addr, "size": 2 << 20, "stream": 0, "frames": frames})
        trace.append({"action": "segment_free", "addr": addr, "size": 2 << 20, "stream": 0, "frames": frames})
    return {"segments": [], "device_traces": [trace]}


def test_a_frames_list_shared_by_every_entry_is_checked_once():
    from oomtune.trace import replay_snapshot

    _CountingList.walks = 0
    frames = _CountingList([{"name": "train_step", "filename": "train.py", "line": 1}] * 1000)
    snap = _shared_frames_snapshot(500, frames)      # 500 releases, each holding the 1,000 frames
    validate_snapshot(snap)
    assert _CountingList.walks == 1                  # not 500: the one list, checked once by identity
    replay_snapshot(snap)                            # the release classifier reads frames too
    assert _CountingList.walks == 2                  # once more in all (one verdict per list object)


def test_the_shared_frames_pickle_is_bounded_by_its_size():
    # The file: one 100,000-frame list in every one of 40,000 entries (1.4 MB pickled): the
    # checks visit each distinct object once, 1 frames list and 1 frame dict, plus cache hits.
    from oomtune.trace import snapshot as module

    frame = {"name": "f", "filename": "x.py", "line": 1}
    data = pickle.dumps(_shared_frames_snapshot(20000, [frame] * 100000), protocol=4)
    assert len(data) < 1_500_000
    before = dict(module.CHECK_COUNTS)
    snap = loads_snapshot(data)
    assert snap["device_traces"][0][1]["frames"] is snap["device_traces"][0][3]["frames"]  # the memo kept it shared
    walked = {k: module.CHECK_COUNTS[k] - before[k] for k in before}
    assert walked == {"frames_lists": 1, "frames": 1, "cache_hits": 19999}   # 20,000 releases: 1 walk + 19,999 hits


def test_a_segment_listed_twice_or_a_shared_blocks_list_is_refused():
    blocks = [{"address": 1 << 30, "size": 20 << 20, "state": "inactive"}]
    seg = {"device": 0, "address": 1 << 30, "total_size": 20 << 20, "stream": 0, "segment_type": "large",
           "blocks": blocks}
    with pytest.raises(SnapshotError, match=r"segments\[1\] is the same dict object as segments\[0\]"):
        loads_snapshot(pickle.dumps({"segments": [seg] * 2, "device_traces": [[]]}))
    other = dict(seg, address=2 << 30)   # a second segment dict holding the first one's blocks list
    with pytest.raises(SnapshotError, match=r"segments\[1\] shares its blocks list with segments\[0\]"):
        loads_snapshot(pickle.dumps({"segments": [seg, other], "device_traces": [[]]}))


def test_a_file_above_the_size_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "big.pickle"
    with path.open("wb") as f:   # 1.5 GiB, sparse: nothing to write, nothing to read
        f.truncate(3 << 29)

    def no_open(*a, **k):
        raise AssertionError("the file was opened")

    monkeypatch.setattr(Path, "open", no_open)
    with pytest.raises(SnapshotError) as err:
        load_snapshot(path)
    assert str(err.value) == (f"snapshot file {path} is 1.50 GiB, above the 1.00 GiB read by default (unpickled, a "
                              "snapshot takes 5-10x its size in memory): add --max-size 2GiB to read it")
    monkeypatch.undo()
    # raised, the limit lets it through to the unpickler, which stops at the first byte (zeros)
    with pytest.raises(SnapshotError, match="is not a valid pickle"):
        load_snapshot(path, max_bytes=2 << 30)
