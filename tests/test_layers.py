"""Import direction between layers: the trial protocol knows the target contract
(oomtune.trial._base), never the targets package; no code outside the targets
compares a target's name; the search's objectives sit below the driver (the driver asks them, they
never import it) and the driver never compares an objective's name; and the package-level import
graph -- deferred and string imports included -- has no circle."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import oomtune

ROOT = Path(oomtune.__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_trial_layer_does_not_import_targets():
    # deferred and string imports too (imported_modules): trial/_base.py once found the targets by
    # importlib.import_module of a module-level constant, which the import statements did not show
    offenders = {}
    for p in sorted((ROOT / "trial").glob("*.py")):
        module = "oomtune.trial." + p.stem if p.stem != "__init__" else "oomtune.trial"
        names = _imports(p) | imported_modules(p.read_text(), module, is_package=p.stem == "__init__")
        offenders[str(p.relative_to(ROOT))] = sorted(n for n in names if n.startswith("oomtune.targets"))
    assert {k: v for k, v in offenders.items() if v} == {}


def test_every_target_module_implements_the_contract():
    from oomtune.targets import TARGET_NAMES, get_target
    from oomtune.trial._base import Target, target_for
    from oomtune.workload_spec import WorkloadSpec

    for name in TARGET_NAMES:
        target = get_target(name)
        assert isinstance(target, Target) and target.name == name
        assert target_for(WorkloadSpec(target={"name": name})) is target
    assert get_target("cmd").own_process and not get_target("builtin").own_process
    assert target_for(WorkloadSpec.from_dict({})) is get_target("builtin")  # no target group: builtin


def test_targets_state_what_they_can_do():
    """The capabilities code outside oomtune/targets asks instead of the name."""
    from oomtune.targets import get_target
    from oomtune.workload_spec import WorkloadSpec

    def built_in(**model):
        return WorkloadSpec(target={"name": "builtin"}, model=model, gpu=None)

    builtin, python, cmd = get_target("builtin"), get_target("python"), get_target("cmd")
    # captured on meta and predicted: the built-in workloads and the user's make_workload, not a command
    assert (builtin.capturable, python.capturable, cmd.capturable) == (True, True, False)
    assert (builtin.uses_model_group, python.uses_model_group, cmd.uses_model_group) == (True, False, False)
    assert (builtin.user_code, python.user_code) == (False, True)
    # several ranks: a command starts its own (torchrun); a built-in workload through model.parallel
    assert cmd.starts_ranks and not python.starts_ranks and cmd.records_streams
    assert builtin.distributed(built_in(name="mlp", parallel="ddp")) and not builtin.distributed(built_in(name="mlp"))
    assert builtin.reads_files(built_in(data={"source": "imagefolder"})) and not builtin.reads_files(built_in(name="mlp"))
    assert builtin.can_soak(built_in(name="mlp")) and not builtin.can_soak(built_in(name="mlp", parallel="ddp"))
    assert not cmd.can_soak(WorkloadSpec(target={"name": "cmd"}))
    assert builtin.for_capture(built_in(name="mlp", data={"source": "imagefolder"})) \
        == {"name": "mlp", "data": {"source": "synthetic"}}
    assert Path(cmd.resolve_paths({"name": "cmd", "cwd": "sub"}, Path("/base"))["cwd"]) == Path("/base/sub")
    assert python.resolve_paths({"name": "python", "entry": "pkg.mod:fn"}, Path("/base"))["entry"] == "pkg.mod:fn"


def test_unknown_target_name_is_one_line():
    import pytest

    from oomtune.exceptions import ConfigError
    from oomtune.trial._base import find_target, get_target

    assert find_target("nope") is None and find_target(None) is None
    with pytest.raises(ConfigError, match=r"^target='nope': choose one of builtin, python, cmd$"):
        get_target("nope")


# --- No branching on a target's name outside oomtune/targets/ -------------------------------------

#: The registered target names (oomtune.targets); outside that package code asks the Target object.
TARGET_NAME_LITERALS = ("builtin", "python", "cmd")


def _name_literals(node: ast.AST) -> list[str]:
    """The target-name string constants ``node`` is (a constant) or holds (a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and node.value in TARGET_NAME_LITERALS:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in TARGET_NAME_LITERALS]
    return []


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comparison (``==``, ``!=``, ``in``, ``not in``) or ``match`` case whose
    operand is a target name literal: ``name == "cmd"``, ``t in ("builtin", "python")``, ``case "cmd":``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            if any(_name_literals(x) for x in [node.left, *node.comparators]):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and _name_literals(node.value):
            found.append((node.value.lineno, f"case {ast.unparse(node.value)}"))
    return found


def test_name_comparison_finder_finds_each_form():
    source = ('if target["name"] == "cmd": pass\n'
              'ok = name != "builtin"\n'
              'x = workload["target"]["name"] in ("builtin", "python")\n'
              'y = t.name not in ["cmd"]\n'
              'match name:\n    case "python": pass\n'
              # not comparisons of a target name: a key, an argument, another string
              'd = {"python": [3, 11]}\nf(stacks="python")\nz = kind == "builtins"\n')
    assert [line for line, _ in name_comparisons(source)] == [1, 2, 3, 4, 6]


def test_no_code_outside_targets_branches_on_a_target_name():
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] == "targets":
            continue
        found = name_comparisons(path.read_text())
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


# --- The search's objectives sit below the driver ------------------------------------------------

#: Modules of oomtune.search above the objectives: they use an objective, an objective never uses them.
ABOVE_OBJECTIVES = ("oomtune.search.driver", "oomtune.search.run", "oomtune.search.jobs", "oomtune.search.workers",
                    "oomtune.search.outputs", "oomtune.search.smoke", "oomtune.search.recordings",
                    "oomtune.search.summary")

#: The resolved objective names (oomtune.search.objectives.OBJECTIVES).
OBJECTIVE_NAME_LITERALS = ("batch", "throughput")


def test_the_objectives_import_nothing_that_runs_the_search():
    pkg = ROOT / "search" / "objectives"
    offenders = {}
    for p in sorted(pkg.glob("*.py")):
        module = "oomtune.search.objectives" + ("" if p.stem == "__init__" else "." + p.stem)
        names = _imports(p) | imported_modules(p.read_text(), module, is_package=p.stem == "__init__")
        offenders[p.name] = sorted(n for n in names if n.startswith(ABOVE_OBJECTIVES))
    assert {k: v for k, v in offenders.items() if v} == {}


def test_every_objective_implements_the_contract_in_a_module_of_its_own():
    from oomtune.search.objectives import OBJECTIVES, Objective

    for name, cls in OBJECTIVES.items():
        assert issubclass(cls, Objective) and cls.name == name and not cls.__abstractmethods__
        assert cls.__module__ == f"oomtune.search.objectives.{name}"


def test_the_driver_and_its_modules_never_compare_an_objectives_name():
    found = {}
    for module in ("driver", "confirmation", "summary", "smoke", "recordings", "trial_sets", "faults", "outputs"):
        source = (ROOT / "search" / f"{module}.py").read_text()
        hits = []
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                operands = [node.left, *node.comparators]
                if any(isinstance(x, ast.Constant) and x.value in OBJECTIVE_NAME_LITERALS for x in operands):
                    hits.append((node.lineno, ast.unparse(node)))
        if hits:
            found[module] = hits
    assert found == {}


# --- The package-level import graph has no circle -------------------------------------------------
# Every import counts: module level, deferred (inside a function) and string imports
# (importlib.import_module / __import__ of a literal, or of a module-level string constant); only
# imports under ``if TYPE_CHECKING:`` (never executed) do not. A node is a subpackage or top-level
# module of oomtune (``search``, ``trial``, ``config``); ``oomtune`` itself is the package root.


def _is_module(name: str) -> bool:
    path = ROOT.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported_modules(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """The modules ``source`` (the text of ``module``) imports, deferred and string imports included."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:   # from pkg import submodule: the submodule
                sub = f"{base}.{alias.name}"
                found.add(sub if sub.startswith("oomtune.") and _is_module(sub) else base)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
                elif isinstance(arg, ast.Name) and arg.id in constants:
                    found.add(constants[arg.id])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _node(module: str) -> str | None:
    parts = module.split(".")
    return None if parts[0] != "oomtune" else parts[1] if len(parts) > 1 else "oomtune"


def package_graph() -> dict[str, dict[str, list[str]]]:
    """node -> {node it imports: ["oomtune.a.b -> oomtune.c.d", ...]} over every module of oomtune."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        here = _node(module)
        for imported in imported_modules(path.read_text(), module, is_package=is_package):
            there = _node(imported)
            if there is not None and there != here:
                graph.setdefault(here, {}).setdefault(there, []).append(f"{module} -> {imported}")
    return graph


def circles(graph: dict[str, Any]) -> list[list[str]]:
    """The strongly connected components of more than one node of ``graph`` (node -> its
    successors), each sorted (Tarjan's algorithm, iterative): every import circle lies in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    nodes = sorted(set(graph) | {w for succ in graph.values() for w in succ})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


def test_circle_finder_finds_circles_and_only_circles():
    # a -> b -> c -> a is one circle, d <-> e another; f -> a and c -> g are not in any
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "g"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert circles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b"}, "b": {"c"}, "f": {"a"}}) == []


def test_deferred_and_string_imports_are_read():
    source = ("import importlib\nfrom typing import TYPE_CHECKING\nPKG = 'oomtune.targets'\n"
              "if TYPE_CHECKING:\n    from oomtune.display import starting\n"
              "def f():\n    from oomtune.study import records\n    from .outcome import Outcome\n"
              "    importlib.import_module('oomtune.trial.soak')\n    return importlib.import_module(PKG)\n")
    found = imported_modules(source, "oomtune.trial._base")
    assert {"oomtune.study.records", "oomtune.trial.outcome", "oomtune.trial.soak", "oomtune.targets"} <= found
    assert "oomtune.display" not in found   # under TYPE_CHECKING: never executed


def test_oomtune_has_no_import_circle():
    graph = package_graph()
    found = circles(graph)
    edges = {f"{a} -> {b}": graph[a][b][:3] for comp in found for a in comp for b in comp if b in graph.get(a, {})}
    assert found == [], edges


def module_graph() -> dict[str, set[str]]:
    """module -> the oomtune modules it imports (deferred, string and ``TYPE_CHECKING`` imports all
    count here: a reader follows each), over every module of oomtune; a package's ``__init__`` is
    left out (importing ``oomtune.x.y`` runs it first, which is not a choice of the importer)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            continue
        module = ".".join(parts)
        source = path.read_text().replace("if TYPE_CHECKING:", "if True:")
        graph[module] = {m for m in imported_modules(source, module)
                         if m.startswith("oomtune.") and m != module and _is_module(m)
                         and not (ROOT.parent / m.replace(".", "/") / "__init__.py").exists()}
    return graph


def test_module_graph_reads_deferred_and_type_checking_imports(tmp_path):
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from oomtune.search.options import X\n"
              "def f():\n    from oomtune.trial import ranks\n")
    found = imported_modules(source.replace("if TYPE_CHECKING:", "if True:"), "oomtune.search.driver")
    assert {"oomtune.search.options", "oomtune.trial.ranks"} <= found


def test_no_two_modules_of_oomtune_import_each_other_even_inside_a_function():
    # A circle of modules, even through an import deferred into a function, is a module that cannot
    # be read without the other (both at once); each was broken by moving what both need below them.
    graph = module_graph()
    found = circles(graph)
    edges = {f"{a} -> {b}" for comp in found for a in comp for b in comp if b in graph.get(a, set())}
    assert found == [], sorted(edges)


# --- The data in the corridors is typed: no untyped field on the prepared run or the workload ------

def untyped_fields(source: str, class_name: str) -> list[str]:
    """The fields of class ``class_name`` in ``source`` whose annotation names ``typing.Any`` anywhere
    (``Any``, ``Mapping[str, Any]``, ``dict[str, Any] | None``, ``Optional[Any]``): such a field says
    nothing of what it carries. Read from the source's annotations."""
    import re

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    text = ast.unparse(item.annotation)
                    if re.search(r"\bAny\b", text):
                        found.append(f"{item.target.id}: {text}")
    return found


def test_untyped_field_finder_finds_each_form():
    source = ("class A:\n    a: Any\n    b: Mapping[str, Any]\n    c: Any | None\n    d: dict[str, Any] | None\n"
              "    e: Optional[Any]\n    f: int\n    g: Mapping[str, JsonValue]\n    h: Anything\n"
              "class B:\n    x: Any\n")
    assert untyped_fields(source, "A") == ["a: Any", "b: Mapping[str, Any]", "c: Any | None",
                                           "d: dict[str, Any] | None", "e: Optional[Any]"]


def test_prepared_run_and_workload_spec_fields_are_typed():
    """What every command reads once prepared (the config's schema objects, the workload, the target,
    the device, the space) is typed: no field of PreparedRun or WorkloadSpec is ``Any`` or an
    untyped mapping, and the workload spec is frozen and slotted."""
    import dataclasses

    from oomtune.prepared import PreparedRun
    from oomtune.workload_spec import WorkloadSpec

    offenders = {"PreparedRun": untyped_fields((ROOT / "prepared.py").read_text(), "PreparedRun"),
                 "WorkloadSpec": untyped_fields((ROOT / "workload_spec.py").read_text(), "WorkloadSpec")}
    assert {k: v for k, v in offenders.items() if v} == {}
    # the classes read are the ones imported (a field added elsewhere would not be checked)
    assert [f.name for f in dataclasses.fields(PreparedRun)] == [
        line.split(":")[0].strip() for line in _field_lines((ROOT / "prepared.py").read_text(), "PreparedRun")]
    assert WorkloadSpec.__dataclass_params__.frozen and "__slots__" in WorkloadSpec.__dict__


def test_trial_spec_fields_are_typed_across_the_process_boundary():
    """What the parent asks a trial process to do is typed: no field of TrialSpec names ``Any``, and
    its workload is the same WorkloadSpec every command reads (spec.json carries the flat form only
    between :meth:`TrialSpec.to_json` and :meth:`TrialSpec.from_json`)."""
    import typing

    from oomtune.trial.record import TrialSpec
    from oomtune.workload_spec import WorkloadSpec

    assert untyped_fields((ROOT / "trial" / "record.py").read_text(), "TrialSpec") == []
    assert typing.get_type_hints(TrialSpec)["workload"] is WorkloadSpec
    spec = TrialSpec(workload={"name": "mlp", "target": {"name": "builtin"}, "grad_accum": 2}, batch_size=4)
    assert isinstance(spec.workload, WorkloadSpec) and spec.workload.training == {"grad_accum": 2}
    assert isinstance(TrialSpec.from_json(spec.to_json()).workload, WorkloadSpec)


def test_search_options_fields_are_typed_sections():
    """The search driver's options hold the config's typed sections and the workload spec, not a flat
    workload mapping or copied ``Any`` fields: no field of SearchOptions names ``Any``, its
    ``search``/``trial``/``workload`` fields are the schema's and the spec's classes, and the options
    are frozen (a reader cannot change what the search was started with)."""
    import dataclasses
    import typing

    from oomtune.schema import SearchConf, TrialConf
    from oomtune.search.driver import SearchOptions
    from oomtune.workload_spec import WorkloadSpec

    source = (ROOT / "search" / "options.py").read_text()
    assert untyped_fields(source, "SearchOptions") == []
    # the class read is the one imported (a field added elsewhere would not be checked)
    assert [f.name for f in dataclasses.fields(SearchOptions)] == [
        line.split(":")[0].strip() for line in _field_lines(source, "SearchOptions")]
    hints = typing.get_type_hints(SearchOptions)
    assert (hints["search"], hints["trial"], hints["workload"]) == (SearchConf, TrialConf, WorkloadSpec)
    assert SearchOptions.__dataclass_params__.frozen


def test_the_target_contract_and_the_trial_side_read_the_workload_spec():
    """What a trial trains reaches the target contract typed: every :class:`Target` method that reads
    a workload takes the :class:`WorkloadSpec` (in the base class and in every registered target,
    which override them) and ``at_shape`` returns one; so do ``resolve_execute``, the candidates'
    ``apply``/``apply_data`` and the target GPU's functions. The flat mapping is read only where a
    trial process reads its spec.json (``WorkloadSpec.from_dict``)."""
    import typing

    from oomtune.capture.gpu_target import resolve_gpu_key, target_from_workload
    from oomtune.space import Candidate
    from oomtune.targets import TARGET_NAMES, get_target, build_trial_workload
    from oomtune.trial._base import Target, target_for, worst_shape_spec
    from oomtune.trial.execute import resolve_execute
    from oomtune.workload_spec import WorkloadSpec

    methods = ("distributed", "reads_files", "can_soak", "for_capture", "shapes", "at_shape", "worst_shape",
               "label", "check_training", "build_workload")
    offenders = []
    for cls in (Target, *(type(get_target(name)) for name in TARGET_NAMES)):
        for name in methods:
            hints = typing.get_type_hints(getattr(cls, name))
            if hints.get("workload") is not WorkloadSpec:
                offenders.append(f"{cls.__name__}.{name}: {hints.get('workload')}")
        if typing.get_type_hints(cls.at_shape).get("return") is not WorkloadSpec:
            offenders.append(f"{cls.__name__}.at_shape returns {typing.get_type_hints(cls.at_shape).get('return')}")
    assert offenders == []
    for fn in (resolve_execute, Candidate.apply, Candidate.apply_data, resolve_gpu_key, target_for,
               worst_shape_spec, build_trial_workload):
        assert typing.get_type_hints(fn)["workload"] is WorkloadSpec, fn.__qualname__
    for fn in (Candidate.apply, resolve_gpu_key, worst_shape_spec):
        assert typing.get_type_hints(fn)["return"] is WorkloadSpec, fn.__qualname__
    assert typing.get_type_hints(target_from_workload)["workload"] == (WorkloadSpec | None)
    # best.yaml's workload section is read as the spec too (one validator: WorkloadSpec.from_best)
    from oomtune.best import BestConfig

    assert typing.get_type_hints(BestConfig.workload_spec.fget)["return"] is WorkloadSpec


def _field_lines(source: str, class_name: str) -> list[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return [ast.unparse(i) for i in node.body if isinstance(i, ast.AnnAssign)]
    return []


# --- The trial record is typed end to end: every section frozen, slotted, and saying what it holds ---

#: TrialResult's one field that keeps a mapping: ``settings_effective``, torch's own report of the
#: allocator settings in effect (``torch.cuda.memory._snapshot()["allocator_settings"]``, keys and
#: value types torch's, compared key by key in oomtune/trial/child.py) -- a top-level field, not a section.
_RECORD_MAPPINGS = {"TrialResult": ["settings_effective: dict[str, Any] | None"]}


def untyped_or_bare(source: str, class_name: str) -> list[str]:
    """The fields of ``class_name`` whose annotation names ``Any`` (:func:`untyped_fields`) or a
    bare container that says nothing of its items (``dict``, ``list``, ``Mapping`` without
    parameters, ``dict[...]`` / ``list[...]``: mutable in a frozen record)."""
    import re

    found = list(untyped_fields(source, class_name))
    for line in _field_lines(source, class_name):
        name, _, rest = line.partition(":")
        annotation = rest.split("=")[0].strip()
        if re.search(r"\b(dict|list|Mapping|MutableMapping|Dict|List|set)\b", annotation):
            entry = f"{name.strip()}: {annotation}"
            if entry not in found:
                found.append(entry)
    return found


def _record_sections() -> dict[str, type]:
    """TrialResult and every dataclass reachable from its fields' types, by name."""
    import dataclasses
    import typing

    from oomtune.trial.record import TrialResult

    seen: dict[str, type] = {}
    todo = [TrialResult]
    while todo:
        cls = todo.pop()
        if cls.__name__ in seen:
            continue
        seen[cls.__name__] = cls
        stack = list(typing.get_type_hints(cls).values())
        while stack:
            tp = stack.pop()
            stack.extend(typing.get_args(tp))
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                todo.append(tp)
    return seen


def test_untyped_or_bare_finder_finds_each_form():
    source = ("class A:\n    a: dict\n    b: dict[str, int]\n    c: list[int] | None\n    d: Mapping\n"
              "    e: tuple[int, ...]\n    f: Any\n    g: str | None = None\n    h: tuple[EnvVar, ...] = ()\n")
    assert untyped_or_bare(source, "A") == ["f: Any", "a: dict", "b: dict[str, int]", "c: list[int] | None",
                                            "d: Mapping"]


def test_trial_record_sections_are_typed_frozen_and_slotted():
    """No section of the trial record (what a trial reports, read back by the search, the report and
    resumed studies) holds ``Any`` or a bare mapping or list: each field says what it carries. Every
    section, the record itself and the device it names are frozen dataclasses with slots."""
    import inspect

    sections = _record_sections()
    # the free extra mapping is gone; the sections that replaced it are reached
    assert {"TrialProcess", "ExecutionInfo", "BudgetReadings", "AllocatorSeen", "DistributedInfo", "ScriptReports",
            "StoppedOverLimit", "OomDetails", "RetriedAfter", "KernelsRan", "DeviceInfo"} <= set(sections)
    offenders = {}
    for name, cls in sections.items():
        found = untyped_or_bare(inspect.getsource(inspect.getmodule(cls)), name)
        found = [f for f in found if f not in _RECORD_MAPPINGS.get(name, [])]
        if found:
            offenders[name] = found
        assert cls.__dataclass_params__.frozen and "__slots__" in cls.__dict__, name
    assert offenders == {}
