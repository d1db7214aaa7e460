"""What eval.py draws and prints beside the task's report (tasks/): the calibration line and the confusion PNG."""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont



def format_trust_line(trust: dict) -> str:
    """Calibration and selective-prediction figures in one line."""
    t = trust["temperature"]
    sel = trust["selective"]
    line = (f"calibration: ECE {trust['ece']:.2f}% (uncalibrated {trust['ece_uncalibrated']:.2f}%), NLL "
            f"{trust['nll']:.4f}, temperature {'none' if t is None else f'{t:.4f}'}")
    if sel["threshold"] is not None:
        line += (f"; selective ({sel['method']} score >= {sel['threshold']:.4g}): coverage {sel['coverage']:.2f}%, "
                 f"accuracy {sel['accuracy']:.2f}%")
    return (line + "".join(f"\ncalibration warning: {note}" for note in trust.get("calibration_notes") or []) +
            "".join(f"\nreject warning: {note}" for note in trust.get("reject_notes") or []))


def confusion_png_path(json_path: str | Path) -> Path:
    json_path = Path(json_path)
    return json_path.with_name(f"{json_path.stem}_confusion.png")


LABEL_GAP = 4   # pixels between a rotated column label and the grid


def draw_confusion(confusion: torch.Tensor, classes: list[str], path: str | Path, max_side: int = 1600) -> Path:
    """Rows are true classes, columns predictions; each cell is shaded by its share of the row (recall),
    blue on the diagonal and red off it, with the count written in it when the cells are large enough."""
    counts = confusion.to(torch.int64)
    n = len(classes)
    cell = max(1, min(48, max_side // max(n, 1)))
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    title = "confusion matrix: rows = true class, columns = predicted class (shade = share of the row)"
    show_labels = cell >= 10
    names = [name[:20] for name in classes]
    label_w = int(max(measure.textlength(name, font=font) for name in names)) + 8 if show_labels else 0
    title_h = 22
    left, top = 8 + label_w, title_h + label_w
    side = n * cell
    width = max(left + side + 8, int(measure.textlength(title, font=font)) + 16)
    img = Image.new("RGB", (width, top + side + 8), "white")
    draw = ImageDraw.Draw(img)
    draw.text((8, 5), title, fill="black", font=font)
    row_totals = counts.sum(dim=1).clamp(min=1).to(torch.float64)
    share = (counts.to(torch.float64) / row_totals[:, None]).tolist()
    values = counts.tolist()
    for i in range(n):
        for j in range(n):
            level = share[i][j]
            shade = int(round(255 * (1 - level)))
            color = (shade, shade, 255) if i == j else (255, shade, shade)
            x0, y0 = left + j * cell, top + i * cell
            draw.rectangle([x0, y0, x0 + cell - 1, y0 + cell - 1], fill=color,
                           outline=(200, 200, 200) if cell >= 4 else None)
            if cell >= 28 and values[i][j]:
                text = str(values[i][j])
                if measure.textlength(text, font=font) <= cell - 4:
                    draw.text((x0 + 3, y0 + cell // 2 - 5), text, fill="white" if level > 0.6 else "black", font=font)
    if show_labels:
        for i, name in enumerate(names):
            draw.text((8, top + i * cell + cell // 2 - 5), name, fill="black", font=font)
            # column labels: drawn on a strip, rotated to read bottom-up, ending LABEL_GAP pixels above the
            # grid (the strip's start becomes its bottom), no wider than a cell so neighbours do not cover it
            high = min(12, cell)
            strip = Image.new("RGB", (label_w, high), "white")
            ImageDraw.Draw(strip).text((LABEL_GAP, 0), name, fill="black", font=font)
            img.paste(strip.rotate(90, expand=True), (left + i * cell + (cell - high) // 2, title_h))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
