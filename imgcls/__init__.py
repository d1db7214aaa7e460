"""imgcls's Python API: the same work as the entry scripts, from Python.

    from imgcls import Classifier, train

    summary = train("quickstart", {"train.epochs": 3, "output.dir": "runs/api"})
    with Classifier.load("runs/api/best.pt") as model:
        rows = model.predict(["img.jpg", "photos/"])   # infer.py's rows: path, label, prob, ...

`train` runs train.py's training (same config rules, same run directory) and returns summary.json's
content; `Classifier` opens a checkpoint or an export through the one Predictor that infer.py, eval.py and
serve.py use, so its rows equal infer.py's for the same images."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Union

from imgcls.core.errors import ConfigError

__all__ = ["Classifier", "train", "load_config"]


def load_config(config: Union[str, Path, dict, None] = None, overrides: Union[dict, Iterable[str]] = ()):
    """A validated Config: `config` a name in configs/, a YAML path or a dict of sections over base.yaml's
    defaults; `overrides` dotted keys, as {"train.epochs": 3} or ["train.epochs=3"]. A mistake raises
    ConfigError naming the key and what is allowed."""
    from imgcls.config import Config, apply_dict, apply_overrides, load_config as load_named, nest, validate

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


def train(config: Union[str, Path, dict, None] = None, overrides: Union[dict, Iterable[str]] = (),
          resume: Optional[str] = None, finetune: Optional[str] = None) -> dict:
    """Train as train.py does and return the run's summary.json. A usage mistake raises ConfigError (train.py's
    exit 2) before any work; a run that does not finish raises RuntimeError with its exit status (its run
    directory keeps last.pt for `resume`)."""
    from imgcls.training.trainer import run

    cfg = load_config(config, overrides)
    code = run(cfg, resume=resume, finetune=finetune)
    summary_path = Path(cfg.output.dir) / "summary.json"
    if code != 0:
        raise RuntimeError(f"training stopped with exit status {code}; see {Path(cfg.output.dir) / 'train.log'}")
    return json.loads(summary_path.read_text())


class Classifier:
    """A trained model (a checkpoint or an export) that classifies images as infer.py does."""

    def __init__(self, predictor):
        self.predictor = predictor

    @classmethod
    def load(cls, path: Union[str, Path], device: str = "auto", amp: Optional[str] = None,
             topk: int = 5) -> "Classifier":
        from imgcls.model_files.predictor import Predictor

        if not Path(path).exists():
            raise ConfigError(f"Classifier.load: {path} does not exist")
        return cls(Predictor.open(str(path), device, amp, topk))

    @property
    def classes(self) -> list[str]:
        return list(self.predictor.classes)

    def predict(self, images: Union[str, Path, Iterable[Union[str, Path]]], batch_size: Optional[int] = None,
                num_workers: int = 0) -> list[dict]:
        """infer.py's rows for image files, folders, globs or image URLs (unreadable files and URLs that fail
        get `error`)."""
        from imgcls.commands.infer import fixed_batch_size
        from imgcls.data.datasets import expand_inputs, inference_batches
        from imgcls.data.urls import downloaded

        inputs = [str(images)] if isinstance(images, (str, Path)) else [str(p) for p in images]
        with downloaded(inputs) as fetched:
            paths = expand_inputs(fetched.inputs)
            p = self.predictor
            loader = inference_batches(paths, p.transform, fixed_batch_size(p.model_file, batch_size), num_workers,
                                       p.runtime.device)
            return fetched.restore(p.predict_rows(loader, paths))

    def embed(self, images: Union[str, Path, Iterable[Union[str, Path]]], batch_size: Optional[int] = None,
              num_workers: int = 0) -> tuple[list[str], "numpy.ndarray"]:
        """embed.py's vectors: (the paths read, an [N, D] float32 array of L2-normalised pre-logits features
        in that order); unreadable files are left out."""
        import numpy

        from imgcls.commands.infer import fixed_batch_size
        from imgcls.data.datasets import expand_inputs, inference_batches
        from imgcls.embedding.embedder import Embedder

        inputs = [str(images)] if isinstance(images, (str, Path)) else [str(p) for p in images]
        paths = expand_inputs(inputs)
        embedder = Embedder.from_model_file(self.predictor.model_file, str(self.predictor.runtime.device))
        loader = inference_batches(paths, embedder.transform, fixed_batch_size(embedder.model_file, batch_size),
                                   num_workers, embedder.runtime.device)
        read, parts = [], []

        def keep(vectors, valid, indices, errors):
            parts.append(vectors[valid[:len(vectors)]])
            read.extend(paths[i] for i, ok in zip(indices, valid) if ok)

        embedder.run(loader, keep)
        width = parts[0].shape[1] if parts else 0
        return read, numpy.concatenate(parts) if parts else numpy.zeros((0, width), numpy.float32)

    def close(self) -> None:
        self.predictor.close()

    def __enter__(self) -> "Classifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
