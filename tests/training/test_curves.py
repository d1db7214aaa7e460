"""curves.png (issue 34): loss, LR and validation metrics per epoch, redrawn atomically at epoch ends, at a
bounded share of the run's time, and at the run's end."""
from __future__ import annotations

import math

import pytest
from conftest import run_script, tiny_overrides
from PIL import Image

import imgcls.training.runlog as curves
from imgcls.training.runlog import (CURVES_FILE, CurvesPicture, draw_curves, log_ticks, nice_ticks, read_columns,
                                    write_curves)

HEADER = "epoch,step,lr,train_loss,val_top1,val_top5,val_loss,val_mean_class_acc\n"


def test_curves_are_drawn_from_metrics_csv(tmp_path):
    (tmp_path / "metrics.csv").write_text(HEADER + "1,10,0.1,2.0,40,80,1.5,40\n2,20,0.05,1.2,,,,\n"
                                          "3,30,0.01,0.8,75,95,0.7,74\n")
    columns = read_columns(tmp_path / "metrics.csv")
    assert columns["epoch"] == [1, 2, 3] and columns["val_top1"][0] == 40
    write_curves(tmp_path, enabled=False)
    assert not (tmp_path / CURVES_FILE).exists()
    write_curves(tmp_path, enabled=True)
    image = Image.open(tmp_path / CURVES_FILE)
    assert image.format == "PNG" and image.size == (960, 288)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []   # written through a rename
    # the three panels are not blank: the picture holds plotted colours, not just white and grey
    colours = image.convert("RGB").getcolors(1 << 20)
    assert len(colours) > 20


def test_axis_ticks_are_round_values_inside_the_range():
    assert nice_ticks(0.0, 8.8, 6) == [0, 2, 4, 6, 8]
    assert nice_ticks(-0.4, 8.8, 6) == [0, 2, 4, 6, 8]
    assert nice_ticks(10.0, 100.0, 6) == [20, 40, 60, 80, 100]
    assert nice_ticks(1, 1) == [1]
    assert log_ticks(-6.2, -0.9) == [-6, -5, -4, -3, -2, -1]        # 1e-6 ... 0.1: the powers of ten
    assert [round(10 ** t, 6) for t in log_ticks(-2.05, -0.95)] == [0.01, 0.02, 0.05, 0.1]  # few: 2x, 5x too


def test_curves_draw_any_run_length_and_columns_with_gaps(tmp_path):
    one = {"epoch": [1.0], "lr": [0.0], "train_loss": [2.0], "val_loss": [math.nan]}
    draw_curves(one, tmp_path / "one.png")
    long = {"epoch": [float(e) for e in range(1, 301)], "lr": [0.1 * 0.99 ** e for e in range(300)],
            "train_loss": [1 / e for e in range(1, 301)],
            "val_top1": [math.nan if e % 2 else 50 + e / 10 for e in range(300)]}
    draw_curves(long, tmp_path / "long.png")
    draw_curves({}, tmp_path / "empty.png")
    for name in ("one.png", "long.png", "empty.png"):
        assert Image.open(tmp_path / name).size == (960, 288)


def colour_pixels(image, colour: str, left: int, right: int) -> int:
    rgb = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
    pixels = image.convert("RGB").load()
    return sum(pixels[x, y] == rgb for x in range(left, right) for y in range(image.size[1]))


def test_mean_class_accuracy_over_top1_leaves_top1_visible(tmp_path):
    """Issue 51: on a balanced split mean class accuracy equals top-1 and was drawn exactly over it."""
    columns = {"epoch": [1.0, 2.0, 3.0, 4.0], "lr": [0.1] * 4, "train_loss": [2.0, 1.5, 1.2, 1.0],
               "val_top1": [40.0, 55.0, 70.0, 80.0], "val_top5": [80.0, 90.0, 95.0, 97.0],
               "val_mean_class_acc": [40.0, 55.0, 70.0, 80.0]}
    image = Image.open(draw_curves(columns, tmp_path / "c.png"))
    top1, mean_class = curves.COLOURS[0], curves.COLOURS[2]
    assert colour_pixels(image, top1, 640, 960) > 150          # the line, not only its legend swatch (32 px)
    assert colour_pixels(image, mean_class, 640, 960) > 150
    labels = [line[0] for line in curves.mark_coinciding([("top1", columns["val_top1"], top1),
                                                          ("mean_class_acc", columns["val_mean_class_acc"], mean_class)])]
    assert labels == ["top1", "mean_class_acc (= top1, dashed)"]


def red_pixels(image, left: int, right: int) -> int:
    """The note's (anti-aliased) text: clearly red, which nothing else in the LR panel is."""
    pixels = image.convert("RGB").load()
    return sum(r - g > 80 and r - b > 60 for x in range(left, right) for y in range(image.size[1])
               for r, g, b in [pixels[x, y]])


def test_a_warmup_longer_than_the_run_is_said_in_the_lr_panel(tmp_path):
    (tmp_path / "metrics.csv").write_text(HEADER + "1,10,0.02,2.0,40,80,1.5,41\n2,20,0.04,1.2,60,90,1.1,62\n")
    (tmp_path / "config.yaml").write_text("train: {epochs: 2}\nschedule: {warmup_epochs: 5.0}\n")
    write_curves(tmp_path, enabled=True)
    note = curves.warmup_note(tmp_path, read_columns(tmp_path / "metrics.csv"))
    assert note == "warmup 5 ep >= run's 2 ep: no peak LR"
    assert red_pixels(Image.open(tmp_path / CURVES_FILE), 320, 640) > 50
    (tmp_path / "config.yaml").write_text("train: {epochs: 2}\nschedule: {warmup_epochs: 1.0}\n")
    write_curves(tmp_path, enabled=True)
    assert curves.warmup_note(tmp_path, read_columns(tmp_path / "metrics.csv")) is None
    assert red_pixels(Image.open(tmp_path / CURVES_FILE), 320, 640) == 0


@pytest.mark.slow
def test_a_run_leaves_its_curves(tmp_path, tiny_tree):
    run_dir = tmp_path / "run"
    result = run_script("train.py", "--config", "base", *tiny_overrides(tiny_tree, run_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    assert Image.open(run_dir / CURVES_FILE).format == "PNG"
    assert "could not draw" not in result.stderr


def test_redraws_keep_under_their_share_of_the_run_and_the_end_draws_what_is_left(tmp_path, monkeypatch):
    now, drawn = [0.0], []

    def draw(run_dir, enabled):  # a draw that takes 0.5 s on the fake clock
        drawn.append(now[0])
        now[0] += 0.5

    monkeypatch.setattr(curves, "write_curves", draw)
    monkeypatch.setattr(curves, "FIRST_DRAW_S", 0.8)     # a first draw taken to cost 0.8 s
    picture = CurvesPicture(tmp_path, True, clock=lambda: now[0])
    picture.finish()
    assert drawn == []                                   # nothing to draw before an epoch ends
    for _ in range(7):                                   # 6 s epochs: none drawn before 0.8 s / COST_SHARE
        now[0] += 6
        picture.epoch_end()
    assert drawn == [42.0]                               # then 0.5 s / COST_SHARE = 25 s between draws
    for _ in range(5):
        now[0] += 6
        picture.epoch_end()
    assert drawn == [42.0, 72.5]
    now[0] += 6
    picture.epoch_end()
    now[0] += 1
    picture.finish()
    assert drawn == [42.0, 72.5, 80.0]                   # the last epoch is drawn at the end
    picture.finish()
    assert len(drawn) == 3                               # and only once
    now[0] += 60                                         # a long epoch: drawn at its end
    picture.epoch_end()
    assert drawn[-1] == 140.5
    short = CurvesPicture(tmp_path, True, clock=lambda: now[0])
    drawn.clear()
    for _ in range(6):                                   # a 36 s run: one draw, at its end
        now[0] += 6
        short.epoch_end()
    short.finish()
    assert len(drawn) == 1
