"""The checkpoint registry's speed and safety, measured on real files, a real SQLite database and real processes.

Run from the repository root: ``make bench-registry`` (or ``.venv/bin/python -m bench.bench_registry``). Prints the
figures and saves bench/results/registry.json:

  hash_blake3_gbps / hash_sha256_gbps   the registry's parallel streaming hashers over the same files
  sha256sum_gbps                        coreutils ``sha256sum`` over the same files, in the same run
  hash_speedup_vs_sha256sum             BLAKE3 (registry) / sha256sum; target ≥ 2
  validate_16384_files_ms               validating a 16,384-file manifest on the metadata path (completeness, marker,
                                        every file's size; no re-hash), median and p99; target ≤ 500 ms
  latest_lookup_100k_ms                 latest-validated lookup for a job with 100,000 checkpoints (the service call,
                                        and the HTTP route), median and p99; target ≤ 10 ms
  torn_writes                           1,000 writers SIGKILLed at random points, then byte flips: violations must be 0
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import insert
from sqlmodel import Session

from bench.common import latency_summary, write_result
from reprise_cli.servers import free_port
from reprise_registry import db
from reprise_registry.app import create_app
from reprise_registry.checkpoints import service
from reprise_registry.checkpoints.models import Algorithm, Checkpoint, CheckpointCreate, CheckpointState, FileReport
from reprise_registry.db import Engines
from reprise_registry.settings import RegistrySettings
from reprise_registry.validation.hashing import hash_files
from reprise_registry.validation.service import validate_checkpoint

TORN = Path(__file__).resolve().parents[1] / "services" / "checkpoint-registry" / "tests" / "torn.py"


def _ms(samples_ns: list[int]) -> dict[str, float]:
    summary = latency_summary(samples_ns)
    return {key.replace("_us", "_ms"): round(value / 1000, 3) if key.endswith("_us") else value
            for key, value in summary.items()}  # fmt: skip


def bench_hashing(root: Path, *, files: int, mib: int, repeats: int) -> dict[str, Any]:
    """Throughput of BLAKE3 and SHA-256 (registry) and sha256sum over the same page-cached files."""
    paths = []
    for index in range(files):
        path = root / f"shard-{index:03d}.bin"
        with path.open("wb") as sink:
            for _ in range(mib):
                sink.write(os.urandom(1 << 20))
        paths.append(path)
    total = files * mib * (1 << 20)
    shutil.which("sha256sum") or sys.exit("sha256sum not found")
    subprocess.run(["sha256sum", *map(str, paths)], check=True, capture_output=True)  # warm the page cache

    def timed(run: Any) -> float:
        best = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best.append(time.perf_counter() - start)
        return statistics.median(best)

    blake = timed(lambda: hash_files(paths, Algorithm.BLAKE3))
    sha = timed(lambda: hash_files(paths, Algorithm.SHA256))
    coreutils = timed(lambda: subprocess.run(["sha256sum", *map(str, paths)], check=True, capture_output=True))
    return {
        "hash_bytes": total,
        "hash_files": files,
        "hash_blake3_gbps": round(total / blake / 1e9, 3),
        "hash_sha256_gbps": round(total / sha / 1e9, 3),
        "sha256sum_gbps": round(total / coreutils / 1e9, 3),
        "hash_speedup_vs_sha256sum": round(coreutils / blake, 2),
        "hash_sha256_speedup_vs_sha256sum": round(coreutils / sha, 2),
    }


def bench_validation(root: Path, url: str, *, files: int, ranks: int, iterations: int) -> dict[str, Any]:
    """Validate (metadata path) one committed checkpoint of `files` files written by `ranks` ranks."""
    engine = db.make_write_engine(url)
    db.upgrade(engine)
    directory = root / "many"
    directory.mkdir()
    per_rank = files // ranks
    with Session(engine) as session:
        data = CheckpointCreate(job_id="bench-v", step=1, path=str(directory), world_size=ranks)
        checkpoint = service.begin(session, data=data, roots=[root.resolve()])
        assert checkpoint.id is not None
        for rank in range(ranks):
            reports = []
            for index in range(per_rank):
                name = f"__{rank}_{index}.distcp"
                (directory / name).write_bytes(b"x" * 64)
                reports.append(FileReport(path=name, size_bytes=64, digest="0" * 64))
            service.report_rank(session, checkpoint_id=checkpoint.id, rank=rank, files=reports, roots=[root.resolve()])
        (directory / "COMMITTED").write_bytes(b"")
        assert service.try_commit(session, checkpoint_id=checkpoint.id, roots=[root.resolve()]).committed
    engines = Engines(read=engine, write=engine)
    samples = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        outcome = validate_checkpoint(engines, checkpoint_id=checkpoint.id, sample_fraction=0.0, roots=[root.resolve()])
        samples.append(time.perf_counter_ns() - start)
        assert outcome.state == CheckpointState.VALIDATED, outcome.reason
    engine.dispose()
    return {"validate_files": files, "validate_16384_files_ms": _ms(samples)}


def bench_latest(url: str, *, checkpoints: int, lookups: int) -> dict[str, Any]:
    """Latest-validated lookups for a job with `checkpoints` checkpoints (one in ten not validated)."""
    engine = db.make_write_engine(url)
    db.upgrade(engine)
    states = [CheckpointState.VALIDATED] * 9 + [CheckpointState.CORRUPT]
    rows = [
        {"job_id": "bench-l", "step": step, "path": f"/c/{step}", "state": states[step % 10], "layout": "per_rank",
         "marker": "COMMITTED", "restart_epoch": 0, "reason": "", "load_failure": ""}
        for step in range(checkpoints)
    ]  # fmt: skip
    with Session(engine) as session:
        for offset in range(0, len(rows), 10_000):
            session.execute(insert(Checkpoint), rows[offset : offset + 10_000])
        session.commit()
    service_ns = []
    with Session(engine) as session:
        for _ in range(lookups):
            start = time.perf_counter_ns()
            found = service.latest_validated(session, job_id="bench-l")
            service_ns.append(time.perf_counter_ns() - start)
            session.expunge_all()
    assert found.step == checkpoints - 2
    engine.dispose()
    http_ns = []
    key = secrets.token_urlsafe(32)  # the bootstrap admin key: checked in the registry, no key authority needed
    settings = RegistrySettings(
        database_url=url, nats_url="nats://127.0.0.1:1", consume_agent_events=False, admin_api_key=key
    )
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {key}"}) as client:
        for _ in range(lookups):
            start = time.perf_counter_ns()
            answer = client.get("/v1/jobs/bench-l/checkpoints/latest")
            http_ns.append(time.perf_counter_ns() - start)
            assert answer.status_code == 200
    return {
        "latest_checkpoints": checkpoints,
        "latest_lookup_100k_ms": _ms(service_ns),
        "latest_lookup_100k_http_ms": _ms(http_ns),
    }


def bench_torn(root: Path, *, runs: int, parallel: int) -> dict[str, Any]:
    """The torn-write campaign of the acceptance test, at bench size, against a registry process."""
    spec = importlib.util.spec_from_file_location("registry_torn", TORN)
    assert spec is not None and spec.loader is not None
    torn = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = torn  # dataclasses look their module up there
    spec.loader.exec_module(torn)
    port = free_port()
    proc = torn.start_registry(root, port)
    base = f"http://127.0.0.1:{port}"
    try:
        torn.wait_healthy(base)
        start = time.monotonic()
        stats = torn.campaign(base, root / "ckpt", job="torn", runs=runs, parallel=parallel, seed=1000)
        elapsed = time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return {
        "torn_writes": {
            "runs": stats.runs,
            "killed": stats.killed,
            "final_states": stats.states,
            "byte_flips": stats.flipped,
            "violations": len(stats.violations),
            "violation_examples": stats.violations[:5],
            "seconds": round(elapsed, 1),
        }
    }


def main() -> None:
    """Run every benchmark, print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args()
    quick = args.quick
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-registry-") as tmp:
        root = Path(tmp)
        (root / "hash").mkdir()
        figures |= bench_hashing(root / "hash", files=8 if quick else 16, mib=16 if quick else 64, repeats=3)
        print({k: v for k, v in figures.items() if k.startswith(("hash", "sha"))}, flush=True)
        figures |= bench_validation(root, f"sqlite:///{root / 'v.db'}", files=16_384, ranks=64,
                                    iterations=5 if quick else 20)  # fmt: skip
        print("validate_16384_files_ms", figures["validate_16384_files_ms"], flush=True)
        figures |= bench_latest(f"sqlite:///{root / 'l.db'}", checkpoints=100_000, lookups=200 if quick else 2000)
        print("latest_lookup_100k_ms", figures["latest_lookup_100k_ms"], flush=True)
        (root / "torn").mkdir()
        figures |= bench_torn(root / "torn", runs=100 if quick else 1000, parallel=8)
        print("torn_writes", figures["torn_writes"], flush=True)
    figures["targets"] = {
        "hash_speedup_vs_sha256sum": ">= 2",
        "validate_16384_files_ms.median_ms": "<= 500",
        "latest_lookup_100k_ms.median_ms": "<= 10",
        "torn_writes.violations": "0",
    }
    print("saved", write_result("registry", figures))


if __name__ == "__main__":
    main()
