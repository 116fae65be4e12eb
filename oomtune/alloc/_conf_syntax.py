"""PYTORCH_CUDA_ALLOC_CONF syntax: tokens, the ``key:value`` grammar and the value forms.

Reproduces ``ConfigTokenizer`` (c10/core/AllocatorConfig.h) and the value parsers of
``AcceleratorAllocatorConfig`` (c10/core/AllocatorConfig.cpp: ``parseRoundUpPower2Divisions``,
``toBool``, ``stoull`` for sizes), stricter where torch mis-parses silently (see
:mod:`oomtune.alloc.settings`), and the reverse: Python values rendered as torch tokens.
Private helpers of :class:`oomtune.alloc.settings.AllocatorSettings` (imported there by name);
every error is an :class:`AllocatorConfigError` of one line.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from oomtune.exceptions import AllocatorConfigError
from oomtune.units import MiB

_INTERVALS = 16                      # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB
_MAX_MB = (2**64 - 1) // MiB         # SIZE_MAX / kMB: torch clamps *_mb values to this
_WS = " \t\n\v\f\r"                  # std::isspace in the C locale
_INT_RE = re.compile(r"\d+")
_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _bad(key: str, value: Any, why: str) -> AllocatorConfigError:
    """One line naming the key, the value and what is allowed."""
    return AllocatorConfigError(f"{key}:{value} {why}")


def _tokenize(text: str) -> list[str]:
    """ConfigTokenizer: ',' ':' '[' ']' are tokens of their own; whitespace is dropped anywhere."""
    tokens, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append(buf)
            tokens.append(ch)
            buf = ""
        elif ch not in _WS:
            buf += ch
    return tokens + [buf] if buf else tokens


def _split_pairs(text: str) -> list[tuple[str, str | list[tuple[str, str]]]]:
    """Tokens -> [(key, value)], value a token or a list of (a, b) pairs.

    Accepts what torch 2.14.1 accepts with a defined meaning: one trailing ',' after the last value
    and one before a list's ']' (``expandable_segments:True,``; :meth:`AllocatorSettings.render`
    drops them). Refuses what torch refuses (empty keys, ``,,``, a missing value: torch raises or hits
    an INTERNAL ASSERT) and what torch accepts without a defined meaning, saying what torch would do:
    ``key,value`` (torch ignores its ':' check), text after a list (ignored by torch), ``[]``.
    """
    toks, i, pairs = _tokenize(text), 0, []
    bad = lambda why: AllocatorConfigError(f"malformed allocator settings {text!r}: {why}")  # noqa: E731
    while i < len(toks):
        key = toks[i]
        if key in ",:[]":
            raise bad(f"expected a key but found {key!r} (empty key, ',,' or a stray bracket; torch raises "
                      f"'Unrecognized key {key!r}')")
        if i + 1 < len(toks) and toks[i + 1] == "," and i + 2 < len(toks) and toks[i + 2] not in ",:[]" \
                and (i + 3 >= len(toks) or toks[i + 3] != ":"):
            raise bad(f"'{key},{toks[i + 2]}' has ',' where ':' belongs; torch would silently read it as "
                      f"{key}:{toks[i + 2]} (its ':' check is ignored): write {key}:{toks[i + 2]}")
        if i + 1 >= len(toks) or toks[i + 1] != ":":
            raise bad(f"key {key!r} must be followed by ':' and a value (torch fails with an INTERNAL ASSERT)")
        i += 2
        if i >= len(toks) or toks[i] in ",:]":
            raise bad(f"missing value after '{key}:' (torch fails with an INTERNAL ASSERT or stoull)")
        if toks[i] == "[":
            items, i = _split_list(toks, i + 1, key, bad)
            pairs.append((key, items))
            if i < len(toks) and toks[i] not in ",":
                raise bad(f"{''.join(toks[i:])!r} after the list of {key!r} has no meaning (torch ignores "
                          f"it silently); separate settings with ','")
        else:
            pairs.append((key, toks[i]))
            i += 1
        if i < len(toks):
            if toks[i] != ",":
                raise bad(f"expected ',' after the value of {key!r} but found {toks[i]!r} (a missing ','?)")
            i += 1   # a ',' at the very end is accepted, as torch does
    return pairs


def _split_list(toks: list[str], i: int, key: str, bad: Any) -> tuple[list[tuple[str, str]], int]:
    """Parse ``a:b,c:d]`` (a ',' before ']' allowed, as torch) starting after '['; returns the pairs
    and the index after ']'."""
    items: list[tuple[str, str]] = []
    while True:
        if i >= len(toks):
            raise bad(f"unclosed '[' in the value of {key!r} (torch fails with an INTERNAL ASSERT)")
        if toks[i] == "]" and not items:
            raise bad(f"empty list '[]' for {key!r} sets nothing (torch accepts it and keeps its default): "
                      f"remove {key!r} or give INTERVAL:VALUE items")
        a = toks[i]
        if a in ",:[]" or i + 2 >= len(toks) or toks[i + 1] != ":" or toks[i + 2] in ",:[]":
            raise bad(f"list items of {key!r} must be 'INTERVAL:VALUE' (near {''.join(toks[i:i + 3])!r})")
        items.append((a, toks[i + 2]))
        i += 3
        if i < len(toks) and toks[i] == "]":
            return items, i + 1
        if i >= len(toks) or toks[i] != ",":
            raise bad(f"unclosed '[' in the value of {key!r}")
        i += 1
        if i < len(toks) and toks[i] == "]" and items:
            return items, i + 1   # "[256:1,512:2,]": torch accepts the ',' before ']'


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _uint(key: str, token: Any) -> int:
    """A decimal whole number, an optional '+' first (torch's stoull, without its prefix parsing and
    wrap-around: ``20.5`` would be read as 20, ``-1`` wrap to SIZE_MAX, ``0x40`` be read as 0)."""
    if isinstance(token, str) and _INT_RE.fullmatch(token.removeprefix("+")):
        token = token.removeprefix("+")
    if not isinstance(token, str) or not _INT_RE.fullmatch(token):
        prefix = re.match(r"[+]?\d+", token) if isinstance(token, str) else None
        if isinstance(token, str) and token.startswith("-") and _INT_RE.fullmatch(token[1:]):
            why = "is negative (torch's stoull would wrap it to 2**64 - 1 silently): give a whole number"
        elif prefix is not None:
            why = (f"is not a whole number (torch's stoull would read it as {int(prefix.group(0))}): "
                   "give decimal digits only, e.g. 512")
        else:
            why = "is not a whole number (decimal digits only, e.g. 512)"
        raise _bad(key, token, why)
    n = int(token)
    if n > 2**64 - 1:
        raise _bad(key, token, f"is out of range (must be <= {2**64 - 1}; torch: stoull)")
    return n


def _bool(key: str, token: Any) -> bool:
    if token not in ("True", "False"):  # ConfigTokenizer::toBool: case-sensitive
        raise _bad(key, token, "is not a boolean: expected 'True' or 'False' (case-sensitive, as torch)")
    return token == "True"


def _mb_bytes(key: str, token: Any) -> int:
    return min(_uint(key, token), _MAX_MB) * MiB  # torch: val_env = min(val_env, SIZE_MAX / kMB)


def _divisions(token: Any, gt_fix: bool) -> tuple[int, ...]:
    """``parseRoundUpPower2Divisions``: one power of 2 for all 16 intervals, or the list form."""
    key = "roundup_power2_divisions"
    if isinstance(token, str):
        n = _uint(key, token)
        if not _is_pow2(n):  # the single form rejects 0 (torch: isPowerOf2_64(value))
            raise _bad(key, token, "invalid: the divisions has to be a power of 2 (1, 2, 4, ...)")
        return (n,) * _INTERVALS
    div, last, first = [0] * _INTERVALS, 0, True
    for a, b in token:
        n = _uint(key, b)
        if n != 0 and not _is_pow2(n):
            raise _bad(key, f"[{a}:{b}]", "invalid: the divisions has to be a power of 2 or 0 (off)")
        if a == ">":
            start = last + 1 if gt_fix else last
            div[start:] = [n] * (_INTERVALS - start)
            continue
        boundary = _uint(key, a)
        if not _is_pow2(boundary):
            raise _bad(key, f"[{a}:{b}]", "invalid: the intervals (MiB) have to be a power of 2 or '>'")
        idx = min(boundary.bit_length() - 1, _INTERVALS - 1)
        if first:
            div[:idx] = [n] * idx
            first = False
        div[idx], last = n, idx
    return tuple(div)


def _divisions_mapping(div: tuple[int, ...]) -> int | dict[str, int]:
    """The 16 divisions as torch's user form: one int, or {"MiB": n, ..., ">": n}.

    The list names the first interval of the last run as well as '>' so that the string means
    the same under both '>' semantics (fill from last_index before 2.9, from last_index + 1 since).
    """
    if len(set(div)) == 1:
        return div[0]
    a = next(j for j in range(_INTERVALS) if div[j] != div[0]) - 1      # end of the first run
    b = next(j for j in range(_INTERVALS - 1, -1, -1) if div[j] != div[-1]) + 1  # start of the last
    out = {str(1 << a): div[0]}
    out.update({str(1 << j): div[j] for j in range(a + 1, b + 1)})
    out[">"] = div[-1]
    return out


def _token(value: Any) -> str:
    """A Python value as a torch token: True/False, ints, shortest-repr floats, [a:b,...] lists."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, Mapping):
        return "[" + ",".join(f"{k}:{_token(v)}" for k, v in value.items()) + "]"
    return repr(value) if isinstance(value, float) else str(value)
