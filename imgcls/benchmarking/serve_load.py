"""A closed-loop load test of a running serve.py: N clients, each posting the next image as soon as its
last answer came, for a fixed number of requests; prints one JSON object per client count with the
served rate and the latency percentiles. Every answer must be a 200 with a label.

python -m imgcls.benchmarking.serve_load --url http://127.0.0.1:8000 --images DIR [--clients 1,4,16]
                                  [--requests 200] [--api-key KEY]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import requests

from imgcls.data.images import is_image_file


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def run_load(url: str, bodies: list[bytes], clients: int, total: int, api_key: str | None = None) -> dict:
    """`total` requests from `clients` concurrent clients; {clients, requests, img_per_s, p50_ms, p95_ms}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    latencies: list[float] = []
    failures: list[str] = []
    counter = iter(range(total))
    lock = threading.Lock()

    def client() -> None:
        with requests.Session() as session:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                start = time.perf_counter()
                response = session.post(f"{url}/predict", data=bodies[i % len(bodies)], headers=headers, timeout=120)
                elapsed = time.perf_counter() - start
                with lock:
                    latencies.append(elapsed)
                    if response.status_code != 200 or "label" not in response.json():
                        failures.append(f"{response.status_code} {response.text[:200]}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if failures:
        raise SystemExit(f"{len(failures)} of {total} requests failed, first: {failures[0]}")
    return {"clients": clients, "requests": total, "img_per_s": round(total / wall, 2),
            "p50_ms": round(1000 * percentile(latencies, 50), 1), "p95_ms": round(1000 * percentile(latencies, 95), 1),
            "mean_ms": round(1000 * statistics.fmean(latencies), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--images", required=True, help="a folder of images (recursive), posted in turn")
    parser.add_argument("--clients", default="1,4,16", help="comma-separated client counts, run in this order")
    parser.add_argument("--requests", type=int, default=200, help="requests per client count")
    parser.add_argument("--api-key", help="the server's --api-key")
    args = parser.parse_args(argv)
    paths = sorted(p for p in Path(args.images).rglob("*") if p.is_file() and is_image_file(p))
    if not paths:
        parser.error(f"--images {args.images}: no image files")
    bodies = [p.read_bytes() for p in paths]
    run_load(args.url, bodies, 1, min(8, args.requests), args.api_key)  # warm-up: connections, first batches
    for clients in (int(c) for c in args.clients.split(",")):
        print(json.dumps(run_load(args.url, bodies, clients, args.requests, args.api_key)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
