"""Writing a trial's values in one transaction (oomtune.search.trial_writes): the rows
must be what Optuna's own Trial API writes, read back through Optuna's own readers."""

from __future__ import annotations

import optuna
import pytest

from oomtune.study.storage import make_storage
from oomtune.search.trial_writes import one_transaction, set_trial_attrs

optuna.logging.set_verbosity(optuna.logging.ERROR)


@pytest.fixture(params=["sqlite", "journal"])
def study(request, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}" if request.param == "sqlite" else f"journal:{tmp_path / 's.log'}"
    return optuna.create_study(storage=make_storage(url), study_name="w", direction="maximize")


def test_attrs_and_constraint_read_back_as_optunas_own(study):
    ours, theirs = study.ask(), study.ask()
    set_trial_attrs(ours, {"result": {"outcome": "ok", "peak": 123}, "outcome": "ok"}, {"memory": -0.25})
    theirs.set_user_attr("result", {"outcome": "ok", "peak": 123})
    theirs.set_user_attr("outcome", "ok")
    theirs.set_constraint("memory", -0.25)
    study.tell(ours, 1.0)
    study.tell(theirs, 1.0)
    a, b = study.get_trials()
    assert a.user_attrs == b.user_attrs == {"result": {"outcome": "ok", "peak": 123}, "outcome": "ok"}
    assert a.constraints == b.constraints == {"memory": -0.25}   # FrozenTrial.constraints: Optuna's reader
    assert a.system_attrs == b.system_attrs


def test_parameters_written_together_are_the_suggested_ones(study):
    trial = study.ask()
    with one_transaction(trial):
        x = trial.suggest_int("x", 1, 100, log=True)
        c = trial.suggest_categorical("c", [None, "a", 2])
        assert trial.params == {"x": x, "c": c}   # Optuna's cache sees them at once
    study.tell(trial, 1.0)
    frozen = study.get_trials()[0]
    assert frozen.params == {"x": x, "c": c}
    assert frozen.distributions == {"x": optuna.distributions.IntDistribution(1, 100, log=True),
                                    "c": optuna.distributions.CategoricalDistribution([None, "a", 2])}


def test_attributes_set_inside_the_block_are_written_with_the_parameters(study):
    trial = study.ask()
    with one_transaction(trial):
        x = trial.suggest_int("x", 0, 9)
        set_trial_attrs(trial, {"conf": "expandable_segments:True"})
        assert trial.user_attrs["conf"] == "expandable_segments:True"   # cached at once, as set_user_attr does
    study.tell(trial, 1.0)
    frozen = study.get_trials()[0]
    assert frozen.params == {"x": x} and frozen.user_attrs == {"conf": "expandable_segments:True"}


def test_an_incompatible_distribution_is_refused_as_optuna_refuses_it(study):
    first = study.ask()
    with one_transaction(first):
        first.suggest_categorical("c", ["a", "b"])
    study.tell(first, 1.0)
    other = optuna.load_study(study_name="w", storage=study._storage)   # another worker: no cached distribution
    second = other.ask()
    with pytest.raises(ValueError, match="Cannot set different distribution kind|dynamic value space"):
        with one_transaction(second):
            second.suggest_categorical("c", ["a", "b", "z"])   # CategoricalDistribution does not support a changed choice set
