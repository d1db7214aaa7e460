"""model.grad_checkpointing: the same loss and gradients as without it (fp32, eval-mode BatchNorm), a lower
peak memory, and a refusal (exit 2, naming the model) where the model has no checkpointing."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_script, tiny_overrides

from imgcls.config import load_config
from imgcls.core.errors import ModelError
from imgcls.models.factory import build_model, check_grad_checkpointing, create_model

# deep enough (11 checkpointed blocks) that recomputing them frees most of the activations
MODEL = "mobilenetv3_small_050"

PEAK_SCRIPT = """
import sys, torch
sys.path.insert(0, {repo!r})
from imgcls.compute.memory import current_rss_bytes, peak_memory_bytes, reset_peak_memory
from imgcls.models.factory import create_model
torch.manual_seed(0)
model = create_model({model!r}, 3, grad_checkpointing={on})
x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 3, (32,))
torch.nn.functional.cross_entropy(model(x[:2]), y[:2]).backward()  # allocator pools, gradients
cpu = torch.device("cpu")
base = current_rss_bytes()
reset_peak_memory(cpu)
torch.nn.functional.cross_entropy(model(x), y).backward()
print(peak_memory_bytes(cpu) - base)
"""


def loss_and_grads(model, images, targets):
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(images), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointing_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    plain = create_model(MODEL, 5).eval()  # eval: BatchNorm uses its running statistics, so both see the same
    checkpointed = create_model(MODEL, 5, grad_checkpointing=True).eval()
    checkpointed.load_state_dict(plain.state_dict())
    images, targets = torch.randn(4, 3, 48, 48), torch.tensor([0, 1, 2, 4])
    loss_a, grads_a = loss_and_grads(plain, images, targets)
    loss_b, grads_b = loss_and_grads(checkpointed, images, targets)
    assert torch.allclose(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7), name
    assert any(getattr(m, "grad_checkpointing", False) for m in checkpointed.modules())


def measured_peak(on: bool) -> int:
    """Peak RSS growth of one forward/backward, in a fresh process (freed memory kept by the allocator from
    a previous measurement would hide the difference)."""
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT.format(repo=str(REPO), model=MODEL, on=on)],
                          capture_output=True, text=True, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_checkpointing_lowers_the_peak_memory():
    without, with_it = measured_peak(False), measured_peak(True)
    assert with_it < 0.85 * without, (with_it, without)


def test_config_key_reaches_the_model():
    cfg = load_config("base", [f"model.name={MODEL}", "model.grad_checkpointing=true"])
    assert any(getattr(m, "grad_checkpointing", False) for m in build_model(cfg.model, 3).modules())
    densenet = load_config("base", ["model.name=tv:densenet121", "model.grad_checkpointing=true"])
    check_grad_checkpointing(densenet.model)  # torchvision's memory_efficient DenseNet
    assert build_model(densenet.model, 3).features.denseblock1.denselayer1.memory_efficient


@pytest.mark.parametrize("name", ["tv:resnet18", "dla34"])
def test_models_without_checkpointing_are_refused(name):
    cfg = load_config("base", [f"model.name={name}", "model.grad_checkpointing=true"])
    with pytest.raises(ModelError, match=name.removeprefix("tv:")):
        check_grad_checkpointing(cfg.model)


@pytest.mark.slow
def test_train_refuses_before_any_work(tmp_path, tiny_tree):
    out = tmp_path / "run"
    result = run_script("train.py", "--config", "base",
                        *tiny_overrides(tiny_tree, out, **{"model.name": "tv:resnet18",
                                                           "model.grad_checkpointing": "true"}))
    assert result.returncode == 2
    assert "resnet18" in result.stderr and "model.grad_checkpointing" in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("train.py: training tv:resnet18")  # what it does, then why not
    assert not out.exists()
