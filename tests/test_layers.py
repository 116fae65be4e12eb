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
