"""``oomtune check``: a CI regression check of a best.yaml against the current code.

Two modes:

* ``predict`` (no GPU, deterministic): re-trace the workload recorded in best.yaml with the CURRENT
  code (the built-in workload code of this oomtune, or the user's ``target: python`` factory) on the
  meta device, replay it under the recorded allocator settings on the recorded virtual GPU geometry
  (:func:`oomtune.plan.predictor.sim_geometry`), and compare the predicted peak reserved with
  ``best.predicted_peak_reserved_bytes`` recorded at tuning time (under a shape distribution, with
  ``best.predicted_at_worst_shape``, at its largest shape, as the search's frontier predicted it).
  Fails when it grew by more than ``tolerance`` (default 0.5%) or no longer fits the budget.
* ``run``: run the recorded configuration as a trial (``TrialRunner(launcher="spawn")``, the recorded
  workload, budget and batch size, more measured steps than a search trial) on a CUDA device or on
  the virtual GPU on CPU. Fails on running out of memory (any failed trial), peak reserved grown by
  more than ``max_memory_growth`` over ``best.metrics.peak_reserved_bytes``, or throughput fallen by
  more than ``max_slowdown``. Device memory is only compared with device memory and simulated with
  simulated (anything else is refused as bad input).

Default mode (:func:`default_mode`): ``run`` when CUDA is available and best.yaml was measured on a
CUDA device (the real thing can be re-measured); ``predict`` otherwise: without CUDA a device
measurement cannot be reproduced, and for a virtual-GPU best.yaml the prediction is the same
simulation without the noise of CPU timings on shared CI machines.

Limits are inclusive: growth exactly equal to the limit passes. They are compared exactly, as
rationals of the decimal limit the user gave (``new - old <= limit * old``). They are validated
before anything runs or is written (:func:`validate_limits`): ``max_slowdown`` in [0, 1) (a loss of
100% or more of the throughput cannot be a limit), ``max_memory_growth`` and ``tolerance`` finite
and >= 0; the JUnit path's directory must be creatable and writable (:func:`check_junit_path`).

Slowdown on the virtual GPU: a run-mode check of a best.yaml measured on the virtual GPU (CPU)
times CPU steps, which on shared CI machines swing by ~3x between runs. There, unless a
``max_slowdown`` is given explicitly, the slowdown check is skipped (a skipped JUnit case whose
message says why); the memory checks still apply. On a CUDA best.yaml the default is 10%.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomtune.outcome import Outcome
from oomtune.exceptions import BestFileError, ConfigError
from oomtune.units import format_bytes
from oomtune.workload_spec import WorkloadSpec

if TYPE_CHECKING:
    from oomtune.trial._base import Target

__all__ = ["CHECK_MODES", "CheckCase", "CheckReport", "PreparedCheck", "prepare_check", "default_mode", "relative_change", "within_limit",
           "within_drop", "evaluate_run", "check_predict", "check_run", "write_junit", "validate_limits",
           "check_junit_path", "default_max_slowdown", "DEFAULT_MAX_SLOWDOWN", "DEFAULT_MAX_MEMORY_GROWTH",
           "DEFAULT_TOLERANCE", "SIMULATED_SLOWDOWN_NOTE", "recorded_headroom"]

CHECK_MODES = ("run", "predict")
DEFAULT_MAX_SLOWDOWN = 0.10
DEFAULT_MAX_MEMORY_GROWTH = 0.05
DEFAULT_TOLERANCE = 0.005
SIMULATED_SLOWDOWN_NOTE = ("slowdown not checked: best.yaml was measured on the virtual GPU (CPU), whose "
                           "step times swing ~3x on shared machines; give --max-slowdown to check it anyway")


@dataclass
class CheckCase:
    """One named check (a JUnit testcase). ``passed`` None means skipped (``message`` says why)."""

    name: str
    passed: bool | None
    message: str
    time_s: float = 0.0


@dataclass
class CheckReport:
    """The outcome of ``oomtune check``: the cases, the one-line summary and the figures."""

    mode: str
    cases: list[CheckCase]
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when no case failed (skipped cases do not fail)."""
        return all(c.passed is not False for c in self.cases)

    @property
    def exit_code(self) -> int:
        """0 pass, 1 regression."""
        return 0 if self.passed else 1


def default_mode(best: Any, cuda_available: bool) -> str:
    """``run`` if CUDA is available and best.yaml was measured on a CUDA device, else ``predict``."""
    return "run" if cuda_available and best.device.get("kind") == "cuda" else "predict"


def relative_change(new: int | float, old: int | float) -> float:
    """``(new - old) / old``: +0.05 is 5% more. ``old`` must be > 0."""
    return (new - old) / old


def within_limit(new: int | float, old: int | float, limit: float) -> bool:
    """True when ``new - old <= limit * old``, exactly (``limit`` taken as the decimal it prints as:
    0.005 is 1/200). ``old`` must be > 0."""
    return Fraction(new) - Fraction(old) <= Fraction(repr(float(limit))) * Fraction(old)


def within_drop(new: int | float, old: int | float, limit: float) -> bool:
    """True when ``old - new <= limit * old`` exactly (a slowdown of at most ``limit``)."""
    return Fraction(old) - Fraction(new) <= Fraction(repr(float(limit))) * Fraction(old)


def _check_limit(name: str, value: Any, what: str, *, below_one: bool = False) -> float:
    """``value`` as a finite fraction >= 0 (and < 1 when ``below_one``). Raises ConfigError."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and value >= 0 and (not below_one or value < 1))
    if not ok:
        rng = "in [0, 1)" if below_one else ">= 0"
        raise ConfigError(f"{name}={value!r}: expected a fraction {rng} such as 0.05 ({what})")
    return float(value)


def validate_limits(*, max_slowdown: float | None = None, max_memory_growth: float | None = None,
                    tolerance: float | None = None) -> None:
    """Check the limits given (None: not given): ``max_slowdown`` in [0, 1) (relative loss of
    throughput; 1 would allow any slowdown), ``max_memory_growth`` >= 0 and ``tolerance`` >= 0
    (relative growth of peak reserved), all finite.

    Raises:
        ConfigError: the first bad limit, naming the flag and the value.
    """
    if max_slowdown is not None:
        _check_limit("--max-slowdown", max_slowdown, "relative loss of throughput", below_one=True)
    if max_memory_growth is not None:
        _check_limit("--max-memory-growth", max_memory_growth, "relative growth of peak reserved")
    if tolerance is not None:
        _check_limit("--tolerance", tolerance, "relative growth of the predicted peak reserved")


def check_junit_path(path: str | Path) -> Path:
    """Check, before the check runs, that a JUnit report can be written at ``path``
    (:func:`oomtune.plan.feasibility.check_writable`: not a directory, a file can be created in its
    nearest existing folder). Missing folders are created only when the report is written.

    Raises:
        ConfigError: the path is a directory, or its folder cannot be created or written.
    """
    from oomtune.plan.feasibility import check_writable

    return check_writable(path, "--junit")


def default_max_slowdown(best: Any) -> float | None:
    """The run-mode slowdown limit when none is given: None (skip the check) for a best.yaml
    measured on the virtual GPU (CPU timings are too noisy to compare), else
    :data:`DEFAULT_MAX_SLOWDOWN`."""
    source = best.best.metrics.get("memory_source") or best.device.get("memory_source")
    simulated = source == "simulated" or best.device.get("kind") == "cpu"
    return None if simulated else DEFAULT_MAX_SLOWDOWN


def _geometry(best: Any) -> dict[str, Any]:
    """The virtual GPU of the recorded trial: the recorded budget on the recorded device, under the
    memory fraction the trials ran with (``device.memory_fraction``: ``off`` = none, the virtual GPU
    then the budget's size; a recorded ``best.memory_fraction`` on a real device)."""
    dev = best.device
    budget, total = dev.get("budget_bytes"), dev.get("total_memory_bytes")
    if not isinstance(budget, int) or budget <= 0:
        raise BestFileError(f"best.yaml device.budget_bytes must be a positive integer, got {budget!r}")
    off = dev.get("memory_fraction") == "off"
    if dev.get("memory_source") == "simulated" or dev.get("kind") == "cpu":
        from oomtune.alloc.geometry import budget_geometry

        size = total if isinstance(total, int) and total >= budget and not off else None  # None: budget-sized
        return budget_geometry(budget, size)
    if not isinstance(total, int) or total < budget:
        raise BestFileError(f"best.yaml device.total_memory_bytes={total!r} must be an integer >= budget_bytes")
    fraction = 1.0 if off else (best.best.memory_fraction or min(1.0, budget / total))
    return {"total_memory_bytes": total, "memory_fraction": fraction}


def fraction_case(best: Any, *, applied: float | None = None, device_total: int | None = None,
                  ran: bool = False, geometry: dict[str, Any] | None = None) -> CheckCase:
    """Does the answer's memory fraction travel with it? Only
    ``garbage_collection_threshold`` needs one (:func:`oomtune.best.needs_memory_fraction`).

    FAIL when the answer's threshold acted in the trials under a fraction < 1 that best.yaml does not
    record (files from before it was recorded: applied without it, the threshold is inert and the
    batch may not fit); in run mode (``ran``) also when the check trial applied another fraction than
    the recorded one (``applied``), or ran on a device of another size (``device_total``, bytes:
    the same fraction then allows another budget). PASS otherwise, naming what applies it.
    ``geometry``: the trials' (:attr:`PreparedCheck.geometry`; default read from ``best``)."""
    from oomtune.best import FRACTION_KEY, needs_memory_fraction

    conf = best.best.alloc_conf
    recorded = best.best.memory_fraction
    if not needs_memory_fraction(conf):
        return CheckCase("memory fraction", True, f"not needed: {conf or 'the default allocator'} has no "
                         "garbage_collection_threshold")
    trial_fraction = (geometry or _geometry(best))["memory_fraction"]
    if recorded is None:
        if best.device.get("memory_fraction") is None and trial_fraction < 1.0:
            return CheckCase("memory fraction", False, (
                f"{conf}: the garbage_collection_threshold acted in the trials under a memory fraction of "
                f"{trial_fraction:.6g}, which best.yaml does not record; applied without it the threshold is inert "
                f"and batch {best.best.batch_size} may not fit: search again (best.yaml then carries the fraction)"))
        return CheckCase("memory fraction", True, "none: the trials ran without a fraction < 1, where the "
                         "threshold is inert, as it will be when applied")
    if ran and applied is not None and abs(applied - recorded) > 0.01 * recorded:
        return CheckCase("memory fraction", False, f"the check trial ran under a memory fraction of {applied:.6g}, "
                         f"best.yaml records {recorded:.6g}")
    total = best.device.get("total_memory_bytes")
    if ran and device_total and isinstance(total, int) and abs(device_total - total) > 0.01 * total:
        return CheckCase("memory fraction", False, (
            f"best.yaml's memory fraction {recorded:.6g} is of a {format_bytes(total)} device; this one has "
            f"{format_bytes(device_total)}, where it allows {format_bytes(int(recorded * device_total))}, not the "
            f"{format_bytes(int(recorded * total))} the answer was found with"))
    return CheckCase("memory fraction", True, f"{recorded:.6g} of {format_bytes(total) if isinstance(total, int) else 'the device'} "
                     f"recorded and applied ({FRACTION_KEY} by apply_best / oomtune env)")


def recorded_headroom(best: Any) -> float:
    """The search's headroom best.yaml recorded (``device.headroom``, a fraction of the budget kept
    free; 0.0 when a file from before it was recorded has none).

    Raises:
        BestFileError: a recorded headroom outside [0, 1).
    """
    headroom = best.device.get("headroom", 0.0)
    if headroom is None:
        headroom = 0.0
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise BestFileError(f"best.yaml device.headroom={headroom!r} must be a fraction in [0, 1)")
    return float(headroom)


def _search_limit(best: Any) -> tuple[int, str]:
    """The limit the search judged "fits" by: ``budget_bytes * (1 - headroom)``
    with the headroom best.yaml recorded (:class:`oomtune.study.records.MemoryLimit`; 0 when a
    file from before the headroom was recorded has none). Returns (limit in bytes, a phrase).

    Raises:
        BestFileError: a recorded headroom outside [0, 1).
    """
    from oomtune.study.records import MemoryLimit

    budget = int(best.device["budget_bytes"])
    headroom = recorded_headroom(best)
    limit = MemoryLimit(budget, headroom).limit_bytes
    if not headroom:
        return limit, f"the {format_bytes(budget)} budget"
    return limit, (f"the search's limit {format_bytes(limit)} (budget {format_bytes(budget)} minus "
                   f"{float(headroom):.0%} headroom)")


def _workload(best: Any) -> tuple[WorkloadSpec, Target | None]:
    """The workload recorded in best.yaml (:meth:`oomtune.workload_spec.WorkloadSpec.from_best`:
    the target, the model group of a built-in workload, the target GPU ``device.target_gpu``, the
    answer's training settings ``workload.training`` and the rank count ``workload.ranks``), and the
    :class:`oomtune.trial._base.Target` serving it (None: a target this oomtune does not know, whose
    model group is then not read).

    Raises:
        BestFileError: a malformed or unknown key, or a built-in workload without its model."""
    from oomtune.trial._base import find_target

    spec = best.workload_spec
    target = find_target(spec.target_name)
    try:
        model = target.model_keys(spec.model) if target is not None else None
    except ConfigError as exc:
        raise BestFileError(f"best.yaml workload.{exc}") from None
    return dataclasses.replace(spec, model=model), target


@dataclass(frozen=True)
class PreparedCheck:
    """best.yaml read and validated once for both modes (:func:`prepare_check`): what ``oomtune
    check`` runs or predicts. The check's input is best.yaml, not a Hydra config: this is its
    counterpart of :class:`oomtune.prepared.PreparedRun`.

    Attributes:
        best: the loaded :class:`oomtune.best.BestConfig`.
        workload: the recorded :class:`oomtune.workload_spec.WorkloadSpec` (:func:`_workload`: model
            keys, target, target GPU, training settings, ranks).
        target: the :class:`oomtune.trial._base.Target` serving it (None: a target this oomtune
            does not know).
        geometry: the virtual GPU of the recorded trials (:func:`_geometry`: ``total_memory_bytes``,
            ``memory_fraction``).
        budget_bytes: the recorded budget, bytes.
        limit_bytes / limit_text: the limit the search judged "fits" by (:func:`_search_limit`).
        ranks: the rank count the answer was tuned for (1 unless ``workload.ranks``).
    """

    best: Any
    workload: WorkloadSpec
    target: Target | None
    geometry: dict[str, Any]
    budget_bytes: int
    limit_bytes: int
    limit_text: str
    ranks: int


def prepare_check(best: Any) -> PreparedCheck:
    """Read best.yaml's device, workload and limit sections once (:class:`PreparedCheck`).

    Raises:
        BestFileError: a malformed budget, device size, headroom, target, model, training settings
            or rank count (one line naming the key).
    """
    geometry = _geometry(best)
    workload, target = _workload(best)
    limit_bytes, limit_text = _search_limit(best)
    return PreparedCheck(best=best, workload=workload, target=target,
                         geometry=geometry, budget_bytes=int(best.device["budget_bytes"]), limit_bytes=limit_bytes,
                         limit_text=limit_text, ranks=workload.ranks or 1)


def check_predict(best: Any, *, tolerance: float = DEFAULT_TOLERANCE, timeout_s: float | None = None,
                  best_path: str | Path | None = None) -> CheckReport:
    """Predict the recorded configuration with the current code and compare (see module docstring).

    A target oomtune cannot capture (``target=cmd``, the HF and Lightning integrations) is not
    re-traced: its best.yaml names the allocation stream its prediction replayed
    (``best.predicted_stream``, recorded by the search's trials: :mod:`oomtune.plan.recorded`), which
    is replayed on the current virtual GPU instead. That checks the allocator model and the budget,
    not the script (a changed script is seen by ``--mode run``, which runs it).

    Args:
        timeout_s: the wall limit of each capture of a python entry, seconds (run in a process of its
            own: :mod:`oomtune.plan.isolation`; None: :data:`oomtune.plan.predictor.CAPTURE_TIMEOUT_S`).
        best_path: where best.yaml was read from (the file or its run directory): the recorded
            stream's file is found beside it (default: the current directory).

    Returns:
        a report with the cases ``fits budget (predicted)`` and ``prediction``.

    Raises:
        BestFileError: no ``best.predicted_peak_reserved_bytes`` recorded, a malformed workload or
            device section, or a recorded stream that is missing, unreadable or not the one
            recorded (its SHA-256). ConfigError: the workload cannot be built by the current code,
            or a bad tolerance; a target that cannot be traced and whose best.yaml names no stream.
    """
    from oomtune.plan.predictor import PREDICT_STEPS, Predictor

    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.plan.predictor import simulable

    validate_limits(tolerance=tolerance)
    tolerance = float(tolerance)
    if not simulable(AllocatorSettings.parse(best.best.alloc_conf or "")):
        raise ConfigError(f"--mode predict cannot simulate best.yaml's alloc_conf {best.best.alloc_conf!r} "
                          "(the virtual GPU models only the native caching allocator): use --mode run")
    recorded = best.best.predicted_peak_reserved_bytes
    if isinstance(recorded, bool) or not isinstance(recorded, int) or recorded <= 0:
        raise BestFileError("best.yaml has no best.predicted_peak_reserved_bytes (the search ran without "
                            "prediction, e.g. search.prune=off or a cmd target): use --mode run")
    run = prepare_check(best)
    recorded_stream = None
    if run.target is None or not run.target.capturable:
        if not best.best.predicted_stream:
            raise ConfigError(f"--mode predict cannot trace target {run.workload.target_name!r} and "
                              "best.yaml names no recorded allocation stream (best.predicted_stream): use --mode run")
        recorded_stream = _recorded_stream(best, best_path)
    t0 = time.perf_counter()
    if recorded_stream is not None:
        from oomtune.plan.recorded import RecordedPredictor

        predictor = RecordedPredictor({best.best.batch_size: recorded_stream}, run.geometry,
                                      steps=best.best.predicted_steps or 0)
    else:
        # the steps the recorded prediction replayed (2 in best.yaml files written before they were recorded)
        workload = run.workload
        if best.best.predicted_at_worst_shape:   # the search's frontier predicted the largest shape
            from oomtune.trial._base import worst_shape_spec

            workload = worst_shape_spec(workload)
        predictor = Predictor(workload, run.geometry, steps=best.best.predicted_steps or PREDICT_STEPS,
                              timeout_s=timeout_s, timeout_name="--timeout")
    pred = predictor.predict_detail(best.best.batch_size, best.best.alloc_conf)
    elapsed = time.perf_counter() - t0
    change = relative_change(pred.peak_reserved_bytes, recorded)
    ok = within_limit(pred.peak_reserved_bytes, recorded, tolerance)
    figures = {"predicted_peak_reserved_bytes": pred.peak_reserved_bytes, "recorded_bytes": recorded,
               "change": change, "tolerance": tolerance, "fits": pred.fits,
               "fallback": sorted(predictor.fallback_reasons)}
    limit_bytes, limit_text = run.limit_bytes, run.limit_text
    fits = bool(pred.fits) and pred.peak_reserved_bytes is not None and pred.peak_reserved_bytes <= limit_bytes
    figures.update(fits=fits, limit_bytes=limit_bytes)
    compare = (f"predicted peak reserved {format_bytes(pred.peak_reserved_bytes)} (simulated) vs recorded "
               f"{format_bytes(recorded)} ({change:+.2%}, tolerance {tolerance:.2%})")
    fraction = fraction_case(best, geometry=run.geometry)
    cases = [
        CheckCase("fits budget (predicted)", fits,
                  f"batch {best.best.batch_size} fits {limit_text}: peak reserved "
                  f"{format_bytes(pred.peak_reserved_bytes)} (simulated)" if fits
                  else f"batch {best.best.batch_size} no longer fits {limit_text}: "
                       f"needs {format_bytes(pred.peak_reserved_bytes)} reserved (simulated)", elapsed),
        CheckCase("prediction", ok, compare, 0.0),
        fraction,
    ]
    verdict = "PASS" if all(c.passed for c in cases) else "FAIL"
    tail = "" if fits else f"; does not fit {limit_text}"
    if fraction.passed is False:
        tail += f"; memory fraction: {fraction.message}"
    return CheckReport("predict", cases, f"oomtune check: {verdict} {compare}{tail}", figures)


def _recorded_stream(best: Any, best_path: str | Path | None) -> Any:
    """The allocation stream ``best.predicted_stream`` names, beside best.yaml, checked against its
    recorded SHA-256.

    Raises:
        BestFileError: the file is missing or unreadable, not the one recorded, or not a stream.
    """
    import hashlib

    from oomtune.alloc.stream import AllocationStream

    base = Path(best_path) if best_path is not None else Path.cwd()
    folder = base if base.is_dir() else base.parent
    path = folder / best.best.predicted_stream
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BestFileError(f"best.predicted_stream: cannot read {str(path)!r} ({exc.strerror or exc}); keep it "
                            "beside best.yaml, or use --mode run") from None
    if best.best.predicted_stream_sha256 and hashlib.sha256(data).hexdigest() != best.best.predicted_stream_sha256:
        raise BestFileError(f"best.predicted_stream: {str(path)!r} is not the stream the search recorded (its "
                            "SHA-256 differs from best.predicted_stream_sha256): copy the run directory whole")
    try:
        return AllocationStream.load(path)
    except ConfigError as exc:
        raise BestFileError(f"best.predicted_stream: {exc}") from None


def _run_device(best: Any, device: str | None) -> str:
    """The trial device: ``device`` if given, else the recorded kind (``cuda`` or ``cpu``).

    Raises:
        ConfigError: the run would measure another memory source than best.yaml recorded.
        DeviceError: CUDA asked for but unavailable, or the budget above the device.
    """
    from oomtune.device import resolve_budget, resolve_device

    recorded_kind = best.device.get("kind", "cpu")
    spec = device or ("cuda" if recorded_kind == "cuda" else "cpu")
    target = resolve_device(spec)
    recorded_src = best.best.metrics.get("memory_source") or best.device.get("memory_source")
    if recorded_src is not None and recorded_src != target.memory_source:
        raise ConfigError(
            f"best.yaml holds {recorded_src} memory figures but a run on {target.spec} measures "
            f"{target.memory_source} memory: they are not comparable (use --mode predict, or --device "
            f"{'cuda' if recorded_src == 'device' else 'cpu'})")
    if not target.simulated:
        resolve_budget(int(best.device["budget_bytes"]), target)
    return target.spec


def _rank_gpus(ranks: int, where: str) -> str:
    """The GPUs of a check run of ``ranks`` ranks, one each: ``cuda:0,1,...`` (the first visible ones).

    Raises:
        ConfigError: ``where`` names one GPU (``cuda:N``), or fewer GPUs are visible than the ranks
            best.yaml was tuned for (its answer holds per rank at that rank count only).
    """
    if ":" in where:
        raise ConfigError(f"--device {where} names one GPU but best.yaml was tuned for {ranks} ranks, one GPU each "
                          f"(workload.ranks): use --device cuda")
    import torch

    visible = torch.cuda.device_count()
    if visible < ranks:
        raise ConfigError(f"best.yaml was tuned for {ranks} ranks, one GPU each (workload.ranks), but {visible} GPU(s) "
                          f"are visible: run the check where {ranks} are, or use --mode predict")
    return "cuda:" + ",".join(str(i) for i in range(ranks))


def _memory_case(res: Any, metrics: dict[str, Any], limit: float) -> CheckCase:
    """Peak reserved against best.yaml's, else the device-level (NVML) peak against best.yaml's (a
    ``target=cmd`` run on a GPU without the capture hook). Without a reading the memory is not
    checked, and the case says so: FAIL when best.yaml has a reading the run did not reproduce, an
    explicit SKIP with the reason when neither has one (never a PASS)."""
    pairs = (("peak reserved", res.memory.peak_reserved_bytes, metrics.get("peak_reserved_bytes")),
             ("device peak (NVML)", res.memory.device_peak_bytes, metrics.get("device_peak_bytes")))
    for what, new, recorded in pairs:
        if new is not None and isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and recorded > 0:
            change = relative_change(new, recorded)
            return CheckCase("memory growth", within_limit(new, recorded, limit),
                             f"{what} {format_bytes(new)} ({res.memory.source}) vs recorded {format_bytes(recorded)} "
                             f"({change:+.2%}, limit +{limit:.2%})")
    had = [what for what, _new, recorded in pairs if isinstance(recorded, (int, float)) and recorded]
    if had:
        return CheckCase("memory growth", False, f"memory not checked: best.yaml records a {had[0]} but the run "
                         "gave no memory reading (no NVML, or the command no longer reports memory)")
    return CheckCase("memory growth", None, "memory not checked: neither best.yaml nor the run has a memory reading "
                     "(a target=cmd script without oomtune.capture_hook, on the virtual GPU or without NVML)")


def _speed_case(res: Any, recorded: Any, limit: float) -> CheckCase:
    if res.throughput.samples_per_s is None:
        return CheckCase("slowdown", None, "no throughput reading")
    if not isinstance(recorded, (int, float)) or recorded <= 0:
        return CheckCase("slowdown", None, "best.yaml records no throughput")
    change = relative_change(res.throughput.samples_per_s, recorded)
    ok = within_drop(res.throughput.samples_per_s, recorded, limit)
    return CheckCase("slowdown", ok, f"throughput {res.throughput.samples_per_s:.1f} vs recorded {recorded:.1f} "
                     f"samples/s ({change:+.2%}, limit -{limit:.2%})")


def evaluate_run(best: Any, res: Any, *, max_memory_growth: float, max_slowdown: float | None,
                 geometry: dict[str, Any] | None = None) -> CheckReport:
    """Judge a finished check trial (a :class:`TrialResult`) against best.yaml's recorded metrics.

    ``max_slowdown`` None skips the slowdown case (:data:`SIMULATED_SLOWDOWN_NOTE`, also returned in
    ``figures["notes"]`` and left out of the summary line)."""
    elapsed = res.wall_s or 0.0
    if res.outcome is not Outcome.OK:
        what = "out of memory" if res.outcome.is_memory else f"trial failed ({res.outcome})"
        msg = f"{what} at batch {best.best.batch_size}: {res.message or 'no message'}"
        cases = [CheckCase("oom", False, msg, elapsed),
                 CheckCase("memory growth", None, "the trial did not complete"),
                 CheckCase("slowdown", None, "the trial did not complete")]
        return CheckReport("run", cases, f"oomtune check: FAIL {msg}", {"outcome": res.outcome.value})
    metrics = best.best.metrics
    speed = (CheckCase("slowdown", None, SIMULATED_SLOWDOWN_NOTE) if max_slowdown is None
             else _speed_case(res, metrics.get("throughput"), max_slowdown))
    memory = _memory_case(res, metrics, max_memory_growth)
    fraction = fraction_case(best, applied=res.budget.memory_fraction, ran=True, geometry=geometry,
                             device_total=getattr(res.device, "total_memory_bytes", None)
                             if res.memory.source == "device" else None)
    cases = [CheckCase("oom", True, f"batch {best.best.batch_size} ran {res.throughput.steps} steps within the "
                       f"{format_bytes(best.device.get('budget_bytes'))} budget", elapsed),
             memory, speed, fraction]
    # a check whose memory could not be read is not a pass
    verdict = ("FAIL" if any(c.passed is False for c in cases) else "SKIP" if memory.passed is None else "PASS")
    parts = "; ".join(c.message for c in cases[1:] if (c is not speed or max_slowdown is not None)
                      and (c is not fraction or fraction.passed is False))
    figures = {"outcome": res.outcome.value, "peak_reserved_bytes": res.memory.peak_reserved_bytes,
               "throughput": res.throughput.samples_per_s, "memory_source": res.memory.source,
               "notes": [SIMULATED_SLOWDOWN_NOTE] if max_slowdown is None else []}
    return CheckReport("run", cases, f"oomtune check: {verdict} {parts}", figures)


def check_run(best: Any, *, max_memory_growth: float = DEFAULT_MAX_MEMORY_GROWTH,
              max_slowdown: float | None = None, device: str | None = None, steps: int = 10,
              timeout_s: float = 600.0, workdir: Path | None = None, runner: Any = None,
              say: Callable[[str], None] | None = None) -> CheckReport:
    """Run the recorded configuration as a trial and compare with best.yaml's metrics.

    Args:
        max_memory_growth: allowed relative growth of peak reserved, >= 0.
        max_slowdown: allowed relative loss of throughput in [0, 1); None: the default
            (:func:`default_max_slowdown`: 10% on a CUDA best.yaml, not checked on a virtual-GPU one).
        device: ``cpu``, ``cuda`` or ``cuda:N``; default the recorded kind.
        steps: measured steps (after 1 warm-up step).
        workdir: the trial's directory (default a temporary one).
        runner: a ``TrialRunner`` (default ``TrialRunner(launcher="spawn")``: a clean process).
        say: called with progress lines (what runs, each step done, the end; :func:`_watch_steps`).

    Raises:
        ConfigError: bad limits or steps, incomparable memory sources, fewer visible GPUs than the
            ranks best.yaml was tuned for (:func:`_rank_gpus`). DeviceError: no such device or the
            budget above it. BestFileError: malformed best.yaml sections.
    """
    from oomtune.trial.record import TrialSpec
    from oomtune.trial.runner import TrialRunner

    validate_limits(max_slowdown=max_slowdown, max_memory_growth=max_memory_growth)
    if max_slowdown is None:
        max_slowdown = default_max_slowdown(best)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--steps={steps!r}: expected an integer >= 1")
    run = prepare_check(best)
    ranks = run.ranks
    where = _run_device(best, device)
    if ranks > 1 and where.startswith("cuda"):   # one GPU per rank, as the search ran it
        where = _rank_gpus(ranks, where)
    spec = TrialSpec(workload=run.workload, batch_size=best.best.batch_size, alloc_conf=best.best.alloc_conf,
                     device=where, budget_bytes=run.budget_bytes,
                     warmup_steps=1, measure_steps=steps, timeout_s=float(timeout_s),
                     device_memory_bytes=run.geometry["total_memory_bytes"],
                     memory_fraction=best.device.get("memory_fraction") != "off", ranks=ranks)
    runner = runner or TrialRunner(launcher="spawn")
    say = say or (lambda text: None)
    conf = best.best.alloc_conf or "the default allocator"
    say(f"running batch {spec.batch_size}, {conf} on {spec.device} in a clean process: {spec.warmup_steps} "
        f"warm-up + {steps} measured steps (timeout {timeout_s:g} s); starting: importing torch ...")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="oomtune-check-") as tmp:
        where = Path(workdir) if workdir is not None else Path(tmp)
        with _watch_steps(where, spec.warmup_steps, started, say):
            res = runner.run(spec, workdir=where)
    say(f"trial finished after {time.monotonic() - started:.1f} s: {res.outcome}")
    return evaluate_run(best, res, max_memory_growth=max_memory_growth, max_slowdown=max_slowdown,
                        geometry=run.geometry)


@contextlib.contextmanager
def _watch_steps(workdir: Path, warmup_steps: int, started: float, say: Callable[[str], None],
                 interval_s: float = 0.5) -> Iterator[None]:
    """While the block runs, read the trial's progress record (``workdir/progress.json``,
    :func:`oomtune.trial.record.read_progress`) every ``interval_s`` seconds and ``say`` one line per
    change: ``step 3/11 done, 12.4 s`` (``step 1/11 done, warm-up, 6.0 s`` for a warm-up step),
    seconds since ``started`` (``time.monotonic()``)."""
    from oomtune.trial.record import PROGRESS_FILE, read_progress

    stop = threading.Event()

    def watch() -> None:
        last = None
        while True:
            done = stop.wait(interval_s)
            now = read_progress(workdir / PROGRESS_FILE)
            if now is not None and now != last:
                last, elapsed = now, time.monotonic() - started
                if now[0] == 0:
                    say(f"ready after {elapsed:.1f} s: {now[1]} steps to run")
                else:
                    say(f"step {now[0]}/{now[1]} done{', warm-up' if now[0] <= warmup_steps else ''}, "
                        f"{elapsed:.1f} s")
            if done:
                return

    thread = threading.Thread(target=watch, name="oomtune-check-steps", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def write_junit(report: CheckReport, path: str | Path) -> Path:
    """Write a JUnit XML report: one ``testsuite`` named ``oomtune check (<mode>)``, one ``testcase``
    per :class:`CheckCase` with a ``failure`` (failed) or ``skipped`` (no reading) element.

    Raises:
        ConfigError: the file cannot be written.
    """
    import xml.etree.ElementTree as ET

    failures = sum(c.passed is False for c in report.cases)
    skipped = sum(c.passed is None for c in report.cases)
    suite = ET.Element("testsuite", name=f"oomtune check ({report.mode})", tests=str(len(report.cases)),
                       failures=str(failures), errors="0", skipped=str(skipped),
                       time=f"{sum(c.time_s for c in report.cases):.3f}")
    for case in report.cases:
        el = ET.SubElement(suite, "testcase", classname=f"oomtune.check.{report.mode}", name=case.name,
                           time=f"{case.time_s:.3f}")
        if case.passed is False:
            ET.SubElement(el, "failure", message=case.message, type="regression").text = case.message
        elif case.passed is None:
            ET.SubElement(el, "skipped", message=case.message)
        else:
            ET.SubElement(el, "system-out").text = case.message
    ET.SubElement(suite, "system-out").text = report.summary
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
    except OSError as exc:
        raise ConfigError(f"cannot write JUnit report {str(path)!r}: {exc.strerror or exc}") from None
    return path
