"""A long thin image costs what its output costs: the eval transform cuts an image longer than
MAX_EVAL_ASPECT to 1 around its centre before it resizes (a 400000x1 PNG of a few KB would otherwise be
resized to 14,400,000 x 36 pixels on the way to a 32 px crop: gigabytes), and training crops first anyway."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, make_tree, run_script, tiny_overrides
from PIL import Image

from imgcls.data.images import MAX_EVAL_ASPECT, centre_box
from imgcls.data.transforms import EvalTransform

SHAPES = [(400_000, 1), (1, 400_000)]  # (width, height)
# Far above what the bounded path adds (a few MB), far below what resizing the whole strip takes (GBs).
EXTRA_RSS_MB = 300


def _strip(path, width: int, height: int):
    """A PNG of a few KB: a repeating ramp along the long side."""
    ramp = (np.arange(max(width, height)) % 251).astype(np.uint8)
    pixels = ramp.reshape(height, width)
    Image.fromarray(np.stack([pixels, 255 - pixels, pixels // 2], axis=-1)).save(path)
    return path


def test_the_centre_box_keeps_ordinary_images_whole_and_cuts_long_ones():
    assert centre_box(640, 480) == (0, 0, 640, 480)
    assert centre_box(16 * 30, 30) == (0, 0, 480, 30)                    # at the limit: whole
    assert centre_box(400_000, 1) == (199_992, 0, 200_008, 1)            # 16 x 1 around the centre
    assert centre_box(1, 400_000) == (0, 199_992, 1, 200_008)
    assert centre_box(1000, 10, max_aspect=4) == (480, 0, 520, 10)
    left, top, right, bottom = centre_box(123_457, 7)
    assert (right - left, bottom - top) == (MAX_EVAL_ASPECT * 7, 7)


@pytest.mark.parametrize("width,height", SHAPES)
def test_a_long_thin_image_is_evaluated_as_its_centre(tmp_path, width, height):
    path = _strip(tmp_path / "strip.png", width, height)
    transform = EvalTransform(32, 0.875, "bilinear")
    out = transform(str(path))
    left, top, right, bottom = centre_box(width, height)
    centre = tmp_path / "centre.png"
    Image.open(path).crop((left, top, right, bottom)).save(centre)
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
    assert torch.equal(out, transform(str(centre)))                     # the same pixels as its centre alone
    assert out.float().std() > 0                                        # the ramp is there, not a flat fill


def _peak_rss_mb(code: str, *args: str) -> float:
    """The peak RSS of a fresh interpreter running `code` (its own, read by the parent)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read()
    assert os.waitstatus_to_exitcode(status) == 0, stderr[-2000:]
    return usage.ru_maxrss / 1024


@pytest.mark.slow
def test_the_eval_and_train_transforms_stay_flat_in_memory_whatever_the_shape(tmp_path):
    code = ("import sys; from imgcls.data.transforms import EvalTransform, TrainTransform; "
            "out = EvalTransform(32, 0.875, 'bilinear')(sys.argv[1]); "
            "crop = TrainTransform(32, (0.08, 1.0), (0.75, 1.33), 0.5, 0.0, 'bilinear')(sys.argv[1], seed=0); "
            "assert out.shape == crop.shape == (3, 32, 32)")
    small = tmp_path / "small.png"
    Image.fromarray(np.full((30, 40, 3), 128, np.uint8)).save(small)
    baseline = _peak_rss_mb(code, str(small))
    for width, height in SHAPES:
        peak = _peak_rss_mb(code, str(_strip(tmp_path / f"{width}x{height}.png", width, height)))
        assert peak < baseline + EXTRA_RSS_MB, (width, height, peak, baseline)


@pytest.mark.slow
def test_infer_classifies_long_thin_images_in_bounded_memory(tmp_path):
    data = make_tree(tmp_path / "data", {"a": (6, 2), "b": (6, 2)})
    run_dir = tmp_path / "run"
    trained = run_script("train.py", "--config", "base",
                         *tiny_overrides(data, run_dir, **{"train.epochs": 1, "data.img_size": 32}))
    assert trained.returncode == 0, trained.stderr[-2000:]
    code = ("import sys, infer; sys.exit(infer.main([sys.argv[1], '--checkpoint', sys.argv[2], '--output', "
            "sys.argv[3], '--num-workers', '0']))")
    small = sorted((data / "val" / "a").iterdir())[0]
    baseline = _peak_rss_mb(code, str(small), str(run_dir / "best.pt"), str(tmp_path / "small.json"))
    for width, height in SHAPES:
        path = _strip(tmp_path / f"{width}x{height}.png", width, height)
        out = tmp_path / f"{width}x{height}.json"
        peak = _peak_rss_mb(code, str(path), str(run_dir / "best.pt"), str(out))
        assert peak < baseline + EXTRA_RSS_MB, (width, height, peak, baseline)
        rows = json.loads(out.read_text())
        assert len(rows) == 1 and rows[0]["label"] in ("a", "b") and not rows[0].get("error")
        assert 0.0 <= rows[0]["prob"] <= 1.0
