"""The memory breakdown (parameters, gradients, optimizer state, activations per sample) adds up to the
measured peak; the finder reports it and the largest batch with and without activation checkpointing; an
out-of-memory error names what fills the memory and the options in the order that helps."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

import imgcls.training.batch_finder as batch_finder
from imgcls.compute.device import DeviceInput
from imgcls.compute.memory import breakdown_from_steps, optimizer_state_bytes, parameter_bytes
from imgcls.config import load_config
from imgcls.models.factory import create_model
from imgcls.training.batch_finder import StepResult, format_finder_table, run_finder
from imgcls.training.step import build_train_step

MiB = 2**20

ADDS_UP_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {repo!r})
from imgcls.config import load_config
from imgcls.training.batch_finder import TrainingStepProbe
cfg = load_config("base", ["model.name=resnet10t", "data.img_size=48", "train.amp=none", "train.device=cpu"])
torch.manual_seed(0)
probe = TrainingStepProbe(cfg, 3, torch.device("cpu"), None)
breakdown = probe.breakdown(8, 32)
print(json.dumps({{"predicted": breakdown.total(48), "measured": probe(48).peak_bytes, **breakdown.as_dict(48)}}))
"""


@pytest.mark.slow
def test_breakdown_adds_up_to_the_measured_peak_on_cpu():
    """Measured at batches 8 and 32 (a spread the allocator's reuse cannot hide), checked at 48 (a fresh
    process: memory freed by earlier tests and kept by the allocator would hide what the step adds)."""
    done = subprocess.run([sys.executable, "-c", ADDS_UP_SCRIPT.format(repo=str(REPO))], capture_output=True,
                          text=True, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["predicted"] == pytest.approx(out["measured"], rel=0.15)
    model = create_model("resnet10t", 3)
    assert out["parameters_mb"] == pytest.approx(parameter_bytes(model) / MiB, abs=0.1)
    assert out["gradients_mb"] == out["parameters_mb"] == out["optimizer_state_mb"]  # fp32 SGD with momentum
    assert out["activations_per_sample_mb"] > 0


def test_breakdown_arithmetic():
    b = breakdown_from_steps(parameters=100 * MiB, gradients=100 * MiB, optimizer_state=200 * MiB,
                             held_before=700 * MiB, small=(8, 1000 * MiB), large=(16, 1080 * MiB))
    assert b.activations_per_sample == 10 * MiB
    assert b.other == 400 * MiB           # held before the step besides parameters and optimizer state
    assert b.total(32) == (100 + 100 + 200 + 400 + 320) * MiB
    row = b.as_dict(32)
    assert row["activations_mb"] == 320 and row["total_mb"] == 1120


@pytest.mark.parametrize("name,copies", [("sgd", 1), ("adamw", 2)])
def test_optimizer_state_estimated_before_and_measured_after_the_first_step(name, copies):
    cfg = load_config("base", ["model.name=resnet10t", f"optim.name={name}", "train.amp=none"])
    model = create_model("resnet10t", 3)
    step = build_train_step(cfg, model, DeviceInput.from_config(cfg, torch.device("cpu"), None), 0.01)
    before = optimizer_state_bytes(step.optimizer)
    assert before == copies * parameter_bytes(model)
    torch.nn.functional.cross_entropy(model(torch.randn(2, 3, 16, 16)), torch.tensor([0, 1])).backward()
    step.optimizer.step()
    assert optimizer_state_bytes(step.optimizer) == pytest.approx(before, rel=0.01)  # + Adam's step counters


class FakeProbe:
    """Stands in for real steps: memory = 500 MiB + per-sample MiB x batch, 2 MiB per sample without
    activation checkpointing and 1 with it."""

    def __init__(self, cfg, num_classes, device, amp_dtype):
        self.per_sample = (1 if cfg.model.grad_checkpointing else 2) * MiB

    def __call__(self, batch):
        return StepResult(0.01 * batch + 0.1, int(500 * MiB + self.per_sample * batch), 500 * MiB)

    def breakdown(self, small, large):
        return breakdown_from_steps(10 * MiB, 10 * MiB, 10 * MiB, 500 * MiB, (small, self(small).peak_bytes),
                                    (large, self(large).peak_bytes))

    def close(self):
        pass


@pytest.mark.parametrize("on", [False, True])
def test_finder_reports_the_largest_batch_with_and_without_checkpointing(monkeypatch, on):
    monkeypatch.setattr(batch_finder, "TrainingStepProbe", FakeProbe)
    cfg = load_config("base", [f"model.grad_checkpointing={str(on).lower()}", "model.name=resnet10t",
                               "train.memory_budget_gb=0.5859375", "optim.base_batch_size=1024"])
    report = run_finder(cfg, torch.device("cpu"), None, 3, 10_000, compare_checkpointing=True)
    # 100 MiB over the 500 MiB base: ~50 samples without, ~100 with
    assert 47 <= report["max_batch_without_grad_checkpointing"] <= 50
    assert 95 <= report["max_batch_with_grad_checkpointing"] <= 100
    assert report["memory_breakdown"]["activations_per_sample_mb"] == (1 if on else 2)
    table = format_finder_table(report)
    assert "optimizer state" in table and "per sample" in table
    assert "largest batch with model.grad_checkpointing" in table


@pytest.mark.slow
def test_out_of_memory_names_what_fills_the_memory_and_the_options_in_order(capsys):
    from imgcls.cli import run_main

    cfg = load_config("base", ["model.name=resnet10t", "train.amp=none"])
    model = create_model("resnet10t", 3)
    step = build_train_step(cfg, model, DeviceInput.from_config(cfg, torch.device("cpu"), None), 0.01)

    class Exploding(torch.nn.Module):  # the model's parameters; a forward that runs out of memory
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, images):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. Of the allocated memory "
                                         "3.00 GiB is allocated by PyTorch, and 5.00 GiB is reserved by PyTorch "
                                         "but unallocated.")

    step.model = Exploding()

    def main():
        step.forward_backward(torch.zeros(6, 3, 16, 16), torch.zeros(6, dtype=torch.long), 1, True)

    with pytest.raises(SystemExit) as exit_info:
        run_main(main)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"parameters {parameter_bytes(model) / MiB:.1f} MiB" in err and "at batch 6" in err
    assert "optimizer state" in err and "activations" in err
    order = [err.index(words) for words in ("train.amp=bf16", "train.accum_steps", "model.grad_checkpointing=true",
                                            "data.img_size")]
    assert order == sorted(order)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in err
