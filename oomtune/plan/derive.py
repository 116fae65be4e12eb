"""Request streams at other batch sizes without capturing them.

Across batch sizes a training step usually makes the same requests in the same order (the same
operators run), and each request's size is a low-degree polynomial in the batch size ``b``, in bytes:
an activation of shape ``[b, C, H, W]`` holds ``b * C * H * W * itemsize`` bytes (degree 1; attention
scores ``[b, h, T, T]`` are quadratic in the length ``T`` but linear in ``b``); a similarity matrix
of a contrastive loss, ``[b, b]``, is quadratic in ``b``; weights, gradients and optimizer state do not
depend on ``b`` (degree 0). The sizes are the *requests* (``UntypedStorage.nbytes()``, what the
recorder captures), never the allocator's rounded block or segment sizes: the replay applies the
caching allocator's rounding (512-byte blocks, 2/20 MiB segments, ``roundup_power2_divisions``) to
every request, derived or captured, so the rounding is never fitted.

Not every batch size makes the same requests: at batch 1 some tensors are already contiguous
(a size-1 dimension's stride does not count), so copies that other batch sizes make are skipped, and
an operator may switch algorithm above some size. So the captures are grouped into **regimes**:
maximal runs of consecutive captured batch sizes whose streams have the same structure (actions,
keys, CUDA streams, capture fallback reason). Within a regime, :class:`PolynomialStreamModel` fits
every request's size exactly, in integers (Newton's divided differences over fractions), as the
polynomial of lowest degree through all the regime's captures, and accepts the fit only when

* the degree is at most :data:`MAX_DEGREE`, and
* the regime has at least ``degree + 2`` captures to fit and check the polynomial, **plus one
  more** that verifies it (``degree + 3``: four captures for the usual affine stream).

A batch size is then derived only inside an accepted regime (between its smallest and largest
capture: interpolation, never extrapolation), and only when every derived size is a whole number
>= 1. Anything else is captured: batch sizes outside every regime or between two regimes, and every
batch size of a regime whose sizes are not such polynomials (the reason is kept:
:meth:`StreamDeriver.notes`). :meth:`StreamDeriver.wanted` names the captures that make the most
batch sizes derivable, so that a plan captures them first, at once, in parallel.

Derived streams are exact wherever checked: tests/test_plan_derive.py compares them with real
captures, and a plan with derivation with one capturing every batch size.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from fractions import Fraction
from math import lcm
from typing import Any

__all__ = ["MAX_DEGREE", "MIN_FIT_CAPTURES", "PolynomialStreamModel", "AffineStreamModel", "StreamDeriver",
           "Regime", "repeat_steady_step", "fit_polynomial"]

#: The highest degree of a request's size in the batch size that is derived (quadratic: ``[b, b]``).
MAX_DEGREE = 2
#: Captures one regime needs at the least: a constant fitted, checked and verified (degree 0 + 3).
MIN_FIT_CAPTURES = 3
#: Captures beyond the ``degree + 2`` that fit and check a polynomial: the verification.
VERIFY_CAPTURES = 1


def fit_polynomial(xs: tuple[int, ...], ys: tuple[int, ...]) -> tuple[int, tuple[int, ...], int]:
    """The polynomial of lowest degree through the points ``(xs[i], ys[i])`` (distinct ``xs``), exactly:
    ``(degree, (c0, c1, ..., c_degree), den)`` with ``y = (c0 + c1 x + ... ) / den`` in integers
    (``den`` >= 1). Newton's divided differences over fractions; the interpolating polynomial through
    n points has degree <= n - 1, and its degree is that of the last non-zero divided difference."""
    n = len(xs)
    table = [Fraction(y) for y in ys]
    coef = [table[0]]
    for k in range(1, n):
        table = [(table[i + 1] - table[i]) / (xs[i + k] - xs[i]) for i in range(n - k)]
        coef.append(table[0])
    degree = max((k for k, c in enumerate(coef) if c != 0), default=0)
    # Newton form a0 + a1 (x - x0) + a2 (x - x0)(x - x1) + ... expanded to powers of x
    poly = [Fraction(0)] * (degree + 1)
    basis = [Fraction(1)]   # prod_{j<k} (x - x_j), lowest power first
    for k in range(degree + 1):
        for p, b in enumerate(basis):
            poly[p] += coef[k] * b
        basis = [Fraction(0)] + basis                   # basis * x
        for p in range(len(basis) - 1):
            basis[p] -= xs[k] * basis[p + 1]            # ... - x_k * basis
    den = lcm(*(c.denominator for c in poly)) if poly else 1
    return degree, tuple(int(c * den) for c in poly), den


def _value(coeffs: tuple[int, ...], den: int, x: int) -> int | None:
    """``(c0 + c1 x + ...) / den`` when it is a whole number >= 1, else None."""
    num = 0
    for c in reversed(coeffs):
        num = num * x + c
    q, r = divmod(num, den)
    return q if r == 0 and q >= 1 else None


@dataclass(frozen=True)
class PolynomialStreamModel:
    """Every event's size as a polynomial in the batch size (bytes), fitted exactly on the captures of
    one regime (see the module docstring).

    Attributes:
        low / high: the smallest and largest captured batch sizes; :meth:`derive` answers only
            between them (interpolation).
        captured: the batch sizes the fit was made and verified on.
        degree: the highest degree of any event's size (0: nothing depends on the batch size).
    """

    low: int
    high: int
    captured: tuple[int, ...]
    degree: int
    _template: Any                              # the AllocationStream whose actions/keys/streams are shared
    _pattern_of: array                          # per event: index into _patterns
    _patterns: tuple[tuple[tuple[int, ...], int], ...]   # (coefficients, den) per distinct size pattern

    @classmethod
    def fit(cls, streams: dict[int, Any], *, max_degree: int = MAX_DEGREE,
            verify: int = VERIFY_CAPTURES) -> PolynomialStreamModel | None:
        """The model on ``{batch_size: AllocationStream}`` captures, or None (see :meth:`fit_or_why`)."""
        return cls.fit_or_why(streams, max_degree=max_degree, verify=verify)[0]

    @classmethod
    def fit_or_why(cls, streams: dict[int, Any], *, max_degree: int = MAX_DEGREE, verify: int = VERIFY_CAPTURES
                   ) -> tuple[PolynomialStreamModel | None, str | None, int | None]:
        """``(model, None, degree)``, or ``(None, why, degree)``: why not, in words, and the degree
        of the sizes when they are polynomials of degree <= ``max_degree`` but there are fewer than
        ``degree + 2 + verify`` captures (more captures would do: the caller may capture them).

        The captures must share one structure (actions, keys, CUDA streams); each event's sizes must
        lie on one polynomial of degree <= ``max_degree``.
        """
        batches = sorted(streams)
        if not batches:
            return None, "no capture", None
        first = streams[batches[0]]
        for b in batches[1:]:
            s = streams[b]
            if s.actions != first.actions or s.keys != first.keys or s.streams != first.streams:
                return None, (f"the steps at batch {batches[0]} and {b} make different requests "
                              "(other operators or order)"), None
        xs = tuple(batches)
        patterns: dict[tuple[int, ...], int] = {}
        fitted: list[tuple[tuple[int, ...], int]] = []
        degree = 0
        pattern_of = array("l")
        columns = zip(*(streams[b].sizes for b in batches))
        for i, ys in enumerate(columns):
            j = patterns.get(ys)
            if j is None:
                d, coeffs, den = _fit_fast(xs, ys)
                if d > max_degree:   # the interpolant is the only polynomial through the points
                    sizes = ", ".join(f"{y} at {x}" for x, y in zip(xs, ys))
                    return None, (f"request #{i}'s sizes ({sizes}) are not a polynomial of degree <= "
                                  f"{max_degree} in the batch size"), None
                degree = max(degree, d)
                j = patterns[ys] = len(fitted)
                fitted.append((coeffs, den))
            pattern_of.append(j)
        if len(xs) < degree + 2 + verify:
            return None, (f"{len(xs)} capture{'s' if len(xs) != 1 else ''} at batch "
                          f"{', '.join(map(str, xs))}: a polynomial of degree {degree} needs "
                          f"{degree + 2 + verify} to be fitted, checked and verified"), degree
        return cls(xs[0], xs[-1], xs, degree, first, pattern_of, tuple(fitted)), None, degree

    def covers(self, batch_size: int) -> bool:
        """Whether ``batch_size`` lies between the captured extremes (:meth:`derive` may answer)."""
        return self.low <= batch_size <= self.high

    def derive(self, batch_size: int) -> Any | None:
        """The AllocationStream at ``batch_size``: the captures' events with sizes from the model; None
        when a derived size is not a whole number >= 1 (the caller captures that batch size).

        Raises:
            ValueError: ``batch_size`` outside ``[low, high]`` (see :meth:`covers`).
        """
        if not self.covers(batch_size):
            raise ValueError(f"batch size {batch_size} is outside the captured range [{self.low}, {self.high}]")
        return self.stream_at(batch_size)

    def stream_at(self, batch_size: int) -> Any | None:
        """:meth:`derive` without the range check: the fitted polynomials evaluated at ``batch_size``
        anywhere (extrapolation is the caller's decision: :mod:`oomtune.plan.recorded`). None when a
        derived size is not a whole number >= 1."""
        from oomtune.alloc.stream import FREE, PROBE, REQUESTS, AllocationStream

        values = []
        for coeffs, den in self._patterns:
            v = _value(coeffs, den, batch_size)
            if v is None:
                return None
            values.append(v)
        t = self._template
        out = AllocationStream()
        out.actions = array("b", t.actions)
        out.keys = array("q", t.keys)
        out.streams = array("q", t.streams)
        out.sizes = array("q", [values[j] for j in self._pattern_of])
        live: dict[int, int] = {}  # as AllocationStream.append_* leave it: live keys in alloc order
        for a, k, s in zip(out.actions, out.keys, out.sizes):
            if a == FREE:
                del live[k]
            elif a == PROBE and k in live:   # a probe's further candidates: the largest counts
                live[k] = max(live[k], s)
            elif a in REQUESTS and k not in live:   # a conditional request: its first alternative
                live[k] = s
        out._live = live
        return out


def _fit_fast(xs: tuple[int, ...], ys: tuple[int, ...]) -> tuple[int, tuple[int, ...], int]:
    """:func:`fit_polynomial`, with the common cases (all equal; an integer line) done in integers."""
    y0 = ys[0]
    if all(y == y0 for y in ys):
        return 0, (y0,), 1
    slope, rest = divmod(ys[1] - y0, xs[1] - xs[0])
    if not rest and all(y - y0 == slope * (x - xs[0]) for x, y in zip(xs, ys)):
        return 1, (y0 - slope * xs[0], slope), 1
    return fit_polynomial(xs, ys)


class AffineStreamModel:
    """The affine model: :class:`PolynomialStreamModel` of degree <= 1 on at least three
    captures, the third checking the line (kept for callers of the first derivation; the predictor
    uses :class:`StreamDeriver`)."""

    @staticmethod
    def fit(streams: dict[int, Any]) -> PolynomialStreamModel | None:
        """The degree-<=1 model of ``streams`` on at least three captures, or None."""
        if len(streams) < 3:
            return None
        return PolynomialStreamModel.fit(streams, max_degree=1, verify=0)


@dataclass
class Regime:
    """A maximal run of consecutive captured batch sizes whose streams share one structure.

    Attributes:
        batches: the captured batch sizes, ascending.
        model: the fitted model when the regime may derive, else None.
        why: why it may not (None when it may).
        degree: the polynomial degree found (None when the sizes are not such polynomials), so that
            more captures can complete a regime that has too few.
    """

    batches: list[int]
    model: PolynomialStreamModel | None = None
    why: str | None = None
    degree: int | None = None
    structure: int = 0

    @property
    def low(self) -> int:
        return self.batches[0]

    @property
    def high(self) -> int:
        return self.batches[-1]


@dataclass
class StreamDeriver:
    """The captures made so far, grouped into regimes, each with its polynomial model (module docstring).

    Args:
        max_degree: the highest degree derived (:data:`MAX_DEGREE`).
        verify: captures beyond ``degree + 2`` a regime needs (:data:`VERIFY_CAPTURES`).
    """

    max_degree: int = MAX_DEGREE
    verify: int = VERIFY_CAPTURES
    _streams: dict[int, Any] = field(default_factory=dict)
    _kind: dict[int, int] = field(default_factory=dict)          # batch -> structure id
    _kinds: list[tuple[Any, str | None]] = field(default_factory=list)   # structure id -> (stream, reason)
    _regimes: list[Regime] | None = None
    #: set when a capture inside an accepted regime differed from its derivation: derive nothing more
    broken: str | None = None

    def add(self, batch_size: int, stream: Any, reason: str | None = None) -> bool:
        """Record a capture (``reason``: its capture fallback reason, part of its structure). Returns
        False when ``batch_size`` lay inside an accepted regime and the capture differs from the
        stream derived there: derivation is then off for good (:attr:`broken` says why), and streams
        derived before must be dropped by the caller."""
        if batch_size in self._streams:
            return True
        derived = self.derive(batch_size)
        if derived is not None and derived != stream:
            self.broken = f"the stream derived at batch {batch_size} differs from its capture"
        self._streams[batch_size] = stream
        for i, (rep, why) in enumerate(self._kinds):
            if why == reason and rep.actions == stream.actions and rep.keys == stream.keys \
                    and rep.streams == stream.streams:
                self._kind[batch_size] = i
                break
        else:
            self._kind[batch_size] = len(self._kinds)
            self._kinds.append((stream, reason))
        self._regimes = None
        return self.broken is None

    @property
    def captured(self) -> list[int]:
        """The captured batch sizes, ascending."""
        return sorted(self._streams)

    def regimes(self) -> list[Regime]:
        """The regimes of the captures so far, ascending, each fitted (cached until the next capture)."""
        if self._regimes is None:
            out: list[Regime] = []
            for b in self.captured:
                kind = self._kind[b]
                if out and out[-1].structure == kind:
                    out[-1].batches.append(b)
                else:
                    out.append(Regime([b], structure=kind))
            for r in out:
                reason = self._kinds[r.structure][1]
                if reason is not None and "captured on cpu" in reason:
                    # every workload, distributed ones included, is captured on meta first (a rank
                    # under torch's fake process group): the CPU is a fallback
                    r.why = "captured on the CPU (a meta kernel is missing), which may follow other code paths"
                    continue
                r.model, r.why, r.degree = PolynomialStreamModel.fit_or_why(
                    {b: self._streams[b] for b in r.batches}, max_degree=self.max_degree, verify=self.verify)
            self._regimes = out
        return self._regimes

    def covering(self, batch_size: int) -> Regime | None:
        """The regime whose captured range holds ``batch_size`` (None: outside or between regimes)."""
        for r in self.regimes():
            if r.low <= batch_size <= r.high:
                return r
        return None

    def derive(self, batch_size: int) -> Any | None:
        """The derived stream at ``batch_size``, or None (not derivable: capture it)."""
        if self.broken is not None or batch_size in self._streams:
            return None
        r = self.covering(batch_size)
        if r is None or r.model is None:
            return None
        return r.model.derive(batch_size)

    def wanted(self, sizes: Any) -> list[int]:
        """The batch sizes to capture next so that as many of ``sizes`` as possible become derivable:
        before any capture, the smallest two, the median and the largest of ``sizes`` (the smallest
        two because batch 1 or 2 often makes other requests); then, per regime that fits a polynomial
        but has too few captures, the missing ones inside its range (each as far as possible from the
        captures it has); per gap between two regimes, the middle requested size in it. Empty when
        nothing more would help (every size is captured, derivable, or in a regime that does not fit)."""
        sizes = sorted(set(int(b) for b in sizes))
        if not sizes or self.broken is not None:
            return []
        if not self._streams:
            if len(sizes) < MIN_FIT_CAPTURES + 1:
                return sizes
            return list(dict.fromkeys((sizes[0], sizes[1], sizes[len(sizes) // 2], sizes[-1])))
        taken = set(self._streams)
        out: list[int] = []
        regimes = self.regimes()
        for r in regimes:
            if r.model is not None or r.degree is None:
                continue
            need = r.degree + 2 + self.verify - len(r.batches)
            picks = _spread_picks([b for b in sizes if r.low < b < r.high and b not in taken], r.batches, need)
            if len(picks) < need:   # too few requested sizes inside: any batch size in the range will do
                picks += _spread_picks([b for b in range(r.low + 1, r.high) if b not in taken and b not in picks],
                                       r.batches + picks, need - len(picks))
            out += picks
        bounds = [(None, regimes[0].low)] + [(a.high, b.low) for a, b in zip(regimes, regimes[1:])] \
            + [(regimes[-1].high, None)]
        for lo, hi in bounds:
            gap = [b for b in sizes if (lo is None or b > lo) and (hi is None or b < hi) and b not in taken]
            if gap:
                out.append(gap[len(gap) // 2])
        return list(dict.fromkeys(out))

    def notes(self) -> list[str]:
        """One phrase per regime that cannot derive (why; the batch sizes captured there), and per
        structure change (where the requests change), for the plan's output."""
        if self.broken is not None:
            return [f"derivation off ({self.broken}): every batch size captured"]
        out = []
        regimes = self.regimes()
        for a, b in zip(regimes, regimes[1:]):
            out.append(f"the step makes other requests at batch {a.high} than at {b.low}: "
                       "batch sizes between them are captured")
        for r in regimes:
            if r.model is None and len(r.batches) > 1 and r.degree is None:
                out.append(f"batch {r.low}..{r.high} not derived ({r.why}): captured")
        return out


def _spread_picks(candidates: list[int], have: list[int], n: int) -> list[int]:
    """Up to ``n`` of ``candidates``, each the farthest from ``have`` and the ones picked before."""
    picks: list[int] = []
    pool = list(candidates)
    while pool and len(picks) < n:
        best = max(pool, key=lambda b: (min(abs(b - h) for h in have + picks), -b))
        picks.append(best)
        pool.remove(best)
    return picks


def repeat_steady_step(stream: Any, start: int, times: int) -> Any | None:
    """``stream`` followed by ``times`` more copies of its last step ``stream[start:]`` (the steady
    state), each copy's keys shifted past every key in use, so that a stream of ``k`` captured steps
    stands for ``k + times`` steps without running them on meta (the predictor captures
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
    from oomtune.alloc.stream import FREE, REQUESTS, AllocationStream

    if times <= 0:
        return stream
    acts, keys = stream.actions, stream.keys
    own: set[int] = set()
    for i in range(start, len(acts)):
        if acts[i] in REQUESTS:
            own.add(keys[i])
        elif acts[i] != FREE:   # emptyCache: no allocation
            continue
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
