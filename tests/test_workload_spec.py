"""The workload spec's one dict form (oomtune.workload_spec.WorkloadSpec.to_dict / from_dict).

What must hold: the flat mapping is the one trial processes, the study attribute and the stream
cache read before the spec existed (written out by hand below, as trial spec.json files and study
attributes hold it); reading it back gives the spec again; the stream cache keys a spec's captures on
that same mapping, so entries written before stay valid.
"""

from __future__ import annotations

import pytest

from oomtune.exceptions import ConfigError
from oomtune.plan.stream_cache import StreamCache
from oomtune.plan.variants import variant_workload
from oomtune.workload_spec import WorkloadSpec

MLP_MODEL = {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 1, "num_classes": 10}
#: A built-in workload as a search builds it: two ranks (DDP), the target GPU resolved.
DDP = WorkloadSpec(target={"name": "builtin"}, model={**MLP_MODEL, "parallel": "ddp"}, gpu="a100-40gb",
                   gpu_source="model.gpu", ranks=2)
#: A python entry: no model group, the default GPU.
ENTRY = WorkloadSpec(target={"name": "python", "entry": "train.py:make_workload"}, gpu=None)


def test_the_flat_form_is_the_trial_workload_as_written_before():
    # the keys a trial's spec.json and the study's "workload" attribute hold: the model keys, target,
    # gpu, gpu_source, ranks and the training settings, side by side
    spec = WorkloadSpec(target={"name": "builtin"}, model=MLP_MODEL, gpu="l4", gpu_source="the device",
                        training={"grad_accum": 4, "activation_checkpointing": False})
    assert spec.to_dict() == {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 1, "num_classes": 10,
                              "target": {"name": "builtin"}, "gpu": "l4", "gpu_source": "the device",
                              "grad_accum": 4, "activation_checkpointing": False}
    assert ENTRY.to_dict() == {"target": {"name": "python", "entry": "train.py:make_workload"}}


@pytest.mark.parametrize("spec", [DDP, ENTRY, WorkloadSpec(target={"name": "builtin"}, model=MLP_MODEL,
                                                         training={"activation_checkpointing": True}),
                                  WorkloadSpec(target={"name": "cmd", "command": "python train.py"}, gpu="auto",
                                               ranks=4)],
                         ids=["ddp", "entry", "training", "cmd"])
def test_reading_the_flat_form_back_gives_the_spec(spec):
    assert WorkloadSpec.from_dict(spec.to_dict()) == spec


def test_from_dict_sorts_the_flat_keys_into_the_fields():
    spec = WorkloadSpec.from_dict({"name": "mlp", "grad_accum": 2, "ranks": 2, "gpu": "h100-80gb"})
    assert spec.target == {"name": "builtin"}   # no target: a built-in workload
    assert (spec.model, spec.gpu, spec.gpu_source, spec.ranks) == ({"name": "mlp"}, "h100-80gb", None, 2)
    assert spec.training == {"grad_accum": 2}
    assert WorkloadSpec.from_dict({"target": {"name": "python", "entry": "a.py:f"}}).model is None


@pytest.mark.parametrize("bad, names", [
    (["name", "mlp"], "a workload must be a mapping"),
    ({1: "x"}, "a workload must be a mapping"),
    ({"name": "mlp", "seq_len": {1, 2}}, "model.seq_len"),        # a set is no JSON value
    ({"target": "builtin"}, "workload target must be a mapping"),
    ({"name": "mlp", "ranks": "2"}, "workload ranks must be an integer"),
])
def test_a_malformed_flat_form_is_refused_in_one_line(bad, names):
    with pytest.raises(ConfigError, match=names) as err:
        WorkloadSpec.from_dict(bad)
    assert "\n" not in str(err.value)


def test_the_data_settings_are_the_model_groups():
    with_data = WorkloadSpec(target={"name": "builtin"}, model={**MLP_MODEL, "data": {"num_workers": 2}})
    assert with_data.data == {"num_workers": 2} and with_data.to_dict()["data"] == {"num_workers": 2}
    assert DDP.data is None and ENTRY.data is None


def test_the_stream_cache_keys_a_spec_on_the_flat_mapping_it_keyed_before(tmp_path):
    # a built-in workload's key is made of its flat form (the mapping Predictor was given before the
    # spec): the same material, so the same key, and cached captures stay valid
    key, material = StreamCache(tmp_path).capture_key(DDP, 32, 2, False)
    assert material["model"] == {**MLP_MODEL, "parallel": "ddp", "target": {"name": "builtin"}, "gpu": "a100-40gb",
                                 "gpu_source": "model.gpu", "ranks": 2}
    assert (material["what"], material["batch_size"], material["steps"], material["blas_workspaces"]) == (
        "capture", 32, 2, False)
    again = WorkloadSpec.from_dict(DDP.to_dict())   # the worker job's report, read back
    assert StreamCache(tmp_path).capture_key(again, 32, 2, False)[0] == key


def test_a_variant_sets_the_training_settings_as_the_flat_form_did():
    # one micro-batch: the grad_accum key left out; checkpointing None: left as it was
    ckpt = WorkloadSpec(target={"name": "builtin"}, model=MLP_MODEL,
                        training={"grad_accum": 8, "activation_checkpointing": True})
    assert variant_workload(ckpt, grad_accum=1, checkpointing=None).to_dict() == {
        **MLP_MODEL, "target": {"name": "builtin"}, "gpu": "auto", "activation_checkpointing": True}
    assert variant_workload(ckpt, grad_accum=2, checkpointing=False).training == {
        "grad_accum": 2, "activation_checkpointing": False}
    assert ckpt.training == {"grad_accum": 8, "activation_checkpointing": True}   # the spec itself unchanged
