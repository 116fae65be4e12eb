"""The HTML report (oomtune/htmlreport/) on a hand-made run directory (tests/report_run.py), the winner's
step snapshot, and the human output of display.py used by plan and search."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from oomtune.cli import main
from oomtune.htmlreport import build_report
from oomtune.htmlreport._data import gather
from oomtune.htmlreport._step import step_series
from oomtune.trace.snapshot import TRACE_ACTIONS, load_snapshot
from oomtune.workload_spec import WorkloadSpec

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from report_run import MiB, make_run_dir  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run_dir(tmp_path_factory.mktemp("report"))


def test_report_is_one_offline_file_with_every_section(run_dir, tmp_path):
    path = build_report(run_dir, tmp_path / "r.html")
    text = path.read_text()
    # plotly.js embedded once, nothing fetched from the network
    assert re.search(r"<script[^>]+src=", text) is None and re.search(r"<link[^>]+href=", text) is None
    assert text.count("Plotly.newPlot") == 5
    for div in ("fig-frontier", "fig-throughput", "fig-step", "fig-peak", "fig-timeline"):
        assert f'id="{div}"' in text
    # every figure says where its figures came from
    assert text.count("simulated on the virtual GPU") >= 4
    # the summary of best.yaml, the gain, the verdict, advice per failure class that occurred
    assert "Recommended: batch 96 with" in text and "throughput x1.30" in text and "not input-bound" in text
    # best.yaml names trial 2 and no metrics_trial_number (an older file), confirmed: its figures are
    # the confirmation's; the throughput of a simulated run is the CPU's
    assert "trial 2, figures from its clean-process confirmation" in text and "128.0 samples/s (CPU)" in text
    for outcome in ("oom", "oom_fragmentation", "predicted_infeasible"):
        assert f"<b>{outcome}</b>" in text
    assert "https://pytorch.org/memory_viz" in text and "optuna-dashboard sqlite:///" in text


def test_report_reads_trials_from_the_study_storage(run_dir):
    data = gather(run_dir)
    assert [t["number"] for t in data.trials] == [0, 1, 2, 3, 4, 5]
    assert [t["feasible"] for t in data.trials] == [True, False, True, False, False, True]
    assert data.trials[2]["duration_s"] == 5.0 and data.trials[2]["peak_reserved_bytes"] == 700 * MiB
    assert data.plan_file == "frontier.yaml" and data.memory_source == "simulated"


def test_report_tolerates_missing_parts(tmp_path):
    run = tmp_path / "plan_only"
    run.mkdir()
    (run / "plan.yaml").write_text("configurations: []\n")
    text = build_report(run).read_text()
    assert "fig-" not in text.split("</script>", 1)[1]  # nothing to draw, still a page
    with pytest.raises(Exception, match="holds no run.json"):
        build_report(tmp_path)


def test_step_snapshot_is_memory_viz_format_and_matches_the_allocator_rules(run_dir):
    snap = load_snapshot(run_dir / "winner_step.pickle")  # oomtune's restricted unpickler
    trace = snap["device_traces"][0]
    assert {e["action"] for e in trace} <= TRACE_ACTIONS
    assert all(set(e) == {"action", "addr", "size", "stream", "time_us", "frames"} for e in trace)
    # a 3 MiB request opens a 20 MiB segment (kLargeBuffer), recorded before the alloc it serves;
    # 1000 bytes open a 2 MiB small-pool segment; the 5 MiB request reuses the freed 20 MiB segment
    actions = [(e["action"], e["size"]) for e in trace]
    assert actions == [("segment_alloc", 20 * MiB), ("alloc", 3 * MiB), ("segment_alloc", 2 * MiB), ("alloc", 1000),
                       ("free_requested", 3 * MiB), ("free_completed", 3 * MiB), ("alloc", 5 * MiB),
                       ("free_requested", 5 * MiB), ("free_completed", 5 * MiB)]
    assert sum(s["total_size"] for s in snap["segments"]) == 22 * MiB
    series = step_series(snap)
    assert series["peak_allocated_bytes"] == 5 * MiB + 1000 and series["peak_reserved_bytes"] == 22 * MiB
    # at the peak: the 20 MiB segment holds the 5 MiB block (15 MiB free after it), the 2 MiB one the
    # 1000-byte request in a 1024-byte block (512-byte rounding)
    assert series["at_peak"][0] | {"address": 0} == {"address": 0, "size": 20 * MiB, "allocated": 5 * MiB,
                                                     "largest_free": 15 * MiB}
    assert series["at_peak"][1]["largest_free"] == 2 * MiB - 1024


def test_step_snapshot_replays_to_the_same_segments(run_dir):
    from oomtune.trace.replay import replay_snapshot

    snap = load_snapshot(run_dir / "winner_step.pickle")
    result = replay_snapshot(snap, "", total_memory_bytes=1024 * MiB)
    assert result.first_divergence is None
    assert result.recorded_segment_allocs == result.simulated_segment_allocs == [20 * MiB, 2 * MiB]
    assert result.simulated_final_reserved_bytes == result.recorded_final_reserved_bytes == 22 * MiB


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64,roundup_power2_divisions:4",
                                  "garbage_collection_threshold:0.8,expandable_segments:True"])
def test_step_snapshot_records_its_settings_as_torch_does(conf):
    """torch's _snapshot() layout (THCPModule_memorySnapshot): max_split_size in bytes, -1 when
    unlimited; roundup_power2_divisions per interval start in MiB; read back as the same settings,
    so `oomtune simulate winner_step.pickle` replays under the winner's settings by default."""
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.trace.recorded import recorded_settings, snapshot_settings

    rec = snapshot_settings(conf)
    assert rec["PYTORCH_CUDA_ALLOC_CONF"] == conf
    assert rec["max_split_size"] == (64 * MiB if "max_split" in conf else -1)
    assert rec["expandable_segments"] is ("expandable_segments:True" in conf)
    assert set(rec["roundup_power2_divisions"]) == {str(1 << i) for i in range(16)}
    assert set(rec["roundup_power2_divisions"].values()) == ({4} if "roundup" in conf else {0})
    settings, note = recorded_settings({"allocator_settings": rec})
    assert note is None and settings.render() == AllocatorSettings.parse(conf).render()


def test_simulate_labels_a_virtual_gpu_snapshot_as_such(run_dir, capsys):
    # winner_step.pickle carries oomtune: {memory_source: simulated}: its figures are not a device's
    assert main(["simulate", str(run_dir / "winner_step.pickle")]) == 0
    out = capsys.readouterr().out
    assert "(recorded on the virtual GPU)" in out and "recorded on device" not in out


def test_cli_report_writes_and_rejects_a_non_run_dir(run_dir, tmp_path, capsys):
    assert main(["report", str(run_dir), "--out", str(tmp_path / "x.html")]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "x.html").stat().st_size > 1_000_000
    proc = subprocess.run([sys.executable, "-m", "oomtune", "report", str(tmp_path / "missing")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a directory" in proc.stderr


# -- display.py: what plan and search print -----------------------------------------------------------

def test_short_conf_and_legend():
    from oomtune.display import conf_legend, short_conf

    conf = "expandable_segments:True,garbage_collection_threshold:0.8,roundup_power2_divisions:4"
    assert short_conf(conf) == "es:T gc:0.8 r2:4" and short_conf("") == "default"
    assert conf_legend([conf]) == ("es=expandable_segments, T=True, gc=garbage_collection_threshold, "
                                   "r2=roundup_power2_divisions")


def test_plan_recommendation_names_the_gain_over_the_default():
    from oomtune.display import plan_recommendation

    confs = [{"alloc_conf": "", "max_batch_size": 155}, {"alloc_conf": "expandable_segments:True", "max_batch_size": 185},
             {"alloc_conf": "max_split_size_mb:128", "max_batch_size": None}]
    # 185 / 155 = 1.194 -> +19%
    assert plan_recommendation(confs) == "expandable_segments:True: batch 185 vs 155 with the default allocator, +19%"
    assert plan_recommendation(confs[:1]) == "the default allocator: batch 155; no allocator setting fits a larger batch"
    assert plan_recommendation(confs[2:]) is None


def test_plan_compact_table_fits_120_columns_for_the_full_space():
    from rich.console import Console

    from oomtune import config as C
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.display import plan_compact_table
    from oomtune.space import SearchSpace

    space = SearchSpace.from_config(C.compose([]).search)  # the default space: 24 configurations

    batches = [8, 16, 32, 64, 128, 256, 512, 1024]
    confs = [{"alloc_conf": AllocatorSettings.from_mapping({k: v for k, v in m.items() if v is not None}).render(),
              "max_batch_size": 512, "at_max": {"peak_reserved_bytes": 15000 * MiB},
              "batches": [{"batch_size": b, "fits": b <= 512, "completes": b <= 512,
                           "peak_reserved_bytes": b * 30 * MiB} for b in batches]} for m in space.all_settings()]
    assert len(confs) == 24
    table, legend = plan_compact_table({"configurations": confs, "batch_sizes": batches})
    out = io.StringIO()
    Console(file=out, width=120).print(table)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 120 and not any("…" in line for line in lines)
    assert sum(1 for line in lines if re.match(r"\s*(default|es:|gc:|ms:|r2:)", line)) == 24
    assert "es=expandable_segments" in legend and "OOM" in legend


def test_search_progress_prints_one_line_per_trial_without_a_terminal():
    import optuna
    from rich.console import Console

    from oomtune.display import SearchProgress

    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=10.0, params={"batch_size": 8},
                                              distributions={"batch_size": optuna.distributions.IntDistribution(1, 9)},
                                              user_attrs={"role": "search", "outcome": "ok", "alloc_conf": "",
                                                          "result": {"outcome": "ok", "batch_size": 8,
                                                                     "throughput": {"samples_per_s": 10.0}}}))
    for terminal in (False, True):
        out = io.StringIO()
        progress = SearchProgress(Console(file=out, force_terminal=terminal, width=200), 3)
        progress.legend(simulated=True)
        progress(study.trials[0], "search")
        progress.close()
        text = out.getvalue()
        assert "[trial 0] search 1/3" in text and "ok >limit" in text and "throughput is this CPU's" in text
        assert ("eta" in text) is terminal  # the live bar only on a terminal
    # meta asked of a command (target=cmd): its integration runs the steps there, one without on the CPU
    for own_process, says in ((False, "the steps run on the meta device, so throughput is not measured"),
                              (True, "one without runs them on the CPU (throughput this CPU's")):
        out = io.StringIO()
        progress = SearchProgress(Console(file=out, width=200), 3)
        progress.legend(simulated=True, execute="meta", own_process=own_process)
        progress.close()
        assert says in out.getvalue()


def test_plan_prints_a_compact_map_and_a_recommendation_and_writes_the_report(tmp_path, capsys):
    run = tmp_path / "plan"
    assert main(["plan", "model=mlp", "device=cpu", "search.batch_size.low=8", "search.batch_size.high=64",
                 f"hydra.run.dir={run}"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # the map (the table, between the header line and the legend) fits 120 columns; every text line is
    # whole when piped (display.output_console): the first is the plan's one-line summary, unbroken
    start = next(i for i, line in enumerate(lines) if line.startswith("predicted peak reserved"))
    end = next(i for i, line in enumerate(lines) if line.startswith("legend: "))
    assert end - start > 3 and max(len(line) for line in lines[start:end]) <= 120
    assert lines[0].startswith("oomtune plan: mlp") and lines[0].endswith("x batch 8..64 (4 grid points + bisection)")   # 8, 16, 32, 64
    assert sum(1 for line in lines if line.startswith("recommendation (simulated): ")) == 1
    assert any(line.startswith("cells: MiB") for line in lines)
    text = (run / "report.html").read_text()
    assert 'id="fig-frontier"' in text and "Feasibility map" in text and "b=64" in text


def test_search_report_for_a_command_target_says_why_there_is_no_frontier(run_dir):
    from oomtune.htmlreport import write_search_report

    lines = []
    path = write_search_report(run_dir, lines.append, workload={"target": {"name": "cmd"}}, device=None,
                               budget_bytes=1 << 30, headroom=0.05)
    assert path == run_dir / "report.html" and path.is_file()
    assert lines[0].startswith("report: no predicted frontier or winner's step for target=cmd")
    assert lines[-1].startswith(f"wrote {run_dir / 'report.html'}")


def test_importing_the_html_report_keeps_oomtune_report_the_scripts_function():
    import oomtune
    import oomtune.htmlreport  # noqa: F401

    assert callable(oomtune.report) and oomtune.report.__module__ == "oomtune.script_api"


@pytest.mark.slow
def test_peak_segments_of_the_readme_runs_step_sum_to_the_segments_drawn():
    """The README main command's winner: ResNet-18 (64x64, 100 classes) at batch 483 under
    expandable_segments:True, 1 GiB budget on the 80 GiB virtual GPU, 4 steps. An
    expandable segment grows by mapping pages (20 MiB in the large pool, 2 MiB in the small one) and a
    block may span pages mapped at different times: the panel drew each mapped range as a segment,
    "957.6 MiB allocated + 124.6 MiB free over segments that sum to 972 MiB" and a "20 MiB" segment
    holding 41 MiB. Now: one segment per pool (allocator-spec: one expandable segment per pool and
    stream), each holding at most its size, the sizes summing to the reserved bytes at that event
    (the trace's own segment events, summed here) and to the 972 MiB the README reports."""
    from oomtune.device import resolve_device
    from oomtune.htmlreport._figures import peak_segments_figure
    from oomtune.htmlreport._step import step_series, synthesise_snapshot
    from oomtune.plan.predictor import Predictor, sim_geometry

    model = {"name": "resnet", "depth": 18, "image_size": 64, "num_classes": 100, "channels_last": False,
             "optimizer": "sgd", "lr": 0.1, "precision": "fp32", "data": {"source": "synthetic"}}
    geometry = sim_geometry(resolve_device("cpu", virtual_device_memory="80GiB"), 1 << 30)
    stream = Predictor(WorkloadSpec.from_dict(model), geometry, steps=4).stream(483)
    snap = synthesise_snapshot(stream, "expandable_segments:True", total_memory_bytes=geometry["total_memory_bytes"],
                               memory_fraction=geometry["memory_fraction"])
    series = step_series(snap)
    segs = series["at_peak"]
    reserved_then = 0
    for e in snap["device_traces"][0][: series["peak_index"] + 1]:
        if e["action"] in ("segment_alloc", "segment_map"):
            reserved_then += e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            reserved_then -= e["size"]
    assert len(segs) == 2 and all(0 <= s["allocated"] <= s["size"] for s in segs)
    assert sum(s["size"] for s in segs) == reserved_then == 972 * MiB
    assert sum(s["allocated"] for s in segs) == series["peak_allocated_bytes"]
    fig = peak_segments_figure(series, "simulated")
    allocated, free = (sum(trace.y) for trace in fig.data[:2])
    assert allocated + free == pytest.approx(972.0)          # MiB: the bars add up to the segments drawn
    assert "of 972 MiB reserved in use, 1.6% free" in fig.layout.title.text   # the README log's frag 1.6%
