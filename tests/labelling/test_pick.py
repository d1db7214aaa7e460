"""`imgcls label pick` on a trained checkpoint: what is left out (and counted), the picks file, its errors;
`label push` / `pull` through files (the real Label Studio: test_label_studio.py)."""
import csv
import json
import shutil

import numpy as np
import pytest
from PIL import Image

from conftest import exit_code


def pick(*argv):
    from imgcls.cli import label

    return exit_code(lambda: label.main(["pick", *argv]))


@pytest.fixture(scope="module")
def pool(finished_run, faults_tree, tmp_path_factory):
    """The training images as a pool, with a broken file, a path holding a comma and a newline, and a copy of a
    labelled image; `labelled.csv` names two training images."""
    root = tmp_path_factory.mktemp("pick")
    pool = root / "pool"
    shutil.copytree(faults_tree / "train", pool)
    (pool / "a" / "broken.png").write_bytes(b"not an image")
    shutil.copy(pool / "b" / "b_0003.png", pool / "b" / "odd, name\nhere.png")
    labelled = root / "labelled.csv"
    labelled.write_text(f"path,label\npool/a/a_0000.png,a\n{faults_tree}/val/c/c_0000.png,c\n")
    shutil.copy(faults_tree / "val" / "c" / "c_0000.png", pool / "c" / "copy_of_labelled.png")
    return root, finished_run / "best.pt"


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_pick_leaves_out_counts_and_writes_the_same_picks_again(pool, capsys):
    root, best = pool
    args = ["--checkpoint", str(best), "--pool", str(root / "pool"), "--budget", "6", "--exclude",
            str(root / "labelled.csv")]
    assert pick(*args, "--output", str(root / "picks.csv")) == 0
    err = capsys.readouterr().err
    assert "left out 1 pool image(s): unreadable" in err
    assert "1 pool image(s): already labelled" in err
    assert "near duplicates of labelled images" in err  # the copy of the labelled val image
    rows = read_rows(root / "picks.csv")
    assert len(rows) == 6 and list(rows[0]) == ["path", "label", "prob", "score", "reason"]
    picked = {r["path"] for r in rows}
    assert not picked & {str(root / "pool" / "a" / "a_0000.png"), str(root / "pool" / "c" / "copy_of_labelled.png"),
                         str(root / "pool" / "a" / "broken.png")}
    assert all(r["label"] in ("a", "b", "c") and 0 < float(r["prob"]) <= 1 for r in rows)
    assert "young model" in rows[0]["reason"]  # 2 labelled images for 3 classes
    assert pick(*args, "--output", str(root / "again.csv")) == 0
    assert (root / "again.csv").read_bytes() == (root / "picks.csv").read_bytes()
    # every image may be picked: the odd name comes back whole through the CSV's quoting
    everything = ["--checkpoint", str(best), "--pool", str(root / "pool"), "--budget", "36", "--strategy", "margin",
                  "--duplicate-similarity", "1.01", "--output", str(root / "all.csv")]
    assert pick(*everything) == 0
    assert str(root / "pool" / "b" / "odd, name\nhere.png") in {r["path"] for r in read_rows(root / "all.csv")}
    # --skip-foreign: noise, which best.pt's reject threshold calls unknown, is left out and counted
    foreign = root / "foreign"
    foreign.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(foreign / "noise.png")
    assert pick("--checkpoint", str(best), "--pool", str(root / "pool"), str(foreign), "--budget", "3",
                "--skip-foreign", "--output", str(root / "known.csv")) == 0
    assert "foreign (reject option)" in capsys.readouterr().err
    assert str(foreign / "noise.png") not in {r["path"] for r in read_rows(root / "known.csv")}


@pytest.mark.slow
def test_pick_refuses_before_writing_anything(pool, capsys):
    root, best = pool
    labelled = root / "labelled.csv"
    before = labelled.read_bytes()
    base = ["--checkpoint", str(best), "--pool", str(root / "pool")]
    assert pick(*base, "--budget", "3", "--exclude", str(labelled), "--output", str(labelled)) == 2
    assert "which this command reads" in capsys.readouterr().err and labelled.read_bytes() == before
    assert pick(*base, "--budget", "1000", "--output", str(root / "x.csv")) == 2
    assert "the pool holds 39 image(s)" in capsys.readouterr().err
    other = root / "other_task.csv"
    other.write_text("path,label\npool/a/a_0001.png,cat\n")
    assert pick(*base, "--budget", "2", "--exclude", str(other), "--output", str(root / "x.csv")) == 2
    assert "cat are not classes of the checkpoint" in capsys.readouterr().err
    assert pick(*base, "--budget", "2", "--output", str(root / "pool" / "picks.csv")) == 2
    bands = root / "five_bands"  # images of another band count than the checkpoint's data.channels: unreadable
    bands.mkdir(exist_ok=True)
    for i in range(2):
        np.save(bands / f"{i}.npy", np.zeros((16, 16, 5), np.uint8))
    assert pick("--checkpoint", str(best), "--pool", str(bands), "--budget", "1", "--output", str(root / "x.csv")) == 2
    assert "none of the 2 pool image(s) could be read" in capsys.readouterr().err
    assert not (root / "x.csv").exists() and not (root / "pool" / "picks.csv").exists()


def test_push_writes_tasks_and_pull_reads_an_export_back(capsys, tmp_path):
    from imgcls.cli import label

    root = tmp_path / "root"
    picks = tmp_path / "picks.csv"
    picks.write_text(f'path,label,prob,score,reason\n"{root}/pool/a/a_0001.png",a,0.9,0.1,x\n'
                     f'"{root}/pool/b/odd, name\nhere.png",b,0.6,0.2,x\n{root}/pool/c/c_0001.png,c,0.7,0.3,x\n')
    tasks_file = tmp_path / "tasks.json"
    assert exit_code(lambda: label.main(["push", "--input", str(picks), "--output", str(tasks_file),
                                         "--image-root", str(root)])) == 0
    tasks = json.loads(tasks_file.read_text())
    assert tasks[1]["data"]["image"] == "/data/local-files/?d=pool/b/odd%2C%20name%0Ahere.png"
    assert tasks[0]["predictions"][0]["result"][0]["value"]["choices"] == ["a"]
    assert tasks[0]["predictions"][0]["score"] == 0.9
    choice = {"type": "choices", "from_name": "label", "to_name": "image"}
    tasks[0]["annotations"] = [{"result": [{**choice, "value": {"choices": ["b"]}}]}]
    tasks[1]["annotations"] = [{"result": [{**choice, "value": {"choices": ["a"]}}]},
                               {"result": [{**choice, "value": {"choices": ["c"]}}]}]  # annotators disagree
    tasks[2]["annotations"] = [{"result": [], "was_cancelled": True}]
    export = tmp_path / "export.json"
    export.write_text(json.dumps(tasks))
    labelled = tmp_path / "labelled.csv"
    labelled.write_text(f"path,label\n{root}/pool/c/c_0002.png,c\n")
    out = tmp_path / "labels.csv"
    argv = ["pull", "--input", str(export), "--output", str(out), "--labelled", str(labelled)]
    assert exit_code(lambda: label.main([*argv, "--append"])) == 0
    assert "1 skipped" in capsys.readouterr().err
    rows = read_rows(out)
    assert [(r["label"]) for r in rows] == ["c", "b"]
    assert (tmp_path / rows[1]["path"]).resolve() == (root / "pool" / "a" / "a_0001.png").resolve()
    assert exit_code(lambda: label.main(argv)) == 2  # never over an existing file
    assert "1 conflicting" not in capsys.readouterr().err


def test_audit_findings_become_review_tasks(tmp_path):
    from imgcls.cli import label
    from imgcls.labelling.label_studio import label_config

    (tmp_path / "imgs").mkdir()
    audit = tmp_path / "audit.json"
    audit.write_text(json.dumps({"label_issues": [{"path": str(tmp_path / "imgs" / "x.png"), "given": "cat",
                                                   "suggested": "dog", "score": 0.1, "rule": "r"}]}))
    out = tmp_path / "review.json"
    assert exit_code(lambda: label.main(["push", "--input", str(audit), "--output", str(out), "--image-root",
                                         str(tmp_path)])) == 0
    [review] = json.loads(out.read_text())
    assert review["data"]["given"] == "cat" and review["data"]["image"] == "/data/local-files/?d=imgs/x.png"
    assert review["predictions"][0]["result"][0]["value"]["choices"] == ["dog"]
    assert review["predictions"][0]["score"] == pytest.approx(0.9)
    assert exit_code(lambda: label.main(["push", "--input", str(audit), "--output", str(out), "--image-root",
                                         str(tmp_path / "imgs" / "elsewhere")])) == 2  # the image is not under it
    assert '<Choice value="a &amp; b"/>' in label_config(["a & b"])
