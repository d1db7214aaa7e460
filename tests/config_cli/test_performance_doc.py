"""docs/performance.md's tables are what imgcls.benchmarking.figures renders from docs/performance.csv, every figure there
names its command, commit, machine and date, and the script rewrites only the text between the page's two
markers. In-process and standard library only: nothing is measured, no process starts."""
from __future__ import annotations

import csv
import re
from datetime import date
from pathlib import Path

import pytest

from imgcls.benchmarking.figures import (BEGIN, CSV_PATH, END, FIELDS, PAGE_PATH, WRITE_COMMAND, main, read_rows,
                                         render_tables, replace_block)

HEX_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def machine_ids(page: str) -> set[str]:
    """The ids in the first column of the page's Machines table."""
    section = page.split("\n## Machines\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \|", section, re.M)
    return {row for row in rows if row not in ("id", "---")}


def test_the_page_s_tables_are_what_the_csv_gives():
    page = PAGE_PATH.read_text(encoding="utf-8")
    assert replace_block(page, render_tables(read_rows(CSV_PATH))) == page, \
        f"docs/performance.md's tables differ from docs/performance.csv: run {WRITE_COMMAND}"
    assert main(["--check"]) == 0


def test_every_figure_has_a_command_a_commit_a_known_machine_and_an_iso_date():
    page = PAGE_PATH.read_text(encoding="utf-8")
    machines = machine_ids(page)
    assert {"M1", "M2", "M2-AVX2"} <= machines
    with open(CSV_PATH, newline="", encoding="utf-8") as handle:
        records = list(csv.reader(handle))
    assert tuple(records[0]) == FIELDS
    assert all(len(record) == len(FIELDS) for record in records), "a row with a stray or missing comma"
    rows = read_rows(CSV_PATH)
    assert len(rows) == len(records) - 1 and len(rows) > 40
    for number, row in enumerate(rows, 2):
        where = f"docs/performance.csv line {number} ({row['measure'][:50]})"
        assert row["measure"] and row["command"], where
        assert HEX_COMMIT.match(row["commit"]), f"{where}: commit {row['commit']!r}"
        assert row["machine"] in machines, f"{where}: machine {row['machine']!r} is not in {sorted(machines)}"
        assert ISO_DATE.match(row["date"]), f"{where}: date {row['date']!r}"
        date.fromisoformat(row["date"])
        assert "`" not in row["command"] and "/tmp/" not in row["command"] + row["notes"], where
    tweaks = [row for row in rows if row["table"] == "tweaks"]
    assert len(tweaks) >= 8 and all(row["ratio"] for row in tweaks), "every tweak says its share (or 'not measured')"


def stale_copy(tmp_path: Path) -> tuple[Path, Path, str]:
    """A copy of the page whose block is stale, and a copy of the CSV with one figure changed."""
    page = PAGE_PATH.read_text(encoding="utf-8")
    stale = replace_block(page, "### Old figures\n\n| a | b |\n| --- | --- |\n| 1 | 2 |")
    page_copy, csv_copy = tmp_path / "performance.md", tmp_path / "performance.csv"
    page_copy.write_text(stale, encoding="utf-8")
    rows = read_rows(CSV_PATH)
    rows[0]["ours"] = "99.99"
    with open(csv_copy, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return page_copy, csv_copy, stale


def test_write_rewrites_only_the_block(tmp_path):
    page_copy, csv_copy, stale = stale_copy(tmp_path)
    assert main(["--write", "--page", str(page_copy), "--csv", str(csv_copy)]) == 0
    written = page_copy.read_text(encoding="utf-8")
    before, after = stale.split(BEGIN)[0], stale.split(END)[1]
    assert written.startswith(before + BEGIN) and written.endswith(END + after)
    assert written == replace_block(stale, render_tables(read_rows(csv_copy)))
    assert "99.99" in written.split(BEGIN)[1].split(END)[0] and "Old figures" not in written
    assert main(["--check", "--page", str(page_copy), "--csv", str(csv_copy)]) == 0
    assert main(["--write", "--page", str(page_copy), "--csv", str(csv_copy)]) == 0
    assert page_copy.read_text(encoding="utf-8") == written  # a second write changes nothing


def test_check_exits_1_on_a_stale_page_and_names_the_command(tmp_path, capsys):
    page_copy, csv_copy, stale = stale_copy(tmp_path)
    assert main(["--check", "--page", str(page_copy), "--csv", str(csv_copy)]) == 1
    assert WRITE_COMMAND in capsys.readouterr().err
    assert page_copy.read_text(encoding="utf-8") == stale  # --check writes nothing


def test_a_page_without_both_markers_is_refused_and_left_alone(tmp_path, capsys):
    for text in ("# Performance\n\nno markers\n", f"{END}\n{BEGIN}\n", f"{BEGIN}\n{BEGIN}\n{END}\n"):
        with pytest.raises(ValueError):
            replace_block(text, "| a |")
        page = tmp_path / "page.md"
        page.write_text(text, encoding="utf-8")
        assert main(["--write", "--page", str(page), "--csv", str(CSV_PATH)]) == 1
        assert page.read_text(encoding="utf-8") == text
    assert "marker" in capsys.readouterr().err


def test_a_cell_s_pipe_is_escaped_and_a_command_is_code():
    row = dict.fromkeys(FIELDS, "")
    row.update(table="timm", measure="a | b", ours="1", unit="s", command="python train.py --config quickstart",
               commit="abcdef0", machine="M1", date="2026-12-01")
    table = render_tables([row])
    line = table.splitlines()[-1]
    assert "a \\| b" in line and "| 1 s |" in line and "`python train.py --config quickstart`" in line
    assert line.count(" | ") == table.splitlines()[1].count(" | ")
