"""The report after a real `oomtune search` on CPU (virtual GPU): report.html, frontier.yaml and the
winner's step pickle are written; the study opens in optuna-dashboard with readable user attributes
and the objective named; headless Chromium renders every chart without a JavaScript error.

The search is tests/shared_runs.py's ``tiny_meta_search`` (a tiny ResNet-18 on the virtual GPU, its trials'
steps on the meta device), run once per session and also asserted on by tests/test_trial_execute.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from cdp import Browser, chromium_path  # noqa: E402
from shared_runs import tiny_meta_search  # noqa: E402,F401  (the shared search)
from report_run import make_run_dir  # noqa: E402

pytestmark = pytest.mark.slow

#: Each chart: its SVG exists and holds at least one data point (scatter point, line or bar).
CHARTS_JS = """(() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => ({
  id: d.id, svg: d.querySelectorAll('svg.main-svg').length,
  points: d.querySelectorAll('.scatterlayer path.point, .scatterlayer path.js-line, .barlayer path').length})))()"""


@pytest.fixture
def search_run(tiny_meta_search):
    """The shared search's run directory, the search having succeeded."""
    assert tiny_meta_search.code == 0, tiny_meta_search.err[-3000:]
    return tiny_meta_search.run


def test_search_writes_report_frontier_and_winner_step(search_run):
    from oomtune.trace.replay import replay_snapshot
    from oomtune.trace.snapshot import load_snapshot

    from oomtune.capture.virtual_gpu import budget_geometry

    record = yaml.safe_load((search_run / "best.yaml").read_text())
    best, device = record["best"], record["device"]
    text = (search_run / "report.html").read_text()
    assert 'id="fig-frontier"' in text and 'id="fig-step"' in text and 'id="fig-timeline"' in text
    frontier = yaml.safe_load((search_run / "frontier.yaml").read_text())
    confs = [c["alloc_conf"] for c in frontier["configurations"]]
    assert "" in confs and best["alloc_conf"] in confs
    # the pickle loads through the restricted unpickler and replays to the same segments under the
    # winner's settings on the trial's virtual GPU (the device's memory, the budget as a fraction)
    snap = load_snapshot(search_run / "winner_step.pickle")
    assert snap["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == best["alloc_conf"]
    geometry = budget_geometry(device["budget_bytes"], device["total_memory_bytes"])
    fraction = geometry["memory_fraction"]
    result = replay_snapshot(snap, best["alloc_conf"], total_memory_bytes=geometry["total_memory_bytes"],
                             memory_fraction=None if fraction == 1.0 else fraction)
    assert result.first_divergence is None and not result.oom
    assert result.simulated_final_reserved_bytes == result.recorded_final_reserved_bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_study_opens_in_optuna_dashboard_with_readable_attributes(search_run):
    pytest.importorskip("optuna_dashboard", reason="optuna-dashboard not installed (pip install 'oomtune[dashboard]')")
    exe = Path(sys.executable).parent / "optuna-dashboard"  # the console script the README shows
    command = [str(exe)] if exe.exists() else [sys.executable, "-c", "from optuna_dashboard._cli import main; main()"]
    info = json.loads((search_run / "run.json").read_text())
    port = _free_port()
    proc = subprocess.Popen([*command, info["storage"], "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                studies = _get(f"http://127.0.0.1:{port}/api/studies")["study_summaries"]
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.5)
        study_id = next(s["study_id"] for s in studies if s["study_name"] == info["study_name"])
        detail = _get(f"http://127.0.0.1:{port}/api/studies/{study_id}?after=0")
        assert detail["objective_names"] == ["throughput (samples/s)"]
        ran = [{a["key"]: a["value"] for a in t["user_attrs"]} for t in detail["trials"]]
        ran = [a for a in ran if a.get("outcome") == "ok"]
        assert ran and all({"outcome", "alloc_conf", "peak_reserved", "role"} <= set(a) for a in ran)
        assert all(a["peak_reserved"].endswith("MiB (simulated)") for a in ran)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("which", ["handmade", "search"])
def test_report_renders_in_headless_chromium(which, request, tmp_path):
    if chromium_path() is None:
        pytest.skip("chromium not installed (.ci/run installs Debian's chromium package: apt-get install -y chromium)")
    pytest.importorskip("websocket", reason="websocket-client not installed (pip install -e '.[dev]')")
    run_dir = request.getfixturevalue("search_run") if which == "search" else make_run_dir(tmp_path / "hm")
    report = run_dir / "report.html"
    if which == "handmade":
        from oomtune.htmlreport import build_report

        build_report(run_dir)
    with Browser(tmp_path / "profile") as browser:
        browser.load(report.resolve().as_uri())
        charts = browser.evaluate(CHARTS_JS)
        shot = browser.screenshot(tmp_path / f"report-{which}.png")
        errors = browser.console_errors()
    assert errors == []
    assert len(charts) >= 4, charts
    assert all(c["svg"] >= 1 and c["points"] >= 1 for c in charts), charts
    if which == "search":   # its trials ran on the meta device (trial.execute=auto): no throughput to chart
        text = report.read_text()
        assert "fig-throughput" not in {c["id"] for c in charts} and "no throughput chart" in text
    assert shot.stat().st_size > 50_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
