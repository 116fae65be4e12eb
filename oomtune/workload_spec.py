"""What a trial trains, typed and frozen: :class:`WorkloadSpec`.

Built once by the workload's target from the config's ``model`` and ``target`` groups
(:meth:`oomtune.trial._base.Target.workload_spec`, called by :func:`oomtune.prepared.prepare` for
``oomtune search`` and ``oomtune plan``), or read back from best.yaml (:meth:`WorkloadSpec.from_best`,
for ``oomtune check``). Where it crosses a process boundary it is serialised explicitly:

- :meth:`WorkloadSpec.to_dict` / :meth:`WorkloadSpec.from_dict`: the flat mapping a trial process
  and a capture read (the ``model`` keys, ``target``, ``gpu``/``gpu_source``, ``ranks``, the
  training settings): a trial's spec.json, a worker job's report to the process that launched it,
  the study's ``workload`` attribute (studies written before stay comparable: the same keys) and
  the stream cache's key of a built-in workload (cached captures stay valid: the same mapping);
- :meth:`WorkloadSpec.best_record` / :meth:`WorkloadSpec.from_best`: best.yaml's ``workload``
  section (``model`` with its ``gpu`` keys, ``target``, ``ranks``, ``training``) and
  ``device.target_gpu``, as written before this type existed.

Imports nothing of oomtune but its exceptions: every layer may hold one.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union

from oomtune.exceptions import BestFileError, ConfigError

__all__ = ["JsonValue", "JsonObject", "WorkloadSpec", "TRAINING_KEYS", "check_record"]

#: A value JSON and YAML carry: what every field of a :class:`WorkloadSpec` holds.
JsonValue = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
#: A JSON object with string keys.
JsonObject = dict[str, JsonValue]

#: The training settings a search varies and best.yaml records under ``workload.training``:
#: ``grad_accum`` and ``activation_checkpointing`` (re-exported by :mod:`oomtune.workloads.training`).
TRAINING_KEYS = ("grad_accum", "activation_checkpointing")
#: The keys of the target GPU's record inside a flat workload and best.yaml's ``workload.model``.
_GPU_KEYS = ("gpu", "gpu_source")
#: The keys of best.yaml's ``workload`` section.
_RECORD_KEYS = ("target", "model", "ranks", "training")
#: What a ``target`` is when a hand-written best.yaml gives none: a built-in workload.
DEFAULT_TARGET_GROUP: JsonObject = {"name": "builtin"}


def _json_error(value: object, where: str) -> str | None:
    """Where ``value`` holds something JSON cannot carry (a tuple, a set, an object, a non-string
    key), as ``where.key``; None when it is plain JSON."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            bad = _json_error(item, f"{where}[{i}]")
            if bad:
                return bad
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} (key {key!r})"
            bad = _json_error(item, f"{where}.{key}")
            if bad:
                return bad
        return None
    return f"{where} ({type(value).__name__} {value!r})"


def _plain(value: Mapping[str, JsonValue] | None, where: str) -> JsonObject | None:
    """A deep copy of ``value`` as a plain dict of JSON values (None stays None).

    Raises:
        ConfigError: a value JSON cannot carry, naming its key.
    """
    if value is None:
        return None
    out = copy.deepcopy(dict(value))
    bad = _json_error(out, where)
    if bad:
        raise ConfigError(f"{bad} is not a JSON value (null, true/false, a number, a string, a list or a mapping)")
    return out


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """One workload, as every command reads it.

    Attributes:
        target: the ``target`` group (``name`` plus its keys; paths absolute where the search
            resolved them for trials that run in their own directories).
        model: the ``model`` group's keys when the target trains a built-in workload
            (:meth:`oomtune.trial._base.Target.model_keys`), without ``gpu``; None otherwise.
        gpu: the target GPU whose kernels the captures run (``model.gpu``; ``auto`` until
            :func:`oomtune.capture.gpu_target.resolve_gpu_key` resolved it to its canonical key);
            None where a best.yaml recorded none (the default GPU then).
        gpu_source: where the resolved ``gpu`` came from (``model.gpu``, ``the device``, ``default``).
        ranks: the ranks (processes, one GPU each) of every trial, when several or distributed
            (``trial.gpus``); None for one process.
        training: the training settings of an answer (best.yaml's ``workload.training``:
            ``grad_accum``, ``activation_checkpointing``); empty for a search's workload, whose
            candidates set them.

    The mappings are copied on construction and are the spec's own: read them, do not change them
    (:func:`dataclasses.replace` makes a changed spec).

    Raises:
        ConfigError: a field of the wrong type, or a value JSON cannot carry.
    """

    target: JsonObject
    model: JsonObject | None = None
    gpu: str | None = "auto"
    gpu_source: str | None = None
    ranks: int | None = None
    training: JsonObject = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.target, Mapping) or not isinstance(self.target.get("name"), str):
            raise ConfigError(f"workload target must be a mapping with a 'name' string, got {self.target!r}")
        if self.model is not None and not isinstance(self.model, Mapping):
            raise ConfigError(f"workload model must be a mapping or null, got {self.model!r}")
        for name in ("gpu", "gpu_source"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"workload {name} must be a string or null, got {value!r}")
        if self.ranks is not None and (isinstance(self.ranks, bool) or not isinstance(self.ranks, int)
                                       or self.ranks < 1):
            raise ConfigError(f"workload ranks must be an integer >= 1 or null, got {self.ranks!r}")
        if not isinstance(self.training, Mapping):
            raise ConfigError(f"workload training must be a mapping, got {self.training!r}")
        object.__setattr__(self, "target", _plain(self.target, "target"))
        object.__setattr__(self, "model", _plain(self.model, "model"))
        object.__setattr__(self, "training", _plain(self.training, "training"))

    @property
    def target_name(self) -> str:
        """``target.name``: which :class:`oomtune.trial._base.Target` serves this workload."""
        return str(self.target["name"])

    @property
    def data(self) -> JsonObject | None:
        """The data-loader settings of a built-in workload (``model.data``: ``num_workers``,
        ``pin_memory``, ...), as the trial's flat workload carries them under ``data``; None when the
        model group gives none (or there is no model group: a python or command target)."""
        value = self.model.get("data") if self.model is not None else None
        return value if isinstance(value, dict) else None

    # -- the flat form: the process boundary (a trial's spec.json, a worker job's report, the study attribute)
    def to_dict(self) -> JsonObject:
        """The flat mapping a trial process trains and a capture builds (the form the
        :class:`oomtune.trial._base.Target` contract reads): ``{**model, "target", "gpu",
        "gpu_source", "ranks", **training}`` (keys absent where the field is None or empty), a fresh
        copy each call. A trial's spec.json carries it, a worker job's report too, the study's
        ``workload`` attribute stores it and the stream cache keys a built-in workload's captures on
        it; :meth:`from_dict` reads it back."""
        out: JsonObject = copy.deepcopy(self.model) if self.model is not None else {}
        out["target"] = copy.deepcopy(self.target)
        if self.gpu is not None:
            out["gpu"] = self.gpu
        if self.gpu_source is not None:
            out["gpu_source"] = self.gpu_source
        if self.ranks is not None:
            out["ranks"] = self.ranks
        out.update(copy.deepcopy(self.training))
        return out

    @classmethod
    def from_dict(cls, data: object) -> "WorkloadSpec":
        """The spec of a flat mapping :meth:`to_dict` wrote: ``target`` (a built-in workload when
        absent), ``gpu``, ``gpu_source`` and ``ranks`` (None when absent), the training settings
        (:data:`TRAINING_KEYS`) as ``training``, every other key the ``model`` group's (None when
        none is left). ``from_dict(spec.to_dict()) == spec`` for every spec whose model keys are
        none of those names, as every target builds it (:meth:`oomtune.trial._base.Target.
        workload_spec`: the model group without ``gpu``).

        Raises:
            ConfigError: not a mapping with string keys, or a field of the wrong type (one line
                naming it).
        """
        if not isinstance(data, Mapping) or not all(isinstance(k, str) for k in data):
            raise ConfigError(f"a workload must be a mapping with string keys (the model's keys, target, gpu, "
                              f"gpu_source, ranks, {', '.join(TRAINING_KEYS)}), got {data!r}")
        rest = dict(data)
        target = rest.pop("target", None)
        fields = {k: rest.pop(k, None) for k in ("gpu", "gpu_source", "ranks")}
        training = {k: rest.pop(k) for k in TRAINING_KEYS if k in rest}
        return cls(target=dict(DEFAULT_TARGET_GROUP) if target is None else target,  # type: ignore[arg-type]
                   model=rest or None, training=training, **fields)  # type: ignore[arg-type]

    # -- best.yaml's workload section and device.target_gpu
    def best_record(self) -> JsonObject:
        """best.yaml's ``workload`` section: ``model`` (its keys with ``gpu``/``gpu_source``, without
        the training settings, which stand under ``training``) for a built-in workload, ``target``,
        ``ranks`` when set, ``training`` when not empty. The target GPU's full record is
        best.yaml's ``device.target_gpu`` (written by the search's outputs)."""
        out: JsonObject = {}
        if self.model is not None:
            model = {k: v for k, v in self.model.items() if k not in TRAINING_KEYS}
            model.update({k: v for k, v in (("gpu", self.gpu), ("gpu_source", self.gpu_source)) if v is not None})
            out["model"] = copy.deepcopy(model)
        out["target"] = copy.deepcopy(self.target)
        if self.ranks is not None:
            out["ranks"] = self.ranks
        if self.training:
            out["training"] = copy.deepcopy(self.training)
        return out

    @classmethod
    def from_best(cls, section: object, target_gpu: object = None, *,
                  where: str = "best.yaml workload") -> "WorkloadSpec":
        """The spec best.yaml's ``workload`` section and ``device.target_gpu`` record
        (:func:`check_record` first). The target GPU is ``device.target_gpu`` (``key``, ``source``);
        a file from before it was recorded: ``workload.model.gpu``, else none (the default GPU). A
        section without ``target`` (written by hand) is a built-in workload. The model keys are
        kept as recorded; the target decides whether they describe the workload
        (:meth:`oomtune.trial._base.Target.model_keys`).

        Raises:
            BestFileError: the first malformed key, one line naming it and the value.
        """
        check_record(section, where=where)
        assert isinstance(section, dict)
        model = dict(section["model"]) if isinstance(section.get("model"), dict) else None
        gpu = model.pop("gpu", None) if model is not None else None
        source = model.pop("gpu_source", None) if model is not None else None
        if isinstance(target_gpu, dict) and target_gpu.get("key"):
            gpu, source = target_gpu["key"], target_gpu.get("source", "model.gpu")
        try:
            return cls(target=section.get("target") or dict(DEFAULT_TARGET_GROUP), model=model,
                       gpu=None if gpu is None else str(gpu), gpu_source=None if source is None else str(source),
                       ranks=section.get("ranks"), training=section.get("training") or {})
        except ConfigError as exc:
            raise BestFileError(f"{where}: {exc}") from None


def check_record(section: object, *, where: str = "best.yaml workload") -> None:
    """The one validator of best.yaml's ``workload`` section, shared by :func:`oomtune.best.load_best`
    (so ``apply_best``, ``oomtune env`` and ``oomtune show``) and ``oomtune check``
    (:meth:`WorkloadSpec.from_best`). Each key is optional (hand-written files may give none), but
    present it must be well formed, and no other key may stand there:

    - ``target``: a mapping with a string ``name``;
    - ``model``: a mapping with a string ``name``;
    - ``training``: a mapping; its ``grad_accum`` an integer >= 1, its ``activation_checkpointing``
      true, false or null;
    - ``ranks``: an integer >= 1 (the ranks, one GPU each, the answer was tuned for; compared with
      ``WORLD_SIZE`` by :func:`oomtune.best.check_world_size`): a string such as ``'$(touch x)'`` is
      refused rather than skipped.

    Raises:
        BestFileError: the first malformed or unknown key, in one line naming it and the value.
    """
    if not isinstance(section, dict):
        raise BestFileError(f"{where} must be a mapping, got {section!r}")
    unknown = sorted(str(k) for k in section if k not in _RECORD_KEYS)
    if unknown:
        raise BestFileError(f"{where} has unknown key(s) {', '.join(unknown)}: it takes {', '.join(_RECORD_KEYS)}")
    target = section.get("target")
    if target is not None and (not isinstance(target, dict) or not isinstance(target.get("name"), str)):
        raise BestFileError(f"{where}.target must be a mapping with a 'name' string, got {target!r}")
    model = section.get("model")
    if model is not None and (not isinstance(model, dict) or not isinstance(model.get("name"), str)):
        raise BestFileError(f"{where}.model must be a mapping with a 'name' string, got {model!r}")
    training = section.get("training")
    if training is not None:
        if not isinstance(training, dict):
            raise BestFileError(f"{where}.training must be a mapping, got {training!r}")
        accum = training.get("grad_accum", 1)
        if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
            raise BestFileError(f"{where}.training.grad_accum must be an integer >= 1, got {accum!r}")
        ckpt = training.get("activation_checkpointing")
        if ckpt is not None and not isinstance(ckpt, bool):
            raise BestFileError(f"{where}.training.activation_checkpointing must be true, false or null, "
                                f"got {ckpt!r}")
    ranks = section.get("ranks")
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1):
        raise BestFileError(f"{where}.ranks must be an integer >= 1 (the ranks the answer was tuned for), "
                            f"got {ranks!r}")
