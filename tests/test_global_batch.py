"""A fixed global batch (``search.global_batch``), command placeholders, activation checkpointing as
a search dimension, and best.yaml's micro-batch and accumulation."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

import oomtune
from oomtune.cli import main
from oomtune.exceptions import BestFileError, ConfigError
from oomtune.search.frontier import ConfigFrontier, FrontierPlanner
from oomtune.space import SearchSpace, micro_batches
from oomtune.targets.cmd import PLACEHOLDERS, build_command, placeholder_values
from oomtune.workload_spec import WorkloadSpec

REPO = Path(__file__).resolve().parents[1]
ALLOC = {"expandable_segments": [False, True]}


# -- the candidates -------------------------------------------------------------------------------
@pytest.mark.parametrize("n, world, low, high, expected", [
    (64, 1, 1, 512, [1, 2, 4, 8, 16, 32, 64]),
    (64, 2, 1, 512, [1, 2, 4, 8, 16, 32]),        # 32 per rank
    (96, 1, 8, 40, [8, 12, 16, 24, 32]),          # the divisors of 96 in [8, 40]
    (36, 3, 2, 12, [2, 3, 4, 6, 12]),             # 12 per rank
])
def test_micro_batches_are_the_divisors_in_the_range(n, world, low, high, expected):
    assert micro_batches(n, world, low, high) == expected


def test_a_global_batch_without_a_divisor_in_the_range_names_the_nearest_valid_values():
    with pytest.raises(ConfigError) as info:
        micro_batches(37, 1, 8, 16)   # 37 is prime: 1 and 37
    assert str(info.value) == ("search.global_batch=37: no micro-batch in search.batch_size [8, 16] divides 37; "
                               "nearest valid micro-batches: 1 (search.batch_size.low=1), 37 (search.batch_size.high=37)")
    with pytest.raises(ConfigError, match="not divisible by the world size 4"):
        micro_batches(6, 4, 1, 8)


def test_candidates_carry_the_accumulation_that_keeps_the_global_batch():
    space = SearchSpace(1, 512, ALLOC, global_batch=64)
    cand = space.candidate(8, {"expandable_segments": True})
    assert (cand.batch_size, cand.grad_accum) == (8, 8)
    mlp = WorkloadSpec(target={"name": "builtin"}, model={"name": "mlp"})
    applied = cand.apply(mlp)
    assert (applied.model, applied.training) == ({"name": "mlp"}, {"grad_accum": 8})
    assert applied.to_dict()["grad_accum"] == 8 and mlp.training == {}   # the trial's flat form; a new spec
    one = space.candidate(64).apply(dataclasses.replace(mlp, training={"grad_accum": 3}))
    assert one.training == {} and "grad_accum" not in one.to_dict()   # one micro-batch
    assert space.top_batch == 64 and space.batch_choices() == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ConfigError, match="micro-batch 3 does not divide search.global_batch=64"):
        space.candidate(3)


def test_the_sampler_suggests_only_micro_batches_of_the_global_batch():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    space = SearchSpace(2, 16, ALLOC, global_batch=48)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(30):
        trial = study.ask()
        cand = space.suggest(trial, batch_low=8)
        seen.add(cand.batch_size)
        assert cand.batch_size * cand.grad_accum == 48
        study.tell(trial, 1.0)
    assert seen <= {2, 3, 4, 6, 8, 12, 16} and len(seen) > 3


def test_activation_checkpointing_is_a_configuration_of_its_own():
    space = SearchSpace(1, 64, {**ALLOC, "activation_checkpointing": [False, True]})
    assert "activation_checkpointing" not in space.choices and space.checkpointing == [False, True]
    configs = space.all_configs()
    assert len(configs) == 4 and {c["activation_checkpointing"] for c in configs} == {False, True}
    cand = space.candidate(4, {"activation_checkpointing": True})
    assert cand.optuna_params()["activation_checkpointing"] is True and cand.alloc_conf == ""
    assert cand.apply(WorkloadSpec(target={"name": "builtin"}, model={"name": "mlp"})).training == {
        "activation_checkpointing": True}
    with pytest.raises(ConfigError, match="expected a list of true/false"):
        SearchSpace(1, 64, {"activation_checkpointing": ["yes"]})


# -- the frontier moves along the allowed micro-batches ------------------------------------------------
def test_without_predictions_the_frontier_doubles_and_bisects_along_the_micro_batches():
    choices = micro_batches(96, 1, 1, 96)   # 1 2 3 4 6 8 12 16 24 32 48 96
    default = ConfigFrontier({}, "", None)
    other = ConfigFrontier({"expandable_segments": True}, "expandable_segments:True", None)
    planner = FrontierPlanner([default, other], 1, 96, 1 << 30, peak=None, choices=choices, probe_unpredicted=True)
    fits_default = lambda b: b <= 12      # noqa: E731: the default allocator fits up to 12
    fits_other = lambda b: b <= 24        # noqa: E731
    asked: list[tuple[str, int]] = []
    while True:
        round_ = planner.next_round()
        if not round_:
            break
        for c, b in round_:
            assert b in choices
            asked.append((c.alloc_conf or "default", b))
            c.record(b, (fits_default if c.is_default else fits_other)(b))
            c.probes += 1
    # the default: 1, 2, 4, 8, 16 (first failure), then 12 between 8 and 16: exact (the next allowed is 16)
    assert [b for name, b in asked if name == "default"] == [1, 2, 4, 8, 16, 12]
    assert default.ok_max == 12 and default.exact
    # the other configuration starts above the baseline's largest batch (16), doubles (32: fails), then 24
    assert [b for name, b in asked if name != "default"] == [16, 32, 24]
    assert other.ok_max == 24 and other.exact
    assert planner.predicted_or_tried() == (2, 2)


# -- placeholders ------------------------------------------------------------------------------------
def test_every_placeholder_is_substituted():
    assert PLACEHOLDERS == ("batch_size", "grad_accum", "global_batch", "activation_checkpointing")
    cmd = "python t.py --mb {batch_size} --ga {grad_accum} --gb {global_batch} --ck {activation_checkpointing} {{grad_accum}}"
    argv, shell = build_command({"command": cmd}, 4, values=placeholder_values(4, 8, True))
    assert argv == ["python", "t.py", "--mb", "4", "--ga", "8", "--gb", "32", "--ck", "1", "{grad_accum}"] and not shell
    assert build_command({"command": cmd}, 16)[0][3:10] == ["16", "--ga", "1", "--gb", "16", "--ck", "0"]


def test_an_unknown_placeholder_names_the_known_ones():
    with pytest.raises(ConfigError) as info:
        build_command({"command": "python t.py --accum {accum}"}, 4)
    assert str(info.value) == ("target.command: unknown placeholder '{accum}': the known ones are {batch_size}, "
                               "{grad_accum}, {global_batch}, {activation_checkpointing} (write {{accum}} for a "
                               "literal {accum})")


@pytest.mark.parametrize("extra, needle", [
    (["search.global_batch=37", "search.batch_size.low=8", "search.batch_size.high=16"],
     "nearest valid micro-batches: 1 (search.batch_size.low=1), 37 (search.batch_size.high=37)"),
    (["search.global_batch=64", f"target.command='{sys.executable} examples/train_cmd.py --batch-size {{batch_size}}'"],
     "search.global_batch is set but target.command has no {grad_accum} placeholder"),
    (["+search.space.activation_checkpointing=[false,true]",
      f"target.command='{sys.executable} examples/train_cmd.py --batch-size {{batch_size}}'"],
     "search.space.activation_checkpointing is searched but target.command has no {activation_checkpointing}"),
    (["search.global_batch=0"], "search.global_batch=0: must be an integer >= 1"),
])
def test_bad_global_batch_input_exits_2_with_one_line_before_any_trial(extra, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    target = [] if any(e.startswith("target.command") for e in extra) else [
        f"target.command='{sys.executable} examples/train_cmd.py --batch-size {{batch_size}} --grad-accum {{grad_accum}}'"]
    code = main(["search", "target=cmd", "device=cpu", *target, *extra, f"hydra.run.dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("oomtune: error: ") and needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "trials").exists()   # no trial started


def test_checkpointing_on_a_model_without_it_exits_2(tmp_path, capsys):
    code = main(["search", "model=mlp", "device=cpu", "+search.space.activation_checkpointing=[false,true]",
                 f"hydra.run.dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "the built-in mlp has no activation checkpointing" in err and len(err.splitlines()) == 1


# -- best.yaml ---------------------------------------------------------------------------------------
def _best_yaml(path: Path, **best: object) -> Path:
    data = {"schema_version": 1, "workload": {"target": {"name": "cmd", "command": "x"}},
            "device": {"kind": "cpu", "budget_bytes": 1 << 30},
            "best": {"batch_size": 8, "alloc_conf": "expandable_segments:True", **best}}
    path.write_text(yaml.safe_dump(data))
    return path


def test_apply_best_returns_the_micro_batch_and_the_accumulation(tmp_path):
    env: dict[str, str] = {}
    best = oomtune.apply_best(_best_yaml(tmp_path / "best.yaml", grad_accum=4, global_batch=32,
                                        activation_checkpointing=True), environ=env)
    assert (best.batch_size, best.grad_accum, best.activation_checkpointing) == (8, 4, True)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    plain = oomtune.load_best(_best_yaml(tmp_path / "plain.yaml"))
    assert (plain.grad_accum, plain.activation_checkpointing) == (1, None)   # files without them
    with pytest.raises(BestFileError, match="best.grad_accum must be a positive integer"):
        oomtune.load_best(_best_yaml(tmp_path / "bad.yaml", grad_accum=0))


# -- end to end: a built-in workload under a global batch ----------------------------------------------
@pytest.mark.slow
def test_search_keeps_the_global_batch_and_records_the_accumulation(tmp_path, capsys):
    # A wide-input MLP (65536 -> 16 -> 16 -> 10) whose inputs dominate memory, at a budget where the
    # whole global batch does not fit in one micro-batch with the default allocator.
    run = tmp_path / "gb"
    code = main(["search", "model=mlp", "model.in_features=65536", "model.hidden=16", "model.layers=1",
                 "model.num_classes=10", "model.optimizer=sgd", "device=cpu", "budget=45MiB", "search.global_batch=96",
                 "search.batch_size.low=8", "search.space.max_split_size_mb=[null]",
                 "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[null]",
                 "trial.measure_steps=1", "trial.confirm_steps=2", "trial.soak_steps=0", f"hydra.run.dir={run}"])
    assert code == 0
    best = oomtune.load_best(run / "best.yaml")
    choices = [8, 12, 16, 24, 32, 48, 96]                  # the divisors of 96 from 8 up
    assert best.batch_size in choices and best.batch_size * best.grad_accum == 96 and best.best.global_batch == 96
    assert best.workload.get("training", {}).get("grad_accum", 1) == best.grad_accum
    for f in best.frontiers:   # every measured frontier is a micro-batch of the global batch
        assert f["measured_max_batch"] in choices + [None] and f["measured_fail_batch"] in choices + [None]
    # every trial trained the global batch: its micro-batch times its workload's accumulation
    import json

    specs = [json.loads(p.read_text()) for p in (run / "trials").glob("trial-*/spec.json")]
    assert specs and all(s["batch_size"] * s["workload"].get("grad_accum", 1) == 96 for s in specs)
    assert any(s["workload"].get("grad_accum", 1) > 1 for s in specs)   # accumulating trials ran
    # the report's frontier and the winner's step are written (the search's predictor is one per
    # variant: one micro-batch per step, or two standing for more)
    out = capsys.readouterr().out
    assert "not written" not in out
    _check_frontier_and_winner_step(run, best, choices)
    # the CI check re-traces the same micro-batch and accumulation
    assert main(["check", str(run / "best.yaml"), "--mode", "predict"]) == 0


def _check_frontier_and_winner_step(run: Path, best: object, choices: list[int]) -> None:
    """frontier.yaml's figure at the winner and winner_step.pickle are the winner's variant's: a
    Predictor of the workload accumulating two micro-batches (module docstring of
    oomtune.plan.variants), at frontier.yaml's geometry and the trial's steps (warmup + measure)."""
    import pickle

    from oomtune import config as C
    from oomtune.plan.predictor import Predictor, trial_steps
    from oomtune.plan.variants import variant_workload
    from oomtune.workload_spec import WorkloadSpec

    plan = yaml.safe_load((run / "frontier.yaml").read_text())
    assert plan["batch_sizes"] == choices and plan["memory_source"] == "simulated"
    row = next(r for r in plan["configurations"] if r["alloc_conf"] == (best.best.alloc_conf or ""))
    cell = next(c for c in row["batches"] if c["batch_size"] == best.batch_size)
    steps = trial_steps(C.compose(["model=mlp", "trial.measure_steps=1"]).trial)
    assert best.grad_accum > 1   # the budget leaves the whole global batch out of one micro-batch

    def own(grad_accum: int) -> Predictor:
        return Predictor(variant_workload(WorkloadSpec.from_dict(plan["workload"]), grad_accum=grad_accum, checkpointing=None),
                         plan["geometry"], steps=steps)

    mine, single = own(2), own(1)
    expected = mine.predict_detail(best.batch_size, best.best.alloc_conf or "")
    assert (cell["peak_reserved_bytes"], cell["peak_allocated_bytes"]) == (
        expected.peak_reserved_bytes, expected.peak_allocated_bytes)
    # Not the one-micro-batch step's figure: the second micro-batch's first-layer gradients (a
    # 65536 x 16 fp32 weight, 4 MiB, and a 16-float bias in one 512-byte block, kMinBlockSize in
    # CUDACachingAllocator.cpp) are live beside the accumulated .grad until AccumulateGrad adds them.
    alone = single.predict_detail(best.batch_size, best.best.alloc_conf or "")
    assert cell["peak_allocated_bytes"] - alone.peak_allocated_bytes == 65536 * 16 * 4 + 512
    # the winner's step replays the winner's variant's stream: its requests, in order
    snap = pickle.loads((run / "winner_step.pickle").read_bytes())
    sizes = [e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert sizes == [size for action, _key, size, _s in mine.stream(best.batch_size) if action == "alloc"]
    # each micro-batch requests its hidden activations (batch x 16 fp32) as often as the other
    hidden = best.batch_size * 16 * 4
    assert sizes.count(hidden) == 2 * [s for a, _k, s, _st in single.stream(best.batch_size) if a == "alloc"].count(hidden)


def test_another_global_batch_is_another_study():
    from oomtune import config as C

    names = {C.default_study_name(C.compose(["model=mlp", *extra])) for extra in
             ([], ["search.global_batch=64"], ["search.global_batch=128"])}
    assert len(names) == 3
    # null is unset: the key is left out of the digest, as before global batches existed
    assert C.default_study_name(C.compose(["model=mlp"])) == C.default_study_name(
        C.compose(["model=mlp", "search.global_batch=null"]))


def test_a_search_that_predicted_nothing_reports_the_winners_own_variant():
    # search.prune=off: the report's predictor is made at the end of the search; under a global batch
    # of 96 it is one per variant, so micro-batch 48 (2 micro-batches per step) replays the
    # accumulating workload and 96 (the whole global batch) the one-micro-batch workload.
    from types import SimpleNamespace

    from oomtune import config as C
    from oomtune.device import resolve_device
    from oomtune.search.run import _report_predictor

    cfg = C.compose(["model=mlp", "search.global_batch=96", "search.batch_size.low=8", "search.prune=off"])
    space = SearchSpace.from_config(cfg.search, world_size=1)
    from oomtune.schema import typed
    from oomtune.workload_spec import WorkloadSpec

    workload = WorkloadSpec(target={"name": "builtin"},
                            model={"name": "mlp", "in_features": 64, "hidden": 16, "layers": 1, "num_classes": 10})
    p = SimpleNamespace(target=SimpleNamespace(capturable=True), workload=workload, device=resolve_device("cpu"),
                        budget_bytes=1 << 30, conf=typed(cfg))
    predictor = _report_predictor(p, space)
    assert predictor.member(48).model_cfg.get("grad_accum") == 2
    assert "grad_accum" not in predictor.member(96).model_cfg


@pytest.mark.parametrize("script, refused", [
    ("examples/lightning_module.py", False),   # OomtuneCallback sets the module's activation_checkpointing
    ("examples/hf_trainer.py", False),         # OomtuneCallback sets the Trainer's gradient_checkpointing
    ("examples/train_cmd.py", True),           # reads neither the placeholder nor the environment variable
])
def test_a_searched_checkpointing_axis_reaches_an_integrations_script(script, refused):
    from oomtune.exceptions import ConfigError
    from oomtune.targets._cmd_checks import check_training_reaches_command

    argv = [sys.executable, script, "--batch-size", "{batch_size}"]
    call = lambda: check_training_reaches_command(" ".join(argv), argv, str(REPO), accumulates=False,  # noqa: E731
                                                  checkpointing=True)
    if refused:
        with pytest.raises(ConfigError, match="has no {activation_checkpointing} placeholder"):
            call()
    else:
        call()
