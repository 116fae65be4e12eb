"""An on-disk cache of captured allocation streams, so that a repeated plan need not import torch.

Capturing a training step on the meta device needs torch (and, for the vision models, torchvision,
which imports ``torch._dynamo``): about 5 s of imports on a 2-core machine before the first request
is recorded. A captured stream is a pure function of what went into it, so it is kept:

* **the key** is the SHA-256 of everything the capture depends on: the workload (the flat form of
  its :class:`oomtune.workload_spec.WorkloadSpec`, :meth:`~oomtune.workload_spec.WorkloadSpec.to_dict`:
  the ``model`` keys with ``target``, ``gpu``, ``ranks`` and the training settings, as captured), the batch size, the steps, whether cuBLAS workspaces are added and
  ``CUBLAS_WORKSPACE_CONFIG``; the installed torch and torchvision versions (package metadata, no
  import); the Python version and machine; and a fingerprint of oomtune's capture code (the source
  files of ``oomtune/capture``, ``oomtune/workloads`` and the stream format and derivation). A
  change to any of them is another key, so an entry is never stale, only unused.
* **an entry** is ``<key>.<reads>.json`` (the key's material, what the capture read (below), the
  capture's fallback reason, the device it ran on (``captured_on``) and the SHA-256 of the stream
  file) and ``<key>.<reads>.stream`` (:meth:`oomtune.alloc.stream.AllocationStream.save`'s binary
  format, whose loader validates every event). Both are written to temporary names and
  renamed into place, the stream last; an entry whose files are missing, unreadable, of another key,
  whose stream file's SHA-256 is not the recorded one (a flipped bit, a file copied over from
  another entry) or whose events are invalid is a miss (and is written again after the capture),
  never an error.
* **``target: python`` workloads** are keyed by the resolved target group (the entry with
  its file made absolute, so a plan and a search from the same directory share entries) and by
  :func:`entry_fingerprint` (:func:`oomtune.sources.fingerprint`): the SHA-256 of the entry file and of every local module it imports
  (files and packages beside it, followed transitively), and the installed versions of the
  third-party packages those files import (``transformers``, ...). A changed entry file, or a changed
  local module, is another key. Not seen: data files the entry reads, and modules it imports by
  other means than ``import`` statements (``oomtune plan --no-cache`` then captures afresh).
* **what the capture read** from its process: the environment variables it read by name and
  ``sys.argv`` when read (:mod:`oomtune.capture.reads`, recorded while the entry loads and while the
  capture runs; module-level reads of an entry loaded once stay part of every later capture of the
  process), each with the value read. They are stored in the entry (``reads``), not in the key,
  since they are known only after the capture: a key holds one entry per set of values
  (``<key>.<16 hex of the reads>.json``), and a lookup reads the newest entry whose every recorded
  read has the same value in this process now. A changed value is a miss (captured again, and kept
  beside the first entry: back under the first value, the first entry is read), never a stale read.
  Not seen: reads of the whole environment (``os.environ.copy()``) and reads from native code.
* **not cached**: built-in workloads reading real data (their checks look at files that can
  change).

Where: ``$OOMTUNE_CACHE_DIR`` (``off``, ``0``, ``none``, ``false`` or ``no`` turn the cache off), else
``$XDG_CACHE_HOME/oomtune/streams`` (an absolute path; a relative one is ignored, as the XDG
base-directory spec says), else ``~/.cache/oomtune/streams`` (the convention pip and torch's
inductor cache follow). The directory also holds a small ``.json`` per workload config that passed
the workload checks (:meth:`StreamCache.validated`). ``oomtune plan --no-cache`` captures afresh (and refreshes the entries).

Exactness: a stream loaded from the cache equals the capture it was saved from, event by event
(tests/test_stream_cache.py compares a plan from a warm cache with one that captured everything).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from oomtune.workload_spec import JsonObject, WorkloadSpec

__all__ = ["CACHE_ENV", "StreamCache", "default_cache", "cacheable", "code_fingerprint", "entry_fingerprint"]

#: Environment variable naming the cache directory; ``off`` (or ``0``, ``none``) turns it off.
CACHE_ENV = "OOMTUNE_CACHE_DIR"
_OFF = {"off", "0", "none", "false", "no"}
_FORMAT = 2   # 2: entries keyed by what the capture read (environment, argv)
#: Package directories / modules (relative to the oomtune package) whose code decides a capture.
_CODE = ("capture", "workloads", "plan/predictor.py", "plan/derive.py", "alloc/stream.py", "targets")

_fingerprint: str | None = None
_env: dict[str, Any] | None = None


def code_fingerprint() -> str:
    """SHA-256 (hex) of the source of the modules that decide what a capture records
    (:data:`_CODE`), read from the installed package; computed once per process (~1 ms)."""
    global _fingerprint
    if _fingerprint is None:
        root = Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for name in _CODE:
            path = root / name
            files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
            for f in files:
                h.update(str(f.relative_to(root)).encode())
                h.update(b"\0")
                h.update(f.read_bytes())
                h.update(b"\0")
        _fingerprint = h.hexdigest()
    return _fingerprint


def _environment() -> dict[str, Any]:
    """The part of every key that does not depend on the capture: torch's and torchvision's installed
    versions (package metadata, a few ms each), Python, machine, :func:`code_fingerprint`; computed
    once per process."""
    global _env
    if _env is None:
        from oomtune.packages import installed_version

        _env = {"torch": installed_version("torch"), "torchvision": installed_version("torchvision"),
                "python": list(sys.version_info[:2]), "machine": platform.machine(), "code": code_fingerprint()}
    return _env


def cacheable(workload: WorkloadSpec) -> bool:
    """Whether captures of ``workload`` may be cached: a built-in workload on synthetic data (not a
    real data set, whose files the workload's checks read), or a ``target: python`` workload whose
    entry's code can be fingerprinted (:func:`entry_fingerprint`)."""
    from oomtune.trial._base import find_target

    found = find_target(workload.target_name)
    if found is None or not found.capturable:
        return False
    if found.user_code:   # the user's entry: cached while its code is unchanged
        return entry_fingerprint(workload.target) is not None
    return not found.reads_files(workload)


_entry_prints: dict[str, dict[str, Any] | None] = {}


def entry_fingerprint(target: JsonObject) -> dict[str, Any] | None:
    """What a ``target: python`` entry's captures depend on beyond its config, or None when it cannot
    be read (the entry's module cannot be found: not cacheable):

    * ``files``: ``{path: SHA-256}`` of the entry's file (``path/to/file.py:fn``, or the file of
      ``pkg.mod:fn`` as ``importlib.util.find_spec`` finds it) and of every local module it imports,
      transitively (a module is local when ``name.py`` or the package ``name/`` lies in the importing
      file's folder, the folder the entry's loader puts first on ``sys.path``; a package counts with
      every ``.py`` file under it). Imports are read from the source (``ast``), never executed.
    * ``packages``: the installed versions of the other packages those files import (standard
      library modules left out), from package metadata.

    (:func:`oomtune.sources.fingerprint`.) Computed once per process per entry."""
    entry = target.get("entry")
    if not isinstance(entry, str) or ":" not in entry:
        return None
    if entry not in _entry_prints:
        from oomtune.sources import fingerprint
        from oomtune.trial._base import find_target

        found = find_target(target.get("name", "python"))
        paths = found.sources(target) if found is not None else []
        _entry_prints[entry] = fingerprint(paths[0]) if paths else None
    return _entry_prints[entry]


def _workload_material(workload: WorkloadSpec) -> dict[str, Any]:
    """The part of a key that names the workload: for a built-in workload its flat form
    (:meth:`oomtune.workload_spec.WorkloadSpec.to_dict`: the model keys, ``target``, ``gpu``, ...;
    the mapping the key was made of before the spec existed, so entries written then stay valid); for
    ``target: python`` only the target, resolved (the model group plays no part; a relative entry
    file made absolute, as the search does), and its :func:`entry_fingerprint`."""
    from oomtune.trial._base import find_target

    found = find_target(workload.target_name)
    if found is not None and found.user_code and found.capturable:
        from oomtune.targets import resolve_target

        resolved = resolve_target(workload.target)
        return {"model": {"target": resolved}, "entry": entry_fingerprint(resolved)}
    return {"model": workload.to_dict()}


def _material(what: str, workload: WorkloadSpec, **extra: Any) -> dict[str, Any]:
    return {"format": _FORMAT, "what": what, **_workload_material(workload), **extra, **_environment()}


def _json(obj: Any) -> str:
    """The one JSON text of entries and keys (sorted keys; anything JSON lacks as its repr)."""
    return json.dumps(obj, sort_keys=True, default=repr)


def _digest(material: dict[str, Any]) -> str:
    text = json.dumps(material, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _as_read_back(material: dict[str, Any]) -> Any:
    """``material`` as an entry's JSON gives it back (tuples as lists, ...), to compare with one."""
    return json.loads(_json(material))


class StreamCache:
    """Captured streams on disk under ``directory`` (see the module docstring for keys and files).

    Args:
        directory: where entries live (created on the first write).

    Every method is safe to call from forked plan workers at once: writes go to unique temporary
    names and are renamed into place (atomic on POSIX), so a reader sees a whole entry or none.
    I/O errors on write are ignored (a cache that cannot be written is a cache that misses).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.hits = 0
        self.misses = 0

    # -- captures ----------------------------------------------------------------------------------
    def capture_key(self, workload: WorkloadSpec, batch_size: int, steps: int, blas_workspaces: bool
                    ) -> tuple[str, dict[str, Any]]:
        """(hex key, its material) of one capture of ``workload`` (:func:`oomtune.plan.predictor.
        capture_training_stream`'s arguments, plus the versions and code it depends on)."""
        material = _material("capture", workload, batch_size=int(batch_size), steps=int(steps),
                             blas_workspaces=bool(blas_workspaces),
                             cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG") if blas_workspaces
                             else None)
        return _digest(material), material

    def get(self, key: str, material: dict[str, Any]) -> tuple[Any, str | None] | None:
        """The cached ``(AllocationStream, fallback reason)`` under ``key``, or None (a miss: absent,
        unreadable, another key's material, a stream file that does not validate, or no entry of the
        key whose recorded reads (:mod:`oomtune.capture.reads`: environment variables, ``sys.argv``)
        all have the values they hold in this process now). The stream's ``reads`` are the entry's."""
        from oomtune.alloc.stream import AllocationStream
        from oomtune.capture.reads import matches
        from oomtune.exceptions import ConfigError

        for meta_path in self._variants(key):
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                if not isinstance(meta, dict) or meta.get("key") != _as_read_back(material):
                    raise ValueError("another key")
                reads = meta.get("reads")
                if not isinstance(reads, dict):
                    raise ValueError("no reads")
                if not matches(reads):
                    continue   # captured under other values of what it read: another entry, not this one
                reason = meta.get("reason")
                if reason is not None and not isinstance(reason, str):
                    raise ValueError("bad reason")
                stream_path = meta_path.with_name(meta_path.name[:-len(".json")] + ".stream")
                if hashlib.sha256(stream_path.read_bytes()).hexdigest() != meta.get("sha256"):
                    raise ValueError("the stream file is not the one stored")
                stream = AllocationStream.load(stream_path)
                stream.captured_on = meta.get("captured_on") if meta.get("captured_on") in ("meta", "cpu") else None
                stream.reads = reads
                sdpa = meta.get("sdpa")
                stream.sdpa = ({str(k): int(v) for k, v in sdpa.items()} if isinstance(sdpa, dict)
                               and all(isinstance(v, int) for v in sdpa.values()) else None)
            except (OSError, ValueError, ConfigError, RecursionError):   # a file nested too deeply: a miss
                break   # the entry for these values is damaged: a miss (written again after the capture)
            self.hits += 1
            return stream, reason
        self.misses += 1
        return None

    def put(self, key: str, material: dict[str, Any], stream: Any, reason: str | None) -> None:
        """Store one capture under ``key`` and the reads it made (the stream's ``reads``, as
        :func:`oomtune.plan.predictor.capture_training_stream` sets them; none for a stream without):
        the stream to a temporary file, then the metadata with its SHA-256, then the stream renamed
        into place (a reader in between sees a checksum that does not match: a miss). Captures of one
        key under other values of their reads are other entries, kept beside it."""
        reads = dict(getattr(stream, "reads", None) or {})
        meta_path, stream_path = self._paths(key, reads)
        tmp = _tmp(stream_path)
        try:
            meta_path.parent.mkdir(parents=True, exist_ok=True)
            stream.save(tmp)
            digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
            self._write_json(meta_path, {"key": material, "reads": reads, "reason": reason, "sha256": digest,
                                         "captured_on": getattr(stream, "captured_on", None),
                                         "sdpa": getattr(stream, "sdpa", None)})
            os.replace(tmp, stream_path)
        except OSError:
            pass
        finally:
            try:
                tmp.unlink()
            except OSError:
                pass

    def unwritable(self) -> str | None:
        """Why entries cannot be written here (one phrase, e.g. ``"Not a directory"``), or None when
        a file can be created in the directory (made if missing). Reading is unaffected: a read-only
        cache that holds entries still serves them."""
        probe = self.directory / f".probe.{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            return exc.strerror or type(exc).__name__
        return None

    # -- validated workloads -----------------------------------------------------------------------
    def validated(self, workload: WorkloadSpec) -> bool:
        """Whether ``workload`` passed :func:`oomtune.workloads.validate_workload_config` under the
        same versions and code (so checking it again, which imports torch, can be skipped)."""
        path, material = self._validated_entry(workload)
        try:
            return json.loads(path.read_text(encoding="utf-8")).get("key") == _as_read_back(material)
        except (OSError, ValueError, AttributeError, RecursionError):
            return False

    def mark_validated(self, workload: WorkloadSpec) -> None:
        """Record that ``workload`` passed the workload checks (see :meth:`validated`)."""
        path, material = self._validated_entry(workload)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._write_json(path, {"key": material})
        except OSError:
            pass

    def _validated_entry(self, workload: WorkloadSpec) -> tuple[Path, dict[str, Any]]:
        material = _material("validated", workload)
        return self._paths(_digest(material))[0], material

    # -- files -------------------------------------------------------------------------------------
    def _paths(self, key: str, reads: dict[str, Any] | None = None) -> tuple[Path, Path]:
        """(metadata, stream) file of ``key``'s entry for ``reads`` (a capture's reads and their
        values; None or {}: none): ``<key[:2]>/<key>.<16 hex of the reads>.json`` / ``.stream``."""
        variant = hashlib.sha256(_json(reads or {}).encode()).hexdigest()[:16]
        base = self.directory / key[:2] / f"{key}.{variant}"
        return base.with_name(base.name + ".json"), base.with_name(base.name + ".stream")

    def _variants(self, key: str) -> list[Path]:
        """The metadata files of ``key``'s entries (one per set of read values), newest first."""
        found = []
        for path in (self.directory / key[:2]).glob(f"{key}.*.json"):
            try:
                found.append((path.stat().st_mtime, path))
            except OSError:
                continue
        return [p for _, p in sorted(found, key=lambda x: (-x[0], str(x[1])))]

    @staticmethod
    def _write_json(path: Path, obj: Any) -> None:
        """``obj`` as JSON to ``path``, through a temporary file renamed into place."""
        tmp = _tmp(path)
        try:
            tmp.write_text(_json(obj), encoding="utf-8")
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()


def _tmp(path: Path) -> Path:
    """A temporary name beside ``path``, unique to this process (forked workers write at once)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def default_cache(enabled: bool = True) -> StreamCache | None:
    """The cache at ``$OOMTUNE_CACHE_DIR`` / ``$XDG_CACHE_HOME/oomtune/streams`` /
    ``~/.cache/oomtune/streams``; None when ``enabled`` is False or ``OOMTUNE_CACHE_DIR`` is ``off``."""
    if not enabled:
        return None
    where = os.environ.get(CACHE_ENV, "").strip()
    if where.lower() in _OFF:
        return None
    if where:
        return StreamCache(Path(where).expanduser().absolute())
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    if not os.path.isabs(base):   # the XDG base-directory spec: a relative path is invalid, ignore it
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return StreamCache(Path(base) / "oomtune" / "streams")
