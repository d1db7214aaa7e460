"""eval.py --reliability: the reliability diagram (matplotlib, no display)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def draw_reliability(bins: list[dict], path: str | Path, ece: float, ece_uncalibrated: float,
                     temperature: Optional[float]) -> Path:
    """Accuracy against mean confidence per confidence bin (bars; the diagonal is perfect calibration),
    with each bin's share of the samples beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = bins[0]["high"] - bins[0]["low"]
    total = max(1, sum(b["count"] for b in bins))
    shares = [b["count"] / total for b in bins]
    bins = [b for b in bins if b["count"]]  # empty bins draw nothing
    centres = [(b["low"] + b["high"]) / 2 for b in bins]
    accuracy = [b["accuracy"] for b in bins]
    confidence = [b["confidence"] for b in bins]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5.5, 6.5), dpi=100, height_ratios=[3, 1], sharex=True)
    top.bar(centres, accuracy, width=width * 0.95, color="#4c72b0", edgecolor="black", label="accuracy")
    top.bar(centres, [c - a for c, a in zip(confidence, accuracy)], bottom=accuracy, width=width * 0.95,
            color="#dd8452", alpha=0.5, edgecolor="#dd8452", label="gap to mean confidence")
    top.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    t = "none" if temperature is None else f"{temperature:.3f}"
    top.set_title(f"reliability diagram: ECE {ece:.2f}% (uncalibrated {ece_uncalibrated:.2f}%)\n"
                  f"temperature {t}", fontsize=10)
    top.set_ylabel("accuracy")
    top.set_ylim(0, 1)
    top.legend(loc="upper left", fontsize=8)
    bottom.bar([width * (i + 0.5) for i in range(len(shares))], shares, width=width * 0.95, color="gray")
    bottom.set_xlabel("confidence (top-1 probability)")
    bottom.set_ylabel("share of samples")
    bottom.set_xlim(0, 1)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
