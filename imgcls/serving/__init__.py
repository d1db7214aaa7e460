"""serve.py's work: an HTTP model server (FastAPI + uvicorn) whose requests are decoded on their own,
then classified together in dynamically formed batches, with the same rows as infer.py. What a request body can be
refused for and the padded batch sizes a served model sees are here, torch-free: both paths (torch in
serving/model.py, ONNX only in serving/slim.py) share them."""
from __future__ import annotations


class BadImage(Exception):
    """A request body that is no usable image: `kind` names the problem for the JSON error."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def classify_decode_error(message: str) -> str:
    """The kind of problem PIL or the decoder reported (an ImageDecodeError's message)."""
    if "DecompressionBomb" in message:
        return "decompression_bomb"
    if "truncated" in message or "broken data stream" in message or "premature end" in message.lower():
        return "truncated_image"
    if "cannot identify image file" in message or "UnidentifiedImageError" in message:
        return "not_an_image"
    if "are not finite (NaN or infinity)" in message:
        return "non_finite_image"
    if "outside the declared range" in message:
        return "out_of_range_image"
    return "unreadable_image"

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
