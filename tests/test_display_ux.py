"""What a fresh user reads: search progress lines and tables within 100 columns, every measured
figure labelled with its source, twins folded the same way by `oomtune plan` and the search, and
best.yaml naming the trial each figure came from (the fresh-user pass of the last session).

Expected values are worked out by hand from the inputs each test builds."""

from __future__ import annotations

import io

import optuna
import pytest
from rich.console import Console

from oomtune.study import records as R

MiB = 1 << 20
ES = "expandable_segments:True"
ES_GC = "expandable_segments:True,garbage_collection_threshold:0.8"
GC = "garbage_collection_threshold:0.8"


def _trial(study, *, batch, conf, role, outcome="ok", throughput=None, reserved=None, allocated=None,
           frag=None, source="simulated", message=None, feasible=True, predicted=None, confirms=None,
           extra=None):
    result = {"outcome": outcome, "batch_size": batch, "alloc_conf": conf, "throughput": throughput,
              "peak_reserved_bytes": reserved, "peak_allocated_bytes": allocated, "fragmentation": frag,
              "memory_source": source, "message": message, "extra": extra or {}}
    attrs = {R.ATTR_ROLE: role, R.ATTR_OUTCOME: outcome, R.ATTR_CONF: conf, R.ATTR_RESULT: result}
    if predicted is not None:
        attrs[R.ATTR_PREDICTED] = predicted
    if confirms is not None:
        attrs[R.ATTR_CONFIRMS] = confirms
    study.add_trial(optuna.trial.create_trial(
        value=throughput or 0.0, params={"batch_size": batch},
        distributions={"batch_size": optuna.distributions.IntDistribution(1, 4096)}, user_attrs=attrs,
        system_attrs={"constraints": [0.0 if feasible else 0.5]}))
    return study.trials[-1]


def _render(renderable, width=200) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width).print(renderable)
    return out.getvalue().splitlines()


@pytest.fixture
def study():
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.create_study(direction="maximize")


# -- progress lines and the trial table ---------------------------------------------------------------

def test_progress_line_fits_100_columns_and_labels_every_figure(study):
    from oomtune.display import progress_line

    # The README's longest ordinary line: trial 3, the default allocator at 353, over the limit.
    t = _trial(study, batch=353, conf="", role="baseline", throughput=141.6, reserved=1012 * MiB, feasible=False)
    line = progress_line(t, "baseline", None, None, "#1")
    assert len(line) <= 100
    assert "bs=353" in line and "default" in line and "ok >limit" in line
    assert "1012.00 MiB (sim)" in line          # memory on the virtual GPU: simulated
    assert "141.6/s (CPU)" in line              # its throughput is the CPU's
    assert line.endswith("best #1")
    # A search trial of a sampler round, on a device, with every key abbreviated (es, gc).
    t = _trial(study, batch=1024, conf=ES_GC, role="search", throughput=812.3, reserved=15 * 1024 * MiB,
               source="device")
    line = progress_line(t, "search", 12, 12, "#11")
    assert len(line) <= 100 and "[trial 1] search 12/12" in line and "es:T gc:0.8" in line
    assert "15.00 GiB (dev)" in line and "812.3/s (dev)" in line


def test_a_failed_trials_message_goes_to_its_own_line(study):
    from oomtune.display import progress_line

    msg = "out of memory at soak step 10/2000 (seq_len=448): reserved 96.00 MiB, allocated 61.51 MiB (simulated)"
    t = _trial(study, batch=64, conf=ES, role="frontier", outcome="oom_fragmentation", message=msg, feasible=False)
    first, second = progress_line(t, "frontier", None, None, None).split("\n")
    assert len(first) <= 100 and "oom_fragmentation" in first
    assert second == "    " + msg


def _readme_rows(study):
    # The six trials of the README main command (figures from experiments/results/readme_main_command.log),
    # and a sampler trial with the longest configuration of the default space (four keys).
    from oomtune.display import trial_rows

    for batch, conf, role, speed, resv, alloc, frag, ok in [
            (352, "", "baseline", 145.8, 966, 727.08, 0.247, True), (493, ES, "frontier", 135.1, 972, 957.60, 0.015, True),
            (456, GC, "frontier", 117.1, 988, 897.58, 0.092, False), (353, "", "baseline", 141.6, 1012, 729.27, 0.279, False),
            (494, ES, "frontier", 160.7, 992, 959.30, 0.033, False), (493, ES, "confirm", 132.2, 972, 957.60, 0.015, True),
            (222, ES_GC + ",max_split_size_mb:64,roundup_power2_divisions:4", "search", 99.9, 972, 960.0, 0.012, True)]:
        _trial(study, batch=batch, conf=conf, role=role, throughput=speed, reserved=resv * MiB,
               allocated=int(alloc * MiB), frag=frag, feasible=ok, predicted=resv * MiB)
    _trial(study, batch=230, conf=ES_GC + ",max_split_size_mb:256,roundup_power2_divisions:4", role="search",
           outcome="predicted_infeasible", feasible=False)   # the longest outcome name
    return trial_rows(study.trials)


def test_trial_table_fits_100_columns_without_folding_a_number(study):
    from oomtune.display import trial_table, trial_table_legend

    rows = _readme_rows(study)
    lines = _render(trial_table(rows, best_number=1), width=100)
    assert max(len(x) for x in lines) <= 100 and not any("…" in x for x in lines)
    text = "\n".join(lines)
    # Every figure whole on its row: 966 MiB reserved is 966.0, 727.08 MiB allocated 727.1, 24.7%.
    assert any(x.split()[:4] == ["0", "baseline", "352", "default"] and "966.0" in x and "727.1" in x
               and "24.7%" in x and "145.8" in x for x in lines)
    assert "ok >limit" in text
    # The longest outcome wraps between its words, on the row of trial 7 and the line below it.
    row7 = next(i for i, x in enumerate(lines) if x.split()[:3] == ["7", "search", "230"])
    assert "predicted" in lines[row7] and "infeasible" in lines[row7 + 1]
    # The sources, said once in the headers (every row is simulated): memory (sim), samples/s (CPU).
    assert text.count("MiB (sim)") == 2 and "(CPU)" in text
    legend = trial_table_legend(rows)
    assert all(len(x) <= 100 for x in legend)
    assert any("(sim): simulated on the virtual GPU" in x and "(CPU): this CPU's" in x for x in legend)
    assert any(x.startswith("config: es=expandable_segments") and "ms=max_split_size_mb" in x for x in legend)
    # On a wide console the table stays as narrow (its content decides its width).
    assert max(len(x.rstrip()) for x in _render(trial_table(rows), width=200)) <= 100


def test_mixed_sources_are_labelled_per_cell(study):
    from oomtune.display import trial_rows, trial_table

    _trial(study, batch=8, conf="", role="baseline", throughput=10.0, reserved=100 * MiB, source="simulated")
    _trial(study, batch=8, conf="", role="baseline", throughput=20.0, reserved=100 * MiB, source="device")
    text = "\n".join(_render(trial_table(trial_rows(study.trials))))
    assert "100.0 sim" in text and "100.0 dev" in text and "10.0 CPU" in text and "20.0 dev" in text


# -- twins folded alike by plan and search ------------------------------------------------------

class _TwinPredictor:
    """2 MiB per sample under the default allocator, 1 MiB with expandable_segments; the
    garbage-collection threshold changes nothing (so it makes twins)."""

    geometry = {"total_memory_bytes": 1 << 40, "memory_fraction": None}
    capture_seconds = replay_seconds = 0.0
    captures = replays = 0
    _streams: dict = {}
    fallback_reasons: set = set()

    def predict_detail(self, batch, settings):
        from oomtune.plan.predictor import Prediction

        peak = batch * (MiB if settings.expandable_segments else 2 * MiB)
        return Prediction(batch, settings.render(), peak, peak, 0.0, True, 0, peak)


# The twin listed first: the representative is still the one with fewer keys.
SETTINGS = [{"garbage_collection_threshold": 0.8}, {}, {"expandable_segments": True, "garbage_collection_threshold": 0.8},
            {"expandable_segments": True}]


def test_plan_and_search_fold_the_same_twins():
    from oomtune.plan.feasibility import build_plan, grid_batches
    from oomtune.search.frontier import predicted_frontiers

    # Grid 8..64 = [8, 16, 32, 64], limit 64 MiB: the default fits 2 MiB x 32, expandable 1 MiB x 64.
    # gc:0.8 predicts what the default predicts, es:T gc:0.8 what es:T predicts: two pairs of twins.
    pred = _TwinPredictor()
    plan = build_plan(pred, SETTINGS, grid_batches(8, 64), workload={}, device={}, limit_bytes=64 * MiB).to_dict()
    twin_of = {c["alloc_conf"]: c["twin_of"] for c in plan["configurations"]}
    assert twin_of == {GC: "", "": None, ES_GC: ES, ES: None}
    assert {c["alloc_conf"]: c["twins"] for c in plan["configurations"]} == {GC: [], "": [GC], ES_GC: [], ES: [ES_GC]}
    search = {c.alloc_conf: c.twins for c in predicted_frontiers(pred, SETTINGS, 8, 64, 64 * MiB)}
    assert search == {"": [GC], ES: [ES_GC]}


def test_plan_map_shows_twins_once_and_says_what_plus_n_means():
    from oomtune.display import plan_compact_table, plan_recommendation
    from oomtune.plan.feasibility import build_plan, grid_batches

    plan = build_plan(_TwinPredictor(), SETTINGS, grid_batches(8, 64), workload={}, device={},
                      limit_bytes=64 * MiB).to_dict()
    table, legend = plan_compact_table(plan)
    names = [x.split("  ")[0].strip() for x in _render(table) if x.strip().startswith(("default", "es:", "gc:"))]
    assert names == ["default +1", "es:T +1"]
    assert "+N: N more configurations with the same prediction at every batch, folded into this row" in legend
    assert "folded: gc:0.8 = default; es:T gc:0.8 = es:T" in legend
    # The recommendation names the representative, not its twin: 64 / 32 = 2 -> +100%.
    assert plan_recommendation(plan["configurations"]) == f"{ES}: batch 64 vs 32 with the default allocator, +100%"


def test_frontier_table_labels_measured_and_explains_the_fold():
    from oomtune.search.frontier import ConfigFrontier
    from oomtune.search.outputs import frontier_legend, frontier_table

    es = ConfigFrontier({"expandable_segments": True}, ES, 493, ok_max=493, bad_min=494, ratios=[1.0], probes=2,
                        twins=[ES_GC])
    default = ConfigFrontier({}, "", 352, ok_max=352, bad_min=353, ratios=[1.0], probes=2)
    for simulated, label in ((True, "(sim)"), (False, "(dev)")):
        lines = _render(frontier_table([default, es], ES, simulated=simulated), width=100)
        text = "\n".join(lines)
        assert max(len(x) for x in lines) <= 100 and "measured" in text and label in text
        es_row = next(x for x in lines if x.strip().startswith("es:T"))
        assert es_row.split() == ["es:T", "493", "493", "1.000", "+1"]
    legend = frontier_legend([default, es])
    assert all(len(x) <= 100 for x in legend)
    assert any(x.startswith("+N: N more configurations with the same prediction") for x in legend)
    assert any("(sim) on the virtual GPU or (dev) on the device" in x for x in legend)


# -- which trial each figure of best.yaml came from ---------------------------------------------

def test_trials_text_names_the_chosen_and_the_measuring_trial():
    from oomtune.best import trials_text

    assert trials_text({"trial_number": 1, "metrics_trial_number": 5, "confirmed": True}) == \
        "trial 1, figures from trial 5 (its clean-process confirmation)"
    assert trials_text({"trial_number": 0, "metrics_trial_number": 0}) == "trial 0"
    # best.yaml files from before metrics_trial_number: the figures are the confirmation's when confirmed
    assert trials_text({"trial_number": 1, "confirmed": True}) == "trial 1, figures from its clean-process confirmation"
    assert trials_text({"trial_number": 1, "confirmed": False}) == "trial 1"
    assert trials_text({"batch_size": 8}) is None


def test_an_old_best_yaml_still_loads(tmp_path):
    import oomtune

    path = tmp_path / "best.yaml"
    path.write_text("schema_version: 1\nworkload: {model: {name: mlp}}\ndevice: {kind: cpu}\n"
                    "best: {batch_size: 493, alloc_conf: 'expandable_segments:True', confirmed: true, trial_number: 1}\n")
    best = oomtune.load_best(path).best
    assert (best.trial_number, best.metrics_trial_number) == (1, None)
    assert best.trials_text() == "trial 1, figures from its clean-process confirmation"


def test_measured_in_finds_the_confirmation_that_measured_the_figures(study):
    from oomtune.search.outputs import measured_in

    winner = _trial(study, batch=493, conf=ES, role="frontier", throughput=135.1, reserved=972 * MiB)   # 0
    first = _trial(study, batch=493, conf=ES, role="confirm", throughput=130.0, reserved=972 * MiB, confirms=0)
    second = _trial(study, batch=493, conf=ES, role="confirm", throughput=132.2, reserved=972 * MiB, confirms=0)
    # The same measurement, but confirming another trial (7): never taken for trial 0.
    _trial(study, batch=493, conf=ES, role="confirm", throughput=132.2, reserved=972 * MiB, confirms=7)
    trials = study.get_trials()
    assert measured_in(trials, winner, R.result_of(second), True) == 2   # the last clean run: the search keeps it
    assert measured_in(trials, winner, R.result_of(first), True) == 1
    assert measured_in(trials, winner, R.result_of(winner), False) == 0


def test_summary_line_names_both_trials_and_the_sources():
    from types import SimpleNamespace

    from oomtune.best import Choice
    from oomtune.search.outputs import summary_lines

    best = Choice(batch_size=493, alloc_conf=ES, confirmed=True, trial_number=1, metrics_trial_number=5,
                  metrics={"throughput": 132.2, "peak_reserved_bytes": 972 * MiB, "memory_source": "simulated",
                           "soak_passed": True, "soak_steps_run": 2000})
    summary = SimpleNamespace(gain=None, objective="batch", objective_reason="auto", at_top_of_range=False)
    line = summary_lines(summary, best, None, simulated=True, confirm_steps=10, batch_high=512)[0]
    assert line == ("best: batch 493, expandable_segments:True (trial 1); confirmed by trial 5 in a clean process "
                    "(10 steps): 132.2 samples/s (CPU), peak reserved 972.00 MiB (simulated); survived a "
                    "2000-step soak (simulated)")


def test_a_trial_stopped_above_the_limit_says_after_which_step(study):
    from oomtune.display import SEARCH_LEGEND, outcome_label, progress_line

    stop = {"stopped_over_limit": {"step": 1, "used_bytes": 1012 * MiB, "limit_bytes": 972 * MiB}}
    t = _trial(study, batch=353, conf="", role="baseline", reserved=1012 * MiB, feasible=False, extra=stop)
    assert outcome_label(t, R.result_of(t)) == "ok >limit@1"
    line = progress_line(t, "baseline", None, None, "#1")
    assert "ok >limit@1" in line and len(line) <= 100
    assert any(">limit@n: stopped after step n" in legend for legend in SEARCH_LEGEND)
    ran = _trial(study, batch=354, conf="", role="baseline", reserved=1014 * MiB, feasible=False)
    assert outcome_label(ran, R.result_of(ran)) == "ok >limit"   # ran every step


def _wrapped_whole(line: str) -> list[str]:
    """``wrapped(line)``, checked: several lines of at most 100 columns, continuations indented, and
    nothing lost but the spaces at the breaks."""
    from oomtune.display import wrapped

    parts = wrapped(line)
    assert len(parts) > 1 and max(map(len, parts)) <= 100
    assert all(p.startswith("  ") for p in parts[1:])
    assert " ".join(p.strip() for p in parts) == line
    return parts


def test_long_summary_lines_wrap_at_spaces_to_100_columns_losing_nothing():
    from oomtune.display import wrapped

    # the two summary lines of experiments/results/readme_main_command.log above 100 columns (203, 119)
    best = ("best: batch 493, expandable_segments:True (trial 2); confirmed by trial 4 in a clean process "
            "(10 steps): 161.2 samples/s (CPU), peak reserved 972.00 MiB (simulated); survived a 2000-step "
            "soak (simulated)")
    gain = ("vs the default allocator at its largest batch (352): 1.40x batch (493 vs 352) within the same "
            "budget (simulated memory)")
    for line in (best, gain):
        _wrapped_whole(line)
    assert wrapped(gain) == [gain[:100], "  (simulated memory)"]      # "... same budget" is exactly 100
    path = "wrote /tmp/" + "d" * 110 + "/best.yaml"
    assert wrapped(path) == ["wrote", "  " + path[len("wrote "):]]   # a path longer than a line stays whole
    assert wrapped("short") == ["short"] and wrapped("") == [""]


def test_a_figure_stays_on_the_line_of_its_words():
    from oomtune.display import wrapped

    # a new user's finding: the README's summary broke inside "(10 / steps)", another line inside
    # "at batch / 512"; a break beside a figure is taken only after a clause or list item (, ; :)
    best = ("best: batch 493, expandable_segments:True (trial 2); confirmed by trial 4 in a clean process "
            "(10 steps): peak reserved 972.00 MiB (simulated); survived a 2000-step soak (simulated)")
    top = ("note: the answer is the top of the range: the search stopped at batch 512 because "
           "search.batch_size.high is 512; raise it to look further up")
    for line in (best, top):
        parts = _wrapped_whole(line)
        for first, second in zip(parts, parts[1:]):                     # no break beside a figure
            last, next_ = first.split(" ")[-1], second.split()[0]
            assert not (last.lstrip("(")[:1].isdigit() or next_.lstrip("(")[:1].isdigit()), (first, second)
    assert any("(10 steps):" in p for p in wrapped(best))
    figures = " ".join(str(n) for n in range(1, 21))                 # 50 columns of figures, bound to "beta"
    assert wrapped("alpha beta " + figures, 40) == ["alpha", "  beta " + figures]   # longer than a line: whole


def test_the_summary_says_the_warm_up_steps_that_best_yaml_counts():
    from types import SimpleNamespace

    from oomtune.best import Choice
    from oomtune.search.outputs import summary_lines

    # best.yaml's metrics.steps is every step the confirmation ran: 1 warm-up + 10 measured = 11
    best = Choice(batch_size=493, alloc_conf=ES, confirmed=True, trial_number=1, metrics_trial_number=5,
                  metrics={"peak_reserved_bytes": 972 * MiB, "memory_source": "simulated", "steps": 11})
    summary = SimpleNamespace(gain=None, objective="batch", objective_reason="auto", at_top_of_range=False)
    line = summary_lines(summary, best, None, simulated=True, confirm_steps=10, batch_high=512)[0]
    assert "confirmed by trial 5 in a clean process (10 steps after 1 warm-up): peak reserved" in line


def test_device_words_read_without_doubled_parentheses():
    from oomtune.device import TargetDevice
    from oomtune.display import device_words

    cpu = TargetDevice("cpu", "cpu", None, "virtual GPU (CPU)", 80 << 30, True)
    gpu = TargetDevice("cuda:0", "cuda", 0, "NVIDIA H200", 141 << 30, False)
    assert device_words(cpu) == "virtual GPU on the CPU (memory simulated)"
    assert device_words(gpu) == "NVIDIA H200 on cuda:0 (memory measured)"


# -- piped output keeps each line whole ---------------------------------------------------------------

def test_show_piped_keeps_the_best_line_whole_however_long_it_is(tmp_path, monkeypatch, capsys):
    """Field case (this project's CI, stop 43): `oomtune show` captured (not a terminal) printed its
    "best (recorded in the study)" line through a 200-column console that wrapped it: on CI's longer
    temporary path the line broke inside "(its clean-process \\nconfirmation)", so a grep for it failed.
    Piped output keeps every text line whole, however long the storage URL or the allocator settings."""
    from oomtune.cli import main
    from oomtune.search.outputs import BEST_ATTR

    monkeypatch.delenv("COLUMNS", raising=False)
    conf = ("expandable_segments:True,garbage_collection_threshold:0.8,max_split_size_mb:256,"
            "roundup_power2_divisions:[256:8,512:4,>:1]")
    folder = tmp_path / ("a-long-folder-name-" * 12)
    folder.mkdir()
    url = f"sqlite:///{folder}/study.db"
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    s = optuna.create_study(study_name="s", storage=url, direction="maximize")
    _trial(s, batch=96, conf="", role="baseline", throughput=10.0, reserved=500 * MiB)
    _trial(s, batch=128, conf=conf, role="search", throughput=12.0, reserved=600 * MiB)
    _trial(s, batch=128, conf=conf, role="confirm", throughput=11.5, reserved=600 * MiB, confirms=1)
    best = {"best": {"batch_size": 128, "alloc_conf": conf, "trial_number": 1, "metrics_trial_number": 2,
                     "confirmed": True}}
    s._storage.set_study_system_attr(s._study_id, BEST_ATTR, best)
    capsys.readouterr()
    assert main(["show", "--storage", url, "--study", "s"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # by hand: the line show composes from the recorded mapping, in one piece
    expected = (f"best (recorded in the study): batch 128, {conf}; "
                "trial 1, figures from trial 2 (its clean-process confirmation)")
    assert expected in lines
    assert len(expected) > 200   # wider than a piped console: it would have been broken


def test_show_names_the_default_allocator_as_the_search_summary_does(tmp_path, capsys, monkeypatch):
    from oomtune.cli import main
    from oomtune.search.outputs import BEST_ATTR

    url = f"sqlite:///{tmp_path}/study.db"
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    s = optuna.create_study(study_name="s", storage=url, direction="maximize")
    _trial(s, batch=96, conf="", role="baseline", throughput=10.0, reserved=500 * MiB)
    best = {"best": {"batch_size": 96, "alloc_conf": "", "trial_number": 0, "metrics_trial_number": 0,
                     "confirmed": False}}
    s._storage.set_study_system_attr(s._study_id, BEST_ATTR, best)
    capsys.readouterr()
    assert main(["show", "--storage", url, "--study", "s"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("best (recorded"))
    assert line.startswith("best (recorded in the study): batch 96, the default allocator"), line


def test_piped_console_is_wide_and_never_breaks_a_line(monkeypatch, capsys):
    """output_console off a terminal: COLUMNS when set (else 200) for tables, and a text line of any
    length stays one line; a COLUMNS that is not a positive number is ignored."""
    from oomtune.display import output_console

    monkeypatch.delenv("COLUMNS", raising=False)
    console = output_console()
    assert not console.is_terminal and console.width == 200
    line = " ".join(["word"] * 100)   # 499 characters, spaces to break at
    console.print(line, highlight=False, markup=False)
    assert capsys.readouterr().out == line + "\n"
    monkeypatch.setenv("COLUMNS", "90")
    assert output_console(stderr=True).width == 90
    monkeypatch.setenv("COLUMNS", "not-a-number")
    assert output_console().width == 200
