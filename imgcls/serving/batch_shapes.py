"""The padded batch sizes a served model sees (both serve.py paths: torch, and ONNX only)."""
from __future__ import annotations


def batch_shapes(max_batch: int) -> list[int]:
    """The padded batch sizes the model sees: powers of two below `max_batch`, and `max_batch` itself. A few
    fixed shapes (cudnn tunes each once), and one waiting request is not padded to the largest."""
    shapes, size = [], 1
    while size < max_batch:
        shapes.append(size)
        size *= 2
    return shapes + [max_batch]


def padded_size(n: int, shapes: list[int]) -> int:
    return next(size for size in shapes if size >= n)
