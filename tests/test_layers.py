"""Import direction between layers: the trial protocol knows the target contract
(oomtune.trial._base), never the targets package (issue 10, item 5)."""

from __future__ import annotations

import ast
from pathlib import Path

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
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("oomtune.targets"))
                 for p in sorted((ROOT / "trial").glob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_every_target_module_implements_the_contract():
    from oomtune.targets import TARGET_NAMES, get_target
    from oomtune.trial._base import Target, target_for

    for name in TARGET_NAMES:
        target = get_target(name)
        assert isinstance(target, Target) and target.name == name
        assert target_for({"target": {"name": name}}) is target
    assert get_target("cmd").own_process and not get_target("builtin").own_process
    assert target_for({}) is get_target("builtin")  # no target group: builtin


def test_targets_state_what_they_can_do():
    """The capabilities code outside oomtune/targets asks instead of the name (issue 27 item 2)."""
    from oomtune.targets import get_target

    builtin, python, cmd = get_target("builtin"), get_target("python"), get_target("cmd")
    # captured on meta and predicted: the built-in workloads and the user's make_workload, not a command
    assert (builtin.capturable, python.capturable, cmd.capturable) == (True, True, False)
    assert (builtin.uses_model_group, python.uses_model_group, cmd.uses_model_group) == (True, False, False)
    assert (builtin.user_code, python.user_code) == (False, True)
    # several ranks: a command starts its own (torchrun); a built-in workload through model.parallel
    assert cmd.starts_ranks and not python.starts_ranks and cmd.records_streams
    assert builtin.distributed({"name": "mlp", "parallel": "ddp"}) and not builtin.distributed({"name": "mlp"})
    assert builtin.reads_files({"data": {"source": "imagefolder"}}) and not builtin.reads_files({"name": "mlp"})
    assert builtin.can_soak({"name": "mlp"}) and not builtin.can_soak({"name": "mlp", "parallel": "ddp"})
    assert not cmd.can_soak({"target": {"name": "cmd"}})
    assert builtin.for_capture({"name": "mlp", "data": {"source": "imagefolder"}, "target": {"name": "builtin"}}) \
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


# --- No branching on a target's name outside oomtune/targets/ (issue 27 item 2) -------------------

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
