"""Optuna's trial states are compared as ``optuna.trial.TrialState`` members, never as strings.

A string comparison (``t.state.name == "FAIL"``, ``state in ("COMPLETE", "FAIL")``) is not checked by
anything: a misspelt name is silently never equal. Code compares the enum; a serialized form (a
tell record's ``"state"``, a report row) is converted where it is read or written. The names are
TrialState's own (optuna/trial/_state.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import oomtune

ROOT = Path(oomtune.__file__).parent

#: optuna.trial.TrialState's member names (optuna/trial/_state.py: RUNNING, COMPLETE, PRUNED, FAIL, WAITING).
STATE_NAMES = ("RUNNING", "COMPLETE", "PRUNED", "FAIL", "WAITING")


def _state_literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and node.value in STATE_NAMES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in STATE_NAMES]
    return []


def state_string_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comparison or ``match`` case with a TrialState name as a string literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_state_literals(x) for x in [node.left, *node.comparators]):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and _state_literals(node.value):
            found.append((node.value.lineno, f"case {ast.unparse(node.value)}"))
    return found


def test_the_finder_finds_each_form_of_a_state_string_comparison():
    source = ('a = t.state.name == "FAIL"\n'
              'b = "COMPLETE" != t.state.name\n'
              'c = t.state.name in ("WAITING", "RUNNING")\n'
              'd = record["state"] not in ["COMPLETE"]\n'
              'match t.state.name:\n    case "PRUNED": pass\n'
              # not comparisons of a state string: the enum, a name as a value, another string
              'e = t.state is TrialState.FAIL\nf = {"FAIL": 1}\ng = name == "FAILED"\nh = x.replace("PASS", "FAIL")\n')
    assert [line for line, _ in state_string_comparisons(source)] == [1, 2, 3, 4, 6]


def test_no_code_in_oomtune_compares_an_optuna_state_as_a_string():
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        found = state_string_comparisons(path.read_text())
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


def test_the_state_names_are_optunas():
    from optuna.trial import TrialState

    assert set(STATE_NAMES) == {s.name for s in TrialState}
