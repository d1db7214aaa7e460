"""serve.py: answers equal infer.py's rows under concurrent load, batches form, every bad request gets a
4xx while the server stays healthy, the API key, the access log, SIGTERM's graceful exit 0; the batcher
and the pure helpers on their own."""
from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
from conftest import REPO, class_image, run_script, train_tiny, wait_for
from PIL import Image

import serve
from imgcls.benchmarking.serve_load import percentile, run_load
from imgcls.core.errors import CheckpointError, ConfigError
from imgcls.serving.app import DynamicBatcher
from imgcls.serving.model import batch_shapes, classify_decode_error, padded_size

CLASSES = ["a", "b", "c"]
API_KEY = "test-key-27"
MAX_BYTES = 60_000
DRAIN_BYTES = 30_000_000
TIMEOUT = 60  # seconds, every HTTP call


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny checkpoint, its validation images (PNGs plus JPEGs) with infer.py's JSON rows for them, and one
    serve.py process on a free port (API key from the environment), shared by the module."""
    base = tmp_path_factory.mktemp("serve")
    data, checkpoint = train_tiny(base, {name: (8, 4) for name in CLASSES})
    images = sorted((data / "val").rglob("*.png"))
    for i, png in enumerate(images[:4]):  # JPEGs take the tensor decode path
        jpeg = png.with_suffix(".jpg")
        class_image(i % 3, (40, 30)).save(jpeg, quality=90)
        images.append(jpeg)
    log_path = base / "serve.log"
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", IMGCLS_API_KEY=API_KEY)
    proc = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--checkpoint", str(checkpoint), "--port", "0",
                             "--max-batch", "8", "--max-wait-ms", "100", "--max-bytes", str(MAX_BYTES),
                             "--drain-bytes", str(DRAIN_BYTES), "--body-timeout", "3"],
                            cwd=REPO, stdout=log, stderr=log, env=env, start_new_session=True)
    rows_file = base / "rows.json"  # while the server starts
    result = run_script("infer.py", *map(str, images), "--checkpoint", str(checkpoint), "--output", str(rows_file),
                        "--num-workers", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    expected = {row["path"]: row for row in json.loads(rows_file.read_text())}
    wait_for(proc, lambda: "listening on" in log_path.read_text(), "the server listening", timeout=180)
    port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", log_path.read_text()).group(1))
    server = {"url": f"http://127.0.0.1:{port}", "port": port, "proc": proc, "log": log_path, "images": images,
              "expected": expected}
    yield server
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    log.close()


def post(url: str, data=None, files=None, token=API_KEY, headers=None) -> requests.Response:
    headers = dict(headers or {})
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return requests.post(f"{url}/predict", data=data, files=files, headers=headers, timeout=TIMEOUT)


def assert_same_row(got: dict, want: dict) -> None:
    """The same labels in the same order as infer.py's row, probabilities equal to float rounding."""
    assert set(got) == set(want)
    for key, value in want.items():
        if key == "path" or value is None:
            continue
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, abs=1e-5), key
        else:
            assert got[key] == value, key


def health(url: str) -> dict:
    response = requests.get(f"{url}/health", timeout=TIMEOUT)
    assert response.status_code == 200
    return response.json()


@pytest.mark.slow
def test_health_describes_the_model_without_a_token(served):
    body = health(served["url"])
    assert body["status"] == "ok" and body["model"] == "resnet10t"
    assert body["num_classes"] == 3 and body["classes"] == CLASSES
    assert body["preprocessing"]["img_size"] == 16 and body["preprocessing"]["mean"] == [0.485, 0.456, 0.406]
    assert body["batch_shapes"] == [1, 2, 4, 8]
    assert body["checkpoint"] == "best.pt"  # the name, not where it lies on the server


@pytest.mark.slow
def test_sixteen_concurrent_clients_get_infer_rows_in_batches(served):
    url, images, expected = served["url"], served["images"], served["expected"]
    before = health(url)["served"]
    jobs = [images[(client * 3 + i) % len(images)] for client in range(16) for i in range(3)]

    def client(start: int) -> list[tuple[Path, requests.Response]]:
        with requests.Session() as session:
            session.headers["Authorization"] = f"Bearer {API_KEY}"
            return [(path, session.post(f"{url}/predict", data=path.read_bytes(), timeout=TIMEOUT))
                    for path in jobs[start:start + 3]]

    with ThreadPoolExecutor(16) as pool:
        answers = [answer for batch in pool.map(client, range(0, 48, 3)) for answer in batch]
    assert len(answers) == 48
    for path, response in answers:
        assert response.status_code == 200, response.text
        assert_same_row(response.json(), expected[str(path)])
    after = health(url)["served"]
    images_run, batches_run = after["images"] - before["images"], after["batches"] - before["batches"]
    assert images_run == 48
    assert batches_run < 48  # concurrent requests shared forward passes


@pytest.mark.slow
def test_multipart_file_field_gives_the_same_row_with_the_file_name(served):
    path = served["images"][1]
    response = post(served["url"], files={"file": (path.name, path.read_bytes(), "image/png")})
    assert response.status_code == 200, response.text
    assert response.json()["path"] == path.name
    assert_same_row(response.json(), served["expected"][str(path)])


def bad_bodies(tmp_path: Path, good: Path) -> dict[str, bytes]:
    png = good.read_bytes()
    jpeg = io.BytesIO()
    class_image(0, (64, 48)).save(jpeg, format="JPEG", quality=95)
    jpeg = jpeg.getvalue()
    # a JPEG whose frame header claims 30000 x 30000 pixels: torchvision would decode it without PIL's check
    sof = jpeg.index(b"\xff\xc0")
    huge_jpeg = jpeg[:sof + 5] + (30000).to_bytes(2, "big") * 2 + jpeg[sof + 9:]
    bomb = io.BytesIO()
    Image.new("1", (12000, 12000)).save(bomb, format="PNG")  # 144 M pixels in a few kB
    return {"empty_body": b"", "not_an_image": b"hello, not an image" * 10,
            "truncated_image": png[: len(png) // 2], "truncated_jpeg": jpeg[: len(jpeg) // 2],
            "decompression_bomb": bomb.getvalue(), "decompression_bomb_jpeg": huge_jpeg}


@pytest.mark.slow
def test_every_bad_body_gets_a_400_naming_it_and_a_batch_neighbour_is_unaffected(served, tmp_path):
    url, good = served["url"], served["images"][0]
    bodies = bad_bodies(tmp_path, good)
    want_kind = {"truncated_jpeg": "truncated_image", "decompression_bomb_jpeg": "decompression_bomb"}
    with ThreadPoolExecutor(len(bodies) * 2) as pool:
        bad = {name: pool.submit(post, url, body) for name, body in bodies.items()}
        goods = [pool.submit(post, url, good.read_bytes()) for _ in bodies]
        for name, future in bad.items():
            response = future.result()
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"] == want_kind.get(name, name), response.text
            assert response.json()["detail"]
        for future in goods:
            assert future.result().status_code == 200
            assert_same_row(future.result().json(), served["expected"][str(good)])
    assert health(url)["status"] == "ok"


def non_finite_bodies() -> dict[str, bytes]:
    """Uploads whose samples are not finite numbers, or far off their scale: bad input, never a model failure."""
    def saved(array, **kwargs) -> bytes:
        buf = io.BytesIO()
        if kwargs:
            Image.fromarray(array).save(buf, **kwargs)
        else:
            np.save(buf, array)
        return buf.getvalue()

    return {"non_finite_image": saved(np.full((20, 20, 3), np.inf, np.float32)),
            "non_finite_image_tiff": saved(np.full((20, 20), np.nan, np.float32), format="TIFF"),
            "out_of_range_image": saved(np.full((20, 20, 3), 1e30, np.float32))}


@pytest.mark.slow
def test_a_non_finite_upload_gets_a_400_alone_and_never_fails_its_batch_neighbours(served):
    url, good = served["url"], served["images"][0]
    bodies = non_finite_bodies()
    with ThreadPoolExecutor(12) as pool:  # --max-wait-ms 100: they share batches
        bad = {name: pool.submit(post, url, body) for name, body in bodies.items()}
        embeds = {name: pool.submit(requests.post, f"{url}/embed", data=body, timeout=TIMEOUT,
                                    headers={"Authorization": f"Bearer {API_KEY}"}) for name, body in bodies.items()}
        goods = [pool.submit(post, url, good.read_bytes()) for _ in range(6)]
        for name, future in [*bad.items(), *embeds.items()]:
            response = future.result()
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"] == name.removesuffix("_tiff"), response.text
            assert "finite" in response.json()["detail"] or "declared range" in response.json()["detail"]
        for future in goods:
            assert future.result().status_code == 200, future.result().text
            assert_same_row(future.result().json(), served["expected"][str(good)])
    assert health(url)["status"] == "ok"


@pytest.mark.slow
def test_multipart_without_a_file_field_is_400(served):
    response = post(served["url"], files={"image": ("x.png", served["images"][0].read_bytes(), "image/png")})
    assert response.status_code == 400 and response.json()["error"] == "no_file_field"


@pytest.mark.slow
def test_a_body_over_max_bytes_is_413_declared_or_streamed(served):
    big = os.urandom(MAX_BYTES + 1)
    response = post(served["url"], big)
    assert response.status_code == 413 and response.json()["error"] == "too_large"
    chunked = post(served["url"], iter([big[:40_000], big[40_000:]]))  # no Content-Length: counted as it comes
    assert chunked.status_code == 413
    assert health(served["url"])["status"] == "ok"


def raw_request(port: int, head: bytes, body: bytes = b"", wait: float = TIMEOUT) -> bytes:
    """Send `head` and `body` on one connection and read until the server closes it (or `wait` passes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(head + body)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return answer


def test_an_oversized_body_from_a_client_that_sends_before_reading_gets_the_413(served):
    """requests (no Expect: 100-continue) sent 20 MB and got a connection reset: the 413 came before the body
    was read, and the server closed on the unread rest."""
    big = os.urandom(20_000_000)
    for attempt in range(2):  # the connection stays usable: a second one in a row
        response = post(served["url"], big)
        assert response.status_code == 413 and "20000000 bytes" in response.json()["detail"]
    assert health(served["url"])["status"] == "ok"


def test_a_body_past_the_drain_bound_or_too_slow_is_answered_and_closed(served):
    head = (f"POST /predict HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/octet-stream\r\n").encode()
    declared = raw_request(served["port"], head + f"Content-Length: {10 * DRAIN_BYTES}\r\n\r\n".encode(), b"x" * 1000)
    assert declared.startswith(b"HTTP/1.1 413") and b"connection: close" in declared.lower()
    slow = raw_request(served["port"], head + b"Content-Length: 5000\r\n\r\n", b"x" * 10)  # the rest never comes
    assert slow.startswith(b"HTTP/1.1 408") and b"body_timeout" in slow
    assert health(served["url"])["status"] == "ok"


@pytest.mark.slow
def test_the_api_key_is_required_on_predict(served):
    body = served["images"][0].read_bytes()
    assert post(served["url"], body, token=None).status_code == 401
    wrong = post(served["url"], body, token="not-the-key")
    assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
    assert post(served["url"], body).status_code == 200


@pytest.mark.slow
def test_unknown_paths_and_wrong_methods_answer_the_documented_error_shape(served):
    missing = requests.get(f"{served['url']}/nope", timeout=TIMEOUT)
    assert missing.status_code == 404
    assert missing.json() == {"error": "not_found", "detail": "no such endpoint: /nope (POST /predict, GET /health)"}
    wrong = requests.get(f"{served['url']}/predict", headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=TIMEOUT)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json() == {"error": "method_not_allowed", "detail": "GET is not allowed on /predict; use POST"}


def test_usage_errors_are_found_before_the_port_opens(tmp_path):
    with pytest.raises(CheckpointError, match="missing.pt"):
        serve.main(["--checkpoint", str(tmp_path / "missing.pt"), "--port", "0"])
    for flag, value in (("--max-batch", "0"), ("--max-bytes", "0"), ("--port", "70000"), ("--max-wait-ms", "-1")):
        with pytest.raises(ConfigError, match=flag):
            serve.main(["--checkpoint", "x.pt", flag, value])


@pytest.mark.slow
def test_load_generator_measures_every_answer(served):
    bodies = [path.read_bytes() for path in served["images"]]
    result = run_load(served["url"], bodies, clients=4, total=12, api_key=API_KEY)
    assert result["requests"] == 12 and result["img_per_s"] > 0
    assert 0 < result["p50_ms"] <= result["p95_ms"]
    with pytest.raises(SystemExit, match="12 of 12 requests failed, first: 401"):
        run_load(served["url"], bodies, clients=2, total=12, api_key="wrong")


@pytest.mark.slow
def test_sigterm_answers_the_request_in_flight_stops_accepting_and_exits_0(served):
    """Last in the module: it stops the shared server. A request whose headers are in but whose body is
    not is in flight when SIGTERM arrives; it is answered, new connections are refused, exit 0."""
    proc, port, good = served["proc"], served["port"], served["images"][2].read_bytes()
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    sock.sendall(f"POST /predict HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Length: "
                 f"{len(good)}\r\nContent-Type: application/octet-stream\r\n\r\n".encode() + good[:10])
    deadline = time.monotonic() + 30
    while health(served["url"])["in_flight"] < 1:  # the server has read the headers: the request is in flight
        assert time.monotonic() < deadline, "the partial request never reached the server"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the listening socket closes
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(0.05)
        except OSError:
            break
    else:
        pytest.fail("the server still accepts connections 30 s after SIGTERM")
    sock.sendall(good[10:])
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        reply += chunk
    sock.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert_same_row(body, served["expected"][str(served["images"][2])])
    assert proc.wait(timeout=60) == 0
    log = served["log"].read_text()
    assert re.search(r'access 127\.0\.0\.1 "POST /predict" 200 [\d.]+ ms', log)
    for status in (400, 401, 413):
        assert f'"POST /predict" {status} ' in log


# ---------------------------------------------------------------- the pieces on their own


def test_batch_shapes_are_powers_of_two_up_to_the_max():
    assert batch_shapes(1) == [1]
    assert batch_shapes(32) == [1, 2, 4, 8, 16, 32]
    assert batch_shapes(12) == [1, 2, 4, 8, 12]
    assert [padded_size(n, batch_shapes(12)) for n in (1, 3, 5, 9, 12)] == [1, 4, 8, 12, 12]


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)


def test_decode_errors_are_named():
    assert classify_decode_error("DecompressionBombError: Image size (1 pixels) exceeds") == "decompression_bomb"
    assert classify_decode_error("OSError: image file is truncated (3 bytes not processed)") == "truncated_image"
    assert classify_decode_error("UnidentifiedImageError: cannot identify image file") == "not_an_image"
    assert classify_decode_error("unsupported image mode 'X'") == "unreadable_image"


def test_batcher_groups_waiting_requests_and_isolates_a_failed_batch():
    calls = []

    def run(items):
        calls.append(list(items))
        if "boom" in items:
            raise RuntimeError("model failed")
        return [item * 2 for item in items]

    async def scenario():
        batcher = DynamicBatcher(run, max_batch=4, max_wait_s=0.2)
        batcher.start()
        first = await asyncio.gather(*(batcher.submit(f"x{i}") for i in range(6)))
        failed = await asyncio.gather(batcher.submit("boom"), return_exceptions=True)
        after = await batcher.submit("y")
        await batcher.stop()
        return first, failed, after

    first, failed, after = asyncio.run(scenario())
    assert first == [f"x{i}" * 2 for i in range(6)]
    assert [len(c) for c in calls[:2]] == [4, 2]   # max_batch, then the rest when the wait ends
    assert isinstance(failed[0], RuntimeError)
    assert after == "yy"


def test_a_request_that_fails_the_model_fails_alone_not_its_batch_neighbours():
    """main: every request batched with the failing one got its exception (a 500)."""
    calls = []

    def run(items):
        calls.append(list(items))
        if "nan" in items:
            raise RuntimeError("outputs are not finite")
        return [item * 2 for item in items]

    async def scenario():
        batcher = DynamicBatcher(run, max_batch=4, max_wait_s=0.2)
        batcher.start()
        answers = await asyncio.gather(*(batcher.submit(x) for x in ("x", "nan", "y")), return_exceptions=True)
        await batcher.stop()
        return answers, batcher.items_run

    answers, items_run = asyncio.run(scenario())
    assert answers[0] == "xx" and answers[2] == "yy" and isinstance(answers[1], RuntimeError)
    assert calls == [["x", "nan", "y"], ["x"], ["nan"], ["y"]] and items_run == 2


def test_serve_refuses_keys_headers_cannot_carry_and_unbounded_batches():
    for key in ("caf\u00e9", " key", "key ", "tab\tkey"):
        with pytest.raises(ConfigError, match="--api-key"):
            serve.main(["--checkpoint", "x.pt", "--api-key", key])
    with pytest.raises(ConfigError, match="--max-batch"):
        serve.main(["--checkpoint", "x.pt", "--max-batch", "100000"])
    for value in ("0", "nan", "-1"):
        with pytest.raises(ConfigError, match="--body-timeout"):
            serve.main(["--checkpoint", "x.pt", "--body-timeout", value])
    with pytest.raises(SystemExit) as exited:
        serve.main(["--checkpoint", "x.pt", "--reject-below", "nan"])
    assert exited.value.code == 2
