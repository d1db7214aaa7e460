"""data.builtin: the digits tree is written where asked, and never over a folder that holds other files."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_script

from imgcls.data.listing import DataTreeError, ensure_builtin, scan_split


def test_digits_written_once_into_an_empty_folder(tmp_path):
    root = tmp_path / "digits"
    root.mkdir()
    ensure_builtin("digits", root)
    train, val = scan_split(root / "train"), scan_split(root / "val")
    assert train.classes == [str(d) for d in range(10)] and len(train) + len(val) == 1797
    assert len(val) == 355
    marker = root / "train" / "0" / "0000.png"
    stamp = marker.stat().st_mtime_ns
    ensure_builtin("digits", root)  # complete: left as it is
    assert marker.stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_a_folder_holding_other_files_is_never_overwritten(tmp_path):
    mine = tmp_path / "my_data"
    (mine / "train" / "cat").mkdir(parents=True)
    sentinel = mine / "train" / "cat" / "keep.txt"
    sentinel.write_text("precious")
    with pytest.raises(DataTreeError, match="data.builtin=null"):
        ensure_builtin("digits", mine)
    assert sentinel.read_text() == "precious"

    result = run_script("train.py", "--config", "quickstart", f"data.root={mine}", f"output.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "data.builtin=null" in result.stderr
    assert sentinel.read_text() == "precious" and sorted(p.name for p in mine.iterdir()) == ["train"]
