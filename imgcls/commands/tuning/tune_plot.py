"""tune.py's pictures (matplotlib, no display): loss vs wall time per batch size, and the LR range test."""
from __future__ import annotations

import logging
from typing import Optional


def _pyplot():
    # its first use builds a font cache and says so at INFO ("generated new fontManager"), which tune.py's
    # INFO-level output would show
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(results: list[dict], target: Optional[float], path: str, equal_time: Optional[float] = None) -> None:
    """One line per batch size: smoothed training loss against wall time; the target as a dashed line, the
    wall time at which the verdict compares the losses as a dotted one."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for r in results:
        curve = r["curve"]
        if curve is None or not curve.losses:
            continue
        label = f"batch {r['size']}" + (f" ({r['how']})" if r["how"] != "as is" else "")
        ax.plot(curve.seconds, curve.losses, marker=".", label=label)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3g}")
    if equal_time:
        ax.axvline(equal_time, color="black", linestyle=":", linewidth=1,
                   label=f"losses compared at {equal_time:.1f} s")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("smoothed training loss")
    ax.set_title("batch-size sweep: loss vs wall time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_lr_range(doc: dict, path: str) -> None:
    """Smoothed loss against LR (log scale), the steepest descent, the minimum, the divergence point and the
    suggestion marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    ax.plot(doc["lrs"], doc["smoothed_loss"], label="smoothed loss")
    ax.set_xscale("log")
    for key, colour, name in (("steepest_index", "tab:green", "steepest descent"),
                              ("minimum_index", "tab:orange", "lowest loss"),
                              ("divergence_index", "tab:red", "divergence"),
                              ("rise_index", "tab:purple", "rose back (half the fall undone)")):
        i = doc.get(key)
        if i is not None:
            ax.plot([doc["lrs"][i]], [doc["smoothed_loss"][i]], "o", color=colour,
                    label=f"{name}: LR {doc['lrs'][i]:.3g}")
    if doc.get("suggested_lr") is not None:
        ax.axvline(doc["suggested_lr"], color="tab:blue", linestyle="--", linewidth=1,
                   label=f"suggested: LR {doc['suggested_lr']:.3g} ({doc['confidence']} confidence)")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("smoothed training loss")
    ax.set_title(f"LR range test at effective batch {doc['effective_batch']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
