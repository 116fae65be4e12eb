"""Composing oomtune's Hydra config: conf/ lookup, overrides, the run directory, study naming.

The ``oomtune`` sub-commands use Hydra's compose API (not ``@hydra.main``) so that bad overrides
become one clear line with exit code 2 and several sub-commands share one config tree. The run
directory follows ``hydra.run.dir`` (default ``runs/${study_name}``), and the composed config is saved
under ``<run dir>/.hydra/`` as Hydra itself does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oomtune.confdir import conf_dir
from oomtune.exceptions import ConfigError

__all__ = ["conf_dir", "compose", "check_study_name", "run_dir_of", "default_study_name", "budget_key", "budget_note",
           "to_container", "split_value"]


def compose(overrides: Sequence[str] = (), *, config_name: str = "config"):
    """Compose the config with Hydra overrides (``model=resnet``, ``budget=16GiB``, ``hydra.run.dir=...``).

    Returns:
        An OmegaConf ``DictConfig`` including the ``hydra`` node; ``study_name`` is filled in when null.

    Raises:
        ConfigError: an unknown config group option (``model=nope``), a malformed override, or a key
            that does not exist — one line naming it.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    from oomtune.schema import check_added_keys, register

    register()
    for override in overrides:
        check_override_depth(override)   # Hydra's parser recurses per level: a RecursionError otherwise
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name, overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        message = _unparsable_override(overrides) or _with_override(_one_line(exc), overrides)
        m = re.search(r"Could not override '([\w.]+)'", message)
        if m:
            groups = [o for o in overrides if o.split("=", 1)[0] in ("model", "search", "target", "launcher")]
            message = _unknown_key(m.group(1), config_name, groups) or message
        raise ConfigError(message) from None
    finally:
        GlobalHydra.instance().clear()
    check_added_keys(overrides, _option_files(cfg))   # +key: checked against the schema like any key
    try:
        for key in cfg:
            if key != "hydra":
                to_container(cfg[key])  # resolves interpolations: ${foo} fails here, in one line
        with open_dict(cfg):
            if cfg.get("study_name") == "":
                check_study_name("")   # given empty (the config's default is null: derived)
            if cfg.get("study_name") in (None, "auto"):
                cfg.study_name = default_study_name(cfg)
            check_study_name(cfg.study_name)
        OmegaConf.resolve(cfg.hydra.run)
        from oomtune.study.storage import check_storage_url

        # before the run directory is created, which may be the SQLite file's folder
        check_storage_url(cfg.get("storage"), run_dir=Path(str(cfg.hydra.run.dir)))
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from None
    return cfg


def check_override_depth(override: str) -> None:
    """Refuse an override whose value nests lists or dictionaries (``[``, ``{`` outside quotes) more
    than :data:`oomtune.safeload.MAX_DEPTH` levels deep, the limit of every YAML and JSON file
    oomtune reads: Hydra's override parser (ANTLR) recurses once per level, and 3,000 levels ended in
    a ``RecursionError`` traceback.

    Raises:
        ConfigError: one line naming the key and the limit.
    """
    from oomtune.safeload import MAX_DEPTH

    depth = deepest = 0
    quote = None
    for ch in str(override):
        if quote is not None:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > MAX_DEPTH:
        key = str(override).split("=", 1)[0]
        raise ConfigError(f"bad override {key}=...: its value nests lists or dictionaries {deepest} levels deep, more "
                          f"than the {MAX_DEPTH} oomtune reads; give a flat list such as {key.lstrip('+~')}=[0,2,4]")


def _option_files(cfg: Any) -> dict[str, Any]:
    """The option files chosen for the ``model``, ``target`` and ``launcher`` groups (``conf/<group>/<option>.yaml``,
    read size- and depth-limited), as plain mappings: the keys a ``+`` override may extend.

    Raises:
        ConfigError: an option file that cannot be read (a broken installation).
    """
    from oomtune.safeload import read_yaml

    choices = cfg.hydra.runtime.choices if "hydra" in cfg else {}
    out: dict[str, Any] = {}
    for group in ("model", "target", "launcher"):
        option = choices.get(group)
        path = conf_dir() / group / f"{option}.yaml"
        if option is not None and path.is_file():
            data = read_yaml(path, what=f"a {group} option file")
            out[group] = data if isinstance(data, dict) else {}
    return out


def check_study_name(name: Any) -> None:
    """Refuse a study name that cannot be one directory name under ``runs/`` (the run directory is
    ``runs/${study_name}``: ``study_name=../../x`` wrote outside it).

    Raises:
        ConfigError: empty, ``.`` or ``..``, a path separator (``/``, ``\\``, so no absolute path
            either), NUL or another control character, or longer than 255 bytes (a file name's
            limit on Linux file systems); one line with an example of a good name.
    """
    text = str(name)
    why = None
    if not text.strip():
        why = "is empty (drop study_name= for a name derived from the config)"
    elif text in (".", ".."):
        why = "names the current or the parent directory"
    elif "/" in text or "\\" in text:
        why = "contains a path separator ('/' or '\\')"
    elif any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        why = "contains NUL or another control character"
    elif len(text.encode("utf-8", "surrogatepass")) > 255:
        why = "is longer than 255 bytes (a directory name's limit)"
    if why is not None:
        raise ConfigError(f"study_name {text!r} {why}: it must be one directory name under runs/ (e.g. "
                          "study_name=resnet50-16g; hydra.run.dir=DIR chooses the run directory itself)")


def _unknown_key(dotted: str, config_name: str, groups: Sequence[str] = ()) -> str | None:
    """The one line for an override of a key the config lacks (Hydra's "Could not override"):
    'serch.n_trials' -> "unknown config key 'serch.n_trials'; did you mean 'search.n_trials'?";
    with no close key, the keys where the path leaves the config: 'search.data.bogus' ->
    "unknown config key 'search.data.bogus': search.data has num_workers, ..."; None when the
    config cannot be composed (Hydra's own message stays)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            base = hydra_compose(config_name, overrides=list(groups), return_hydra_config=True)
        close, where, keys = _closest_key(dotted, base)
    except Exception:  # best effort: keep Hydra's own message
        return None
    finally:
        GlobalHydra.instance().clear()
    if close is not None:
        return f"unknown config key {dotted!r}; did you mean {close!r}?"
    if not keys:  # the path runs through a value (budget.x): Hydra's message says so
        return None
    return f"unknown config key {dotted!r}: {where or 'the config'} has {', '.join(keys)}"


def _closest_key(dotted: str, base: Any) -> tuple[str | None, str, list[str]]:
    """Walk ``dotted`` down the composed config ``base``, taking at each level the key of that
    mapping closest to the typed one (:func:`difflib.get_close_matches`, its default cutoff 0.6).

    Returns:
        ``(suggestion, where, keys)``: the existing dotted key (``serch.n_trials`` ->
        ``search.n_trials``), or None when some level has no close key; then ``where`` is the path
        of that level (``""`` for the top) and ``keys`` its keys (the top level without ``hydra``;
        none when the path runs through a value).
    """
    import difflib

    from omegaconf import DictConfig

    node, path, parts = base, [], dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None, ".".join(path), []
        keys = [str(k) for k in node.keys()]
        match = part if part in keys else next(iter(difflib.get_close_matches(part, keys, n=1)), None)
        if match is None:
            return None, ".".join(path), [k for k in keys if path or k != "hydra"]
        path.append(match)
        if i < len(parts) - 1:
            node = node.get(match)  # a mapping (or a value the next part cannot be in); leaves unread
    suggestion = ".".join(path)
    return (suggestion if suggestion != dotted else None), suggestion, []


def split_value(words: Sequence[str], at: int) -> str | None:
    """The argument a user meant when the shell split an unquoted value with spaces
    (``target.command=python train.py --batch-size 8`` -> ``target.command=python``, ``train.py``,
    ...): the nearest ``KEY=VALUE`` word before ``at``, with every word after it up to the next
    ``KEY=VALUE`` (flags included), quoted for the shell: ``"target.command='python train.py
    --batch-size 8'"``. None when no such ``KEY=VALUE`` precedes ``at``, it is a flag (``--x=1``) or
    a deletion (``~key``), or another ``KEY=VALUE`` stands between it and ``at``."""
    start = next((j for j in range(at - 1, -1, -1) if "=" in words[j]), None)
    if start is None or words[start].startswith(("-", "~")):
        return None
    if any("=" in w and not w.startswith("-") for w in words[start + 1:at]):
        return None
    key, _, value = words[start].partition("=")
    parts = [value]
    for word in words[start + 1:]:   # every word the shell split off, up to the next KEY=VALUE
        if "=" in word and not word.startswith("-"):
            break
        parts.append(word)
    joined = " ".join(parts).replace("'", "\\'")
    return f"\"{key}='{joined}'\""


def _unparsable_override(overrides: Sequence[str]) -> str | None:
    """The first override Hydra's grammar cannot parse, as one line that shows the quoting that
    works, or None when every override parses.

    ``target.command="python train.py --batch-size {batch_size}"`` typed in bash reaches us as
    ``target.command=python train.py --batch-size {batch_size}`` (bash removed the quotes), and
    Hydra reads ``{`` as the start of a dictionary: "mismatched input '{' expecting <EOF>". Any
    unquoted value with Hydra syntax in it (``{}``, ``[]``, ``=``, ``,``, ``${``) fails the same way;
    quoting the value inside the shell argument, ``"key='value'"``, makes it one string. A value
    with spaces left unquoted (``target.command=python train.py``) reaches us as two arguments, the
    second no ``KEY=VALUE`` at all: the line shows the two joined and quoted.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for i, override in enumerate(overrides):
        try:
            parser.parse_override(override)
        except Exception as exc:  # Hydra's OverrideParseException and ANTLR errors
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            split = "=" not in override and i > 0 and "=" in overrides[i - 1]
            rejoined = split_value(overrides, i) if split else None
            if rejoined:
                return (f"bad override {override!r}: not KEY=VALUE; if it belongs to the value of "
                        f"{overrides[i - 1]!r} (a value with spaces the shell split), quote the whole value "
                        f"inside one argument: {rejoined}")
            key, sep, value = override.partition("=")
            if not sep or not value or value[0] in "'\"" or ("'" in value and '"' in value):
                return None   # not a quoting problem: Hydra's own message says what is wrong
            inner = "'" if "'" not in value else '"'
            fixed = f"{key}={inner}{value}{inner}"
            shell = f'"{fixed}"' if inner == "'" else f"'{fixed}'"
            return (f"bad override {override!r}: {why} (Hydra parses the value: '{{' starts a dictionary, "
                    f"'[' a list); quote the value inside the argument: {shell}")
    return None


def _with_override(message: str, overrides: Sequence[str]) -> str:
    """Name the override a parse error is about when Hydra's message only quotes its value."""
    m = re.search(r"input '([^']*)'", message)
    if m:
        culprits = [o for o in overrides if m.group(1) and m.group(1) in o]
        if culprits:
            return f"bad override {culprits[0]!r}: {message.removeprefix('bad config: ')}"
    return message


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    # Hydra's "Could not find 'model/nope'" is followed by the available options: keep them short.
    options = [ln.strip() for ln in text[1:] if ln.strip().startswith("\t") or ln.startswith("\t")]
    cause = exc.__cause__ or exc.__context__
    if cause is not None and "Error merging override" in first:
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return f"bad override: {first.replace('Error merging override ', '')}: {detail}"
    missing = re.search(r"Could not find '([\w/.-]+)/([^'/]+)'", first)
    avail = re.search(r"Available options in '[^']+':\s*(.*?)\s*(?:Config search path|$)", str(exc), re.S)
    if missing and avail:   # a config group option that does not exist: name it, the choices, the closest
        import difflib

        group, option = missing.groups()
        choices = avail.group(1).split()
        close = difflib.get_close_matches(option, choices, n=1)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        return (f"bad override {group}={option}: there is no {option!r} in the config group {group!r}; "
                f"choose one of {', '.join(choices)}{hint}")
    if "Could not find" in first or "Could not override" in first or "Key '" in first:
        rest = " ".join(ln.strip() for ln in text[1:] if ln.strip()).split("Config search path")[0]
        rest = re.sub(r"(Available options in '\w+':) (.*)", lambda m: m.group(1) + " " + ", ".join(m.group(2).split()), rest)
        return f"bad override: {first} {rest}".strip()
    return f"bad config: {first}" + (f" ({'; '.join(options)})" if options else "")


def to_container(cfg: Any) -> Any:
    """A plain, resolved Python container of a config node (dicts/lists/scalars)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def default_study_name(cfg: Any) -> str:
    """``<model name>-<8 hex>`` (``python-``/``cmd-`` for those targets): a digest of the workload,
    target, budget, device, search space, target GPU (``model.gpu`` unless ``auto``), the global
    batch (when set) and GPUs per trial (``trial.gpus`` when not 1; ``model.parallel`` when not
    none), so rerunning the same command resumes the same study and a changed one starts a new
    study. The budget enters as its parsed value (:func:`budget_key`), so ``16GiB``, ``16gib``,
    ``"16 GiB"`` and ``17179869184B`` name one study.

    For a target that runs the user's code (a python entry's file, a command's script:
    :meth:`oomtune.trial._base.Target.sources`) the digest also covers what that code depends on
    (:func:`oomtune.sources.fingerprint`): the SHA-256 of its file and of its local imports, the
    versions of the packages it imports, and the values of the environment variables it names
    (``os.environ["N_LAYER"]``, ``os.getenv("SEQ_LEN")``): ``N_LAYER=1 oomtune search ...`` after
    ``N_LAYER=2 oomtune search ...`` starts a new study instead of resuming trials of the other model."""
    from oomtune.trial._base import find_target

    target = to_container(cfg.target)
    known = find_target(target.get("name"))
    model = to_container(cfg.model)
    gpu = model.pop("gpu", "auto") if isinstance(model, dict) else "auto"
    if isinstance(model, dict) and model.get("parallel") in (None, "none"):
        model.pop("parallel", None)   # the default leaves the names of single-process studies as they were
    # the model group's keys where they describe the workload (a built-in one), else None
    described = known.model_keys(model) if known is not None and isinstance(model, dict) else None
    key = {
        "model": described,
        "target": target,
        "budget": budget_key(cfg.budget),
        "device": str(cfg.device),
        "batch_size": to_container(cfg.search.batch_size),
        "space": to_container(cfg.search.space),
        "data": to_container(cfg.search.get("data")),
    }
    if str(gpu).strip().lower() != "auto":   # model.gpu (auto, the default, leaves the names of before)
        key["gpu"] = str(gpu)
    if str(cfg.search.get("memory_fraction", "auto")) != "auto":   # auto keeps the names of earlier studies
        key["memory_fraction"] = str(cfg.search.memory_fraction)
    if cfg.search.get("global_batch") is not None:   # absent when unset: earlier studies keep their names
        key["global_batch"] = int(cfg.search.global_batch)
    gpus = int(cfg.trial.get("gpus", 1) or 1)
    if gpus != 1:
        key["gpus"] = gpus
    sources = known.sources(target) if known is not None else []
    if sources:   # the user's code: its files, imports, package versions and environment variables
        from oomtune.sources import fingerprint

        key["sources"] = [fingerprint(p, environ=True) for p in sources]
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{described['name'] if described is not None else target.get('name')}-{digest}"


def budget_key(budget: Any) -> Any:
    """The budget as :func:`oomtune.device.resolve_budget` reads it, without the device: a number
    in (0, 1] is a fraction of the device (returned as ``"fraction=F"``), anything else a size in
    bytes (an int). A value that does not parse is returned as its text (the search refuses it later
    with a clear line)."""
    from oomtune.units import MiB, parse_size

    text = str(budget).strip()
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and 0 < number <= 1:
        return f"fraction={number!r}"
    if number is not None and number < MiB:
        return text
    try:
        return parse_size(text)
    except ConfigError:
        return text


_DECIMAL_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def budget_note(budget: Any) -> str | None:
    """A line showing the conversion of a budget given in decimal units (``16GB`` is 16 x 10^9 bytes
    = 14.90 GiB, not 16 GiB), or None for binary units, plain bytes and fractions. Never raises."""
    import re

    from oomtune.units import format_bytes

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]+)\s*", str(budget))
    if m is None or m.group(2).lower() not in _DECIMAL_UNITS:
        return None
    unit = m.group(2)
    nbytes = int(float(m.group(1)) * _DECIMAL_UNITS[unit.lower()])
    binary = unit[0].upper() + "iB"
    return (f"note: budget {str(budget).strip()} is in decimal units: {m.group(1)} {unit.upper()} = {nbytes:,} "
            f"bytes = {format_bytes(nbytes)} (write {m.group(1)}{binary} for {m.group(1)} x 2^"
            f"{10 * (list(_DECIMAL_UNITS).index(unit.lower()) + 1)} bytes)")


def run_dir_of(cfg: Any) -> Path:
    """The run directory (``hydra.run.dir``), created if needed.

    Raises:
        ConfigError: it cannot be created or written (one line naming the path).
        DiskFullError: its file system is full.
    """
    path = Path(str(cfg.hydra.run.dir)).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".oomtune-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        from oomtune.files import disk_full_error, is_disk_full

        if is_disk_full(exc):
            raise disk_full_error(path, exc) from None
        raise ConfigError(f"run directory {str(path)!r} is not writable: {exc.strerror or exc}") from None
    return path


def save_config(conf: Any, run_dir: Path, overrides: Sequence[str]) -> None:
    """Write ``.hydra/config.yaml`` and ``.hydra/overrides.yaml`` into the run dir, as Hydra does;
    ``conf``: the config as the schema's objects (:func:`oomtune.schema.typed`: every key but Hydra's).

    Raises:
        DiskFullError: no space left (:func:`oomtune.files.write_atomic`).
    """
    from omegaconf import OmegaConf

    from oomtune.files import write_atomic

    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(exist_ok=True)
    plain = dataclasses.asdict(conf)
    write_atomic(hydra_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(plain)))
    write_atomic(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))


def env_overrides() -> list[str]:
    """Extra overrides from ``OOMTUNE_OVERRIDES`` (space-separated), for CI jobs."""
    return os.environ.get("OOMTUNE_OVERRIDES", "").split()
