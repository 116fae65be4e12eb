"""Request streams at other batch sizes without capturing them: the affine model (issue 13, item 3).

Across batch sizes, a training step makes the same requests in the same order (the same operators
run), and each request's size is, for most operators, an affine function of the batch size ``b``:
``size_i(b) = slope_i * b + offset_i`` in bytes (an activation of shape ``[b, C, H, W]`` holds
``b * C * H * W * itemsize`` bytes; weights, gradients and optimizer state do not depend on ``b``).
:class:`AffineStreamModel` fits that model exactly, in integers, on captured streams and derives the
stream at any other batch size between them.

The model holds only when every capture agrees: the same actions, keys (the recorder numbers
storages in allocation order, so equal keys mean that every free releases the same request) and CUDA
streams, and integer slopes and offsets that reproduce every captured size to the byte. Otherwise
:meth:`AffineStreamModel.fit` returns None and the caller captures every batch size. Derived streams
are verified by the caller (:class:`oomtune.plan.predictor.Predictor` spot-captures derived batch
sizes and compares event by event), since three exact points do not prove that a size is affine
everywhere between them (e.g. an operator that switches algorithm at some batch size).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

__all__ = ["AffineStreamModel", "MIN_FIT_CAPTURES", "repeat_steady_step"]

#: Captures a fit needs: two determine every slope and offset, the third checks them.
MIN_FIT_CAPTURES = 3


@dataclass(frozen=True)
class AffineStreamModel:
    """Every event's size as ``slope * batch_size + offset`` (bytes), fitted on real captures.

    Attributes:
        low / high: the smallest and largest captured batch sizes; :meth:`derive` answers only
            between them (interpolation), since outside the captured range the model is unchecked.
        captured: the batch sizes the fit was checked on (at least :data:`MIN_FIT_CAPTURES`).
    """

    low: int
    high: int
    captured: tuple[int, ...]
    _template: Any      # an AllocationStream whose actions, keys and streams every derived one shares
    _slopes: tuple[int, ...]
    _offsets: tuple[int, ...]

    @classmethod
    def fit(cls, streams: dict[int, Any]) -> AffineStreamModel | None:
        """Fit the model on ``{batch_size: AllocationStream}`` captures; None when it does not hold.

        It holds when there are at least :data:`MIN_FIT_CAPTURES` captures, all with the same
        actions, keys and CUDA streams, and each event's sizes lie on one line with integer slope and
        offset (fitted on the smallest and largest batch sizes, checked on all the others).
        """
        if len(streams) < MIN_FIT_CAPTURES:
            return None
        batches = sorted(streams)
        low, high = batches[0], batches[-1]
        first, last = streams[low], streams[high]
        for b in batches[1:]:
            s = streams[b]
            if s.actions != first.actions or s.keys != first.keys or s.streams != first.streams:
                return None
        span = high - low
        slopes, offsets = [], []
        for s_low, s_high in zip(first.sizes, last.sizes):
            slope, rest = divmod(s_high - s_low, span)
            if rest:
                return None
            slopes.append(slope)
            offsets.append(s_low - slope * low)
        for b in batches[1:-1]:
            if any(sl * b + off != s for sl, off, s in zip(slopes, offsets, streams[b].sizes)):
                return None
        return cls(low, high, tuple(batches), first, tuple(slopes), tuple(offsets))

    def covers(self, batch_size: int) -> bool:
        """Whether :meth:`derive` answers for ``batch_size`` (between the captured extremes)."""
        return self.low <= batch_size <= self.high

    def derive(self, batch_size: int) -> Any:
        """The AllocationStream at ``batch_size``: the captures' events with sizes from the model.

        Raises:
            ValueError: ``batch_size`` outside ``[low, high]`` (see :meth:`covers`).
        """
        from oomtune.alloc.stream import AllocationStream

        if not self.covers(batch_size):
            raise ValueError(f"batch size {batch_size} is outside the captured range [{self.low}, {self.high}]")
        t = self._template
        out = AllocationStream()
        out.actions = array("b", t.actions)
        out.keys = array("q", t.keys)
        out.streams = array("q", t.streams)
        out.sizes = array("q", [sl * batch_size + off for sl, off in zip(self._slopes, self._offsets)])
        live: dict[int, int] = {}  # as AllocationStream.append_* leave it: live keys in alloc order
        for a, k, s in zip(out.actions, out.keys, out.sizes):
            if a == 0:
                live[k] = s
            else:
                del live[k]
        out._live = live
        return out


def repeat_steady_step(stream: Any, start: int, times: int) -> Any | None:
    """``stream`` followed by ``times`` more copies of its last step ``stream[start:]`` (the steady
    state), each copy's keys shifted past every key in use, so that a stream of ``k`` captured steps
    stands for ``k + times`` steps without running them on meta (issue 13: the predictor captures
    2 steps and replays the trial's ``warmup + measure``).

    A fixed-shape training step after the first makes the same requests in the same order (the same
    operators on the same shapes; the optimizer state exists from step 1 on), so step 3 repeats step
    2. That holds only for a *self-contained* step: it frees nothing an earlier step allocated and
    leaves nothing of its own allocated (activations, gradients under ``zero_grad(set_to_none=
    True)`` and temporaries all die inside it), which is checked here; the caller checks that the
    workload's shapes are fixed.

    Returns:
        the longer AllocationStream, or None when the last step is not self-contained (capture the
        steps instead).
    """
    from oomtune.alloc.stream import ALLOC, AllocationStream

    if times <= 0:
        return stream
    acts, keys = stream.actions, stream.keys
    own: set[int] = set()
    for i in range(start, len(acts)):
        if acts[i] == ALLOC:
            own.add(keys[i])
        elif keys[i] in own:
            own.discard(keys[i])
        else:
            return None   # it frees an allocation of an earlier step
    if own or start >= len(acts):
        return None       # an allocation of the step outlives it (or an empty step)
    shift = max(keys) + 1 - min(keys[start:])
    out = AllocationStream()
    out.actions, out.keys = array("b", acts), array("q", keys)
    out.sizes, out.streams = array("q", stream.sizes), array("q", stream.streams)
    step_keys = keys[start:]
    for r in range(1, times + 1):
        out.actions.extend(acts[start:])
        out.keys.extend(array("q", [k + r * shift for k in step_keys]))
        out.sizes.extend(stream.sizes[start:])
        out.streams.extend(stream.streams[start:])
    out._live = dict(stream._live)   # every copy frees what it allocates: the live set is the stream's
    return out
