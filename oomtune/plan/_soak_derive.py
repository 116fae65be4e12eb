"""Deriving the soak's per-shape streams from three captures (issue 9: a soak in seconds).

A built-in training step makes the same requests in the same order at every ``seq_len`` /
``image_size``; only their sizes change, and for the transformer each size is a polynomial of degree
at most 2 in the length (embeddings and linear layers: ``N*T*d``; attention scores and the causal
mask: ``N*h*T*T``). So three captures (the smallest, a middle and the largest shape) determine every
other shape's stream by Lagrange interpolation, exactly in integers. The model is accepted only when
the three captures have identical structure (actions, keys, CUDA streams), every interpolated size
is a whole number >= 0, and a fourth capture, of a shape between the anchors, equals its derivation
event for event; otherwise every shape is captured (convolutions' ``floor((s + 2p - k) / stride)``
output sizes, for one, are not polynomial in the image size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["MIN_SHAPES_TO_DERIVE", "derive_shape_streams"]

#: Below this many distinct shapes every shape is captured (the derivation needs four captures).
MIN_SHAPES_TO_DERIVE = 6


def _same_structure(a: Any, b: Any) -> bool:
    return a.actions == b.actions and a.keys == b.keys and a.streams == b.streams


def _interpolate(anchors: list[tuple[int, Any]], shape: int) -> Any | None:
    """The stream at ``shape`` from three (shape, stream) anchors; None when a size is not a whole
    number >= 0 (the sizes are not quadratic in the shape)."""
    from oomtune.alloc.stream import AllocationStream

    (a, sa), (b, sb), (c, sc) = anchors
    # Lagrange weights over the common denominator d = (a-b)(a-c)(b-c):
    # w_a = (t-b)(t-c)(b-c), w_b = -(t-a)(t-c)(a-c), w_c = (t-a)(t-b)(a-b).
    d = (a - b) * (a - c) * (b - c)
    wa, wb, wc = (shape - b) * (shape - c) * (b - c), -(shape - a) * (shape - c) * (a - c), \
        (shape - a) * (shape - b) * (a - b)
    out = AllocationStream()
    for action, key, st, x, y, z in zip(sa.actions, sa.keys, sa.streams, sa.sizes, sb.sizes, sc.sizes):
        if action:
            out.append_free(key, st)
            continue
        num = x * wa + y * wb + z * wc
        if num % d:
            return None
        size = num // d
        if size < 0:
            return None
        out.append_alloc(key, size, st)
    return out


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
    got = {s: cap(s) for s in (*picks, check)}
    anchors = [(s, got[s]) for s in picks]
    ok = all(_same_structure(anchors[0][1], st) for _, st in anchors[1:])
    derived_check = _interpolate(anchors, check) if ok else None
    if derived_check is None or derived_check != got[check]:
        got.update({s: cap(s) for s in shapes if s not in got})
        return {s: got[s] for s in shapes}, made
    out = {}
    for s in shapes:
        stream = got[s] if s in got else _interpolate(anchors, s)
        out[s] = stream if stream is not None else cap(s)   # not quadratic after all: capture it
    return out, made
