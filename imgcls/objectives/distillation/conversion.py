"""The teacher sees the student's batch (the same crop, flip, mixed image) converted on the device to its own
preprocessing: the student's normalisation undone and the teacher's applied (one multiply-add per channel),
and resized to the teacher's input size where it differs."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


class InputConversion(torch.nn.Module):
    """Student-normalised NCHW batch -> teacher-normalised batch at `size` px. x_t = (x_s * std_s + mean_s -
    mean_t) / std_t, i.e. x_s * scale + shift per channel; then a bilinear resize (antialiased when shrinking)
    when the sizes differ."""

    def __init__(self, student_mean: Sequence[float], student_std: Sequence[float], teacher_mean: Sequence[float],
                 teacher_std: Sequence[float], student_size: int, teacher_size: int):
        super().__init__()
        s_mean, s_std = torch.tensor(student_mean, dtype=torch.float64), torch.tensor(student_std, dtype=torch.float64)
        t_mean, t_std = torch.tensor(teacher_mean, dtype=torch.float64), torch.tensor(teacher_std, dtype=torch.float64)
        scale, shift = s_std / t_std, (s_mean - t_mean) / t_std
        self.identity_affine = bool(torch.allclose(scale, torch.ones_like(scale)) and torch.allclose(shift, torch.zeros_like(shift)))
        self.register_buffer("scale", scale.float().view(1, 3, 1, 1), persistent=False)
        self.register_buffer("shift", shift.float().view(1, 3, 1, 1), persistent=False)
        self.size = int(teacher_size)
        self.resizes = int(teacher_size) != int(student_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not self.identity_affine:
            images = torch.addcmul(self.shift.to(images.dtype), images, self.scale.to(images.dtype))
        if self.resizes:
            images = F.interpolate(images, size=(self.size, self.size), mode="bilinear", align_corners=False,
                                   antialias=images.shape[-1] > self.size)
        return images

    def describe(self) -> str:
        parts = ["mean/std converted" if not self.identity_affine else "same mean/std"]
        parts.append(f"resized to {self.size} px" if self.resizes else f"same size {self.size} px")
        return ", ".join(parts)
