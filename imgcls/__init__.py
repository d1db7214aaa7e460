"""imgcls's Python API: the same work as the entry scripts, from Python.

    from imgcls import Classifier, train

    summary = train("quickstart", {"train.epochs": 3, "output.dir": "runs/api"})
    with Classifier.load("runs/api/best.pt") as model:
        rows = model.predict(["img.jpg", "photos/"])   # infer.py's rows: path, label, prob, ...
        rows = model.predict(pil_image)                # or image bytes, a numpy array, a list mixing them

`train` runs train.py's training (same config rules, same run directory) and returns summary.json's
content; `Classifier` opens a checkpoint or an export through the one Predictor that infer.py, eval.py and
serve.py use, so its rows equal infer.py's for the same images.

What `predict` and `embed` take (docs/interface.md): a path (a file, a folder, a glob; `predict`: an http(s) URL
too), an image's encoded bytes, a PIL image, a numpy array or torch tensor ((H, W), (H, W, C) or (C, H, W); (N, ...)
is N images), or a list or tuple mixing them; an empty list gives no rows. In-memory images are named `<image I>`
(I: the position in the list; `<image I.J>` for the J-th of a stacked array). Anything else raises InputTypeError (a
ConfigError and a TypeError)."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Iterable, Optional, Union

from imgcls.core.errors import ConfigError, InputTypeError

ACCEPTED = ("a path (file, folder or glob), an image's bytes, a PIL image, a numpy array or torch tensor, or a list "
            "of these")

__all__ = ["Classifier", "train", "load_config"]


def load_config(config: Union[str, Path, dict, None] = None, overrides: Union[dict, Iterable[str]] = ()):
    """A validated Config: `config` a name in configs/, a YAML path or a dict of sections over base.yaml's
    defaults; `overrides` dotted keys, as {"train.epochs": 3} or ["train.epochs=3"]. A mistake raises
    ConfigError naming the key and what is allowed (InputTypeError for an argument of another type)."""
    from imgcls.config import Config, apply_dict, apply_overrides, load_config as load_named, nest, validate

    if config is not None and not isinstance(config, (str, os.PathLike, dict)):
        raise InputTypeError(f"config = {config!r} ({type(config).__name__}): a config name in configs/, a YAML path, "
                             f"a dict of sections, or None for base.yaml")
    overrides = check_overrides(overrides)
    if not isinstance(config, dict) and not isinstance(overrides, dict):
        return load_named(str(config) if config is not None else "base", list(overrides))
    cfg = load_named(str(config), []) if config is not None and not isinstance(config, dict) else Config()
    if isinstance(config, dict):
        cfg.explicit_keys |= apply_dict(cfg, config, source="config")
    if isinstance(overrides, dict):
        for key, value in overrides.items():
            cfg.explicit_keys |= apply_dict(cfg, nest(key, value), source="overrides")
    else:
        apply_overrides(cfg, list(overrides))
    validate(cfg)
    return cfg


def check_overrides(overrides) -> Union[dict, list]:
    """`overrides` as a dict or a list of KEY=VALUE strings (one string is one override); InputTypeError else."""
    if overrides is None:
        return []
    if isinstance(overrides, (dict, list, tuple)) or isinstance(overrides, str):
        items = [overrides] if isinstance(overrides, str) else overrides
        if isinstance(items, dict) or all(isinstance(item, str) for item in items):
            return items
    raise InputTypeError(f"overrides = {overrides!r}: a dict of dotted keys ({{'train.epochs': 3}}) or a list of "
                         f"KEY=VALUE strings (['train.epochs=3'])")


def train(config: Union[str, Path, dict, None] = None, overrides: Union[dict, Iterable[str]] = (),
          resume: Optional[str] = None, finetune: Optional[str] = None) -> dict:
    """Train as train.py does and return the run's summary.json. A usage mistake raises ConfigError (train.py's
    exit 2) before any work; a run that does not finish raises RuntimeError with its exit status (its run
    directory keeps last.pt for `resume`)."""
    from imgcls.training.trainer import run

    for name, value in (("resume", resume), ("finetune", finetune)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise InputTypeError(f"{name} = {value!r}: a checkpoint path (or 'auto' for resume), or None")
    cfg = load_config(config, overrides)
    code = run(cfg, resume=None if resume is None else str(resume),
               finetune=None if finetune is None else str(finetune))
    summary_path = Path(cfg.output.dir) / "summary.json"
    if code != 0:
        raise RuntimeError(f"training stopped with exit status {code}; see {Path(cfg.output.dir) / 'train.log'}")
    return json.loads(summary_path.read_text())


def image_sources(images, transform, caller: str) -> tuple[list, list[str]]:
    """(what the loader reads: paths and images' bytes, the rows' names) of what `predict` / `embed` take (the
    module says what); InputTypeError naming the item otherwise. Runs of paths expand together, as infer.py's
    arguments do."""
    from imgcls.data.datasets import expand_inputs

    items = list(images) if isinstance(images, (list, tuple)) else [images]
    sources, names, paths = [], [], []
    for position, item in enumerate(items):
        if isinstance(item, (str, os.PathLike)):
            paths.append(str(item))
            continue
        if paths:
            expanded = expand_inputs(paths)
            sources += expanded
            names += expanded
            paths = []
        for suffix, buf in in_memory_images(item, transform, f"{caller}: item {position}" if
                                            isinstance(images, (list, tuple)) else f"{caller}: images"):
            sources.append(buf)
            names.append(f"<image {position}{suffix}>")
    if paths:
        expanded = expand_inputs(paths)
        sources += expanded
        names += expanded
    return sources, names


def in_memory_images(item, transform, where: str) -> list[tuple[str, bytes]]:
    """[(name suffix, bytes the loader decodes)] of one in-memory image (or a stack of them): encoded bytes as
    they are; a PIL image through the pixel policy of file reading; an array as a `.npy` file of it is read."""
    import numpy as np

    if isinstance(item, (bytes, bytearray, memoryview)):
        return [("", bytes(item))]
    if hasattr(item, "detach") and hasattr(item, "numpy"):  # a torch tensor
        item = item.detach().cpu().numpy()
    if isinstance(item, np.ndarray):
        stack = item if item.ndim == 4 else [item]
        return [(f".{j}" if item.ndim == 4 else "", npy_bytes(np.asarray(one))) for j, one in enumerate(stack)]
    from PIL import Image

    if isinstance(item, Image.Image):
        from imgcls.data.images import pil_bands, to_rgb
        from imgcls.data.transforms import reads_bands

        if reads_bands(getattr(transform, "channels", 3), getattr(transform, "value_range", None)):
            return [("", npy_bytes(pil_bands(item, in_place=False)))]
        from PIL import ImageOps
        return [("", npy_bytes(np.asarray(to_rgb(ImageOps.exif_transpose(item)))))]
    raise InputTypeError(f"{where} is {item!r:.80} ({type(item).__name__}): pass {ACCEPTED}")


def npy_bytes(array) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


class Classifier:
    """A trained model (a checkpoint or an export) that classifies images as infer.py does."""

    def __init__(self, predictor):
        self.predictor = predictor

    @classmethod
    def load(cls, path: Union[str, Path], device: str = "auto", amp: Optional[str] = None,
             topk: int = 5) -> "Classifier":
        from imgcls.model_files.predictor import Predictor

        if not isinstance(path, (str, os.PathLike)):
            raise InputTypeError(f"Classifier.load: path = {path!r}: the path of a checkpoint or an export")
        if not Path(path).exists():
            raise ConfigError(f"Classifier.load: {path} does not exist")
        return cls(Predictor.open(str(path), device, amp, topk))

    @property
    def classes(self) -> list[str]:
        return list(self.predictor.classes)

    def predict(self, images, batch_size: Optional[int] = None, num_workers: int = 0) -> list[dict]:
        """infer.py's rows for `images` (the module says what it takes: image URLs too; unreadable images and
        URLs that fail get `error`), in order."""
        from imgcls.commands.infer import fixed_batch_size
        from imgcls.data.datasets import inference_batches
        from imgcls.data.urls import downloaded

        p = self.predictor
        many = isinstance(images, (list, tuple))
        items = list(images) if many else [images]
        with downloaded([str(item) for item in items if isinstance(item, (str, os.PathLike))]) as fetched:
            local = iter(fetched.inputs)
            items = [next(local) if isinstance(item, (str, os.PathLike)) else item for item in items]
            sources, names = image_sources(items if many else items[0], p.transform, "Classifier.predict")
            if not sources:
                return []
            loader = inference_batches(sources, p.transform, fixed_batch_size(p.model_file, batch_size),
                                       num_workers, p.runtime.device)
            return fetched.restore(p.predict_rows(loader, names))

    def embed(self, images, batch_size: Optional[int] = None,
              num_workers: int = 0) -> tuple[list[str], "numpy.ndarray"]:
        """embed.py's vectors: (the names read, an [N, D] float32 array of L2-normalised pre-logits features
        in that order); unreadable images are left out. Takes what `predict` takes."""
        import numpy

        from imgcls.commands.infer import fixed_batch_size
        from imgcls.data.datasets import inference_batches
        from imgcls.embedding.embedder import Embedder

        embedder = Embedder.from_model_file(self.predictor.model_file, str(self.predictor.runtime.device))
        sources, names = image_sources(images, embedder.transform, "Classifier.embed")
        if not sources:
            return [], numpy.zeros((0, 0), numpy.float32)
        loader = inference_batches(sources, embedder.transform, fixed_batch_size(embedder.model_file, batch_size),
                                   num_workers, embedder.runtime.device)
        read, parts = [], []

        def keep(vectors, valid, indices, errors):
            parts.append(vectors[valid[:len(vectors)]])
            read.extend(names[i] for i, ok in zip(indices, valid) if ok)

        embedder.run(loader, keep)
        width = parts[0].shape[1] if parts else 0
        return read, numpy.concatenate(parts) if parts else numpy.zeros((0, width), numpy.float32)

    def close(self) -> None:
        self.predictor.close()

    def __enter__(self) -> "Classifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
