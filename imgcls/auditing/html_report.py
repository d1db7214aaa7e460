"""The audit as one self-contained HTML file: flagged images as thumbnails side by side (leak pairs,
duplicate groups, label issues with their given and suggested class), embedded as base64 data URIs, so
the page needs nothing but itself (no scripts, no external assets)."""
from __future__ import annotations

import base64
import html
import io

from imgcls.data.images import ImageDecodeError, load_rgb
from imgcls.auditing.outliers import outliers_section

THUMB = 128          # thumbnail bounding box, pixels
MAX_SHOWN = 200      # entries per section shown as thumbnails (the JSON has them all)

STYLE = """
body{font-family:sans-serif;margin:16px;background:#fff;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ccc}
.row{display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start;margin:8px 0;padding:6px;border:1px solid #ddd}
figure{margin:0;width:%dpx;font-size:11px;word-break:break-all}
figure img{width:%dpx;height:%dpx;object-fit:contain;background:#eee;display:block}
.note{color:#555;font-size:13px}.bad{color:#b00}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
""" % (THUMB, THUMB, THUMB)


def thumbnail_uri(path: str) -> str:
    """A JPEG data URI of the image shrunk into THUMB x THUMB; '' when it cannot be read."""
    try:
        img = load_rgb(path, min_size=(THUMB, THUMB))
    except (ImageDecodeError, OSError):
        return ""
    img.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(name: str, file: str, caption: str = "") -> str:
    uri = thumbnail_uri(file)
    image = f'<img src="{uri}" alt="{html.escape(name)}">' if uri else '<div class="bad">unreadable</div>'
    extra = f"<b>{html.escape(caption)}</b><br>" if caption else ""
    return f"<figure>{image}<figcaption>{extra}{html.escape(name)}</figcaption></figure>"


def _section(title: str, rows: list[str], total: int, empty: str, note: str = "") -> str:
    head = f"<h2>{html.escape(title)} ({total})</h2>"
    if note:
        head += f'<p class="note">{html.escape(note)}</p>'
    if not total:
        return head + f'<p class="note">{html.escape(empty)}</p>'
    more = (f'<p class="note">the first {MAX_SHOWN} of {total} shown; the JSON lists all</p>'
            if total > MAX_SHOWN else "")
    return head + more + "".join(rows[:MAX_SHOWN])


def render(report: dict, files: dict[str, str], title: str) -> str:
    """The page of an audit `report` (the JSON document); `files` maps each reported name to its file."""
    def fig(name, caption=""):
        return _figure(name, files.get(name, ""), caption)

    leaks = report["leaks"][:MAX_SHOWN]
    leak_rows = []
    for leak in leaks:  # one group: up to 4 members of each split it spans
        identical = " (identical bytes)" if leak["exact"] else ""
        shown = "".join(fig(p, s) for s in leak["splits"] for p in leak[s][:4])
        leak_rows.append(f'<div class="row leak">{shown}<span class="note">{leak["count"]} images, distance '
                         f'{leak["distance"]}{identical}</span></div>')
    dup_rows = [f'<div class="row dup"><span class="note">{html.escape(g["split"])}, {g["kind"]}, '
                f'distance up to {g["distance"]}</span>{"".join(fig(p) for p in g["paths"][:12])}</div>'
                for g in report["duplicates"][:MAX_SHOWN]]
    conflict_rows = []
    for conflict in report.get("label_conflicts", [])[:MAX_SHOWN]:
        shown = list(zip(conflict["paths"], conflict["labels"]))[:12]
        conflict_rows.append('<div class="row conflict">' + "".join(fig(p, "label: " + label) for p, label in shown)
                             + "</div>")
    issue_rows = [f'<div class="row issue">{fig(i["path"], "given: " + i["given"])}<span class="note">suggested: '
                  f'<b>{html.escape(i["suggested"])}</b>, p(given) = {i["score"]:.3f}</span></div>'
                  for i in report["label_issues"][:MAX_SHOWN]]
    counts = report["class_counts"]
    splits = list(counts)
    table = "<table><tr><th>class</th>" + "".join(f"<th>{html.escape(s)}</th>" for s in splits) + "</tr>"
    for name in next(iter(counts.values()), {}):
        table += f"<tr><td>{html.escape(name)}</td>" + "".join(f"<td>{counts[s][name]}</td>" for s in splits) + "</tr>"
    table += "</table>"
    unreadable = "".join(f"<li>{html.escape(u['path'])}: {html.escape(u['reason'])}</li>"
                         for u in report["unreadable_details"])
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        "".join(f'<p class="note">{html.escape(line)}</p>' for line in report["summary"]),
        _section("Leaks: the same image in two splits", leak_rows, len(report["leaks"]), "no leaks found",
                 "the most serious finding: a validation image that training also sees inflates the accuracy"),
        _section("Duplicates inside a split", dup_rows, len(report["duplicates"]), "no duplicates found"),
        _section("Label conflicts: one image, different labels", conflict_rows,
                 len(report.get("label_conflicts", [])), "no label conflicts found"),
        _section("Likely label errors", issue_rows, len(report["label_issues"]),
                 "no likely label errors found" if report["label_issues_source"] else "label issues not searched",
                 report.get("label_issues_note", "")),
        outliers_section(report, fig),
        f"<h2>Unreadable files ({len(report['unreadable'])})</h2><ul>{unreadable}</ul>",
        f"<h2>Images per class</h2>{table}",
        "".join(f'<p class="note">{html.escape(line)}</p>' for line in report["advice"]),
        "</body></html>"]
    return "\n".join(parts)
