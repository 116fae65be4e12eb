"""``oomtune simulate`` end to end (subprocess for exit codes and stderr; in-process for output).

Expected numbers are hand-computed from the rules of c10/cuda/CUDACachingAllocator.cpp under
default settings: a 100 B request rounds to 512 B in the small pool and reserves a 2 MiB segment;
a 5 MiB request reserves a 20 MiB large segment, splitting off a 15 MiB free remainder (> 1 MiB);
a second 5 MiB request is served from that remainder (best fit) without a new segment.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from oomtune.cli import main

MiB = 1 << 20
REAL = Path(__file__).resolve().parent / "data" / "cnn-small-default.pickle"
ROOT = Path(__file__).resolve().parents[1]
S0, L1 = 0x7F0000000000, 0x7F0001000000


def ev(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": []}


def synthetic_snapshot() -> dict:
    trace = [
        ev("segment_alloc", S0, 2 * MiB), ev("alloc", S0, 100),
        ev("segment_alloc", L1, 20 * MiB), ev("alloc", L1, 5 * MiB),
        ev("free_requested", S0, 100), ev("free_completed", S0, 100),
        ev("alloc", L1 + 5 * MiB, 5 * MiB),
        ev("free_requested", L1, 5 * MiB), ev("free_completed", L1, 5 * MiB),
        ev("free_requested", L1 + 5 * MiB, 5 * MiB), ev("free_completed", L1 + 5 * MiB, 5 * MiB),
    ]
    segments = [
        {"device": 0, "address": S0, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
         "blocks": [{"address": S0, "size": 2 * MiB, "requested_size": 0, "state": "inactive"}]},
        {"device": 0, "address": L1, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": L1, "size": 20 * MiB, "requested_size": 0, "state": "inactive"}]},
    ]
    return {"segments": segments, "device_traces": [trace]}


@pytest.fixture
def synthetic(tmp_path) -> Path:
    path = tmp_path / "synthetic.pickle"
    path.write_bytes(pickle.dumps(synthetic_snapshot()))
    return path


def unwrapped(out: str) -> str:
    """The text output with each wrapped line joined again (continuations start with two spaces)."""
    return out.replace("\n  ", " ")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "oomtune", "simulate", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_json_hand_computed(synthetic, capsys):
    assert main(["simulate", str(synthetic), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated_peak_allocated_bytes"] == 10 * MiB      # 5 MiB + 5 MiB (the 512 B block freed first)
    assert out["simulated_peak_reserved_bytes"] == 22 * MiB       # 2 MiB small + 20 MiB large segment
    assert out["recorded_peak_reserved_bytes"] == 22 * MiB
    assert out["recorded_segment_allocs"] == [2 * MiB, 20 * MiB]
    assert out["simulated_segment_allocs"] == [2 * MiB, 20 * MiB]
    assert out["first_divergence"] is None and out["exact"] is True
    assert out["simulated_oom"] is False and out["simulated_num_alloc_retries"] == 0
    assert out["simulated_fragmentation"] == pytest.approx(1 - 10 / 22)
    assert out["settings"] == ""
    assert out["events_replayed"] == 6


def test_budget_too_small_is_oom(synthetic, capsys):
    # 16 MiB cannot hold the 2 MiB small segment (still in use) plus a 20 MiB segment.
    assert main(["simulate", str(synthetic), "--budget", "16MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated_oom"] is True
    assert out["simulated_oom_at"]["event_index"] == 3 and out["simulated_oom_at"]["requested_bytes"] == 5 * MiB


def test_text_output_labels(synthetic, capsys):
    assert main(["simulate", str(synthetic)]) == 0
    out = capsys.readouterr().out
    assert "Peak reserved (simulated): 22.00 MiB" in out
    assert "(recorded on device): 22.00 MiB" in out
    assert "First difference: none: all 2 segment events" in out
    assert "OOM (simulated): no" in out


def test_several_confs_print_a_table(synthetic, capsys, monkeypatch):
    # the table as printed when COLUMNS is unset (not squeezed: 200 columns); pytest-xdist's workers
    # run with COLUMNS=80, which wraps the rows
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["simulate", str(synthetic), "--conf", "", "--conf", "expandable_segments:True"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("default ", "es:T "))}
    # torch's defaults: 10 MiB allocated at peak, 22 MiB reserved as recorded (the module docstring)
    assert rows["default"][1:5] == ["10.00", "MiB", "22.00", "MiB"]
    assert "config: es=expandable_segments, T=True; default = torch's defaults" in out
    assert "peak alloc / resv: peak allocated / reserved" in out  # the headers' legend


@pytest.mark.parametrize("confs", [["", "expandable_segments:True"],
                                   ["", "expandable_segments:True", "max_split_size_mb:64,roundup_power2_divisions:4"]])
def test_output_fits_100_columns_at_word_boundaries(confs, monkeypatch, capsys):
    # the DataParallel trace's device 1: long Budget, OOM and Segment allocs lines (tests/data/README.md)
    gnn = Path(__file__).resolve().parent / "data" / "gnn-dataparallel-expandable-oom.pickle"
    monkeypatch.setenv("COLUMNS", "100")
    for args in ([], [a for c in confs for a in ("--conf", c)]):
        assert main(["simulate", str(gnn), "--device", "1", *args]) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert lines and max(len(line) for line in lines) <= 100 and "\u2026" not in out  # nothing cut with "…"
        if not args:  # one setting: a long line continues, indented, at a space: nothing lost
            assert ("OOM (simulated): no OOM the device did not have; the device's 1 out-of-memory error(s) "
                    "reproduced (OOM entries below)\n") in unwrapped(out)
        else:  # the recorded OOM reproduced under each setting: said below the table, per setting
            assert out.count("OOM (sim), ") == len(confs)


def test_several_confs_json_is_a_list(synthetic, capsys):
    assert main(["simulate", str(synthetic), "--json", "--conf", "", "--conf", "max_split_size_mb:20"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, list) and len(out) == 2


@pytest.mark.parametrize("content", [b"", b"not a pickle at all"])
def test_bad_files_exit_2_one_line(tmp_path, content):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    proc = run_cli(str(path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("oomtune: error: ")


def test_truncated_real_trace_exit_2(tmp_path):
    data = REAL.read_bytes()
    path = tmp_path / "half.pickle"
    path.write_bytes(data[: len(data) // 2])
    proc = run_cli(str(path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


def test_hostile_pickle_exit_2_and_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.")
    proc = run_cli(str(path))
    assert proc.returncode == 2
    assert "refusing to load" in proc.stderr and proc.stderr.count("\n") == 1
    assert not marker.exists()


def test_missing_file_bad_conf_bad_budget_exit_2(tmp_path, synthetic):
    for args in ([str(tmp_path / "missing.pickle")],
                 [str(synthetic), "--conf", "max_split_size_mb:5"],
                 [str(synthetic), "--budget", "lots"]):
        proc = run_cli(*args)
        assert proc.returncode == 2, args
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("oomtune: error: "), proc.stderr


def test_ambiguous_release_decided_by_the_device_limit(tmp_path, capsys):
    trace = [ev("segment_alloc", L1, 20 * MiB), ev("alloc", L1, 5 * MiB),
             ev("free_requested", L1, 5 * MiB), ev("free_completed", L1, 5 * MiB),
             ev("segment_free", L1, 20 * MiB), ev("segment_alloc", S0, 2 * MiB), ev("alloc", S0, 100)]
    snap = {"segments": [{"device": 0, "address": S0, "total_size": 2 * MiB, "stream": 0,
                          "segment_type": "small",
                          "blocks": [{"size": 512, "state": "active_allocated"},
                                     {"size": 2 * MiB - 512, "state": "inactive"}]}],
            "device_traces": [trace]}
    path = tmp_path / "ec.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["simulate", str(path)]) == 0
    out = unwrapped(capsys.readouterr().out)
    # The release is followed by a new 2 MiB segment before the next request, and reserved 20 MiB +
    # 2 MiB needed > the 20 MiB peak the device ever held: a device of 20 MiB up to 22 MiB - 1 B
    # would have released it itself (release_cached_blocks before the retry). The trace cannot tell
    # it from an empty_cache(); the device-limit rule decides, and the replay needs that limit.
    assert ("Recorded releases: 1 run(s) of 1 release(s): the allocator's own release-and-retry, left to "
            "the simulator (decided by: device limit)") in out
    assert "the device limit inferred from the trace, between 20.00 MiB and" in out
    assert "First difference: none: all 3 segment events" in out
    assert main(["simulate", str(path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["device_limit"]["low_bytes"] == 20 * MiB and r["device_limit"]["high_bytes"] == 22 * MiB - 1
    assert r["total_memory_bytes"] == 20 * MiB and r["budget_source"] == "inferred from the trace"
    assert r["exact"] and r["simulated_num_alloc_retries"] == 1
    # --budget overrides: on 1 TiB the allocator never releases, so the recorded release is missing.
    assert main(["simulate", str(path), "--json", "--budget", "1TiB"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["budget_source"] == "given" and not r["exact"]
    assert r["divergence"] == {"index": 1, "recorded": ["segment_free", 20 * MiB, 2],
                               "simulated": ["segment_alloc", 2 * MiB, 2]}


def test_memory_fraction_caps_the_replay_and_needs_a_budget(tmp_path, capsys):
    import json
    import pickle

    from oomtune.cli import main

    # One 40 MiB request (a 40 MiB segment: >= 10 MiB rounds to 2 MiB). On a 100 MiB device with
    # fraction 0.3 only 30 MiB are allowed: out of memory; with 0.5 (50 MiB) it fits.
    a = 1 << 32
    snap = {"segments": [], "device_traces": [[{"action": "alloc", "addr": a, "size": 40 << 20, "stream": 0}]]}
    path = tmp_path / "one.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["simulate", str(path), "--budget", "100MiB", "--memory-fraction", "0.3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["simulated_oom"] is True
    assert main(["simulate", str(path), "--budget", "100MiB", "--memory-fraction", "0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["simulated_oom"] is False
    assert main(["simulate", str(path), "--memory-fraction", "0.5"]) == 2
    assert "needs --budget" in capsys.readouterr().err


def test_json_keys_name_their_source(synthetic, capsys):
    # Every memory figure of --json says where it comes from: simulated_* (the virtual GPU's replay)
    # or recorded_* (the snapshot, i.e. the device); budget_bytes / total_memory_bytes are inputs.
    assert main(["simulate", str(synthetic), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    figures = {k for k in out if k.endswith("_bytes") or k in ("fragmentation", "oom", "oom_at", "num_alloc_retries")}
    assert {k for k in figures if not k.startswith(("simulated_", "recorded_"))} == {"budget_bytes",
                                                                                     "total_memory_bytes"}
    # The trace allocates both segments itself (no segment before recording began), so the starting
    # state is empty; neither segment is released, so both replays end with 2 + 20 MiB reserved.
    assert out["recorded_initial_reserved_bytes"] == 0 and out["recorded_initial_live_bytes"] == 0
    assert out["simulated_final_reserved_bytes"] == out["recorded_final_reserved_bytes"] == 22 * MiB
    assert out["simulated_peak_active_bytes"] == 10 * MiB   # the two 5 MiB blocks live together
    assert "peak_reserved_bytes" not in out and "oom" not in out   # the old, unlabelled names are gone


@pytest.mark.parametrize("recorded, args, line", [
    (None, [], "Settings: torch defaults (the snapshot records no allocator settings)"),
    (None, ["--conf", "expandable_segments:True"], "Settings: expandable_segments:True (given with --conf)"),
    (None, ["--conf", ""], "Settings: torch defaults (given with --conf)"),
    ({"max_split_size": 200 * MiB}, [], "Settings: max_split_size_mb:200 (recorded in the snapshot)"),
    # 5 MiB is below torch's 20 MiB minimum for max_split_size_mb: not representable
    ({"max_split_size": 5 * MiB}, [],
     "Settings: torch defaults (the snapshot's allocator settings cannot be used: see the Notice below)"),
])
def test_settings_line_names_the_settings_once(tmp_path, capsys, recorded, args, line):
    snap = synthetic_snapshot()
    if recorded is not None:
        snap["allocator_settings"] = recorded
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["simulate", str(path), *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if x.startswith("Settings:")] == [line]


def test_points_to_the_device_that_recorded_the_oom(capsys):
    # The DataParallel trace was dumped after an out-of-memory error on device 1 (tests/data/
    # README.md); its device 1 trace holds the one `oom` entry, device 0's holds none. A replay of
    # device 0 alone must say where the error is; the default replays every device.
    gnn = Path(__file__).resolve().parent / "data" / "gnn-dataparallel-expandable-oom.pickle"
    assert main(["simulate", str(gnn), "--device", "0"]) == 0
    out = capsys.readouterr().out
    assert "replaying device 0" in out
    assert "Note: device 1 recorded an out-of-memory error that this replay does not show: add --device 1" in out
    assert "OOM (simulated): no\n" in out
    assert main(["simulate", str(gnn)]) == 0
    out = capsys.readouterr().out
    assert "devices with data: 0, 1, 2; replaying each, one after the other (--device N for one)" in " ".join(
        out.replace("\n  ", " ").split())   # wrapped at 100 columns
    assert [line.split(" (")[0] for line in out.splitlines() if line.startswith("== Device")] == [
        "== Device 0", "== Device 1", "== Device 2"]
    assert "Note: device" not in out
    assert "OOM entries: (recorded on device) 1, (simulated) 1" in out   # device 1's, in the default
    assert main(["simulate", str(gnn), "--device", "1"]) == 0
    out = capsys.readouterr().out
    assert "Note: device" not in out
    # the device's own error is reproduced, not reported as "no" OOM with no word about it
    assert "OOM (simulated): no OOM the device did not have; the device's 1 out-of-memory error(s) reproduced" in out
    assert "OOM entries: (recorded on device) 1, (simulated) 1" in out


@pytest.mark.parametrize("pure", ["0", "1"])   # the compiled path and the reference Python path
@pytest.mark.parametrize("change, message", [
    # each used to end in a traceback (TypeError in _frames_verdict, devices_with_data, the
    # simulator's malloc, _block_addresses; OverflowError in the compiled simulator; TypeError or
    # ValueError in json.dumps): now the loader names the value
    (lambda s: s["device_traces"][0].append(ev("segment_free", L1, 20 * MiB) | {"frames": [{"name": None}]}),
     "device_traces[0][11] has frames[0] with name=None, expected a string"),
    (lambda s: s["segments"][1].update(device=None), "segments[1] has device=None, expected an integer"),
    (lambda s: s["device_traces"][0][3].update(stream=None), "device_traces[0][3] has stream=None"),
    (lambda s: s["segments"][1]["blocks"][0].update(address=None), "segments[1].blocks[0] has address=None"),
    (lambda s: s["device_traces"][0][3].update(size=1 << 63), "has size=9223372036854775808, beyond the 64-bit"),
    (lambda s: s.update(allocator_settings={"PYTORCH_CUDA_ALLOC_CONF": b""}), "holds a value of type bytes"),
])
def test_values_that_crashed_the_replay_exit_2_one_line(tmp_path, monkeypatch, pure, change, message):
    monkeypatch.setenv("OOMTUNE_PURE_PYTHON", pure)
    snap = synthetic_snapshot()
    change(snap)
    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps(snap))
    for args in ([], ["--json"]):
        proc = run_cli(str(path), *args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("oomtune: error: "), proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr


def test_recorded_divisions_that_are_not_numbers_give_a_notice(tmp_path, capsys):
    # int("abc") used to raise ValueError out of recorded_settings; such settings cannot be used,
    # so the replay runs under torch's defaults and says why (as for other unusable settings).
    snap = synthetic_snapshot() | {"allocator_settings": {"roundup_power2_divisions": {"1": "abc", "2": 4}}}
    path = tmp_path / "divs.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["simulate", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"] == "" and out["settings_source"] == "torch defaults (none recorded)"
    assert out["notes"] == ["the recorded allocator_settings cannot be used (roundup_power2_divisions holds "
                            "{'1': 'abc'}, expected whole numbers); replayed under torch's defaults"]
    assert out["exact"] is True   # the synthetic trace replays exactly under torch's defaults


def test_the_default_replay_covers_every_device_holding_memory(tmp_path, capsys):
    # Device 0 has a trace entry but no memory; device 1 holds a 20 MiB segment recorded before
    # history began (no entries). The default replay used to replay device 0 alone, "exact" at 0 B.
    seg = {"device": 1, "address": 1 << 30, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
           "blocks": [{"address": 1 << 30, "size": 20 * MiB, "requested_size": 20 * MiB, "state": "active_allocated"}]}
    snap = {"segments": [seg], "device_traces": [[{"action": "snapshot", "addr": 0, "size": 0, "stream": 0}], [], []]}
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["simulate", str(path), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["device"] for r in records] == [0, 1]          # device 2 holds nothing: not replayed
    dev1 = records[1]
    assert dev1["recorded_final_reserved_bytes"] == dev1["simulated_final_reserved_bytes"] == 20 * MiB
    assert dev1["exact"] is True
    # a device holding nothing, named on purpose, is never "exact"
    assert main(["simulate", str(path), "--json", "--device", "2"]) == 0
    empty = json.loads(capsys.readouterr().out)
    assert empty["exact"] is False and any("device 2 holds no trace entries or segments" in n for n in empty["notes"])


def test_budget_without_a_unit_is_refused_as_ambiguous(capsys):
    trace = Path(__file__).resolve().parent / "data" / "cnn-small-default.pickle"
    assert main(["simulate", str(trace), "--budget", "1024"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget '1024' is ambiguous" in err and "1024MiB" in err
    assert main(["simulate", str(trace), "--max-size", "512"]) == 2
    assert "--max-size '512' is ambiguous" in capsys.readouterr().err
