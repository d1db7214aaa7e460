"""`Predictor`: one model file (a checkpoint or an export) to result rows, for infer.py, serve.py and
eval.py alike. It opens the file, sets up the runtime (device, precision, the recorded thread count),
builds the model (BatchNorm folded and channels_last for infer.py and serve.py, unfolded where the reject
score reads the stages; as trained for eval.py, which reproduces training's validation to the last digit),
and runs padded fixed-shape batches through it:
the task's probabilities (calibrated by the stored temperature), the reject scores, the task's rows.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from imgcls.core.errors import ConfigError
from imgcls.data.transforms import EvalTransform
from imgcls.evaluation.evaluate import check_finite_outputs, predict
from imgcls.evaluation.rejection import Rejector, has_modules
from imgcls.model_files.formats import FORMATS
from imgcls.model_files.model_file import ModelFile
from imgcls.model_files.loading import load_model_file
from imgcls.prediction.trust import ScoreRecorder, TrustOptions, apply_reject, build_rejector, check_trust_options
from imgcls.runtime.device import DeviceInput, inference_amp, select_device
from imgcls.runtime.runtime import Runtime, build_runtime
from imgcls.models.factory import fold_batchnorm
from imgcls.models.feature_tap import classifier_name
from imgcls.tasks.base import Predictions, Task
from imgcls.tasks.multi_label_rows import applied_thresholds

log = logging.getLogger(__name__)


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
        if for_serving and rejector is not None and rejector.needs_layers:
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
