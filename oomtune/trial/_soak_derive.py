"""Deriving the soak's per-shape streams from a few captures (a soak in seconds).

A built-in training step makes the same requests in the same order at every ``seq_len`` /
``image_size``; only their sizes change. For the transformer each size is either a polynomial of
degree at most 2 in the length (embeddings and linear layers: ``N*T*d``; math attention's scores:
``N*h*T*T``) or, for the fused attention kernels a capture runs as on the GPU, linear in
the length rounded up to a block: memory-efficient attention's logsumexp ``N*h*ceil(T/32)*32``,
FlashAttention's backward ``softmax_d`` and ``dq_accum`` in ``ceil(T/128)*128``. So each request's
size follows one of the models ``quadratic in T`` or ``a*roundup(T, m) + b`` (m = 32, 64, 128,
256), fitted on three captures (the smallest, a middle and the largest shape) exactly in integers and
accepted only when it also reproduces the checks: a fourth capture between the anchors and, when
the shapes have finer residues than all of those, a fifth of the shape whose length has the fewest
factors of two (so that a rounding is seen where it rounds). The three anchors must have identical
structure (actions, keys, CUDA streams); a request no model reproduces, or a derived size that is not
a whole number >= 0, turns derivation off: every shape is captured (convolutions'
``floor((s + 2p - k) / stride)`` output sizes, for one, follow none of the models).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["MIN_SHAPES_TO_DERIVE", "derive_shape_streams"]

#: Below this many distinct shapes every shape is captured (the derivation needs four captures).
MIN_SHAPES_TO_DERIVE = 6


def _same_structure(a: Any, b: Any) -> bool:
    return a.actions == b.actions and a.keys == b.keys and a.streams == b.streams


_ROUNDINGS = (32, 64, 128, 256)


def _roundup(t: int, m: int) -> int:
    return -(-t // m) * m


def _quadratic(pts: list[tuple[int, int]], t: int) -> int | None:
    """Lagrange interpolation of the three points at ``t``, exactly; None when not a whole number."""
    (a, x), (b, y), (c, z) = pts
    d = (a - b) * (a - c) * (b - c)
    num = x * (t - b) * (t - c) * (b - c) - y * (t - a) * (t - c) * (a - c) + z * (t - a) * (t - b) * (a - b)
    return None if num % d else num // d


def _rounded_linear(pts: list[tuple[int, int]], m: int) -> tuple[int, int, int] | None:
    """(m, slope, intercept) of ``size = slope * roundup(T, m) + intercept`` through the points, in
    integers; None when no such line passes through all of them."""
    xs = [(_roundup(t, m), v) for t, v in pts]
    distinct = {r for r, _ in xs}
    if len(distinct) < 2:
        return None
    (r0, v0), (r1, v1) = sorted({r: v for r, v in xs}.items())[:2]
    if (v1 - v0) % (r1 - r0):
        return None
    slope = (v1 - v0) // (r1 - r0)
    icpt = v0 - slope * r0
    return (m, slope, icpt) if all(slope * r + icpt == v for r, v in xs) else None


def _fit(anchors: list[tuple[int, int]], checks: list[tuple[int, int]]) -> Any:
    """The first model that reproduces anchors and checks: ("q", anchors) or ("r", m, slope,
    intercept); None when none does."""
    if all(_quadratic(anchors, t) == v for t, v in checks):
        return ("q", anchors)
    for m in _ROUNDINGS:
        got = _rounded_linear(anchors + checks, m)
        if got is not None:
            return ("r", *got)
    return None


def _evaluate(model: Any, t: int) -> int | None:
    if model[0] == "q":
        return _quadratic(model[1], t)
    _, m, slope, icpt = model
    return slope * _roundup(t, m) + icpt


def _models(anchors: list[tuple[int, Any]], checks: list[tuple[int, Any]]) -> list[Any] | None:
    """Per alloc event of the anchors' common structure, its size model; None when the anchors
    differ in structure or an event follows no model."""
    first = anchors[0][1]
    if not all(_same_structure(first, st) for _, st in anchors[1:] + checks):
        return None
    models: list[Any] = []
    for i, action in enumerate(first.actions):
        if action:
            models.append(None)
            continue
        model = _fit([(s, st.sizes[i]) for s, st in anchors], [(s, st.sizes[i]) for s, st in checks])
        if model is None:
            return None
        models.append(model)
    return models


def _interpolate(template: Any, models: list[Any], shape: int) -> Any | None:
    """The stream at ``shape`` from the per-event models; None when a size is not a whole number >= 0."""
    from oomtune.alloc.stream import AllocationStream

    out = AllocationStream()
    for action, key, st, model in zip(template.actions, template.keys, template.streams, models):
        if action:
            out.append_free(key, st)
            continue
        size = _evaluate(model, shape)
        if size is None or size < 0:
            return None
        out.append_alloc(key, size, st)
    return out


def _two_adic(t: int) -> int:
    return (t & -t).bit_length() if t else 64


def derive_shape_streams(shapes: list[Any], capture: Callable[[Any], Any]) -> tuple[dict[Any, Any], int]:
    """Streams for every shape of ``shapes`` (distinct, ints), captured or derived (module docstring).

    Args:
        shapes: the distinct shapes, in order of first use.
        capture: ``capture(shape)`` -> that shape's ``AllocationStream``.

    Returns:
        (shape -> stream in the order of ``shapes``, number of captures made).
    """
    made = 0

    def cap(shape: Any) -> Any:
        nonlocal made
        made += 1
        return capture(shape)

    ints = all(isinstance(s, int) and not isinstance(s, bool) for s in shapes)
    if not ints or len(shapes) < MIN_SHAPES_TO_DERIVE:
        return {s: cap(s) for s in shapes}, made
    ordered = sorted(shapes)
    picks = [ordered[0], ordered[len(ordered) // 2], ordered[-1]]
    check = ordered[len(ordered) // 4] if ordered[len(ordered) // 4] not in picks else ordered[1]
    checks = [check]
    odd = min((s for s in ordered if s not in picks and s != check), key=_two_adic, default=None)
    if odd is not None and _two_adic(odd) < min(_two_adic(s) for s in (*picks, check)):
        checks.append(odd)   # a length a rounding rounds: the anchors alone may all be multiples of it
    got = {s: cap(s) for s in (*picks, *checks)}
    anchors = [(s, got[s]) for s in picks]
    models = _models(anchors, [(s, got[s]) for s in checks])
    derived_checks = [_interpolate(got[picks[0]], models, s) for s in checks] if models is not None else [None]
    if any(d is None or d != got[s] for d, s in zip(derived_checks, checks)):
        got.update({s: cap(s) for s in shapes if s not in got})
        return {s: got[s] for s in shapes}, made
    out = {}
    for s in shapes:
        stream = got[s] if s in got else _interpolate(got[picks[0]], models, s)
        out[s] = stream if stream is not None else cap(s)   # a size came out fractional: capture it
    return out, made
