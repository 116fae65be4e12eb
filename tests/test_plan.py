"""``oomtune plan``: the batch grid, the exact bisection, agreement with live virtual-GPU trials,
plan.yaml, and bad input (exit 2)."""

from __future__ import annotations

import os

import pytest
import yaml

from oomtune.cli import main
from oomtune.commands.plan import plan
from oomtune.plan.feasibility import grid_batches, largest_fitting
from oomtune.trial.child import run_child
from oomtune.trial.record import TrialSpec
from oomtune.units import MiB
from oomtune.workload_spec import WorkloadSpec

# A tiny MLP: every tensor < 1 MiB (small pool) at the batch sizes used here.
MLP = ["model=mlp", "model.in_features=64", "model.hidden=128", "model.layers=1", "model.num_classes=10",
       "model.optimizer=sgd"]
RESNET = ["model=resnet", "model.depth=18", "model.image_size=32", "model.num_classes=10"]


class _Quiet:
    """A console that swallows output (plan() prints the table)."""

    def print(self, *a, **k):
        pass


def _plan(tmp_path, *overrides):
    return plan(["device=cpu", f"hydra.run.dir={tmp_path}/run", *overrides], console=_Quiet())


# -- grid and bisection (hand-computed) --------------------------------------------------------------
@pytest.mark.parametrize("low, high, expected", [
    (8, 1024, [8, 16, 32, 64, 128, 256, 512, 1024]),
    (6, 100, [6, 8, 16, 32, 64, 100]),
    (1, 1, [1]),
    (3, 3, [3]),
])
def test_grid_is_powers_of_two_plus_both_ends(low, high, expected):
    assert grid_batches(low, high) == expected


def test_explicit_grid_is_sorted_and_deduplicated():
    assert grid_batches(8, 1024, [32, 8, 32]) == [8, 32]


@pytest.mark.parametrize("bad", [[], [0], [8, "x"], [True]])
def test_bad_explicit_grid_is_a_config_error(bad):
    from oomtune.exceptions import ConfigError

    with pytest.raises(ConfigError, match="plan.batch_sizes"):
        grid_batches(8, 1024, bad)


@pytest.mark.parametrize("limit, expected", [(300, 300), (8, 8), (7, None), (1024, 1024), (5000, 1024),
                                             (511, 511), (512, 512), (513, 513)])
def test_bisection_finds_the_exact_largest_fitting_batch(limit, expected):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= limit

    grid = grid_batches(8, 1024)
    assert largest_fitting(fits, grid) == expected
    # grid scan (at most 8 calls) + bisection over a gap of at most 512 (at most 9 calls)
    assert len(calls) <= len(grid) + 9


# -- agreement with live virtual-GPU trials --------------------------------------------------------
def _trial(workload, batch, budget, alloc_conf=""):
    """A virtual-GPU trial in this process, the config's steps (trial.warmup_steps 1 + measure_steps 3),
    which the plan captures (oomtune.plan.predictor.trial_steps)."""
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") == alloc_conf == ""
    return run_child(TrialSpec(workload=workload, batch_size=batch, alloc_conf=alloc_conf, device="cpu",
                               budget_bytes=budget, warmup_steps=1, measure_steps=3,
                               device_memory_bytes=80 << 30))  # the search's virtual GPU (virtual_device_memory)


def _clear_alloc_env(monkeypatch):
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("model, batch", [(MLP, 16), (RESNET, 4)])
def test_plan_agrees_exactly_with_a_live_virtual_gpu_trial(model, batch, tmp_path, monkeypatch):
    _clear_alloc_env(monkeypatch)
    fmap = _plan(tmp_path, *model, "budget=1GiB", f"+plan.batch_sizes=[{batch}]",
                 "search.space.expandable_segments=[false]", "search.space.max_split_size_mb=[null]",
                 "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[null]")
    assert [r.alloc_conf for r in fmap.rows] == [""]
    cell = fmap.rows[0].cells[0]
    res = _trial(fmap.workload, batch, 1 << 30)
    assert res.outcome == "ok", res.message
    assert res.memory.source == "simulated"
    assert cell.fits
    assert cell.peak_reserved_bytes == res.memory.peak_reserved_bytes
    assert cell.peak_allocated_bytes == res.memory.peak_allocated_bytes


def test_plan_agrees_with_a_spawned_trial_under_expandable_segments(tmp_path, monkeypatch):
    """Non-default settings must reach torch before its allocator config is parsed: a fresh process."""
    from oomtune.trial.runner import TrialRunner

    _clear_alloc_env(monkeypatch)
    fmap = _plan(tmp_path, *RESNET, "budget=1GiB", "+plan.batch_sizes=[4]", "search.space.max_split_size_mb=[null]",
                 "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[null]")
    row = next(r for r in fmap.rows if r.alloc_conf == "expandable_segments:True")
    spec = TrialSpec(workload=fmap.workload, batch_size=4, alloc_conf=row.alloc_conf, device="cpu",
                     budget_bytes=1 << 30, warmup_steps=1, measure_steps=3, timeout_s=120,
                     device_memory_bytes=fmap.geometry["total_memory_bytes"])
    res = TrialRunner(launcher="spawn").run(spec, workdir=tmp_path / "trial")
    assert res.outcome == "ok", res.message
    assert row.cells[0].peak_reserved_bytes == res.memory.peak_reserved_bytes
    assert row.cells[0].peak_allocated_bytes == res.memory.peak_allocated_bytes


def test_plan_predicts_the_trials_own_steps_where_a_late_step_peaks_higher(tmp_path, monkeypatch):
    """garbage_collection_threshold frees cached blocks by age, so the allocator's state keeps changing
    after the second step: ResNet-18 64x64 at batch 456 under a 1 GiB budget peaked at 988 MiB in its
    4th step in the README's search (above the 972.8 MiB limit), while a 2-step capture put it within.
    The plan captures the trial's warmup_steps + measure_steps (1 + 3 by default), so its cell is the
    spawned trial's measured peak, to the byte, and both say it is above the limit. The trial runs its
    steps on the meta device, as the search's trials on the virtual GPU do (``trial.execute=auto``):
    its memory figures are the simulator's either way, and the same four steps on the CPU would cost a
    minute of ResNet-18 arithmetic at batch 456 (the CPU run's agreement with the plan is the two
    tests above)."""
    from oomtune.trial.runner import TrialRunner

    _clear_alloc_env(monkeypatch)
    conf = "garbage_collection_threshold:0.8"
    fmap = _plan(tmp_path, "model=resnet", "budget=1GiB", "+plan.batch_sizes=[456]",
                 "search.space.expandable_segments=[false]", "search.space.max_split_size_mb=[null]",
                 "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[0.8]")
    row = next(r for r in fmap.rows if r.alloc_conf == conf)
    spec = TrialSpec(workload=fmap.workload, batch_size=456, alloc_conf=conf, device="cpu", budget_bytes=1 << 30,
                     warmup_steps=1, measure_steps=3, timeout_s=300, execute="meta",
                     device_memory_bytes=fmap.geometry["total_memory_bytes"])
    res = TrialRunner(launcher="spawn").run(spec, workdir=tmp_path / "trial")
    assert res.outcome == "ok", res.message
    assert res.execution.where == "meta"
    limit = int((1 << 30) * 0.95)   # budget x (1 - search.headroom 0.05)
    assert res.memory.peak_reserved_bytes > limit and not row.cells[0].fits
    assert row.cells[0].peak_reserved_bytes == res.memory.peak_reserved_bytes


@pytest.mark.parametrize("budget, high, expected, over_outcomes", [
    # Hand calculation: at batch 2049 the hidden activation is 2049 * 128 * 4 = 1,049,088 bytes, above
    # kSmallSize (1 MiB), so it needs a large-pool segment of at least kLargeBuffer = 20 MiB, which a
    # 6 MiB budget cannot hold; at 2048 it is exactly 1 MiB and stays in the small pool.
    # The class at 2049: the trial's virtual GPU is 80 GiB with the budget as memory fraction (the
    # message prints "6.00 MiB allowed", the card has ~80 GiB free). "Tried to allocate 20.00 MiB" is a
    # request of at most 10 MiB - 512 B; free under the fraction + reserved-but-unallocated is
    # 6 MiB - allocated < 10 MiB, so not fragmentation; the fraction (6 MiB < 80 GiB) was the limit:
    # "fraction_cap".
    (6 * MiB, 8192, 2048, ("fraction_cap",)),
    # 30 MiB: the boundary lies between grid points (found by bisection; the trials are the oracle).
    # Not plain "oom" (the fraction is the limit, the card has ~80 GiB free); which of the two others
    # depends on the request that fails at B + 1 and the memory allocated then (fragmentation when the
    # request <= 30 MiB - allocated), and B is not known by hand: both stay possible. The class at a
    # hand-known boundary is exact in the case above.
    (30 * MiB, 16384, None, ("fraction_cap", "oom_fragmentation")),
])
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_largest_fitting_batch_is_the_trial_boundary(budget, high, expected, over_outcomes, tmp_path,
                                                     monkeypatch):
    """The predicted maximum B runs in a live virtual-GPU trial and B + 1 runs out of memory."""
    _clear_alloc_env(monkeypatch)
    # headroom 0: "fits" is then exactly "the trial does not run out of memory" (the OOM boundary)
    fmap = _plan(tmp_path, *MLP, f"budget={budget}B", "search.headroom=0", "search.batch_size.low=8",
                 f"search.batch_size.high={high}",
                 "search.space.expandable_segments=[false]", "search.space.max_split_size_mb=[null]",
                 "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[null]")
    row = fmap.rows[0]
    best = row.max_batch_size
    if expected is not None:
        assert best == expected
    else:
        assert best is not None and best not in fmap.batch_sizes and 8 < best < high
    ok = _trial(fmap.workload, best, budget)
    over = _trial(fmap.workload, best + 1, budget)
    assert ok.outcome == "ok", ok.message
    assert over.outcome in over_outcomes, over.outcome
    assert row.at_max.peak_reserved_bytes == ok.memory.peak_reserved_bytes <= budget


# -- plan.yaml and the command -------------------------------------------------------------------------
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_plan_yaml_has_every_configuration_of_the_default_space(tmp_path, monkeypatch, capsys):
    out = tmp_path / "p" / "plan.yaml"
    code = main(["plan", "device=cpu", *MLP, "budget=1GiB", "+plan.batch_sizes=[8,32]", "--out", str(out)])
    assert code == 0
    data = yaml.safe_load(out.read_text())
    # default space: expandable 2 x max_split 3 x roundup 2 x gc 2
    assert len(data["configurations"]) == 2 * 3 * 2 * 2
    assert data["memory_source"] == "simulated" and data["batch_sizes"] == [8, 32]
    assert data["device"]["budget_bytes"] == 1 << 30
    # the virtual GPU is virtual_device_memory (80 GiB) with the 1 GiB budget as its memory fraction
    assert data["geometry"] == {"total_memory_bytes": 80 << 30, "memory_fraction": 1 / 80}
    # the tiny MLP's tensors all fit one 2 MiB small-pool segment (kSmallBuffer) at batch 8
    assert all(c["batches"][0]["peak_reserved_bytes"] == 2 * MiB for c in data["configurations"])
    text = capsys.readouterr().out
    assert "simulated" in text and "capture" in text and "replay" in text
    # written with libyaml's emitter where there is one: the text PyYAML's own safe_dump gives
    assert out.read_text() == yaml.safe_dump(data, sort_keys=False)


def test_plan_writes_into_the_run_dir_by_default(tmp_path):
    assert main(["plan", "device=cpu", *MLP, "+plan.batch_sizes=[8]", f"hydra.run.dir={tmp_path}/r",
                 "search.space.expandable_segments=[false]"]) == 0
    assert (tmp_path / "r" / "plan.yaml").is_file()


@pytest.mark.parametrize("args, needle", [
    (["model=nope"], "bad override model=nope"),
    (["budget=lots"], "invalid size"),
    (["budget=100GiB", "virtual_device_memory=80GiB"], "above"),
    (["search.space.garbage_collection_threshold=[1.5]"], "garbage_collection_threshold"),
    (["search.space.max_split_size_mb=[5]"], "max_split_size_mb"),
    (["model.depth=19"], "model.depth"),
    (["+plan.batch_sizes=[0]"], "plan.batch_sizes"),
    (["target=python", "target.entry=no_such_module_xyz:make"], "no_such_module_xyz"),
    (["target=cmd", "target.command='python train.py'"], "cannot be traced"),
    (["search.headroom=1"], "search.headroom=1"),
    (["search.headroom=-0.1"], "search.headroom=-0.1"),
    (["search.headroom=abc"], "search.headroom"),
    # keys the plan itself does not read are checked as the search checks them (same overrides)
    (["search.objective=fast"], "search.objective='fast': must be auto, throughput or batch"),
    (["trial.measure_steps=0"], "trial.measure_steps=0: must be >= 1"),
])
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path, capsys):
    code = main(["plan", "device=cpu", f"hydra.run.dir={tmp_path}/run", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("oomtune: error: ") and needle in err
    assert len(err.splitlines()) == 1


# -- headroom: the search's feasibility (completes AND peak reserved <= budget * (1 - headroom)) -------
SINGLE = ["search.space.expandable_segments=[false]", "search.space.max_split_size_mb=[null]",
          "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[null]"]


@pytest.mark.parametrize("headroom, limit, expected", [
    # the tiny MLP at batch 8 reserves one kSmallBuffer = 2 MiB segment (hand calculation, see above);
    # 4 MiB * (1 - 0.5) = 2 MiB exactly: fits (inclusive, as MemoryLimit in the search)
    ("0.5", 2 * MiB, 8),
    # 4 MiB * 0.49 = 2,055,208.96 -> 2,055,208 bytes < 2 MiB: completes, but over the limit
    ("0.51", 2_055_208, None),
])
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_headroom_decides_the_largest_batch_like_the_search(headroom, limit, expected, tmp_path, monkeypatch):
    _clear_alloc_env(monkeypatch)
    fmap = _plan(tmp_path, *MLP, "budget=4MiB", f"search.headroom={headroom}", "+plan.batch_sizes=[8]", *SINGLE)
    assert fmap.limit_bytes == limit
    cell = fmap.rows[0].cells[0]
    assert cell.completes and cell.peak_reserved_bytes == 2 * MiB
    assert cell.fits is (expected is not None)
    assert fmap.rows[0].max_batch_size == expected


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_plan_header_and_yaml_show_the_limit(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "device=cpu", *MLP, "budget=4MiB", "search.headroom=0.5", "+plan.batch_sizes=[8]",
                 *SINGLE, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "budget 4.00 MiB, limit 2.00 MiB with headroom 50%" in text
    assert "2.00 MiB" in text and "2097152" not in text   # sizes formatted, never raw bytes
    data = yaml.safe_load(out.read_text())
    assert data["limit"] == {"headroom": 0.5, "limit_bytes": 2 * MiB}
    assert data["configurations"][0]["batches"][0]["fits"] is True


def test_plan_header_and_yaml_name_the_target_gpu(tmp_path, capsys):
    """model.gpu: printed in the header (with how it was chosen) and recorded in plan.yaml."""
    out = tmp_path / "plan.yaml"
    assert main(["plan", "device=cpu", *MLP, "budget=4MiB", "+plan.batch_sizes=[8]", *SINGLE, "--out", str(out)]) == 0
    out_text = " ".join(capsys.readouterr().out.split())   # the console wraps long lines
    assert ("target GPU: A100 (sm80, 108 SMs; the default: set model.gpu= to the GPU you will train on): "
            "attention, dropout, mixed precision and optimizers run its kernels") in out_text
    assert main(["plan", "device=cpu", *MLP, "model.gpu=h100", "budget=4MiB", "+plan.batch_sizes=[8]", *SINGLE,
                 "--out", str(out)]) == 0
    assert "target GPU: H100 (sm90, 132 SMs): " in " ".join(capsys.readouterr().out.split())
    data = yaml.safe_load(out.read_text())
    assert data["device"]["target_gpu"] == {"name": "H100", "compute_capability": "9.0", "sm_count": 132,
                                            "key": "h100", "source": "model.gpu"}
    assert data["workload"]["gpu"] == "h100"


# -- cudaMallocAsync: not simulated; skipped with a notice, an error only when nothing is left ------------
def test_predictor_gives_no_prediction_for_cuda_malloc_async():
    from types import SimpleNamespace

    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.plan.predictor import Predictor

    # a workload that cannot even be built: None must come before any capture is attempted
    predictor = Predictor(WorkloadSpec.from_dict({"name": "no_such_model"}), {"total_memory_bytes": 1 << 30, "memory_fraction": 1.0})
    cand = SimpleNamespace(batch_size=8, settings=AllocatorSettings.parse("backend:cudaMallocAsync"))
    assert predictor.predict(cand) is None


def test_plan_skips_cuda_malloc_async_configurations_with_a_notice(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    code = main(["plan", "device=cpu", *MLP, "budget=1GiB", "+plan.batch_sizes=[8]", *SINGLE,
                 "search.space.backend=[native,cudaMallocAsync]", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "note: skipping 1 backend:cudaMallocAsync configuration(s)" in captured.out
    data = yaml.safe_load(out.read_text())
    assert [c["alloc_conf"] for c in data["configurations"]] == [""]
    assert data["skipped"] == ["backend:cudaMallocAsync"]


def test_only_cuda_malloc_async_configurations_exit_2_before_writing(tmp_path, capsys, monkeypatch):
    from oomtune.space import SearchSpace

    # the search space always adds torch's default (native), so only a space without it gets here
    monkeypatch.setattr(SearchSpace, "all_settings", lambda self: [{"backend": "cudaMallocAsync"}])
    out = tmp_path / "plan.yaml"
    assert main(["plan", "device=cpu", *MLP, "+plan.batch_sizes=[8]", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oomtune: error: every configuration") and "cudaMallocAsync" in err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_unwritable_out_exits_2_before_predicting(tmp_path, capsys, monkeypatch):
    from oomtune.plan import feasibility

    def boom(*a, **k):
        raise AssertionError("predicted although the output cannot be written")

    monkeypatch.setattr(feasibility, "build_plan", boom)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["plan", "device=cpu", *MLP, "+plan.batch_sizes=[8]", "--out", str(blocker / "plan.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oomtune: error: --out") and len(err.splitlines()) == 1


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_predict_raw_is_none_for_cuda_malloc_async_and_the_replay_otherwise(monkeypatch):
    from oomtune.plan.predictor import Predictor

    _clear_alloc_env(monkeypatch)
    model = {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 1, "num_classes": 10, "optimizer": "sgd"}
    predictor = Predictor(WorkloadSpec.from_dict(model), {"total_memory_bytes": 1 << 30, "memory_fraction": 1.0})
    assert predictor.predict_raw(8, "backend:cudaMallocAsync") is None
    assert predictor.predict_raw(8, "") == 2 * MiB   # one kSmallBuffer segment (hand calculation above)


# -- a plan under a shape distribution predicts at its worst shape, and survives the soak
TINY_LM = ["model=transformer", "model.layers=2", "model.d_model=256", "model.vocab_size=32000", "budget=2GiB",
           "search.batch_size.low=1", "search.batch_size.high=64", "search.space.max_split_size_mb=[null]",
           "search.space.roundup_power2_divisions=[null]"]


@pytest.mark.slow
def test_plan_under_lengths_never_exceeds_the_plan_at_the_longest_length_and_survives_the_soak(tmp_path):
    """The issue's case: 2 layers, d_model 256, vocabulary 32000, budget 2 GiB. Before, the plan under
    lengths 64..1024 captured the data's first lengths (the longest 888) and planned batch 4 where a
    fixed length of 1024 plans 3. Now: per configuration, the planned batch under the distribution is
    at most the one at length 1024, and the recommended batch survives a 2000-step soak of the data's
    lengths (oomtune.trial.soak, as the search's confirmation soaks it)."""
    from oomtune.display import recommended_configuration
    from oomtune.trial.soak import soak

    varied = _plan(tmp_path / "a", *TINY_LM, "model.seq_len={low:64,high:1024}").to_dict()
    fixed = _plan(tmp_path / "b", *TINY_LM, "model.seq_len=1024").to_dict()
    at_1024 = {c["alloc_conf"]: c["max_batch_size"] for c in fixed["configurations"]}
    for c in varied["configurations"]:
        assert c["max_batch_size"] is not None and c["max_batch_size"] <= at_1024[c["alloc_conf"]], c["alloc_conf"]
    assert varied["shapes"]["worst"] == 1024 and varied["shapes"]["soak_steps"] == 2000
    rec = recommended_configuration(varied["configurations"])
    model = {**varied["workload"]}
    model.pop("target", None)
    geometry = varied["geometry"]
    result = soak(model, rec["max_batch_size"], rec["alloc_conf"], device_memory_bytes=geometry["total_memory_bytes"],
                  memory_fraction=geometry["memory_fraction"], steps=2000)
    assert result.passed, result.message


# find_soak_case's model (2 layers, d_model 64, vocabulary 2048, lengths 64..512 in buckets of 64) at
# 200 MiB, planned over the default allocator, expandable_segments:True and max_split_size_mb:64 (with
# and without expandable segments): four configurations.
SOAK_LM = ["model=transformer", "model.layers=2", "model.d_model=64", "model.vocab_size=2048",
           "model.seq_len={low:64,high:512,pad_multiple:64}", "budget=200MiB", "search.batch_size.low=1",
           "search.batch_size.high=16", "search.space.max_split_size_mb=[null,64]",
           "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[null]"]


@pytest.fixture(scope="module")
def soak_plan_in_one_process(tmp_path_factory):
    """``plan`` of SOAK_LM with its soak rows in this process alone (``default_workers`` 1) and
    ``CUBLAS_WORKSPACE_CONFIG=:0:0`` (a hand-sized device of a few MiB), as a dict: run once per session by
    whichever pytest-xdist worker asks first (an exclusive lock on a file in the session's shared
    temporary folder; the others read its pickle), and asserted on by the soak's step-down test (its
    default and expandable_segments:True rows) and by the spread-over-processes test (every row)."""
    import fcntl
    import pickle

    import oomtune.plan.parallel as W

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):   # each worker's basetemp is a folder of the session's
        root = root.parent
    folder = root / "plan-soak-lm-one-process"
    folder.mkdir(exist_ok=True)
    done = folder / "plan.pickle"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                with pytest.MonkeyPatch.context() as mp:
                    mp.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
                    mp.setattr(W, "default_workers", lambda: 1)
                    data = _plan(folder, *SOAK_LM).to_dict()
                done.write_bytes(pickle.dumps(data))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return pickle.loads(done.read_bytes())


@pytest.mark.slow
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_plan_steps_a_configuration_down_to_the_batch_that_survives_the_soak(soak_plan_in_one_process):
    """find_soak_case's model (2 layers, d_model 64, vocabulary 2048, lengths 64..512 in buckets of
    64) at 200 MiB (found by scanning budgets 60..300 MiB with `oomtune plan` under the fused-SDPA
    kernels a capture runs as on the GPU): the default allocator fits its largest batch at length 512 on a fresh
    allocator but runs out of memory in the soak, so its planned batch is the largest that survives
    (each checked here with the soak itself), while expandable_segments:True keeps its batch. The plan
    is the spread test's one-process plan: its rows of these two configurations are those of a plan
    of these two alone (each configuration's row is planned and soaked on its own; the two
    max_split_size_mb:64 rows beside them are that test's, and this one's assertions read only the two
    configurations' rows and their entries of the stepped-down list)."""
    from oomtune.trial.soak import soak

    data = soak_plan_in_one_process
    rows = {c["alloc_conf"]: c for c in data["configurations"]}
    default, es = rows[""], rows["expandable_segments:True"]
    model = {k: v for k, v in data["workload"].items() if k != "target"}
    g = data["geometry"]

    def survives(batch, conf):
        return soak(model, batch, conf, device_memory_bytes=g["total_memory_bytes"],
                    memory_fraction=g["memory_fraction"], steps=2000).passed

    assert default["soak"]["passed"] is False and default["max_batch_size"] < default["worst_shape_max_batch_size"]
    assert default["soak"]["failed"]["batch_size"] == default["worst_shape_max_batch_size"]
    assert survives(default["max_batch_size"], "") and not survives(default["max_batch_size"] + 1, "")
    assert es["soak"]["passed"] is True and survives(es["max_batch_size"], "expandable_segments:True")
    stepped = {k: v for k, v in data["shapes"]["stepped_down"].items() if k in ("", "expandable_segments:True")}
    assert stepped == {"": [default["worst_shape_max_batch_size"], default["max_batch_size"]]}


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the soak's rows are spread over forked processes on POSIX")
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_plan_soak_spread_over_processes_gives_the_one_process_rows(tmp_path, monkeypatch, soak_plan_in_one_process):
    """The soak's rows run in forked processes (oomtune.plan.parallel.fork_map): each row's record,
    planned batch and the stepped-down list equal those of the same plan soaked in this process alone."""
    import oomtune.plan.parallel as W

    monkeypatch.setattr(W, "default_workers", lambda: 3)
    spread = _plan(tmp_path / "a", *SOAK_LM).to_dict()
    alone = soak_plan_in_one_process

    def rows(data):
        return [(c["alloc_conf"], c["max_batch_size"], c["worst_shape_max_batch_size"], c["soak"])
                for c in data["configurations"]]

    assert rows(spread) == rows(alone)
    assert len(rows(alone)) == 4 and any(not r[3]["passed"] for r in rows(alone))   # a bisection ran
    assert spread["shapes"]["stepped_down"] == alone["shapes"]["stepped_down"]
    assert spread["shapes"]["soak_captures"] == alone["shapes"]["soak_captures"]
