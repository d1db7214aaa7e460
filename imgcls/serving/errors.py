"""What a request body can be refused for, without torch: the JSON error's `kind` and its detail. Shared by
serve.py's torch path (serving.model) and its ONNX-only path (serving.onnx_only)."""
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
    return "unreadable_image"
