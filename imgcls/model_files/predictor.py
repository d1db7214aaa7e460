"""The trust options of infer.py and serve.py: the reject option (`--reject`, `--reject-below X`) and Grad-CAM explanations
(`--explain DIR`), kept apart from the prediction pass; the scoring itself is evaluation's.

Rows gain `predicted` (the would-be label, also for kept images), `score` (the reject score) and, with
--explain, `explain` (JSON) / `explain_peak` and `explain_overlay` (CSV); a rejected image's `label` is
`unknown`.

`Predictor`: one model file (a checkpoint or an export) to result rows, for infer.py, serve.py and
eval.py alike. It opens the file, sets up the runtime (device, precision, the recorded thread count),
builds the model (BatchNorm folded and channels_last for infer.py and serve.py, unfolded where the reject
score reads the stages; as trained for eval.py, which reproduces training's validation to the last digit),
and runs padded fixed-shape batches through it:
the task's probabilities (calibrated by the stored temperature), the reject scores, the task's rows."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from imgcls.compute.device import DeviceInput, Runtime, build_runtime, inference_amp, select_device
from imgcls.core.errors import ConfigError
from imgcls.data.transforms import EvalTransform
from imgcls.evaluation.evaluate import check_finite_outputs, predict
from imgcls.evaluation.rejection import LOGITS_METHOD, LayerTap, Rejector, has_modules, rejector_from_record
from imgcls.evaluation.trust import usable_rejector
from imgcls.model_files.formats import FORMATS
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.model_file import ModelFile
from imgcls.models.factory import fold_batchnorm
from imgcls.models.feature_tap import FeatureTap, classifier_name
from imgcls.tasks.base import Predictions, Task
from imgcls.tasks.rows import EXPLAIN_COLUMNS, applied_thresholds, reject_rows

log = logging.getLogger(__name__)


REJECT_COLUMNS = ["predicted", "score"]


EXPLAIN_BATCH = 16


OVERLAY_MAX_SIDE = 1024  # an overlay's longer side, in pixels (the original scaled down to it when larger)


@dataclass
class TrustOptions:
    reject: bool = False
    reject_below: Optional[float] = None
    explain_dir: Optional[str] = None

    @property
    def rejecting(self) -> bool:
        return self.reject or self.reject_below is not None


def extra_columns(options: TrustOptions) -> list[str]:
    return (REJECT_COLUMNS if options.rejecting else []) + (EXPLAIN_COLUMNS if options.explain_dir else [])


def check_trust_options(loaded, options: TrustOptions) -> None:
    """Usage errors (exit 2) before any image is read."""
    if options.explain_dir and loaded.kind != "checkpoint":
        raise ConfigError(f"--explain: Grad-CAM needs the model's layers and gradients, which {loaded.path} "
                          f"({loaded.kind} export) does not have; explain with the checkpoint it was exported from")
    if options.explain_dir and Path(options.explain_dir).exists() and not Path(options.explain_dir).is_dir():
        raise ConfigError(f"--explain {options.explain_dir}: a file is there; name a folder for the overlay PNGs")
    record = loaded.calibration
    if options.reject and options.reject_below is None and (record or {}).get("checkpoint_method"):
        raise ConfigError(f"--reject: {loaded.path} ({loaded.kind} export) computes no {record['checkpoint_method']} "
                          f"score, which its checkpoint rejects by, only the {LOGITS_METHOD} score of its logits; "
                          f"export it again with --format onnx (which carries the checkpoint's score), use the "
                          f"checkpoint, or reject by {LOGITS_METHOD} explicitly with --reject-below X")
    if options.reject and options.reject_below is None and not (record and record.get("thresholds")):
        raise ConfigError(f"--reject: {loaded.path} stores no reject threshold (train.py stores one in best.pt "
                          f"after training; last.pt and older files have none); pass --reject-below X "
                          f"({LOGITS_METHOD} score: logsumexp of the logits) or use best.pt")


def build_rejector(loaded, options: TrustOptions, model_has_features: bool,
                   model_has_layers: bool = True) -> Optional[Rejector]:
    """The reject scorer: the stored method where its inputs can be had (an export has logits only: energy),
    with `--reject-below` replacing the threshold."""
    if not options.rejecting:
        return None
    record = loaded.calibration
    if record and record.get("score_output"):  # an export that computes the checkpoint's score itself
        rejector = rejector_from_record(record)
    elif record and record.get("thresholds"):
        rejector = usable_rejector(record, model_has_features, have_layers=model_has_layers)
        if rejector.method != record["method"]:
            log.info("--reject: %s gives no penultimate features; using the %s score (threshold %.4g)",
                     loaded.path, rejector.method, rejector.threshold)
    else:
        rejector = Rejector(LOGITS_METHOD, 0.0)
    if options.reject_below is not None:
        rejector.threshold = float(options.reject_below)
    return rejector


class ScoreRecorder:
    """`predict(on_logits=...)`'s receiver: the reject score of every real row, in input order."""

    def __init__(self, model: torch.nn.Module, rejector: Rejector, head_name: Optional[str] = None):
        self.rejector = rejector
        # an export that computes the score itself (model_file.ScoredFunctionModel): its scores, no taps
        self.scored_model = model if getattr(model, "reject_method", None) == rejector.method else None
        tapped = self.scored_model is None
        self.tap = FeatureTap(model, head_name) if rejector.needs_features and tapped else None
        self.layer_tap = LayerTap(model, rejector.layer_names) if rejector.needs_layers and tapped else None
        self.scores: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, n: int) -> None:
        if self.scored_model is not None:
            self.scores.append(self.scored_model.take_reject_score()[:n].float().cpu())
            return
        features = self.tap.take() if self.tap is not None else None
        features = features[:n].float() if features is not None else None
        layers = self.layer_tap.take() if self.layer_tap is not None else None
        layers = [x[:n] for x in layers] if layers is not None else None
        self.scores.append(self.rejector.scores(logits[:n].float(), features, layers).cpu())

    def all_scores(self) -> torch.Tensor:
        return torch.cat(self.scores) if self.scores else torch.zeros(0)

    def clear(self) -> None:
        """Forget the scores so far (serve.py scores one batch at a time)."""
        self.scores.clear()

    def close(self) -> None:
        for tap in (self.tap, self.layer_tap):
            if tap is not None:
                tap.close()


def apply_reject(rows: list[dict], scores: torch.Tensor, rejector: Rejector) -> int:
    """The reject option on the rows (tasks.rows.reject_rows, the slim server's too): `predicted`
    and `score` on every classified row, `label` = unknown below the threshold; returns how many."""
    return reject_rows(rows, scores.numpy(), rejector.threshold)


def explain_items(rows: list[dict], classes: list[str], task) -> list[tuple[int, int]]:
    """(row position, class index) of every overlay to draw: the classes `task.explained_labels` names in each
    classified row (the predicted class, the would-be label of a rejected one; a multi-label row's called tags)."""
    items = []
    for i, row in enumerate(rows):
        if row.get("error") is not None:
            continue
        items += [(i, classes.index(name)) for name in task.explained_labels(row)]
    return items


def overlay_name(position: int, path: str, tag: Optional[str]) -> str:
    """`00007_stem.png`, or `00007_stem.tag.png` for one of several tags (the tag's unsafe characters as _):
    the position keeps two inputs of one name apart; the folder holds no input (core.files)."""
    stem = Path(path).stem
    if tag is None:
        return f"{position:05d}_{stem}.png"
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in tag)
    return f"{position:05d}_{stem}.{safe}.png"


def display_size(width: int, height: int, max_side: int = OVERLAY_MAX_SIDE) -> tuple[int, int, float]:
    """(width, height, factor) of the overlay: the original scaled down so its longer side is at most
    `max_side` (a 9000 px photo made a 142 MB overlay and gigabytes of float canvases)."""
    factor = min(1.0, max_side / max(width, height))
    return max(1, round(width * factor)), max(1, round(height * factor)), factor


def overlay_base(path: str, d) -> tuple:
    """(width, height, display width, display height, factor, shown pixels) of the image an overlay is drawn
    on: the file as 8-bit RGB, or for data.channels other than 3 its first band stretched between its extremes."""
    from PIL import Image

    from imgcls.data.images import first_band_view, load_rgb, open_image, oriented_size
    from imgcls.data.transforms import read_band_array, reads_bands

    if reads_bands(d.channels, d.value_range):
        image = first_band_view(read_band_array(path, d.channels, d.value_range))
        width, height = image.size
        dw, dh, factor = display_size(width, height)
    else:
        with open_image(path) as header:  # the size from the header; a JPEG decodes at the
            width, height = oriented_size(header)  # overlay's size (draft), not at 9000 px
        dw, dh, factor = display_size(width, height)
        image = load_rgb(path, min_size=(dw, dh))
    shown = np.asarray(image if image.size == (dw, dh) else image.resize((dw, dh), Image.Resampling.BOX))
    return width, height, dw, dh, factor, shown


def explain_rows(loaded, paths: list[str], rows: list[dict], classes: list[str], out_dir: str) -> None:
    """Grad-CAM for each class the model's task explains in a classified row (the predicted class; each of a
    multi-label row's called tags, the overlay named by the tag): an overlay PNG in `out_dir` (longer side at most OVERLAY_MAX_SIDE) and
    `explain` = [{"label", "peak": [x, y], "peak_informative", "overlay", "layer"}], peak in the original's
    pixels, `layer` the one Grad-CAM read (`evaluation.explain.target_layer`: fine enough for the input size).
    A flat heatmap (a feature map of one cell, as at 32 px) has no peak: `peak_informative` is false and
    the peak is the crop's first pixel, which means nothing."""
    from imgcls.data.transforms import normalize_batch
    from imgcls.evaluation.explain import (Explainer, crop_geometry, heatmap_on_original, heatmap_peak, to_original,
                                           write_overlay)
    model = loaded.build_model(torch.device("cpu"), channels_last=False)
    transform = loaded.eval_transform()
    explainer = Explainer(model, transform.img_size)
    log.info("--explain: Grad-CAM on layer %s at %d px", explainer.describe(), transform.img_size)
    d = loaded.cfg.data
    items = explain_items(rows, classes, loaded.task)
    several = loaded.task.explains_each_label
    out = Path(out_dir)
    flat = 0
    try:
        for start in range(0, len(items), EXPLAIN_BATCH):
            chunk = items[start:start + EXPLAIN_BATCH]
            batch = normalize_batch(torch.stack([transform(paths[i]) for i, _ in chunk]), d.mean, d.std)
            cams = explainer.heatmaps(batch, [c for _, c in chunk])
            for (i, c), cam in zip(chunk, cams):
                width, height, dw, dh, factor, shown = overlay_base(paths[i], d)
                geometry = crop_geometry(width, height, transform.resize_to, transform.img_size)
                informative = bool(cam.max() - cam.min() > 1e-6)
                flat += not informative
                peak = to_original(*heatmap_peak(cam), geometry, width, height)
                left, top, sx, sy = geometry
                heat = heatmap_on_original(cam, (left, top, sx / factor, sy / factor), dw, dh)
                overlay = out / overlay_name(i, paths[i], classes[c] if several else None)
                write_overlay(shown, heat, overlay, [round(peak[0] * factor), round(peak[1] * factor)]
                              if informative else None)
                rows[i].setdefault("explain", []).append({"label": classes[c], "peak": peak,
                                                          "peak_informative": informative, "overlay": str(overlay),
                                                          "layer": explainer.layer_name})
        for row in rows:
            if row.get("explain"):
                row["explain_peak"] = " | ".join(f"{e['peak'][0]} {e['peak'][1]}" for e in row["explain"])
                row["explain_overlay"] = " | ".join(e["overlay"] for e in row["explain"])
    finally:
        explainer.close()
    if flat:
        log.warning("--explain: %d of %d heatmap(s) are flat (the read layer's feature map has one cell at "
                    "this input size, or the class gets no gradient): their peak carries no information "
                    "(peak_informative false)", flat, len(items))


@dataclass
class Predictor:
    model_file: ModelFile
    runtime: Runtime
    model: torch.nn.Module
    device_input: DeviceInput
    transform: EvalTransform
    topk: int
    thresholds: list[float]                    # a multi-label model's tag thresholds (--threshold or tuned)
    temperature: Optional[float] = None        # the calibration stored with the model (rows' `prob`)
    rejector: Optional[Rejector] = None        # --reject / --reject-below
    scores: Optional[ScoreRecorder] = None     # the reject scores of the pass being run

    @classmethod
    def open(cls, path, device_setting: Optional[str] = "auto", amp: Optional[str] = None, topk: int = 5,
             trust: Optional[TrustOptions] = None, threshold: Optional[float] = None,
             classes_file: Optional[str] = None, overrides: list[str] = (), for_serving: bool = True,
             channels_last: Optional[bool] = None, compile_model: bool = False) -> "Predictor":
        """Open `path` and set up. `for_serving`: BatchNorm folded into the convolutions and channels_last
        (infer.py, serve.py); else the model as trained, in the training's memory format (eval.py).
        `device_setting` None: the config's train.device and train.amp as they are (eval.py)."""
        return cls.from_model_file(load_model_file(path, overrides, classes_file), device_setting, amp, topk, trust,
                                   threshold, for_serving, channels_last, compile_model)

    @classmethod
    def from_model_file(cls, loaded: ModelFile, device_setting: Optional[str] = "auto", amp: Optional[str] = None,
                        topk: int = 5, trust: Optional[TrustOptions] = None, threshold: Optional[float] = None,
                        for_serving: bool = True, channels_last: Optional[bool] = None,
                        compile_model: bool = False) -> "Predictor":
        task = loaded.task
        if loaded.kind != "checkpoint":
            log.info("%s: %s", loaded.path, FORMATS[loaded.kind].description)
        trust = trust or TrustOptions()
        if threshold is not None:
            task.check_supported("--threshold")
            if not 0.0 <= threshold <= 1.0:
                raise ConfigError(f"--threshold {threshold}: must be a probability in [0, 1]")
        if trust.rejecting:
            task.check_supported("--reject")
        if trust.explain_dir:
            task.check_supported("--explain")
        check_trust_options(loaded, trust)
        if compile_model and loaded.fp32_only:
            raise ConfigError(f"--compile: {FORMATS[loaded.kind].description} runs in its own runtime, not in torch; "
                              f"drop --compile")
        runtime = prediction_runtime(loaded, device_setting, amp)
        device = runtime.device
        if channels_last is None:
            channels_last = True if for_serving else loaded.cfg.train.channels_last
        model = loaded.build_model(device, channels_last=channels_last)
        head_name = classifier_name(model)  # the penultimate features' tap, found before folding renames nothing
        stages = (loaded.calibration or {}).get("layer_names") or []
        rejector = build_rejector(loaded, trust, head_name is not None, has_modules(model, stages))
        if for_serving and rejector is not None and rejector.needs_layers and loaded.kind == "checkpoint":
            # folding traces the stages into one graph, where their outputs cannot be tapped
            log.info("--reject: BatchNorm left unfolded (the %s score reads the model's stages)", rejector.method)
        elif for_serving:
            model = folded(model)
        # the recorder's feature tap goes on before compiling
        scores = ScoreRecorder(model, rejector, head_name) if rejector is not None else None
        if compile_model:
            model = torch.compile(model, dynamic=False)
        device_input = DeviceInput.from_config(loaded.cfg, device, runtime.amp_dtype, channels_last=channels_last)
        return cls(loaded, runtime, model, device_input, loaded.eval_transform(), min(topk, len(loaded.classes)),
                   applied_thresholds(loaded.thresholds, threshold, len(loaded.classes)),
                   (loaded.calibration or {}).get("temperature"), rejector, scores)

    @property
    def task(self) -> Task:
        return self.model_file.task

    @property
    def classes(self) -> list[str]:
        return self.model_file.classes

    @property
    def delimiter(self) -> str:
        return self.model_file.cfg.data.label_delimiter

    def close(self) -> None:
        if self.scores is not None:
            self.scores.close()

    # ---------------------------------------------------------------- the pass

    def predict(self, batches, on_logits: Optional[Callable] = None) -> Predictions:
        """The padded pass over `batches` (images, valid, indices, errors) in input order: the task's
        calibrated probabilities, what a row needs of them, and the reject scores where they are on;
        `on_logits(logits, n)` also gets each batch's logits."""
        receivers = [r for r in (self.scores, on_logits) if r is not None]
        if self.scores is not None:
            self.scores.clear()

        def each_batch(logits, n):
            for receiver in receivers:
                receiver(logits, n)

        return predict(self.model, batches, self.device_input, self.topk, self.temperature,
                       each_batch if receivers else None, self.task)

    def rows(self, names: list, preds: Predictions) -> list[dict]:
        """The task's rows for a pass, with the reject option applied where it is on."""
        check_finite_outputs(preds.nonfinite, int(preds.valid.sum()), self.model_file.path)
        rows = self.task.rows(names, preds, self.classes, self.thresholds, self.delimiter)
        if self.rejector is not None:
            rejected = apply_reject(rows, self.scores.all_scores(), self.rejector)
            log.debug("rejected %d row(s)", rejected)
        return rows

    def predict_rows(self, batches, names: list) -> list[dict]:
        return self.rows(names, self.predict(batches))

    def predict_images(self, images: list[torch.Tensor], names: list, batch_shape: Optional[int] = None) -> list[dict]:
        """Rows for decoded images (uint8 [3, S, S]) run as one batch, padded with zero images to
        `batch_shape` rows (serve.py's fixed shapes)."""
        n = len(images)
        batch = torch.stack(images)
        pad = (batch_shape or n) - n
        if pad > 0:
            batch = torch.cat([batch, batch.new_zeros((pad, *batch.shape[1:]))])
        return self.predict_rows([(batch, torch.ones(n, dtype=torch.bool), torch.arange(n), [""] * n)], names)


def folded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its BatchNorm folded into the preceding convolutions, channels_last."""
    model, count = fold_batchnorm(model)
    if count:
        model = model.to(memory_format=torch.channels_last)  # the folded weights are new tensors
        log.info("folded %d BatchNorm layers into the preceding convolutions", count)
    return model


def prediction_runtime(loaded: ModelFile, device_setting: Optional[str], amp: Optional[str]) -> Runtime:
    """The runtime eval.py sets up, on `--device`, at `--amp` (else the checkpoint's train.amp resolved for
    this device; an ONNX model always runs in fp32), with the checkpoint's thread count. cudnn autotuning
    pays here: padded batches have one input shape, tuned once."""
    try:
        if loaded.fp32_only and amp not in (None, "none", "auto"):
            log.warning("--amp %s: %s runs its fp32 graph in its own runtime; running in fp32", amp,
                        FORMATS[loaded.kind].description)
        # no --amp: the checkpoint's precision, as this machine runs it (fp16 from a GPU, bf16 where emulated)
        setting = amp or inference_amp(loaded.cfg.train.amp, select_device(device_setting or loaded.cfg.train.device))
        return build_runtime(loaded.cfg, saved_threads=loaded.threads, training=False, device_setting=device_setting,
                             amp_setting=setting, fp32_only=loaded.fp32_only)
    except ConfigError as err:
        raise ConfigError(f"--device {device_setting or loaded.cfg.train.device} / --amp {amp or 'from the checkpoint'}: {err}") from err
