"""Typed schema of oomtune's Hydra config (Hydra's structured configs, registered in a ConfigStore).

``conf/config.yaml`` extends ``oomtune_schema``: Hydra then rejects overrides of the wrong type at
compose time (``search.n_trials=abc``, ``search.space=garbage``, ``trial=garbage``) with a message
naming the key. Ranges are checked by :func:`validate` before anything runs or is written. The
``model`` and ``target`` groups vary by workload and are checked by oomtune.workloads/targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from oomtune.exceptions import ConfigError

__all__ = ["RootConf", "SearchConf", "TrialConf", "BatchRangeConf", "register", "typed", "validate", "added_key",
           "check_added_keys", "OPEN", "SHAPE_KEYS_ADDABLE"]


@dataclass
class BatchRangeConf:
    low: int = 8
    high: int = 512


@dataclass
class SearchConf:
    n_trials: int = 12
    timeout: Optional[float] = None
    sampler: str = "tpe"
    seed: int = 0
    headroom: float = 0.05
    memory_fraction: str = "auto"
    prune: str = "predicted"
    prune_margin: float = 0.10
    min_gain: float = 0.02
    baseline: bool = True
    confirm: bool = True
    objective: str = "auto"
    frontier_configs: int = 2
    repeats: int = 3
    window: Optional[float] = None
    finalists: int = 2
    workers: int = 1
    heartbeat_interval: int = 10
    grace_period: int = 30
    batch_size: BatchRangeConf = field(default_factory=BatchRangeConf)
    global_batch: Optional[int] = None
    space: Dict[str, Any] = field(default_factory=dict)
    data: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TrialConf:
    warmup_steps: int = 1
    measure_steps: int = 3
    timeout: float = 300.0
    launcher: str = "auto"
    confirm_steps: int = 10
    soak_steps: int = 2000
    execute: str = "auto"
    gpus: int = 1


@dataclass
class RootConf:
    model: Any = None
    search: SearchConf = field(default_factory=SearchConf)
    target: Any = None
    launcher: Any = None
    budget: str = "1GiB"
    device: str = "auto"
    virtual_device_memory: str = "80GiB"
    storage: Optional[str] = None
    study_name: Optional[str] = None
    trial: TrialConf = field(default_factory=TrialConf)
    plan: Dict[str, Any] = field(default_factory=dict)
    gpu: Any = None   # oomtune plan across cards: a catalogue name, a card file, a list, or all (oomtune.gpu.catalogue)


def register() -> None:
    """Store the schema as ``oomtune_schema`` in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="oomtune_schema", node=RootConf)


def typed(cfg: Any) -> RootConf:
    """The composed config as the schema's objects (``OmegaConf.to_object`` of each key:
    :class:`SearchConf`, :class:`TrialConf`; the ``model``, ``target``, ``launcher``, ``plan`` and
    ``gpu`` groups as plain containers), without Hydra's own ``hydra`` key (the run directory is
    :func:`oomtune.config.run_dir_of`'s). Read after :func:`validate`: the values are checked.
    """
    import dataclasses

    from omegaconf import OmegaConf

    def plain(key: str) -> Any:
        value = cfg.get(key)
        return OmegaConf.to_object(value) if OmegaConf.is_config(value) else value

    return RootConf(**{f.name: plain(f.name) for f in dataclasses.fields(RootConf) if f.name in cfg})


#: A mapping whose keys another check owns (``search.space``: the allocator's keys, refused by
#: :class:`oomtune.space.SearchSpace`; ``search.data``: the data-loader settings; ``hydra``: Hydra's
#: own config, where ``+hydra.job.env_set.X=...`` is Hydra's documented form).
OPEN = object()
#: Keys a ``+`` override may add to the ``target`` group besides its option file's keys: a python
#: entry's shape distribution (:func:`oomtune.workloads.shapes.entry_shape_distribution`, which checks
#: their inner keys; a built-in model's is in its option file).
SHAPE_KEYS_ADDABLE = ("seq_len", "image_size")
#: The keys of the ``plan`` mapping (:func:`oomtune.plan.run.plan` reads ``plan.batch_sizes``).
_PLAN_KEYS = {"batch_sizes": OPEN, "batch": OPEN}


def added_key(override: str) -> str | None:
    """The dotted key a Hydra override adds (``+search.n_trails=5`` and ``++foo=bar`` -> the key
    after the plus signs), or None for an override that adds nothing (``key=value``, ``~key``)."""
    if not override.startswith("+"):
        return None
    return override.lstrip("+").split("=", 1)[0].strip() or None


def _schema_tree(groups: Dict[str, Any]) -> Dict[str, Any]:
    """The keys each level may hold: a dataclass's fields, an option file's keys, or :data:`OPEN`."""
    import dataclasses

    def of(cls: Any) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None   # type: ignore[misc]
            out[f.name] = of(sub) if isinstance(sub, type) and dataclasses.is_dataclass(sub) else OPEN
        return out

    def from_file(node: Any) -> Any:
        if not isinstance(node, dict):
            return OPEN   # a scalar or list in the option file: what it holds is checked by its reader
        return {str(k): from_file(v) for k, v in node.items()}

    tree = of(RootConf)
    tree["hydra"] = OPEN
    tree["plan"] = dict(_PLAN_KEYS)
    tree["search"]["space"] = OPEN
    tree["search"]["data"] = OPEN
    for group in ("model", "target", "launcher"):
        keys = from_file(groups.get(group) or {})
        keys = keys if isinstance(keys, dict) else {}
        if group == "target":   # a python entry's distribution (a built-in model's is in its file)
            for shape in SHAPE_KEYS_ADDABLE:
                keys.setdefault(shape, OPEN)
        if group == "launcher" and "sbatch" in keys:   # any sbatch option (oomtune.search.launchers checks it)
            keys["sbatch"] = OPEN
        tree[group] = keys
    return tree


def check_added_keys(overrides: Any, groups: Dict[str, Any]) -> None:
    """Refuse a ``+key=value`` (or ``++key=value``) override whose key the schema does not have,
    as a plain ``key=value`` of an unknown key is refused (Hydra's ``+`` appends any key, so
    ``+search.n_trails=5`` and ``+foo=bar`` were accepted silently and the search ran with the
    default). The typed levels (the root, ``search``, ``search.batch_size``, ``trial``) allow their
    dataclass fields; ``plan`` its ``batch_sizes``; ``model``, ``target`` and ``launcher`` the keys
    of the chosen option file (``groups``: ``{"model": {...}, "target": {...}, "launcher": {...}}`` as
    read from conf/), ``target`` also the shape distributions :data:`SHAPE_KEYS_ADDABLE`; the
    :data:`OPEN` mappings are checked by their owners (``hydra``, ``search.space``, ``search.data``,
    ``launcher.sbatch``).

    Raises:
        ConfigError: one line naming the key, the closest existing one (``difflib``'s default
            cutoff 0.6) or the keys that level has, and how to fix it.
    """
    import difflib

    tree = _schema_tree(groups)
    for override in overrides:
        dotted = added_key(str(override))
        if dotted is None:
            continue
        node: Any = tree
        path: list[str] = []
        for part in dotted.split("."):
            if node is OPEN:
                break
            if part not in node:
                keys = [k for k in node if path or k != "hydra"]
                close = difflib.get_close_matches(part, keys, n=1)
                where = ".".join(path) or "the config"
                hint = (f"did you mean {'.'.join(path + [close[0]])!r}?" if close
                        else f"{where} has {', '.join(keys)}")
                raise ConfigError(f"unknown config key {dotted!r} in {override!r}: '+' adds a key, but {where} "
                                  f"takes no {part!r}; {hint}")
            path.append(part)
            node = node[part]


def _check(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {rule}")


def missing_values(cfg: Any) -> list[str]:
    """The keys of the composed config that still hold OmegaConf's ``???`` (a value the chosen option
    file leaves to the user, e.g. ``target.command`` of ``target=cmd``), dotted and sorted; Hydra's
    own ``hydra`` key is left out (its run-time values are filled in by Hydra)."""
    from omegaconf import OmegaConf

    out: list[str] = []
    for key in cfg.keys():
        if key == "hydra":
            continue
        if OmegaConf.is_missing(cfg, key):
            out.append(str(key))
            continue
        value = cfg.get(key)
        if OmegaConf.is_config(value):
            out += sorted(OmegaConf.missing_keys(value))
    return out


def validate(cfg: Any) -> None:
    """Ranges of the typed keys, checked before a study is opened or a file written; first, that
    no key is left without a value (:func:`missing_values`).

    Raises:
        ConfigError: a key without a value, or the first key out of range, in one line.
    """
    from omegaconf import OmegaConf

    missing = missing_values(cfg)
    if missing:
        key = missing[0]
        group = key.split(".", 1)[0]
        node = cfg.get(group) if "." in key else None
        option = node.get("name") if OmegaConf.is_dict(node) else None
        chosen = f"{group}={option} needs it" if option else "it has no default"
        raise ConfigError(f"{key} has no value: {chosen}; add {key}=VALUE to the command (quote a value with "
                          f"spaces inside the argument: \"{key}='...'\")")
    s, t = cfg.search, cfg.trial
    _check(s.n_trials >= 0, "search.n_trials", s.n_trials, "must be >= 0")
    _check(s.timeout is None or s.timeout > 0, "search.timeout", s.timeout, "must be > 0 seconds (or null)")
    _check(0 <= s.seed < 2**32, "search.seed", s.seed, "must be in [0, 2**32)")
    _check(0 <= s.headroom < 1, "search.headroom", s.headroom, "must be in [0, 1)")
    _check(s.prune in ("predicted", "off"), "search.prune", s.prune, "must be 'predicted' or 'off'")
    _check(s.memory_fraction in ("auto", "off"), "search.memory_fraction", s.memory_fraction,
           "must be 'auto' (trials run under the budget as a memory fraction) or 'off' (no fraction)")
    _check(s.prune_margin >= 0, "search.prune_margin", s.prune_margin, "must be >= 0")
    _check(s.min_gain >= 0, "search.min_gain", s.min_gain, "must be >= 0")
    _check(s.objective in ("auto", "throughput", "batch"), "search.objective", s.objective,
           "must be auto, throughput or batch")
    _check(s.frontier_configs >= 0, "search.frontier_configs", s.frontier_configs, "must be >= 0")
    _check(s.repeats == 1 or s.repeats >= 3, "search.repeats", s.repeats,
           "must be >= 3 (or 1: one clean run, no throughput gain claimed): with 2 clean runs per side a 2% "
           "gain passes by chance about 1 time in 6 under GPU noise, with 3 (every run of the winner above "
           "every run of the baseline) 1 time in 20")
    _check(s.window is None or s.window >= 0, "search.window", s.window,
           "must be >= 0 seconds (0: confirm_steps only; null: 5 on a GPU, 0 on the virtual GPU)")
    _check(s.finalists >= 1, "search.finalists", s.finalists, "must be >= 1")
    _check(s.workers >= 1, "search.workers", s.workers, "must be >= 1 (trials run at once by this process)")
    _check(s.heartbeat_interval >= 1, "search.heartbeat_interval", s.heartbeat_interval, "must be >= 1 second")
    _check(s.grace_period >= 1, "search.grace_period", s.grace_period, "must be >= 1 second")
    _check(s.global_batch is None or s.global_batch >= 1, "search.global_batch", s.global_batch,
           "must be an integer >= 1 (samples per optimizer step, over all ranks), or null")
    _check(t.warmup_steps >= 0, "trial.warmup_steps", t.warmup_steps, "must be >= 0")
    _check(t.measure_steps >= 1, "trial.measure_steps", t.measure_steps, "must be >= 1")
    _check(t.confirm_steps >= 1, "trial.confirm_steps", t.confirm_steps, "must be >= 1")
    _check(t.soak_steps >= 0, "trial.soak_steps", t.soak_steps, "must be >= 0 (0: no soak)")
    _check(t.timeout > 0, "trial.timeout", t.timeout, "must be > 0 seconds")
    _check(t.gpus >= 1, "trial.gpus", t.gpus, "must be >= 1 (GPUs per trial, one rank each)")
    _check(t.launcher in ("auto", "fork", "spawn"), "trial.launcher", t.launcher, "must be auto, fork or spawn")
    _check(t.execute in ("auto", "meta", "cpu"), "trial.execute", t.execute, "must be auto, meta or cpu")
    for key in ("space", "data"):
        for name, values in (s[key] or {}).items():
            _check(values is None or isinstance(values, (list, tuple, str, int, float, bool))
                   or hasattr(values, "__len__"), f"search.{key}.{name}", values, "must be a list of candidates")
    run_dir = str(cfg.hydra.run.dir) if "hydra" in cfg else "x"
    _check(run_dir.strip() != "", "hydra.run.dir", run_dir, "must not be empty")
    check_device_and_budget(cfg)
    model = cfg.get("model")
    gpu = model.get("gpu") if model is not None and hasattr(model, "get") else None
    if gpu is not None and str(gpu).strip().lower() != "auto":
        from oomtune.capture.gpu_target import parse_gpu

        parse_gpu(gpu)   # model.gpu: a known GPU or a compute capability, checked without torch


def check_device_and_budget(cfg: Any) -> None:
    """The syntax of ``device``, ``budget`` and ``virtual_device_memory``, checked without torch
    (importing it takes seconds): bad input exits at once, before anything else runs. Whether the
    device exists and the budget fits it is checked later (:func:`oomtune.device.resolve_device`,
    :func:`oomtune.device.resolve_budget`).

    Raises:
        ConfigError: the first malformed value, in one line.
    """
    from oomtune.device import check_device_spec, parse_budget
    from oomtune.units import parse_size

    check_device_spec(cfg.device)
    parse_budget(cfg.budget)
    vdm = cfg.get("virtual_device_memory")
    if vdm is not None:
        _check(parse_size(vdm) > 0, "virtual_device_memory", vdm, "must be > 0")
