"""The smoke test of a search whose trials run on the meta device (``trial.execute=meta``).

The meta device runs no arithmetic, so one real CPU step of the workload, at the smallest batch with
the default allocator, is where the user's code itself runs (under a global batch, a step of two
micro-batches, as the recordings run: :func:`oomtune.search.recordings.record_streams`; its cost grows
with the micro-batches, and a third repeats the second's code); once per study (a study that passed it
does not run it again; its study attribute ``smoke_test`` says so), on a thread of its own beside the
frontier rounds (:class:`Background`)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from oomtune.outcome import Outcome
from oomtune.search.faults import SetupFault
from oomtune.trial.record import TrialResult, TrialSpec
from oomtune.units import format_bytes

if TYPE_CHECKING:
    from oomtune.search.options import SearchOptions

__all__ = ["smoke_test", "cpu_trial", "Background", "STUDY_ATTR"]

#: The study's user attribute recording a passed smoke test: ``{"batch_size": ..., "wall_s": ...}``.
STUDY_ATTR = "smoke_test"
#: Micro-batches of the smoke test's step under a global batch (the recordings' two).
SMOKE_MICRO_BATCHES = 2


def smoke_test(study: Any, space: Any, opt: SearchOptions, *, peak: Callable[[int, dict], "tuple[int, bool] | None"],
               run: Callable[[TrialSpec], TrialResult]) -> str | None:
    """With trials on the meta device (``opt.execute`` ``meta``), one real CPU step of the workload at
    the smallest batch of ``space`` with the default allocator (at most :data:`SMOKE_MICRO_BATCHES`
    micro-batches under a global batch), unless ``study`` passed it before or one of its trials ran
    its steps on the CPU already (:func:`cpu_trial`: a command that records its stream without an
    integration).
    Returns one line to print (None when there is nothing to say: not meta).

    ``peak(batch, params)``: the virtual GPU's (simulated) peak reserved in bytes, or None; when it
    exceeds the host's available memory (``opt.host_available_bytes``) the step is skipped, and
    said so. ``run(spec)``: runs the step in a trial process.

    Raises:
        SetupFault: the step fails (an error, a crash, a timeout; not a simulated out-of-memory,
            which the smoke test does not look at: it runs without a budget).
    """
    if opt.execute != "meta":
        return None
    done = study.user_attrs.get(STUDY_ATTR)
    batch = space.batch_low
    if done:
        return f"smoke test: passed before (one real CPU step at batch {done.get('batch_size')}, in this study)"
    ran = cpu_trial(study)
    if ran is not None:   # a command without an integration (capture_hook alone) computes on the CPU
        return (f"smoke test: not needed: trial {ran.number} ran the workload's steps on the CPU (batch "
                f"{ran.params.get('batch_size')}); trials that cannot run on the meta device run on the CPU")
    need = peak(batch, space.default(batch).optuna_params())
    avail = opt.host_available_bytes
    if need is not None and avail is not None and need[0] > avail:
        return (f"smoke test skipped: one CPU step at batch {batch} needs about {format_bytes(need[0])} "
                f"(simulated), more than this host's available memory ({format_bytes(avail)})")
    cand = space.default(batch)
    if cand.grad_accum > SMOKE_MICRO_BATCHES:   # under a global batch: two micro-batches, as the recordings
        cand = dataclasses.replace(cand, grad_accum=SMOKE_MICRO_BATCHES)
    spec = TrialSpec(workload=cand.apply_data(opt.workload), batch_size=batch, alloc_conf="",
                     device=opt.device, budget_bytes=None, warmup_steps=0, measure_steps=1,
                     timeout_s=opt.trial.timeout, device_memory_bytes=opt.device_memory_bytes,
                     execute="cpu")
    result = run(spec)
    if result.outcome is not Outcome.OK:
        raise SetupFault(f"the workload fails on the CPU at batch {batch} (the smoke test: one real step, "
                         f"default allocator): {result.outcome}: {result.message}")
    study.set_user_attr(STUDY_ATTR, {"batch_size": batch, "wall_s": result.wall_s})
    wall = f" in {result.wall_s:.1f} s" if result.wall_s is not None else ""
    micro = f" x {cand.grad_accum} micro-batches" if cand.grad_accum > 1 else ""
    return (f"smoke test: one real CPU step at batch {batch}{micro} (default allocator) ran{wall}; the trials run "
            "their steps on the meta device (memory simulated, throughput not measured)")


def cpu_trial(study: Any) -> Any | None:
    """The first finished trial of ``study`` whose steps ran on the CPU although meta was asked
    (``execution.where == "cpu"`` in its record, with a result ``ok``: the workload's code computed
    real values there, which is what the smoke test checks); None when there is none."""
    from oomtune.study import records as R

    for t in study.get_trials(deepcopy=False):
        res = R.result_of(t)
        if res is not None and res.outcome is Outcome.OK and res.execution.where == "cpu":
            return t
    return None


class Background:
    """A call run on a thread of its own (its real CPU step can take long for a large model; the meta
    trials beside it need little CPU); :meth:`finish` waits for it and returns its value or raises
    its exception."""

    def __init__(self, call: Callable[[], Any], name: str = "oomtune-smoke-test"):
        self._box: dict[str, Any] = {}

        def run() -> None:
            try:
                self._box["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to finish
                self._box["raised"] = exc

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def finish(self) -> Any:
        """The call's value, once it has returned.

        Raises:
            BaseException: whatever the call raised.
        """
        while self._thread.is_alive():
            self._thread.join(0.5)   # in slices: Ctrl-C still reaches the waiting thread
        if "raised" in self._box:
            raise self._box["raised"]
        return self._box.get("value")
