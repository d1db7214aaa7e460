"""`imgcls label push` and `pull`: picks (or audit findings) as Label Studio tasks, finished annotations as the
`path,label` CSV train.py reads.

A task is `{"data": {"image": URL, "path": ABSOLUTE PATH, ...}, "predictions": [{"model_version", "score",
"result": [one `choices` result]}]}`: the image as a local-files URL (`/data/local-files/?d=` and its path under
the document root, Label Studio's documented way to serve local images: the server runs with
LABEL_STUDIO_LOCAL_FILES_SERVING_ENABLED=true and LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT=the root), the model's
label as the pre-annotation. `label_config` is the project's labelling interface for a model's classes.

The server is spoken to through its documented REST API with the standard library (urllib): the official client,
label-studio-sdk, pins numpy and pulls OpenCV, which would change the versions the training stack runs on, for
three calls (import tasks, export them, read the project). The token comes from LABEL_STUDIO_API_KEY, is sent as
`Authorization: Token ...` (a legacy token) or, for a personal access token (a JWT), exchanged for an access token
first; it is never printed."""
from __future__ import annotations

import csv
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Optional
from xml.sax.saxutils import quoteattr

from imgcls.core.errors import ConfigError, DataTreeError
from imgcls.core.files import write_json

TOKEN_VARIABLE = "LABEL_STUDIO_API_KEY"
LOCAL_FILES = "/data/local-files/?d="
FROM_NAME, TO_NAME = "label", "image"
TIMEOUT_S = 60


class LabelStudioError(Exception):
    """The server refused or failed a request (exit 1); the message names the request, never the token."""


def label_config(classes: list[str]) -> str:
    """The labelling interface of a single-label project: the image and one choice per class."""
    choices = "".join(f"<Choice value={quoteattr(name)}/>" for name in classes)
    return (f'<View><Image name="{TO_NAME}" value="${TO_NAME}"/><Choices name="{FROM_NAME}" toName="{TO_NAME}" '
            f'choice="single" showInline="true">{choices}</Choices></View>')


def image_url(path: str, root: str) -> str:
    """The local-files URL of `path` (which must lie under the document root `root`)."""
    absolute, top = os.path.realpath(path), os.path.realpath(root)
    if not (absolute + os.sep).startswith(top.rstrip(os.sep) + os.sep):
        raise ConfigError(f"{path}: not under --image-root {root} (the server's LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT)"
                          f"; Label Studio serves local files from under that root only")
    return LOCAL_FILES + urllib.parse.quote(os.path.relpath(absolute, top).replace(os.sep, "/"))


def task(path: str, root: str, label: str, score: float, model_version: str, extra: Optional[dict] = None) -> dict:
    result = {"from_name": FROM_NAME, "to_name": TO_NAME, "type": "choices", "value": {"choices": [label]}}
    return {"data": {TO_NAME: image_url(path, root), "path": os.path.abspath(path), **(extra or {})},
            "predictions": [{"model_version": model_version, "score": float(score), "result": [result]}]}


def tasks_from_picks(picks_csv: str, root: str) -> list[dict]:
    with open(picks_csv, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"path", "label", "prob"} <= set(rows[0]):
        raise DataTreeError(f"--input {picks_csv}: not a picks file (imgcls label pick writes path, label, prob, "
                            f"score, reason)")
    return [task(r["path"], root, r["label"], float(r["prob"]), "imgcls label pick",
                 {"why": r.get("reason", ""), "pick_score": r.get("score", "")}) for r in rows]


def tasks_from_audit(audit_json: str, root: str) -> list[dict]:
    """audit.py --json's likely label errors, for review: the suggested label as the pre-annotation, scored by
    1 - the out-of-sample probability of the given label."""
    with open(audit_json, encoding="utf-8") as f:
        report = json.load(f)
    if not isinstance(report, dict) or "label_issues" not in report:
        raise DataTreeError(f"--input {audit_json}: not audit.py --json output (no label_issues)")
    return [task(issue["path"], root, issue["suggested"], 1.0 - float(issue["score"]), "imgcls audit",
                 {"given": issue["given"]}) for issue in report["label_issues"]]


# ---------------------------------------------------------------- the server


def token() -> str:
    value = os.environ.get(TOKEN_VARIABLE, "").strip()
    if not value:
        raise ConfigError(f"--url: set {TOKEN_VARIABLE} to your Label Studio API token (Account & Settings)")
    return value


def request(url: str, path: str, authorization: str, body=None, method: Optional[str] = None):
    """One JSON request; LabelStudioError with the status and the server's words (never the token)."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Authorization": authorization, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        detail = err.read()[:500].decode("utf-8", "replace")
        raise LabelStudioError(f"Label Studio {method or ('POST' if data else 'GET')} {path}: HTTP {err.code} "
                               f"{err.reason}: {detail}") from None
    except (urllib.error.URLError, OSError) as err:
        raise LabelStudioError(f"Label Studio at {url}: {getattr(err, 'reason', err)}") from None


def authorization(url: str) -> str:
    """The Authorization header: a legacy token as it is; a personal access token (a JWT refresh token)
    exchanged for a short-lived access token."""
    secret = token()
    if secret.count(".") == 2:
        access = request(url, "/api/token/refresh", "", {"refresh": secret})
        return f"Bearer {access['access']}"
    return f"Token {secret}"


def project_choices(url: str, project: int, auth: str) -> set:
    """The choice values of the project's labelling interface (a pushed label outside them is refused)."""
    import re

    config = request(url, f"/api/projects/{project}", auth).get("label_config", "")
    return set(re.findall(r"<Choice\b[^>]*\bvalue=\"([^\"]*)\"", config))


def ensure_storages(url: str, project: int, auth: str, root: str, tasks: list[dict]) -> None:
    """A local-files storage of the project for each top folder under `root` the images lie in: Label Studio
    serves /data/local-files/ URLs only under a storage's path, a folder strictly inside the document root."""
    tops = {urllib.parse.unquote(t["data"][TO_NAME][len(LOCAL_FILES):]).split("/")[0] for t in tasks}
    if any(top == urllib.parse.unquote(t["data"][TO_NAME][len(LOCAL_FILES):]) for t in tasks for top in tops):
        raise ConfigError(f"--image-root {root}: images lie directly in it; Label Studio serves local files from "
                          f"folders inside its document root, not from the root itself: pass a folder above")
    have = {os.path.realpath(s["path"]) for s in request(url, f"/api/storages/localfiles?project={project}", auth)}
    for top in sorted(tops):
        folder = os.path.realpath(os.path.join(root, top))
        if folder not in have:
            request(url, "/api/storages/localfiles", auth, {"project": project, "path": folder, "title": top,
                                                             "use_blob_urls": False})


def run_push(input_file: str, output: Optional[str], url: Optional[str], project: Optional[int],
             image_root: Optional[str]) -> int:
    root = image_root or os.getcwd()
    reader = tasks_from_audit if input_file.lower().endswith(".json") else tasks_from_picks
    tasks = reader(input_file, root)
    if output is not None:
        if os.path.realpath(output) == os.path.realpath(input_file):
            raise ConfigError(f"--output {output}: is the --input file; name a new file")
        write_json(tasks, output)
        print(f"wrote {len(tasks)} Label Studio task(s) to {output} (import it into a project whose labelling "
              f"interface has <Choices name=\"{FROM_NAME}\" toName=\"{TO_NAME}\">)", file=sys.stderr)
        return 0
    auth = authorization(url)
    choices = project_choices(url, project, auth)
    outside = sorted({t["predictions"][0]["result"][0]["value"]["choices"][0] for t in tasks} - choices)
    if outside:
        raise ConfigError(f"--project {project}: its labelling interface has no choice {', '.join(outside[:5])}; "
                          f"create it with the model's classes (imgcls.labelling.label_studio.label_config)")
    ensure_storages(url, project, auth, root, tasks)
    answer = request(url, f"/api/projects/{project}/import", auth, tasks)
    print(f"sent {len(tasks)} task(s) to project {project} at {url} (Label Studio counted "
          f"{answer.get('task_count', '?')})", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- pull


def task_path(item: dict, root: str) -> str:
    """The image file of an exported task: the `path` push stored, else its local-files URL under `root`."""
    data = item.get("data") or {}
    if data.get("path"):
        return data["path"]
    image = str(data.get(TO_NAME, ""))
    if image.startswith(LOCAL_FILES):
        return os.path.join(root, urllib.parse.unquote(image[len(LOCAL_FILES):]))
    raise DataTreeError(f"task {item.get('id')}: its image {image!r} is no local file (no data.path, no "
                        f"{LOCAL_FILES} URL)")


def annotation_labels(annotation: dict) -> list[str]:
    return [choice for result in annotation.get("result") or [] if result.get("type") == "choices"
            for choice in (result.get("value") or {}).get("choices") or []]


def finished_labels(items: list[dict], root: str) -> tuple[dict, dict]:
    """({path: label} of the tasks whose finished annotations agree on one label, {reason: count} of the rest):
    skipped (every annotation cancelled), unannotated, conflicting (annotators disagree, or one gives several)."""
    labels, counts = {}, {"skipped": 0, "not annotated": 0, "conflicting": 0}
    for item in items:
        annotations = item.get("annotations") or []
        done = [a for a in annotations if not a.get("was_cancelled")]
        if not annotations:
            counts["not annotated"] += 1
            continue
        if not done:
            counts["skipped"] += 1
            continue
        given = {tuple(annotation_labels(a)) for a in done}
        if len(given) != 1 or len(next(iter(given))) != 1:
            counts["conflicting"] += 1
            continue
        labels[os.path.abspath(task_path(item, root))] = next(iter(given))[0]
    return labels, counts


def exported_tasks(input_file: Optional[str], url: Optional[str], project: Optional[int]) -> list[dict]:
    if input_file is not None:
        with open(input_file, encoding="utf-8") as f:
            items = json.load(f)
        if not isinstance(items, list):
            raise DataTreeError(f"--input {input_file}: not a Label Studio JSON export (a list of tasks)")
        return items
    return request(url, f"/api/projects/{project}/export?exportType=JSON&download_all_tasks=true",
                   authorization(url))


def labelled_rows(labelled_csv: str) -> dict:
    """{absolute path: label} of a path,label CSV (paths relative to its folder)."""
    from imgcls.data.listing import read_csv_rows

    base = Path(labelled_csv).parent
    return {os.path.abspath(r.path if os.path.isabs(r.path) else base / r.path): r.label
            for r in read_csv_rows(labelled_csv, "path", "label")}


def write_label_rows(rows: dict, output: str) -> None:
    """path,label rows, paths relative to the output's folder (where train.py resolves them without data.root)."""
    target = Path(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = os.path.abspath(target.parent)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label"])
        writer.writerows((os.path.relpath(path, folder), label) for path, label in rows.items())
    os.replace(tmp, target)


def run_pull(input_file: Optional[str], url: Optional[str], project: Optional[int], output: str,
             image_root: Optional[str], labelled_csv: Optional[str], append: bool) -> int:
    for role, path in (("--input", input_file), ("--labelled", labelled_csv)):
        if path and os.path.exists(output) and os.path.samefile(output, path):
            raise ConfigError(f"--output {output}: is the {role} file, which this command reads; name a new file")
    if os.path.exists(output):
        raise ConfigError(f"--output {output}: exists; label pull writes a new file and never replaces one (with "
                          f"--labelled L.csv --append the new file holds L's rows and the new ones)")
    labels, counts = finished_labels(exported_tasks(input_file, url, project), image_root or os.getcwd())
    rows = {}
    if labelled_csv:
        known = labelled_rows(labelled_csv)
        counts["already labelled"] = sum(1 for p in labels if p in known)
        counts["relabelled differently (the labelled CSV's label kept)"] = sum(
            1 for p, label in labels.items() if p in known and known[p] != label)
        labels = {p: label for p, label in labels.items() if p not in known}
        if append:
            rows.update(known)
    rows.update(labels)
    write_label_rows(rows, output)
    left = "; ".join(f"{n} {reason}" for reason, n in counts.items() if n)
    print(f"wrote {len(rows)} row(s) to {output}: {len(labels)} new label(s)" + (f"; left out: {left}" if left else ""),
          file=sys.stderr)
    return 0
