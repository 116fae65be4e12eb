"""Reading allocator settings for the simulator (the options ``DeviceCachingAllocator`` consults)."""

from __future__ import annotations

from typing import Any

from oomtune.alloc._blocks import K_LARGE_BUFFER, SIZE_MAX
from oomtune.exceptions import AllocatorConfigError

__all__ = ["read_settings"]


def read_settings(settings: Any) -> dict[str, Any]:
    """The allocator options the simulator uses, from ``AllocatorSettings``, a string or None.

    Returns a dict: max_split (bytes; SIZE_MAX = unlimited, as torch stores it), non_split
    (max_non_split_rounding, bytes), gc (threshold), divs (16 divisions or None when all <= 1),
    expandable (bool), large_segment (bytes).

    Raises:
        AllocatorConfigError: a malformed string (from ``AllocatorSettings.parse``) or a backend
            other than native (cudaMallocAsync is a different allocator; it is not simulated).
    """
    if settings is None:
        return {"max_split": SIZE_MAX, "non_split": K_LARGE_BUFFER, "gc": 0.0, "divs": None,
                "expandable": False, "large_segment": K_LARGE_BUFFER}
    if isinstance(settings, str):
        from oomtune.alloc.settings import AllocatorSettings
        settings = AllocatorSettings.parse(settings)
    backend = getattr(settings, "backend", "native")
    if backend != "native":
        raise AllocatorConfigError(
            f"backend:{backend} cannot be simulated: the virtual GPU models only the native caching allocator")
    max_split = getattr(settings, "max_split_size_bytes", None)
    divs = tuple(int(d) for d in getattr(settings, "roundup_power2_divisions", ()) or ())
    return {"max_split": SIZE_MAX if max_split is None else int(max_split),
            "non_split": int(getattr(settings, "max_non_split_rounding_bytes", K_LARGE_BUFFER)),
            "gc": float(getattr(settings, "garbage_collection_threshold", 0.0) or 0.0),
            "divs": divs if any(d > 1 for d in divs) else None,
            "expandable": bool(getattr(settings, "expandable_segments", False)),
            "large_segment": int(getattr(settings, "large_segment_size_bytes", K_LARGE_BUFFER))}
