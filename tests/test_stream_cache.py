"""The on-disk cache of captured streams (oomtune.plan.stream_cache: plan speed).

What must hold: a stream read back equals the one stored, event by event; any change of what a
capture depends on is another key; a damaged entry is a miss, never an error; a plan read from a
warm cache gives the same map as one that captured everything, without importing torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from oomtune.exceptions import UserCodeError
from oomtune.alloc.stream import AllocationStream
from oomtune.plan import stream_cache as SC
from oomtune.plan.stream_cache import StreamCache, cacheable, default_cache
from oomtune.workload_spec import WorkloadSpec

ROOT = Path(__file__).resolve().parents[1]
MLP = {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 1, "num_classes": 10,
       "target": {"name": "builtin"}}


def _stream() -> AllocationStream:
    # a hand-made stream: two live blocks at once on stream 0, one on stream 1, one left live at the end
    return AllocationStream([("alloc", 1, 512, 0), ("alloc", 2, 1 << 20, 0), ("free", 1),
                             ("alloc", 3, 3 << 20, 1), ("free", 2), ("alloc", 4, 0, 0), ("free", 3)])


def test_a_stored_stream_reads_back_equal_with_its_reason(tmp_path):
    cache = StreamCache(tmp_path)
    key, material = cache.capture_key(WorkloadSpec.from_dict(MLP), 32, 2, False)
    assert cache.get(key, material) is None and cache.misses == 1
    cache.put(key, material, _stream(), "meta kernel missing (x): captured on cpu")
    stream, reason = cache.get(key, material)
    assert stream == _stream() and list(stream) == list(_stream())
    assert stream.live_keys == [4]   # the live set (what derivation copies) survives too
    assert reason == "meta kernel missing (x): captured on cpu" and cache.hits == 1


@pytest.mark.parametrize("change", ["batch", "steps", "blas", "model", "torch", "code"])
def test_every_input_of_a_capture_is_part_of_its_key(change, tmp_path, monkeypatch):
    cache = StreamCache(tmp_path)
    base = cache.capture_key(WorkloadSpec.from_dict(MLP), 32, 2, False)[0]
    args = {"batch": (MLP, 33, 2, False), "steps": (MLP, 32, 3, False), "blas": (MLP, 32, 2, True),
            "model": ({**MLP, "hidden": 129}, 32, 2, False)}.get(change, (MLP, 32, 2, False))
    monkeypatch.setattr(SC, "_env", None)   # the environment part of the key, computed again below
    if change == "torch":
        from oomtune import packages

        real = packages.installed_version
        monkeypatch.setattr(packages, "installed_version", lambda d: "9.9.9" if d == "torch" else real(d))
    if change == "code":
        monkeypatch.setattr(SC, "_fingerprint", "0" * 64)
    assert cache.capture_key(WorkloadSpec.from_dict(args[0]), *args[1:])[0] != base


def test_the_cublas_workspace_setting_keys_real_gpu_captures_only(tmp_path, monkeypatch):
    cache = StreamCache(tmp_path)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    plain, gpu = cache.capture_key(WorkloadSpec.from_dict(MLP), 8, 2, False)[0], cache.capture_key(WorkloadSpec.from_dict(MLP), 8, 2, True)[0]
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert cache.capture_key(WorkloadSpec.from_dict(MLP), 8, 2, False)[0] == plain
    assert cache.capture_key(WorkloadSpec.from_dict(MLP), 8, 2, True)[0] != gpu


@pytest.mark.parametrize("damage", ["truncated stream", "not a stream", "no stream", "bad json", "other key",
                                    "reason not text", "one bit flipped", "another entry's stream", "no checksum"])
def test_a_damaged_entry_is_a_miss_and_is_written_again(damage, tmp_path):
    cache = StreamCache(tmp_path)
    key, material = cache.capture_key(WorkloadSpec.from_dict(MLP), 32, 2, False)
    cache.put(key, material, _stream(), None)
    meta, data = cache._paths(key)
    if damage == "truncated stream":
        data.write_bytes(data.read_bytes()[:-5])
    elif damage == "not a stream":
        data.write_bytes(b"hello")
    elif damage == "no stream":
        data.unlink()
    elif damage == "bad json":
        meta.write_text("{", encoding="utf-8")
    elif damage == "other key":
        other = dict(material, batch_size=64)
        meta.write_text(json.dumps({"key": other, "reason": None}), encoding="utf-8")
    elif damage == "reason not text":
        stored = json.loads(meta.read_text(encoding="utf-8"))
        meta.write_text(json.dumps({**stored, "reason": 5}), encoding="utf-8")
    elif damage == "one bit flipped":   # still a valid stream: a size of 1 MiB + 2**40 (found by a user)
        raw = bytearray(data.read_bytes())
        raw[-8 * 7 * 2 + 8 + 5] ^= 1   # in the sizes column: the second event's size
        data.write_bytes(bytes(raw))
        assert AllocationStream.load(data) != _stream()   # it parses, with another size
    elif damage == "another entry's stream":   # a valid stream file copied over from another key
        other_key, other_material = cache.capture_key(WorkloadSpec.from_dict(MLP), 64, 2, False)
        cache.put(other_key, other_material, AllocationStream([("alloc", 1, 4096, 0), ("free", 1)]), None)
        data.write_bytes(cache._paths(other_key)[1].read_bytes())
    else:   # written by a version without checksums
        stored = json.loads(meta.read_text(encoding="utf-8"))
        meta.write_text(json.dumps({k: v for k, v in stored.items() if k != "sha256"}), encoding="utf-8")
    assert cache.get(key, material) is None
    cache.put(key, material, _stream(), None)
    assert cache.get(key, material)[0] == _stream()


def test_an_unwritable_cache_is_a_cache_that_misses(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = StreamCache(blocker / "streams")
    key, material = cache.capture_key(WorkloadSpec.from_dict(MLP), 32, 2, False)
    cache.put(key, material, _stream(), None)   # no error
    assert cache.get(key, material) is None
    cache.mark_validated(WorkloadSpec.from_dict(MLP))
    assert not cache.validated(WorkloadSpec.from_dict(MLP))
    assert cache.unwritable() == "Not a directory"   # ENOTDIR's strerror: what the plan's note names
    assert StreamCache(tmp_path / "new").unwritable() is None and (tmp_path / "new").is_dir()


def test_validated_marks_are_per_config(tmp_path):
    cache = StreamCache(tmp_path)
    assert not cache.validated(WorkloadSpec.from_dict(MLP))
    cache.mark_validated(WorkloadSpec.from_dict(MLP))
    assert cache.validated(WorkloadSpec.from_dict(MLP)) and not cache.validated(WorkloadSpec.from_dict({**MLP, "layers": 2}))


def test_real_data_is_not_cached_and_python_entries_are_when_their_code_can_be_read(tmp_path):
    assert cacheable(WorkloadSpec.from_dict(MLP)) and cacheable(WorkloadSpec.from_dict({**MLP, "data": {"source": "synthetic"}}))
    assert not cacheable(WorkloadSpec.from_dict({**MLP, "data": {"source": "imagefolder", "path": "/data"}}))
    assert cacheable(WorkloadSpec.from_dict({"target": {"name": "python", "entry": str(ROOT / "examples/my_workload.py") + ":make_workload"}}))
    assert not cacheable(WorkloadSpec.from_dict({"target": {"name": "python", "entry": str(tmp_path / "absent.py") + ":f"}}))
    assert not cacheable(WorkloadSpec.from_dict({"target": {"name": "python", "entry": "no_such_module_i26:f"}}))


ENTRY = """import torch
from torch import nn
import helper_mod

def make_workload(batch_size, device):
    model = nn.Linear(helper_mod.WIDTH, 10).to(device)
    def batches():
        while True:
            yield torch.randn(batch_size, helper_mod.WIDTH, device=device), torch.randint(0, 10, (batch_size,), device=device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), batches()
"""


def _entry(tmp_path: Path, width: int = 32, body: str = ENTRY) -> dict:
    (tmp_path / "wl.py").write_text(body)
    (tmp_path / "helper_mod.py").write_text(f"WIDTH = {width}\n")
    SC._entry_prints.clear()   # computed once per process: a new file content means a new process here
    return {"target": {"name": "python", "entry": str(tmp_path / "wl.py") + ":make_workload"}}


def test_a_python_entry_is_keyed_by_its_code_its_local_imports_and_its_packages(tmp_path, monkeypatch):
    cache = StreamCache(tmp_path / "cache")
    wl = _entry(tmp_path)
    base = cache.capture_key(WorkloadSpec.from_dict(wl), 8, 2, False)
    material = base[1]
    assert material["model"] == {"target": wl["target"]}
    assert set(material["entry"]["files"]) == {str((tmp_path / "wl.py").resolve()),
                                               str((tmp_path / "helper_mod.py").resolve())}
    assert material["entry"]["packages"]["torch"].startswith("torch==")
    # the same entry named relative to the current directory: the same key (a plan and a search share it)
    monkeypatch.chdir(tmp_path)
    rel = {"target": {"name": "python", "entry": "wl.py:make_workload"}}
    assert cache.capture_key(WorkloadSpec.from_dict(rel), 8, 2, False)[0] == base[0]
    # a changed entry file, a changed local module: other keys
    assert cache.capture_key(WorkloadSpec.from_dict(_entry(tmp_path, body=ENTRY + "\n# changed\n")), 8, 2, False)[0] != base[0]
    assert cache.capture_key(WorkloadSpec.from_dict(_entry(tmp_path, width=33)), 8, 2, False)[0] != base[0]
    assert cache.capture_key(WorkloadSpec.from_dict(_entry(tmp_path)), 8, 2, False)[0] == base[0]     # back as it was


def test_a_search_after_a_plan_of_a_python_entry_reads_its_captures_and_a_changed_entry_misses(tmp_path, monkeypatch):
    from oomtune.device import resolve_device
    from oomtune.plan import predictor as P

    device = resolve_device("cpu", virtual_device_memory="1GiB")
    cache = StreamCache(tmp_path / "cache")
    wl = _entry(tmp_path)
    plan = P.Predictor.for_search(WorkloadSpec.from_dict(wl), device, 64 << 20, cache=cache)
    plan.prepare([8, 16, 32, 64])
    want = {b: plan.predict_detail(b, "") for b in (8, 24, 64)}
    assert plan.cached_batches == [] and plan.captures >= 3

    def no_capture(*a, **k):
        raise AssertionError("captured although the cache holds the stream")

    real_capture = P.capture_training_stream
    monkeypatch.setattr(P, "capture_training_stream", no_capture)
    search = P.Predictor.for_search(WorkloadSpec.from_dict(wl), device, 64 << 20, cache=cache)
    search.prepare([8, 16, 32, 64])
    assert {b: search.predict_detail(b, "") for b in (8, 24, 64)} == want
    assert sorted(search.cached_batches) == sorted(plan._captured)
    # the entry file changed: every capture is a miss (here the capture function refuses, so it is called;
    # in the capture's own process, whose exception arrives as the one-line UserCodeError)
    changed = _entry(tmp_path, width=48)
    with pytest.raises(UserCodeError, match="raised AssertionError at .*captured although"):
        P.Predictor.for_search(WorkloadSpec.from_dict(changed), device, 64 << 20, cache=cache).prepare([8, 16, 32, 64])
    monkeypatch.setattr(P, "capture_training_stream", real_capture)
    for name in [m for m in sys.modules if m == "helper_mod" or m.startswith("oomtune_user_wl_")]:
        monkeypatch.delitem(sys.modules, name)   # this process loaded the old code; a new process would not
    # the old bytecode too: CPython checks a .pyc by its source's mtime in whole seconds and its size, and
    # "WIDTH = 48" rewritten within the second of "WIDTH = 32" (same size) would load the old code
    shutil.rmtree(tmp_path / "__pycache__", ignore_errors=True)
    fresh = P.Predictor.for_search(WorkloadSpec.from_dict(changed), device, 64 << 20, cache=cache)
    assert fresh.predict_detail(64, "").peak_allocated_bytes > want[64].peak_allocated_bytes   # 48 features, not 32


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.setenv("OOMTUNE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache().directory == tmp_path / "c"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OOMTUNE_CACHE_DIR", "rel")   # a relative path is taken from where the command runs
    assert default_cache().directory == tmp_path / "rel"
    for off in ("off", "0", "OFF", "none"):
        monkeypatch.setenv("OOMTUNE_CACHE_DIR", off)
        assert default_cache() is None
    monkeypatch.delenv("OOMTUNE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache().directory == tmp_path / "xdg" / "oomtune" / "streams"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relxdg")   # relative: invalid by the XDG spec, ignored
    assert default_cache().directory == tmp_path / "home" / ".cache" / "oomtune" / "streams"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache().directory == tmp_path / "home" / ".cache" / "oomtune" / "streams"
    assert default_cache(enabled=False) is None


def test_a_predictor_on_a_warm_cache_captures_nothing_and_predicts_the_same(tmp_path, monkeypatch):
    from oomtune.alloc.geometry import budget_geometry
    from oomtune.plan import predictor as P

    geometry = budget_geometry(64 << 20, 1 << 30)
    grid = [8, 16, 24, 32, 48, 64]
    confs = ["", "expandable_segments:True", "max_split_size_mb:20,roundup_power2_divisions:4"]
    fresh = P.Predictor(WorkloadSpec.from_dict(MLP), geometry)   # no cache: the reference
    fresh.prepare(grid)
    expected = {(b, c): fresh.predict_detail(b, c) for b in grid for c in confs}

    cold = P.Predictor(WorkloadSpec.from_dict(MLP), geometry, cache=StreamCache(tmp_path))
    cold.prepare(grid)
    assert {(b, c): cold.predict_detail(b, c) for b in grid for c in confs} == expected
    assert cold.cached_batches == [] and cold.captures == fresh.captures

    def no_capture(*a, **k):
        raise AssertionError("captured although the cache holds the stream")

    monkeypatch.setattr(P, "capture_training_stream", no_capture)
    warm = P.Predictor(WorkloadSpec.from_dict(MLP), geometry, cache=StreamCache(tmp_path))
    warm.prepare(grid)
    assert {(b, c): warm.predict_detail(b, c) for b in grid for c in confs} == expected
    assert sorted(warm.cached_batches) == sorted(fresh._captured) and warm.derived_batches == fresh.derived_batches
    # read_cache=False captures again (here: the capture function refuses, so it must be called)
    again = P.Predictor(WorkloadSpec.from_dict(MLP), geometry, cache=StreamCache(tmp_path), read_cache=False)
    with pytest.raises(AssertionError, match="captured although"):
        again.prepare(grid)


PLAN = ["plan", "model=mlp", "model.in_features=64", "model.hidden=128", "model.layers=1", "model.num_classes=10",
        "budget=64MiB", "device=cpu", "virtual_device_memory=1GiB", "search.batch_size.low=8",
        "search.batch_size.high=96"]


def _plan_process(tmp_path: Path, name: str, *extra: str) -> tuple[dict, list[str], str]:
    """Run ``oomtune plan`` in a fresh interpreter with the cache in tmp_path/cache: (plan.yaml, the
    heavy modules loaded when it finished, its output)."""
    out = tmp_path / name
    code = ("import sys, json\nfrom oomtune.cli import main\n"
            f"rc = main({[*PLAN, f'hydra.run.dir={out}', '--out', str(out / 'plan.yaml'), *extra]!r})\n"
            "print(json.dumps({'rc': rc, 'loaded': sorted(m for m in ('torch', 'torchvision') if m in sys.modules)}))")
    env = dict(os.environ, OOMTUNE_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["rc"] == 0
    # the output's lines wrap at 120 columns (rich): compare with spaces normalised
    return yaml.safe_load((out / "plan.yaml").read_text()), last["loaded"], " ".join(proc.stdout.split())


def _without_timing(plan: dict) -> dict:
    return {k: v for k, v in plan.items() if k not in ("timing", "created")}


@pytest.mark.slow
def test_a_repeated_plan_reads_the_cache_gives_the_same_map_and_imports_no_torch(tmp_path):
    cold, cold_loaded, cold_text = _plan_process(tmp_path, "cold")
    assert f"kept in the stream cache {tmp_path / 'cache'}" in cold_text
    assert "torch" in cold_loaded
    assert cold["timing"]["cached"] == 0 and cold["timing"]["captures"] >= 3
    warm, warm_loaded, text = _plan_process(tmp_path, "warm")
    assert f"kept in the stream cache {tmp_path / 'cache'}" not in text
    assert warm_loaded == []
    assert warm["timing"]["cached"] == warm["timing"]["captures"] == cold["timing"]["captures"]
    assert "read from the stream cache" in text
    assert _without_timing(warm) == _without_timing(cold)
    again, again_loaded, _ = _plan_process(tmp_path, "again", "--no-cache")
    assert again["timing"]["cached"] == 0 and "torch" in again_loaded
    assert _without_timing(again) == _without_timing(cold)


def test_the_search_predictor_takes_the_cache_and_says_what_it_read(tmp_path):
    from oomtune.device import resolve_device
    from oomtune.plan.predictor import Predictor
    from oomtune.search.run import _cached_words

    device = resolve_device("cpu", virtual_device_memory="1GiB")
    first = Predictor.for_search(WorkloadSpec.from_dict(MLP), device, 64 << 20, cache=StreamCache(tmp_path))
    first.predict_detail(16, "")
    assert _cached_words(first) == ""   # it captured
    second = Predictor.for_search(WorkloadSpec.from_dict(MLP), device, 64 << 20, cache=StreamCache(tmp_path))
    assert second.predict_detail(16, "") == first.predict_detail(16, "")
    assert second.cached_batches == [16] and _cached_words(second) == ", 1 of 1 read from the stream cache"


def test_a_plan_with_an_unwritable_cache_says_so_and_still_plans(tmp_path, monkeypatch, capsys):
    from oomtune.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("OOMTUNE_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "p" / "plan.yaml"
    assert main([*PLAN[:-2], "+plan.batch_sizes=[8,16]", "--out", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())   # rich wraps the lines at 120 columns
    assert f"note: the stream cache {blocker / 'cache'} cannot be written (Not a directory)" in text
    assert yaml.safe_load(out.read_text())["timing"]["cached"] == 0
