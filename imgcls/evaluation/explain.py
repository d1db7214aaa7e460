"""Grad-CAM explanations (the `grad-cam` package, pytorch-grad-cam): a heatmap per image for a class, its
peak mapped back to the original image's pixels (undoing the eval resize and centre crop), and an
overlay PNG of the heatmap on the original image.

Target layer: of the stages timm's `feature_info` names, the deepest whose feature map at the input size has
at least MIN_CAM_CELLS cells a side (ResNet at 224 px: `layer4`, 7x7; at 48 px: `layer2`, 6x6; the last
stage there is 2x2, coarser than the objects); without an input size the last stage; without `feature_info`
the model's last Conv2d (torchvision models).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

MIN_CAM_CELLS = 6   # the coarsest map Grad-CAM may read: 6-7 cells a side (ResNet's 7x7 at 224 px)


def stage_cells(model: torch.nn.Module, img_size: Optional[int]) -> list[tuple[str, Optional[int]]]:
    """(module name, cells a side of its map at `img_size`, None when unknown) of each stage timm's
    `feature_info` lists, shallow to deep."""
    info = getattr(model, "feature_info", None)
    if not info:
        return []
    stages = info if isinstance(info, list) else [dict(module=m, reduction=r) for m, r in
                                                  zip(info.module_name(), info.reduction())]
    return [(s["module"], img_size // s["reduction"] if img_size and s.get("reduction") else None) for s in stages]


def target_layer(model: torch.nn.Module, img_size: Optional[int] = None) -> tuple[str, torch.nn.Module]:
    """(name, module) of the layer Grad-CAM reads: of timm's feature_info stages, the deepest with at least
    MIN_CAM_CELLS cells a side at `img_size` (the shallowest when none has; the last without `img_size`),
    else the last Conv2d."""
    stages = stage_cells(model, img_size)
    fine = [name for name, cells in stages if cells is not None and cells >= MIN_CAM_CELLS]
    names = ([fine[-1]] if fine else [stages[0][0]] if stages and img_size else []) + \
        ([stages[-1][0]] if stages else [])
    for name in names:
        try:
            return name, model.get_submodule(name)
        except AttributeError:
            continue
    convs = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    if not convs:
        raise ValueError("the model has no convolution layer for Grad-CAM")
    return convs[-1]


def crop_geometry(width: int, height: int, resize_to: int, img_size: int) -> tuple[float, float, float, float]:
    """(left, top, scale_x, scale_y) of the eval transform on a width x height image: the shorter side is
    resized to `resize_to` (torchvision's rule: the longer side int(resize_to * long / short)), then the
    centre `img_size` square is cut at (left, top) of the resized image."""
    short, long = min(width, height), max(width, height)
    long_resized = int(resize_to * long / short)
    resized_w, resized_h = (resize_to, long_resized) if width <= height else (long_resized, resize_to)
    left = int(round((resized_w - img_size) / 2.0))
    top = int(round((resized_h - img_size) / 2.0))
    return left, top, resized_w / width, resized_h / height


def to_original(x: float, y: float, geometry: tuple[float, float, float, float], width: int,
                height: int) -> list[int]:
    """A pixel (x, y) of the model's input -> the original image's pixel it came from (clamped inside)."""
    left, top, sx, sy = geometry
    ox = (x + 0.5 + left) / sx - 0.5
    oy = (y + 0.5 + top) / sy - 0.5
    return [int(min(max(round(ox), 0), width - 1)), int(min(max(round(oy), 0), height - 1))]


def heatmap_peak(cam: np.ndarray) -> tuple[int, int]:
    """(x, y) of the heatmap's maximum (the first in row order on ties)."""
    y, x = np.unravel_index(int(np.argmax(cam)), cam.shape)
    return int(x), int(y)


def heatmap_on_original(cam: np.ndarray, geometry, width: int, height: int) -> np.ndarray:
    """The input-sized heatmap placed where the crop came from on a width x height canvas (0 outside it)."""
    from PIL import Image

    left, top, sx, sy = geometry
    side = cam.shape[0]
    x0, y0 = left / sx, top / sy
    w, h = max(1, round(side / sx)), max(1, round(side / sy))
    scaled = np.asarray(Image.fromarray(cam.astype(np.float32), mode="F").resize((w, h), Image.BILINEAR))
    canvas = np.zeros((height, width), dtype=np.float32)
    cx0, cy0 = int(round(x0)), int(round(y0))
    sx0, sy0 = max(0, -cx0), max(0, -cy0)
    ex, ey = min(width, cx0 + w), min(height, cy0 + h)
    canvas[max(cy0, 0):ey, max(cx0, 0):ex] = scaled[sy0:sy0 + ey - max(cy0, 0), sx0:sx0 + ex - max(cx0, 0)]
    return canvas


class Explainer:
    """Grad-CAM of one model: `heatmaps(batch, class_indices)` -> [N, H, W] in [0, 1] at the input size."""

    def __init__(self, model: torch.nn.Module, img_size: Optional[int] = None):
        from pytorch_grad_cam import GradCAM

        self.model = model.eval()
        self.layer_name, layer = target_layer(model, img_size)
        self.cells = dict(stage_cells(model, img_size)).get(self.layer_name)
        self.cam = GradCAM(model=self.model, target_layers=[layer])

    def describe(self) -> str:
        """The layer and its map's size, for the log."""
        return f"'{self.layer_name}'" + (f" ({self.cells}x{self.cells} cells)" if self.cells else "")

    def heatmaps(self, batch: torch.Tensor, class_indices: list[int]) -> np.ndarray:
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

        targets = [ClassifierOutputTarget(int(c)) for c in class_indices]
        with torch.enable_grad():
            return self.cam(input_tensor=batch, targets=targets)

    def close(self) -> None:
        self.cam.activations_and_grads.release()


def write_overlay(original_rgb: np.ndarray, heatmap: np.ndarray, path: Path, peak: Optional[list[int]] = None) -> Path:
    """The heatmap (jet) blended onto the original image, the peak marked with a small circle, as a PNG."""
    from PIL import Image, ImageDraw
    from pytorch_grad_cam.utils.image import show_cam_on_image

    blended = show_cam_on_image(original_rgb.astype(np.float32) / 255.0, heatmap, use_rgb=True, image_weight=0.55)
    image = Image.fromarray(blended)
    if peak is not None:
        r = max(2, int(math.ceil(min(image.size) / 40)))
        ImageDraw.Draw(image).ellipse([peak[0] - r, peak[1] - r, peak[0] + r, peak[1] + r], outline="white", width=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
