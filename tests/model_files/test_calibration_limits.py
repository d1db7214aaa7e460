"""Calibration at its limits (issue 34): a fit that ends at a bound, a split with no errors or too few images
is said in the record, the log and eval.py's output, and the temperature never sharpens the softmax without
errors to calibrate against."""
from __future__ import annotations

import logging

import torch

from commands.report import format_trust_line
from evaluation.calibration import (MAX_TEMPERATURE, MIN_CALIBRATION_ERRORS, MIN_TEMPERATURE,
                                           calibrated_temperature, fit_temperature)
from evaluation.split_outputs import SplitOutputs
from evaluation.trust import build_record, export_record, trust_metrics


def all_right_split(n=300, classes=4, seed=0):
    """Every sample right, with a clear but finite margin: the NLL keeps falling as T -> 0."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    logits = torch.randn(n, classes, generator=g) * 0.3
    logits[torch.arange(n), labels] += 2.0
    return logits, labels


def test_a_split_without_errors_keeps_the_plain_softmax():
    logits, labels = all_right_split()
    assert fit_temperature(logits, labels) == MIN_TEMPERATURE          # the raw fit runs to the bound
    fit = calibrated_temperature(logits, labels)
    assert fit.temperature == 1.0 and fit.fitted == MIN_TEMPERATURE and fit.errors == 0
    assert any("lower bound" in n for n in fit.notes)
    assert any("0 error(s)" in n and "kept at 1.0" in n for n in fit.notes)


def test_a_split_with_enough_errors_may_sharpen():
    """An under-confident model (logits shrunk 4x) with plenty of errors: T < 1 is fitted and kept."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2000, 5, generator=g) * 1.5
    labels = torch.multinomial(base.softmax(1), 1, generator=g).squeeze(1)
    fit = calibrated_temperature(base / 4.0, labels)
    assert fit.errors >= MIN_CALIBRATION_ERRORS and 0.15 < fit.temperature < 0.4
    assert fit.temperature == fit.fitted and fit.notes == []


def test_few_errors_do_not_sharpen_and_the_upper_bound_is_said():
    logits, labels = all_right_split(n=40)
    labels[:2] = (logits[:2].argmax(1) + 1) % 4                          # two errors, 40 images
    fit = calibrated_temperature(logits, labels)
    assert fit.errors == 2 and fit.temperature >= 1.0
    assert any("only 40 validation images" in n for n in fit.notes)
    noise = torch.randn(500, 4, generator=torch.Generator().manual_seed(2)) * 50   # confident, random labels
    random_labels = torch.randint(0, 4, (500,), generator=torch.Generator().manual_seed(3))
    fit = calibrated_temperature(noise, random_labels)
    assert fit.temperature == MAX_TEMPERATURE and any("upper bound" in n for n in fit.notes)


def test_the_notes_reach_the_record_the_export_and_eval_output(caplog):
    from training_run.calibrate import log_record

    logits, labels = all_right_split()
    val = SplitOutputs(logits, labels, torch.arange(len(labels)), None)
    record = build_record(val, None, "auto", 0.95, seed=0)
    assert record["temperature"] == 1.0 and len(record["temperature_notes"]) == 2
    assert export_record(record)["temperature_notes"] == record["temperature_notes"]
    with caplog.at_level(logging.WARNING):
        log_record(record, val)
    assert "calibration: the validation split has 0 error(s)" in caplog.text
    trust = trust_metrics(val, record)
    assert trust["calibration_notes"] == record["temperature_notes"]
    line = format_trust_line(trust)
    assert line.count("calibration warning:") == 2 and "lower bound" in line
    assert build_record(val, None, 2.5, 0.95, seed=0)["temperature_notes"] == []
