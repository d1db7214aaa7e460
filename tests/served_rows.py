"""Comparing serve.py's rows from two paths (torch and ONNX-only): labels identical and probabilities within a
tolerance, except that labels whose probabilities are tied (an int8 model's discrete outputs tie often) may
come in either order: torch.topk leaves the order of ties unspecified."""
from __future__ import annotations

import numpy as np
import pytest


def top_labels(row: dict) -> list[tuple[str, float]]:
    k = sum(1 for key in row if key.startswith("top") and key.endswith("_label"))
    return [(row[f"top{j}_label"], row[f"top{j}_prob"]) for j in range(1, k + 1)]


def assert_same_ranking(got: list[tuple[str, float]], want: list[tuple[str, float]], tolerance: float) -> None:
    """The same probabilities position by position; a different label only where the other path's label at
    that position is tied with it (or with a tie running past the k-th label)."""
    assert len(got) == len(want)
    wanted = dict(want)
    for j, ((label, prob), (want_label, want_prob)) in enumerate(zip(got, want)):
        assert prob == pytest.approx(want_prob, abs=tolerance), (j, got, want)
        if label != want_label:
            tie_prob = wanted[label] if label in wanted else want[-1][1]
            assert abs(tie_prob - want_prob) <= tolerance, (j, got, want)


def assert_same_rows(got_rows: list[dict], want_rows: list[dict], tolerance: float) -> None:
    assert len(got_rows) == len(want_rows)
    for got, want in zip(got_rows, want_rows):
        assert set(got) == set(want), (got, want)
        ranking = top_labels(want)
        if ranking:
            assert_same_ranking(top_labels(got), ranking, tolerance)
        for key, value in want.items():
            if key.startswith("top"):
                continue
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, abs=tolerance), (key, got, want)
            elif isinstance(value, dict):
                assert list(got[key]) == list(value)
                assert np.allclose(list(got[key].values()), list(value.values()), atol=tolerance, rtol=0)
            elif key in ("label", "predicted") and value == ranking[0][0] and got[key] != value:
                assert got[key] == top_labels(got)[0][0], (key, got, want)  # a tied top-1, checked above
            else:
                assert got[key] == value, (key, got, want)
