"""Byte sizes: parsing user strings and formatting for display.

oomtune holds every size in bytes (names end in ``_bytes``); MiB/GiB appear only in what is shown.
"""

from __future__ import annotations

import math
import re

from oomtune.exceptions import ConfigError

__all__ = ["KiB", "MiB", "GiB", "TiB", "parse_size", "parse_size_with_unit", "format_bytes"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kb": 1000, "kib": KiB,
    "m": MiB, "mb": 1000**2, "mib": MiB,
    "g": GiB, "gb": 1000**3, "gib": GiB,
    "t": TiB, "tb": 1000**4, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Parse a size such as ``"16GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``17179869184`` into bytes.

    Binary units (KiB, MiB, GiB, TiB, and the bare K/M/G/T) are powers of 1024; decimal units
    (kB, MB, GB, TB) are powers of 1000, as in IEC 80000-13. Case is ignored.

    Returns:
        The size in bytes (int, >= 0), rounded down to a whole byte.

    Raises:
        ConfigError: the text is not a number with a known unit, or is negative/not finite.
    """
    if isinstance(text, bool):
        raise ConfigError(f"invalid size {text!r}: expected a number of bytes or e.g. '16GiB'")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _SIZE_RE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"invalid size {text!r}: expected a number with a unit such as 512MiB, 16GiB or 1.5GB"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    if value < 0:
        raise ConfigError(f"invalid size {text!r}: a size cannot be negative; give e.g. 512MiB")
    if not math.isfinite(value):
        raise ConfigError(f"invalid size {text!r}: must be a finite number >= 0")
    return int(value * _UNITS[unit])


def parse_size_with_unit(text: str | int | float, *, what: str = "size") -> int:
    """:func:`parse_size` for a capacity given by a person (``--budget``, ``--max-size``), refusing a
    number without a unit as ambiguous, whatever its size: ``1024`` means 1024 bytes to
    :func:`parse_size` but probably 1024 MiB to whoever typed it (the same rule as ``budget=`` of
    ``oomtune search``, :func:`oomtune.device.parse_budget`); ``1024B`` says bytes.

    Raises:
        ConfigError: ``"--budget '1024' is ambiguous: ..."``, or what :func:`parse_size` raises.
    """
    stripped = str(text).strip()
    try:
        number = float(stripped)
    except ValueError:
        number = None
    if number is not None and math.isfinite(number) and number > 0:
        raise ConfigError(f"{what} {stripped!r} is ambiguous (a number without a unit): give a size with a "
                          f"unit, e.g. {what} {stripped}MiB or {what} 16GiB ({what} {stripped}B for bytes)")
    try:
        return parse_size(text)
    except ConfigError:
        raise ConfigError(f"invalid {what} {stripped!r}: expected a size with a unit, e.g. 512MiB, 16GiB "
                          "or 1.5GB") from None


def format_bytes(n: int | float | None, *, precision: int = 2) -> str:
    """Format a byte count for display with binary units (``"1.50 GiB"``); ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{sign}{n / scale:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"
