"""Torn writes: a checkpoint writer killed at random points, byte flips, and the check that none is ever restorable.

Used by tests/test_torn_writes.py (200 kills) and bench/bench_registry.py (1,000 kills). Run as a script, this module
is the writer: it talks to a running registry over HTTP with the standard library only (fast to start) and writes
per-rank files in small chunks. Between any two of its steps (a registry call, a chunk, the marker) it stops at a
*kill point*: it says `point` on stdout and waits for `go` on stdin. The driver SIGKILLs it at the point the run's
plan names, so where a writer dies is chosen by the seed, not by how fast the machine happens to be.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

WORLD = 3
FILE_BYTES = 96 * 1024
CHUNK = 16 * 1024
POINTS = 1 + WORLD * (-(-FILE_BYTES // CHUNK) + 1) + 1  # begin, per rank its chunks and report, the marker
MODES = ("in_order", "report_first", "marker_early")
# The registry's bootstrap admin key for this run: the driver makes it, the writers it starts inherit it.
KEY_VARIABLE = "REPRISE_TORN_API_KEY"
os.environ.setdefault(KEY_VARIABLE, secrets.token_urlsafe(32))


def content(seed: int, rank: int) -> bytes:
    """The bytes rank `rank` of run `seed` means to write (the ground truth the checks compare with)."""
    return random.Random(seed * 1000 + rank).randbytes(FILE_BYTES + rank)


def _call(base: str, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        base + path,
        data=data,
        method=method,
        headers={"content-type": "application/json", "authorization": f"Bearer {os.environ[KEY_VARIABLE]}"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        result: dict[str, Any] = json.loads(answer.read())
        return result


def kill_point() -> None:
    """Tell the driver where the writer is and wait until it says go (or kills the writer here)."""
    print("point", flush=True)
    if sys.stdin.readline() != "go\n":
        raise SystemExit("the driver went away")


def write(base: str, job: str, step: int, root: Path, mode: str) -> None:
    """Begin, write each rank's file in chunks (reporting before or after), write the marker, commit."""
    root.mkdir(parents=True, exist_ok=True)
    begun = _call(
        base, "POST", "/v1/checkpoints", {"job_id": job, "step": step, "path": str(root), "world_size": WORLD}
    )
    kill_point()
    for rank in range(WORLD):
        data = content(step, rank)
        digest = blake3.blake3(data).hexdigest()
        report = {"files": [{"path": f"rank-{rank:05d}.pt", "size_bytes": len(data), "digest": digest}]}
        if mode != "in_order":  # a writer that knows its digests up front (it hashed the state in memory)
            _call(base, "PUT", f"/v1/checkpoints/{begun['id']}/ranks/{rank}", report)
            kill_point()
        if mode == "marker_early" and rank == WORLD - 1:
            (root / "COMMITTED").write_bytes(b"")  # a buggy writer: the marker before the last rank's data
        with (root / f"rank-{rank:05d}.pt").open("wb") as sink:  # in place, not atomic: tearing is the point
            for offset in range(0, len(data), CHUNK):
                sink.write(data[offset : offset + CHUNK])
                sink.flush()
                kill_point()
        if mode == "in_order":
            _call(base, "PUT", f"/v1/checkpoints/{begun['id']}/ranks/{rank}", report)
            kill_point()
    (root / "COMMITTED").write_bytes(b"")
    kill_point()
    _call(base, "POST", f"/v1/checkpoints/{begun['id']}/commit")


@dataclass
class TornStats:
    """What a torn-write campaign did and found."""

    runs: int = 0
    killed: int = 0
    states: dict[str, int] = field(default_factory=dict)
    flipped: int = 0
    violations: list[str] = field(default_factory=list)


def run_writers(base: str, root: Path, *, job: str, runs: int, parallel: int, seed: int) -> TornStats:
    """Start `runs` writers (`parallel` at a time); each is SIGKILLed at a random kill point or, for about one run in
    four (a plan past the last point), allowed to finish."""
    rng = random.Random(seed)
    plan = [(step, MODES[step % len(MODES)], rng.randrange(POINTS + POINTS // 3)) for step in range(runs)]
    stats = TornStats(runs=runs)

    def one(step: int, mode: str, kill_at: int) -> bool:
        argv = [sys.executable, __file__, base, job, str(step), str(root / f"step-{step}"), mode]
        with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
            assert proc.stdin is not None and proc.stdout is not None
            reached = 0
            while proc.stdout.readline() == b"point\n":
                if reached == kill_at:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    return True
                reached += 1
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
            if proc.wait() != 0:
                raise RuntimeError(f"writer {step} failed by itself (exit {proc.returncode})")
            return False

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        stats.killed = sum(pool.map(lambda item: one(*item), plan))
    return stats


def intact(checkpoint: dict[str, Any]) -> bool:
    """Every rank file on disk is exactly what the writer meant to write, and the marker is there."""
    root = Path(checkpoint["path"])
    for rank in range(WORLD):
        path = root / f"rank-{rank:05d}.pt"
        if not path.is_file() or path.read_bytes() != content(checkpoint["step"], rank):
            return False
    return (root / "COMMITTED").is_file()


def all_checkpoints(base: str, job: str) -> list[dict[str, Any]]:
    """Every checkpoint of the job."""
    return list(_call(base, "GET", f"/v1/jobs/{job}/checkpoints?limit=1000")["data"])


def check(base: str, job: str, stats: TornStats, when: str) -> None:
    """Record a violation for any validated checkpoint that is not intact, or a latest that is not intact."""
    rows = all_checkpoints(base, job)
    for row in rows:
        if row["state"] == "validated" and not intact(row):
            stats.violations.append(f"{when}: checkpoint {row['id']} (step {row['step']}) validated but torn")
    try:
        latest = _call(base, "GET", f"/v1/jobs/{job}/checkpoints/latest")
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
        return
    if latest["state"] != "validated" or not intact(latest):
        stats.violations.append(f"{when}: latest {latest['id']} is {latest['state']} and not intact")


def commit_everything(base: str, job: str) -> None:
    """Try to commit every unfinished checkpoint (as the NATS path does automatically): only complete ones may."""
    for row in all_checkpoints(base, job):
        if row["state"] == "writing":
            try:
                _call(base, "POST", f"/v1/checkpoints/{row['id']}/commit")
            except urllib.error.HTTPError as exc:
                if exc.code != 409:
                    raise


def settle(base: str, job: str, timeout_s: float = 60.0) -> None:
    """Wait until the registry's validator has decided every committed checkpoint."""
    deadline = time.monotonic() + timeout_s
    while any(r["state"] == "committed" for r in all_checkpoints(base, job)):
        if time.monotonic() > deadline:
            raise TimeoutError("committed checkpoints still undecided")
        time.sleep(0.1)


def flip_bytes(base: str, job: str, stats: TornStats, *, seed: int, share: float = 0.5) -> list[int]:
    """Flip one random byte in a random file of a share of the validated checkpoints; re-verify every one."""
    rng = random.Random(seed)
    flipped = []
    for row in all_checkpoints(base, job):
        if row["state"] != "validated":
            continue
        if rng.random() < share:
            path = Path(row["path"]) / f"rank-{rng.randrange(WORLD):05d}.pt"
            data = bytearray(path.read_bytes())
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
            flipped.append(row["id"])
        _call(base, "POST", f"/v1/checkpoints/{row['id']}/validate?sample_fraction=1")
    stats.flipped = len(flipped)
    return flipped


def campaign(base: str, root: Path, *, job: str, runs: int, parallel: int, seed: int) -> TornStats:
    """Kill writers, check; commit what can be, settle, check; flip bytes, re-verify, check."""
    stats = run_writers(base, root, job=job, runs=runs, parallel=parallel, seed=seed)
    check(base, job, stats, "after the kills")
    commit_everything(base, job)
    settle(base, job)
    check(base, job, stats, "after committing everything")
    flipped = flip_bytes(base, job, stats, seed=seed)
    check(base, job, stats, "after the byte flips")
    rows = {row["id"]: row for row in all_checkpoints(base, job)}
    stats.violations += [f"flipped {i} is {rows[i]['state']}" for i in flipped if rows[i]["state"] != "corrupt"]
    for row in rows.values():
        stats.states[row["state"]] = stats.states.get(row["state"], 0) + 1
    return stats


def start_registry(root: Path, port: int) -> subprocess.Popen[bytes]:
    """The registry as its own process on SQLite, validating every 0.2 s, with NATS unreachable."""
    env = {
        **os.environ,
        "REPRISE_DATABASE_URL": f"sqlite:///{root / 'registry.db'}",
        "REPRISE_HTTP_PORT": str(port),
        "REPRISE_NATS_URL": "nats://127.0.0.1:1",
        "REPRISE_CONSUME_AGENT_EVENTS": "false",
        "REPRISE_VALIDATE_INTERVAL_S": "0.2",
        "REPRISE_LOG_LEVEL": "WARNING",
        "REPRISE_ADMIN_API_KEY": os.environ[KEY_VARIABLE],
    }
    log = (root / "registry.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "reprise_registry"], env=env, stdout=log, stderr=log)


def wait_healthy(base: str, timeout_s: float = 30.0) -> None:
    """Wait for /healthz and for the schema (a first list call answers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _call(base, "GET", "/v1/jobs/probe/checkpoints")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


if __name__ == "__main__":
    write(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5])
