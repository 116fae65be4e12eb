"""Recordings of allocation streams by a target whose trials record them (``target=cmd``).

The default allocator's trials at a few small batch sizes (the *anchors*) record their step's
allocation stream; a predictor made of those recordings (the search's ``recording`` factory)
derives the other batch sizes, so that every configuration's frontier is predicted as for a
captured workload. A probe's own recording checks the derivation (:func:`learn_recording`); a
recording within the limit is a probe's result, not launched again (:func:`from_recording`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oomtune.outcome import Outcome
from oomtune.study import records as R

__all__ = ["MAX_ANCHORS", "anchor_batches", "recorded_accum", "recorded", "record_streams", "learn_recording",
           "from_recording"]

#: Batch sizes a target that records its streams may record before giving up on a model of them.
MAX_ANCHORS = 5


def anchor_batches(space: Any) -> list[int]:
    """The batch sizes that may be recorded first (the default allocator): the smallest allowed
    ones of ``space`` (with a global batch, of those that accumulate), cheap to run; three are
    recorded, more (up to :data:`MAX_ANCHORS`) only while the recordings do not determine a model
    (the smallest batch can run other code); the affine model derives the others from them."""
    from oomtune.plan.feasibility import grid_batches

    choices = space.batch_choices()
    if choices is None:
        return grid_batches(space.batch_low, space.batch_high)[:MAX_ANCHORS]
    return [b for b in choices if space.grad_accum_for(b) > 1][:MAX_ANCHORS]


def recorded_accum(space: Any, batch: int) -> int:
    """Micro-batches per step of the recordings the predictor stands on (1 without a global
    batch; 2 with one: :func:`record_streams`); 0 for a batch they do not stand for."""
    if space.global_batch is None:
        return 1
    return 2 if space.grad_accum_for(batch) > 1 else 0


def recorded(trial: Any, accum: int) -> tuple[int, Any] | None:
    """(batch, stream) of a finished trial's recorded allocation stream when it ran ``accum``
    micro-batches per step; None when it recorded none (or ran another accumulation)."""
    from oomtune.exceptions import ConfigError
    from oomtune.plan.recorded import load_recording

    res = R.result_of(trial)
    path = None if res is None else res.script.stream_file
    if not path or res.outcome is not Outcome.OK:
        return None
    ran = res.script.grad_accum or 1
    if ran != accum:
        return None
    try:
        stream, _ = load_recording(path)
    except ConfigError:
        return None
    return int(trial.params["batch_size"]), stream


def record_streams(space: Any, *, steps: int, device: str, run_batch: Callable[[list, str], list[Any]],
                   recording: Callable[..., Any]) -> tuple[Any | None, str]:
    """Run the default allocator at the anchor batch sizes (:func:`anchor_batches`) and make a
    predictor of their recordings (``recording(streams by batch, steps, stands_for)``). Returns
    (predictor, note): the predictor is None, and the note says why, when fewer than three recorded
    or the recordings do not determine the others.

    Without a global batch the anchors are baseline probes (``run_batch(cands, "frontier")``: role
    ``baseline``). With one, they run two micro-batches per step whatever the global batch (role
    ``record``: not candidates), so that every recording has one structure and the model stands for
    every micro-batch that accumulates, as a capture does
    (:func:`oomtune.workloads.loop.prediction_workload`). ``device``: where the trials run (a
    ``cuda`` device records from its memory history, else the virtual GPU)."""
    anchors = anchor_batches(space)
    if len(anchors) < 3:
        return None, (f"only {len(anchors)} batch size{'' if len(anchors) == 1 else 's'} to record: the allocator "
                      "configurations are probed by trials")
    accum = 1 if space.global_batch is None else 2
    # without a global batch the anchors are the default allocator's first baseline probes; with one,
    # and for the other activation checkpointing values, recordings (role record: not candidates)
    members: dict[Any, Any] = {}
    done_batches: list[int] = []
    for ckpt in (space.checkpointing or [None]):
        role = "frontier" if accum == 1 and not ckpt else "record"
        params = {} if ckpt is None else {"activation_checkpointing": ckpt}
        got: dict[int, Any] = {}
        predictor, failed, done = None, [], 0
        while done < len(anchors) and not failed:
            # the smallest anchor alone first: a command that fails (or hangs) at it is not run twice more
            batch_of = anchors[:1] if done == 0 else anchors[done:3] if done < 3 else anchors[done:done + 1]
            trials = run_batch([space.candidate(b, params) for b in batch_of], role)
            done += len(batch_of)
            for b, t in zip(batch_of, trials):
                r = recorded(t, accum)
                if r is not None:
                    got[r[0]] = r[1]
                elif R.result_of(t) is None or R.result_of(t).outcome is not Outcome.OK:
                    failed.append(b)
                    res = R.result_of(t)
                    how = ("no result" if res is None else
                           f"{res.outcome}: {res.message}" if res.message else str(res.outcome))
            if failed or len(got) < done:   # a failure, or a run that recorded no stream
                break
            if len(got) < 3:
                continue
            predictor = recording(got, steps, lambda b: recorded_accum(space, b) == accum)
            if predictor.usable:
                break
        what = "" if ckpt is None else f" (activation checkpointing {'on' if ckpt else 'off'})"
        if len(got) < 3 or predictor is None:
            why = (f"the default allocator's trial at batch {', '.join(map(str, failed))}{what} failed ({how})"
                   if failed else "the command recorded no allocation stream (call "
                   "oomtune.capture_hook() or use an integration, oomtune.integrations)")
            return None, f"no predictions: {why}; every allocator configuration is probed by trials"
        if not predictor.usable:
            return None, (f"no predictions{what}: {predictor.derivation_note}; every allocator "
                          "configuration is probed by trials")
        members[ckpt] = predictor
        done_batches += sorted(got)
    per_step = "" if accum == 1 else ", two micro-batches per step"
    note = (f"recorded the allocation streams of batch {', '.join(map(str, done_batches))} "
            f"(default allocator{per_step}, "
            + ("from the device's memory history" if str(device).startswith("cuda") else "on the virtual GPU")
            + (", with and without activation checkpointing" if len(members) > 1 else "")
            + "); the other batch sizes are derived from them")
    if list(members) == [None]:
        return members[None], note
    from oomtune.plan.recorded import RecordedVariants

    return RecordedVariants(members), note


def learn_recording(predictor: Any, planner: Any, trial: Any, space: Any, say: Callable[[str], None]) -> None:
    """A probe's own recording checks the stream ``predictor`` derived for its batch size; a
    difference stops the predictions (the remaining probes go by trials:
    :meth:`oomtune.search.frontier.FrontierPlanner.drop_predictions`), said in one line."""
    if predictor is None or not hasattr(predictor, "add_recording") or planner.peak is None:
        return
    batch = int(trial.params["batch_size"])
    got = recorded(trial, recorded_accum(space, batch))
    if got is None:
        return
    ckpt = trial.params.get("activation_checkpointing")
    if not predictor.add_recording(*got, **({} if ckpt is None else {"checkpointing": ckpt})):
        say(f"note: {predictor.derivation_note}; from here on a configuration's frontier is "
            "found by trials (none is needed where the answer already runs the batch range's top)")
        planner.drop_predictions()


def from_recording(study: Any, space: Any, recording: Any, limit: Any, objective: Any, cand: Any) -> Any | None:
    """A finished recording (role ``record``, :func:`record_streams`) of ``study`` whose result is
    ``cand``'s own, so that the probe is not launched again: the same parameters (batch, allocator
    settings, data-loader settings, activation checkpointing), the same step (the recording's two
    micro-batches; under an objective that does not measure time, any accumulating step of two or
    more, whose requests repeat the second micro-batch's: :func:`oomtune.workloads.training.
    prediction_workload`), and a run that stayed within ``limit``. A recording runs on an unbounded
    virtual GPU (or without a memory fraction); one whose peak stayed within the limit never reached
    the memory fraction, so the caching allocator made the same calls as under the budget
    (CUDACachingAllocator.cpp, ``DeviceCachingAllocator::malloc``: the cap is consulted only when a
    segment is about to be allocated beyond it). None when there is none (always for a target whose
    trials record nothing: ``recording`` None)."""
    recorded_steps = 1 if space.global_batch is None else 2
    same_step = cand.grad_accum == recorded_steps or (
        not objective.measures_time and cand.grad_accum >= 2 and recorded_steps >= 2)
    if not same_step or recording is None:   # only targets whose trials record run recordings
        return None
    # a read of its own: the worker's last read may predate the recordings' results
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(R.ATTR_ROLE) != "record" or t.params != cand.optuna_params():
            continue
        res = R.result_of(t)
        if (res is not None and res.outcome is Outcome.OK and res.alloc_conf == cand.alloc_conf
                and R.used_bytes(res) is not None and R.violation(res, limit) <= 0):
            return t
    return None
