"""The pooled pre-logits features of a classifier, with its logits from the same pass: what embed.py,
search.py, eval.py --knn / --linear-probe, export.py --embedding and serve.py /embed read."""
from __future__ import annotations

import torch

TORCHVISION_HEADS = ("fc", "classifier", "heads", "head")


def features_and_logits(model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled pre-logits features [N, D], logits [N, C]) of one forward pass. timm models: the input of
    the classifier as timm defines it, `forward_head(forward_features(x), pre_logits=True)`; torchvision
    models: the flattened input of their final classifier (`fc`, `classifier`, `heads`), caught by a hook."""
    if hasattr(model, "forward_head") and hasattr(model, "forward_features"):
        pooled = model.forward_features(images)
        return model.forward_head(pooled, pre_logits=True), model.forward_head(pooled)
    head = next((getattr(model, name) for name in TORCHVISION_HEADS if isinstance(getattr(model, name, None),
                                                                                 torch.nn.Module)), None)
    if head is None:
        raise TypeError(f"{type(model).__name__} has neither timm's forward_head nor a final classifier named "
                        f"{', '.join(TORCHVISION_HEADS)}: its pre-logits features cannot be found")
    caught = []
    hook = head.register_forward_pre_hook(lambda module, args: caught.append(args[0]))
    try:
        logits = model(images)
    finally:
        hook.remove()
    return caught[0].flatten(1), logits
