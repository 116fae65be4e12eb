"""Predictions from recorded streams: allocator tuning for code oomtune cannot capture itself.

A ``target=cmd`` trial (a user's own script, with :func:`oomtune.capture_hook` or an integration)
records the allocation stream of its steps as it runs on the virtual GPU and writes it beside its
result (``stream.bin`` and ``stream.bin.json``: :mod:`oomtune.script_api`). The request stream a
program makes does not depend on the allocator's settings (the same ops ask for the same sizes in the
same order), so one recording at a batch size stands for that batch size under every allocator
configuration: replayed as ``oomtune plan`` replays a capture.

:class:`RecordedPredictor` is a :class:`oomtune.plan.predictor.Predictor` whose streams are such
recordings instead of meta captures. Other batch sizes are derived from three or more recordings with
the same affine model ``plan`` uses (:class:`oomtune.plan.derive.AffineStreamModel`), between the
recorded batch sizes and above them (extrapolation: the frontier usually lies far above the small
batch sizes recorded first). Every later recording (a probe at a predicted frontier records its own
stream) is compared event by event with the stream derived for its batch size; a difference is
recorded (:attr:`RecordedPredictor.mismatch`) and the caller stops trusting the predictions.

Accumulation: recordings of different batch sizes share their structure only when their steps hold
the same number of micro-batches. Under a fixed global batch the search therefore records its anchors
with two micro-batches per step (role ``record``: not candidates), as captures do
(:func:`oomtune.workloads.loop.prediction_workload`: a third micro-batch repeats the second's
requests), and the predictor answers only for the micro-batches that accumulate (``covers``); the
micro-batch that is the whole global batch is left to a trial.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomtune.exceptions import ConfigError
from oomtune.plan.derive import MIN_FIT_CAPTURES, AffineStreamModel
from oomtune.plan.predictor import Predictor
from oomtune.workload_spec import WorkloadSpec

__all__ = ["load_recording", "RecordedPredictor", "RecordedVariants", "NoPrediction"]


class NoPrediction(ConfigError):
    """No stream is known for this batch size (not recorded, and not derivable)."""


def load_recording(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """(AllocationStream, metadata) of a trial's recorded stream file and its ``.json`` sidecar
    (``source``, ``rank``, ``world_size``, ``events``).

    Raises:
        ConfigError: a missing or malformed file.
    """
    from oomtune.alloc.stream import AllocationStream

    stream = AllocationStream.load(path)
    meta_path = Path(str(path) + ".json")
    from oomtune.safeload import read_json

    try:   # size and depth limited (oomtune.safeload): one line, never a RecursionError
        meta = read_json(meta_path, what="a recorded stream's metadata", error=ValueError) if meta_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"recorded stream metadata {str(meta_path)!r} is unreadable: {exc}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"recorded stream metadata {str(meta_path)!r} is not a JSON object")
    return stream, meta


class RecordedPredictor(Predictor):
    """A :class:`~oomtune.plan.predictor.Predictor` over recorded streams (see the module docstring).

    Args:
        recordings: ``{batch_size: AllocationStream}`` recorded by trials of one step structure.
        geometry: :func:`oomtune.plan.predictor.sim_geometry` of the trials' device and budget.
        steps: the optimizer steps a recording holds (for best.yaml; informational).
        extrapolate: derive batch sizes above the largest recording too (checked by later
            recordings).
        covers: the batch sizes the recordings stand for (default: all; under a global batch, the
            micro-batches that accumulate).

    Attributes:
        mismatch: None, or the first batch size whose recording differed from the derived stream.
        recorded: the batch sizes recorded so far.
    """

    def __init__(self, recordings: dict[int, Any], geometry: dict[str, Any], *, steps: int = 0,
                 extrapolate: bool = True, covers: Any = None) -> None:
        super().__init__(WorkloadSpec(target={"name": "cmd"}, gpu=None), geometry, steps=steps, derive=True, cache=None)
        self.extrapolate = extrapolate
        self.covers = covers or (lambda b: True)
        self.mismatch: int | None = None
        self._note: str | None = None
        self.recorded: list[int] = []
        self.verified: list[int] = []
        for b, stream in sorted(recordings.items()):
            self._streams[b] = self._captured[b] = stream
            self._capture_reasons[b] = None
            self.recorded.append(b)
        self._refit()

    def _refit(self) -> None:
        """Fit the affine model on the recordings that share the structure (actions, keys, CUDA
        streams) of the largest recorded batch: a very small batch can run other code (a batch of 1
        squeezes or broadcasts), so it is left out of the fit (it stays predicted from its own
        recording)."""
        largest = self._captured[max(self._captured)] if self._captured else None
        group = {b: st for b, st in self._captured.items() if largest is not None and st.actions == largest.actions
                 and st.keys == largest.keys and st.streams == largest.streams}
        self._model = AffineStreamModel.fit(group) if len(group) >= MIN_FIT_CAPTURES else None
        self._derivable: dict[int, Any] = {}
        self._note = None if self.mismatch is None else self._note
        if self._model is None:
            if len(group) >= MIN_FIT_CAPTURES:
                why = "recorded streams are not affine in the batch size"
            else:
                why = f"fewer than {MIN_FIT_CAPTURES} recordings of one structure (the same requests in the same order)"
            self._note = f"{why}: only recorded batch sizes are predicted"

    @property
    def derivation_note(self) -> str | None:
        """Why streams of unrecorded batch sizes are not derived (one line), or None."""
        return self._note

    @property
    def usable(self) -> bool:
        """Streams of unrecorded batch sizes can be derived (and no recording contradicted them)."""
        return self._model is not None and self.mismatch is None

    def can_predict(self, batch_size: int, **_: Any) -> bool:
        """Whether a stream is known for ``batch_size`` (recorded, or derivable: every request's size
        a whole number of bytes >= 1 on the fitted lines)."""
        if batch_size in self._captured:
            return True
        if not self.usable or not self.covers(batch_size):
            return False
        if batch_size < self._model.low or (batch_size > self._model.high and not self.extrapolate):
            return False
        return self._derived(batch_size) is not None

    def _derived(self, batch_size: int) -> Any | None:
        """The stream at ``batch_size`` from the fitted model, between the recorded batch sizes or
        above them (the same lines, extrapolated); None where a size is not a whole number >= 1."""
        if batch_size in self._derivable:
            return self._derivable[batch_size]
        out = self._model.stream_at(batch_size)
        self._derivable[batch_size] = out
        return out

    def prepare(self, batch_sizes: Any, *, limit_bytes: int | None = None) -> None:
        """Nothing to capture ahead: streams are recorded by trials (``limit_bytes``, the bound on
        what a capturing predictor captures, has nothing to bound here)."""

    def predict(self, candidate: Any) -> int | None:
        """As :meth:`Predictor.predict`; None also when no stream is known for the batch size."""
        return super().predict(candidate) if self.can_predict(candidate.batch_size) else None

    def predict_raw(self, batch_size: int, settings: Any) -> int | None:
        """As :meth:`Predictor.predict_raw`; None also when no stream is known for the batch size."""
        return super().predict_raw(batch_size, settings) if self.can_predict(batch_size) else None

    def stream(self, batch_size: int) -> Any:
        """The recorded stream at ``batch_size``, or the one derived from the recordings.

        Raises:
            NoPrediction: neither recorded nor derivable.
        """
        stream = self._streams.get(batch_size)
        if stream is not None:
            return stream
        if not self.can_predict(batch_size):
            raise NoPrediction(f"no recorded or derivable allocation stream at batch {batch_size}")
        derived = self._derived(batch_size)
        self._streams[batch_size] = derived
        self.derived_batches.append(batch_size)
        return derived

    def _capture_raw(self, batch_size: int) -> tuple[Any, str | None]:
        raise NoPrediction(f"batch {batch_size} was not recorded (a command cannot be captured without running it)")

    def add_recording(self, batch_size: int, stream: Any, **_: Any) -> bool:
        """Learn a trial's recording at ``batch_size``: when its stream was derived, compare them event
        by event (a verification); the recording is kept and the model refitted on all recordings.

        Returns:
            False when the recording differs from the derived stream (``mismatch`` is set).
        """
        derived = self._streams.get(batch_size) if batch_size not in self._captured else None
        if derived is None and self.can_predict(batch_size) and batch_size not in self._captured:
            derived = self.stream(batch_size)
        same = derived is None or derived == stream
        if derived is not None:
            (self.verified if same else []).append(batch_size)
        if not same and self.mismatch is None:
            self.mismatch = batch_size
            self._note = (f"the stream recorded at batch {batch_size} differs from the one derived "
                          "from the earlier recordings: predictions stopped")
        self._streams[batch_size] = self._captured[batch_size] = stream
        self._capture_reasons[batch_size] = None
        if batch_size not in self.recorded:
            self.recorded.append(batch_size)
        for key in [k for k in self._cache if k[0] == batch_size]:
            del self._cache[key]
        for key in [k for k in self._replays if k[0] == batch_size]:
            del self._replays[key]
        if same and self.mismatch is None:
            self._refit()
        return same


class RecordedVariants:
    """Recorded-stream predictors per activation checkpointing value (each value runs other requests,
    so each has its own recordings), behind the predictor API with a ``checkpointing`` keyword (as
    :class:`oomtune.plan.variants.PredictorVariants`).

    Args:
        members: ``{activation_checkpointing: RecordedPredictor}``.
    """

    def __init__(self, members: dict[Any, RecordedPredictor]) -> None:
        self._by = dict(members)
        first = next(iter(self._by.values()))
        self.geometry, self.steps, self.cache, self.workers = first.geometry, first.steps, None, 1
        self.calibration = 1.0

    def member(self, batch_size: int, checkpointing: Any = None) -> RecordedPredictor:
        """The recordings of ``checkpointing`` (its first value's when None)."""
        return self._by.get(checkpointing, next(iter(self._by.values())))

    @property
    def usable(self) -> bool:
        return all(m.usable for m in self._by.values())

    @property
    def derivation_note(self) -> str | None:
        notes = [f"activation checkpointing {'on' if k else 'off'}: {m.derivation_note}"
                 for k, m in self._by.items() if m.derivation_note]
        return "; ".join(notes) or None

    @property
    def recorded(self) -> list[int]:
        return [b for m in self._by.values() for b in m.recorded]

    def can_predict(self, batch_size: int, *, checkpointing: Any = None) -> bool:
        return self.member(batch_size, checkpointing).can_predict(batch_size)

    def stream(self, batch_size: int, checkpointing: Any = None) -> Any:
        return self.member(batch_size, checkpointing).stream(batch_size)

    def predict_detail(self, batch_size: int, settings: Any, *, checkpointing: Any = None) -> Any:
        return self.member(batch_size, checkpointing).predict_detail(batch_size, settings)

    def predict_raw(self, batch_size: int, settings: Any, *, checkpointing: Any = None) -> int | None:
        return self.member(batch_size, checkpointing).predict_raw(batch_size, settings)

    def predict(self, candidate: Any) -> int | None:
        return self.member(candidate.batch_size, getattr(candidate, "activation_checkpointing", None)).predict(candidate)

    def add_recording(self, batch_size: int, stream: Any, *, checkpointing: Any = None) -> bool:
        return self.member(batch_size, checkpointing).add_recording(batch_size, stream)

    def calibrate(self, pairs: list[tuple[int, int]]) -> float:
        for m in self._by.values():
            self.calibration = m.calibrate(pairs)
        return self.calibration

    @property
    def capture_seconds(self) -> float:
        return 0.0

    @property
    def replay_seconds(self) -> float:
        return sum(m.replay_seconds for m in self._by.values())

    @property
    def fallback_reasons(self) -> set[str]:
        return set()

    @property
    def captures(self) -> int:
        return len(self.recorded)

    @property
    def cached_batches(self) -> list[int]:
        return []

    def prepare(self, batch_sizes: Any, checkpointing: Any = None, *, limit_bytes: int | None = None) -> None:
        """Nothing to capture ahead: streams are recorded by trials (``limit_bytes``, the bound on
        what a capturing predictor captures, has nothing to bound here)."""
