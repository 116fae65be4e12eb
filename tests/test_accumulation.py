"""Gradient accumulation, activation checkpointing and a python entry's own step: what a step
trains, and what its prediction holds."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

from oomtune.alloc.geometry import budget_geometry
from oomtune.exceptions import ConfigError
from oomtune.plan.predictor import Predictor
from oomtune.targets.python_entry import build_user_workload
from oomtune.workloads.loop import build_workload, grad_accum_of, prediction_workload
from oomtune.workload_spec import WorkloadSpec

GEOMETRY = budget_geometry(1 << 30, 80 << 30)
# One Linear(1024 -> 1024) with bias, SGD with momentum, batch 1: the parameters dominate memory.
LINEAR = {"name": "mlp", "in_features": 1024, "layers": 0, "num_classes": 1024, "optimizer": "sgd",
          "target": {"name": "builtin"}}


def test_two_micro_batches_exceed_one_by_the_fp32_gradients():
    # Hand calculation. Parameters P = 4 B x (1024 x 1024 + 1024) = 4,198,400 bytes (fp32). From the
    # second step on, one micro-batch per step peaks in backward with the parameters, the momentum
    # buffers and the new gradients alive: 3P (+ the small activations). With two micro-batches the
    # second one's backward makes new gradients while the first one's are still held for
    # accumulation (AccumulateGrad adds in place afterwards): 4P + the same small activations. The
    # difference is exactly the fp32 gradients, P.
    p_bytes = 4 * (1024 * 1024 + 1024)
    one = Predictor(WorkloadSpec.from_dict({**LINEAR}), GEOMETRY, steps=4, derive=False).predict_detail(1, "")
    two = Predictor(WorkloadSpec.from_dict({**LINEAR, "grad_accum": 2}), GEOMETRY, steps=4, derive=False).predict_detail(1, "")
    assert two.peak_allocated_bytes - one.peak_allocated_bytes == p_bytes
    # more micro-batches repeat the second's requests: the prediction captures two of them
    eight = Predictor(WorkloadSpec.from_dict({**LINEAR, "grad_accum": 8}), GEOMETRY, steps=4, derive=False).predict_detail(1, "")
    assert eight.peak_allocated_bytes == two.peak_allocated_bytes


def test_a_step_runs_grad_accum_micro_batches_then_one_update():
    wl = build_workload({**LINEAR, "in_features": 8, "num_classes": 4, "grad_accum": 3}, 2, "cpu")
    forwards, updates = [], []
    wl.model.register_forward_hook(lambda *a: forwards.append(1))
    real_step = wl.optimizer.step
    wl.optimizer.step = lambda *a, **k: (updates.append(1), real_step(*a, **k))
    timings = wl.run_steps(2, sync=False)
    assert (len(forwards), len(updates)) == (6, 2)
    assert wl.samples_per_step == 6 and timings.samples_per_step == 6   # micro-batch x grad_accum


def test_accumulated_gradients_are_the_mean_over_the_micro_batches():
    # the loss of each micro-batch is divided by grad_accum, as accumulating trainers do: the
    # gradient of 2 micro-batches of 3 equals the gradient of one batch of 6 (same samples)
    torch.manual_seed(0)
    data = [(torch.randn(3, 4), torch.randint(0, 2, (3,))) for _ in range(2)]
    cfg = {"name": "mlp", "in_features": 4, "layers": 0, "num_classes": 2, "optimizer": "sgd", "lr": 0.0}
    acc = build_workload({**cfg, "grad_accum": 2}, 3, "cpu")
    acc.optimizer.zero_grad = lambda **kw: None   # keep the gradients to read them
    acc.train_step(iter(data))
    whole = build_workload(cfg, 6, "cpu")
    whole.model.load_state_dict(acc.model.state_dict())
    whole.optimizer.zero_grad = lambda **kw: None
    whole.train_step(iter([(torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data]))]))
    for a, b in zip(acc.model.parameters(), whole.model.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_prediction_workload_keeps_at_most_two_micro_batches():
    assert prediction_workload({"grad_accum": 16})["grad_accum"] == 2
    assert prediction_workload({"grad_accum": 2})["grad_accum"] == 2
    assert "grad_accum" not in prediction_workload({})
    with pytest.raises(ConfigError, match="grad_accum=0: expected an integer >= 1"):
        grad_accum_of({"grad_accum": 0})


@pytest.mark.parametrize("name", ["transformer", "resnet"])
def test_builtin_activation_checkpointing_keeps_less_for_backward(name):
    cfg = ({"name": "transformer", "layers": 2, "d_model": 64, "heads": 2, "vocab_size": 128, "seq_len": 64,
            "optimizer": "sgd", "target": {"name": "builtin"}} if name == "transformer" else
           {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10, "optimizer": "sgd",
            "target": {"name": "builtin"}})
    plain = Predictor(WorkloadSpec.from_dict(cfg), GEOMETRY, steps=2, derive=False).predict_detail(16, "")
    ckpt = Predictor(WorkloadSpec.from_dict({**cfg, "activation_checkpointing": True}), GEOMETRY, steps=2,
                     derive=False).predict_detail(16, "")
    assert ckpt.peak_allocated_bytes < plain.peak_allocated_bytes


def test_the_mlp_has_no_activation_checkpointing():
    with pytest.raises(ConfigError, match="the built-in mlp has no activation checkpointing"):
        build_workload({**LINEAR, "activation_checkpointing": True}, 1, "meta")


ENTRY = textwrap.dedent('''
    import torch
    from torch import nn

    calls = []

    def make_workload(batch_size, device, activation_checkpointing=False):
        calls.append(activation_checkpointing)
        model = nn.Linear(4, 2).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step_fn(model, batch):
            out = model(batch["x"])
            return (out ** 2).mean() + out.abs().mean()      # two losses, a dict batch

        def batches():
            while True:
                yield {"x": torch.randn(batch_size, 4, device=device)}

        return {"model": model, "optimizer": opt, "batches": batches(), "step_fn": step_fn,
                "max_grad_norm": 0.5}

    def no_ckpt(batch_size, device):
        model = nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), [(torch.randn(batch_size, 4), torch.zeros(batch_size, dtype=torch.long))]
''')


@pytest.fixture
def entry(tmp_path):
    path = tmp_path / "step_entry.py"
    path.write_text(ENTRY)
    return str(path)


def test_python_entry_step_fn_with_accumulation_and_clipping(entry):
    wl = build_user_workload({"name": "python", "entry": f"{entry}:make_workload"}, 3, "cpu", grad_accum=2,
                             activation_checkpointing=True)
    norms = []
    real = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = lambda params, max_norm, **kw: norms.append(max_norm) or real(params, max_norm, **kw)
    try:
        wl.run_steps(2, sync=False)
    finally:
        torch.nn.utils.clip_grad_norm_ = real
    assert norms == [0.5, 0.5]                 # once per optimizer step, before it
    assert wl.samples_per_step == 6
    import sys

    module = next(m for n, m in sys.modules.items() if n.startswith("oomtune_user_step_entry"))
    assert module.calls == [True]              # the activation_checkpointing argument reached it


def test_checkpointing_needs_the_entry_argument(entry):
    with pytest.raises(ConfigError, match="needs the function to take an activation_checkpointing argument"):
        build_user_workload({"name": "python", "entry": f"{entry}:no_ckpt"}, 2, "cpu", activation_checkpointing=True)


def test_a_step_fn_must_return_a_scalar(tmp_path):
    path = tmp_path / "bad_step.py"
    path.write_text(textwrap.dedent('''
        import torch
        def make_workload(batch_size):
            m = torch.nn.Linear(2, 2)
            return {"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1),
                    "batches": [torch.zeros(batch_size, 2)], "step_fn": lambda model, b: model(b)}
    '''))
    wl = build_user_workload({"name": "python", "entry": f"{path}:make_workload"}, 2, "cpu")
    with pytest.raises(ConfigError, match=r"step_fn\(model, batch\) must return the loss as a scalar tensor"):
        wl.train_step()


def test_a_data_generator_that_cannot_run_on_meta_is_captured_on_cpu_with_one_line(tmp_path):
    path = tmp_path / "item_entry.py"
    path.write_text(textwrap.dedent('''
        import torch
        def make_workload(batch_size, device):
            m = torch.nn.Linear(4, 3).to(device)
            n = int(torch.tensor(batch_size, device=device).item())     # reads a tensor's value
            return m, torch.optim.SGD(m.parameters(), lr=0.1), [(torch.randn(n, 4, device=device), torch.zeros(n, dtype=torch.long, device=device))]
    '''))
    p = Predictor(WorkloadSpec.from_dict({"target": {"name": "python", "entry": f"{path}:make_workload"}}), GEOMETRY, steps=2, derive=False)
    p.predict_detail(4, "")
    (reason,) = p.fallback_reasons
    assert "cannot be built on meta" in reason and "captured on cpu" in reason and "\n" not in reason


def test_the_training_keys_are_read_without_torch():
    # a command's search reads grad_accum / activation_checkpointing for its environment and
    # placeholders: oomtune.workloads.training and the cmd target import no torch
    import subprocess
    import sys

    code = ("import sys; from oomtune.workloads.training import grad_accum_of; import oomtune.targets.cmd; "
            "print(grad_accum_of({'grad_accum': 4}), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["4", "False"]
