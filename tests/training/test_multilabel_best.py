"""A multi-label validation split where no image carries a tag: mAP is undefined (not 0), and best.pt, early
stopping and the plateau schedule go by the loss instead of freezing at the first epoch."""
from __future__ import annotations

import torch

from imgcls.tasks import deciding_metric, get_task
from imgcls.tasks.metrics import multilabel_metrics
from imgcls.training.state import TrainState


def test_map_of_a_split_without_any_tag_is_undefined_and_prints_so():
    scores = torch.rand(6, 3, generator=torch.Generator().manual_seed(0))
    metrics = multilabel_metrics(scores, torch.zeros(6, 3), ["a", "b", "c"], loss_sum=1.2)
    assert metrics["mAP"] is None and metrics["num_samples"] == 6
    assert "val mAP undefined" in get_task("multilabel").epoch_text(metrics, 5)
    assert deciding_metric(metrics, "mAP") == "loss"
    assert deciding_metric({"mAP": 40.0, "loss": 1.0}, "mAP") == "mAP"


def test_best_follows_the_loss_when_the_map_is_undefined():
    state = TrainState()
    losses = [0.9, 0.5, 0.7, 0.4]
    improved = [state.record_validation(epoch, {"mAP": None, "loss": loss, "num_samples": 8}, "mAP", 0.0, None)
                for epoch, loss in enumerate(losses)]
    assert improved == [True, True, False, True]
    assert state.best_epoch == 4 and state.best_metrics["loss"] == 0.4 and state.best_metrics["mAP"] is None
