"""A Slack-compatible incoming-webhook receiver for tests and the demo: it answers as Slack does and records all.

    python -m reprise_cli.slack_receiver --port 8750 --log .state/slack-receiver.jsonl

POST /services/<anything> takes a message and answers 200 `ok`, or 400 `invalid_payload` / `invalid_blocks` when
the body breaks Slack's rules (JSON with `text` or `blocks`; at most 50 blocks; header text ≤ 150 and section text
≤ 3000 characters; unique block ids ≤ 255). Scripted answers come first, in order, for one path or any:
`ok`, `rate_limited` (429 with Retry-After), `no_service` (404), `channel_is_archived` (410), `server_error` (500),
`invalid_payload` (400); script them with `SlackReceiver.script()` or `POST /script` `{"answers": [...], "path":
optional}`, each answer a name or `{"answer": name, "retry_after": seconds}`. Every request is recorded with its
arrival and answer times (in memory and one JSON line each in the log file): `GET /messages` (JSON, `?path=`),
`GET /` (a small HTML page), `POST /reset` forgets them, `GET /healthz` answers `ok`. POST /hooks/<anything> is a
generic JSON webhook sink: recorded and scripted the same way, but any body is taken.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import signal
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import parse_qs, urlsplit

ANSWERS: dict[str, tuple[int, str]] = {
    "ok": (200, "ok"),
    "rate_limited": (429, "rate_limited"),
    "no_service": (404, "no_service"),
    "channel_is_archived": (410, "channel_is_archived"),
    "server_error": (500, "internal_error"),
    "invalid_payload": (400, "invalid_payload"),
}
MAX_BLOCKS = 50
MAX_HEADER_TEXT = 150
MAX_SECTION_TEXT = 3000
MAX_BLOCK_ID = 255
_KEPT_HEADERS = ("content-type", "user-agent", "x-reprise-timestamp", "x-reprise-signature", "x-reprise-message-id")


@dataclass(frozen=True)
class Scripted:
    """One scripted answer."""

    answer: str
    retry_after: float | None = None

    @classmethod
    def parse(cls, spec: str | dict[str, Any]) -> Scripted:
        """A name, or {"answer": name, "retry_after": seconds}; ValueError for an unknown name."""
        scripted = cls(spec) if isinstance(spec, str) else cls(str(spec["answer"]), spec.get("retry_after"))
        if scripted.answer not in ANSWERS:
            raise ValueError(f"unknown answer {scripted.answer!r}: one of {sorted(ANSWERS)}")
        return scripted


@dataclass
class Received:
    """One request as it arrived and how it was answered (times are Unix seconds of this machine)."""

    path: str
    arrived: float
    answered: float
    status: int
    answer: str
    body: str
    headers: dict[str, str] = field(default_factory=dict)
    retry_after: float | None = None

    def payload(self) -> Any:
        """The body as JSON, or None when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def block_ids(self) -> list[str]:
        """The block ids of the message's blocks (the notifier puts one alert's delivery id in each)."""
        payload = self.payload()
        blocks = payload.get("blocks", []) if isinstance(payload, dict) else []
        return [b["block_id"] for b in blocks if isinstance(b, dict) and "block_id" in b]


def check_slack_payload(body: str) -> str | None:
    """Why Slack would refuse this body (its error code), or None when it would take it."""
    try:
        payload = json.loads(body)
    except ValueError:
        return "invalid_payload"
    if not isinstance(payload, dict) or not (payload.get("text") or payload.get("blocks")):
        return "no_text"
    blocks = payload.get("blocks") or []
    return None if isinstance(blocks, list) and _blocks_ok(blocks) else "invalid_blocks"


def _blocks_ok(blocks: list[Any]) -> bool:
    if len(blocks) > MAX_BLOCKS or not all(isinstance(b, dict) for b in blocks):
        return False
    ids = [str(b["block_id"]) for b in blocks if b.get("block_id")]
    if len(ids) != len(set(ids)) or any(len(i) > MAX_BLOCK_ID for i in ids):
        return False
    for block in blocks:
        text = (block.get("text") or {}).get("text", "")
        limit = MAX_HEADER_TEXT if block.get("type") == "header" else MAX_SECTION_TEXT
        if len(text) > limit or any(len(f.get("text", "")) > 2000 for f in block.get("fields") or []):
            return False
    return True


class SlackReceiver:
    """The receiver: an HTTP server in a background thread, its requests kept in memory and in a JSONL file."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, log_path: Path | None = None) -> None:
        self.log_path = log_path
        self._lock = threading.Lock()
        self._received: list[Received] = []
        self._scripts: dict[str | None, deque[Scripted]] = {}
        self._server = ThreadingHTTPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self._server.receiver = self  # type: ignore[attr-defined]  # the handler finds its receiver here
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8750."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def webhook_url(self, name: str = "T0000/B0000/XXXXXXXXXXXXXXXXXXXXXXXX") -> str:
        """An incoming-webhook URL on this receiver."""
        return f"{self.url}/services/{name}"

    def start(self) -> SlackReceiver:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="slack-receiver", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until shutdown() or a signal."""
        self._server.serve_forever()

    def shutdown(self) -> None:
        """Make serve_forever return (call it from another thread than the one serving)."""
        self._server.shutdown()

    def close(self) -> None:
        """Close the listening socket."""
        self._server.server_close()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def script(self, *answers: str | dict[str, Any], path: str | None = None) -> None:
        """Queue answers for the next requests to `path` (any path when None), in order."""
        parsed = [Scripted.parse(a) for a in answers]
        with self._lock:
            self._scripts.setdefault(path, deque()).extend(parsed)

    def messages(self, path: str | None = None) -> list[Received]:
        """Every request received (to one path), in arrival order."""
        with self._lock:
            return [r for r in self._received if path is None or r.path == path]

    def reset(self) -> None:
        """Forget requests and scripts."""
        with self._lock:
            self._received.clear()
            self._scripts.clear()

    def next_scripted(self, path: str) -> Scripted | None:
        with self._lock:
            for key in (path, None):
                queue = self._scripts.get(key)
                if queue:
                    return queue.popleft()
        return None

    def record(self, received: Received) -> None:
        with self._lock:
            self._received.append(received)
            if self.log_path is not None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with self.log_path.open("a") as sink:
                    sink.write(json.dumps(asdict(received)) + "\n")


class _Handler(BaseHTTPRequestHandler):
    server_version = "slack-receiver/1"

    @property
    def receiver(self) -> SlackReceiver:
        found: SlackReceiver = self.server.receiver  # type: ignore[attr-defined]
        return found

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: every request is recorded instead."""

    def do_POST(self) -> None:
        """A message to a webhook, a script, or a reset."""
        arrived = time.time()
        path = urlsplit(self.path).path
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode("utf-8", errors="replace")
        if path.startswith(("/services/", "/hooks/")):
            self._take(path, body, arrived)
        elif path == "/script":
            try:
                spec = json.loads(body)
                self.receiver.script(*spec["answers"], path=spec.get("path"))
            except (ValueError, KeyError, TypeError) as exc:
                self._send(400, f"bad script: {exc}")
                return
            self._send(200, "ok")
        elif path == "/reset":
            self.receiver.reset()
            self._send(200, "ok")
        else:
            self._send(404, "no_service")

    def _take(self, path: str, body: str, arrived: float) -> None:
        scripted = self.receiver.next_scripted(path)
        if scripted is not None:
            answer, retry_after = scripted.answer, scripted.retry_after
            if answer == "rate_limited" and retry_after is None:
                retry_after = 1.0
        elif path.startswith("/hooks/"):
            answer, retry_after = "ok", None
        else:
            answer, retry_after = check_slack_payload(body) or "ok", None
        status, text = ANSWERS.get(answer, (400, answer))
        headers = {k: v for k, v in self.headers.items() if k.lower() in _KEPT_HEADERS}
        answered = time.time()
        self.receiver.record(Received(path, arrived, answered, status, text, body, headers, retry_after))
        extra = {"Retry-After": f"{retry_after:g}"} if retry_after is not None else {}
        self._send(status, text, extra)

    def do_GET(self) -> None:
        """Recorded messages as JSON or HTML, or the health probe."""
        parts = urlsplit(self.path)
        if parts.path == "/healthz":
            self._send(200, "ok")
        elif parts.path == "/messages":
            wanted = parse_qs(parts.query).get("path", [None])[0]
            records = [asdict(r) for r in self.receiver.messages(wanted)]
            self._send(200, json.dumps(records), content_type="application/json")
        elif parts.path == "/":
            self._send(200, _page(self.receiver.messages()), content_type="text/html; charset=utf-8")
        else:
            self._send(404, "not found")

    def _send(
        self, status: int, text: str, headers: dict[str, str] | None = None, content_type: str = "text/plain"
    ) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)


def _page(received: list[Received]) -> str:
    rows = []
    for r in reversed(received[-200:]):
        payload = r.payload()
        text = payload.get("text", "") if isinstance(payload, dict) else r.body[:300]
        stamp = time.strftime("%H:%M:%S", time.localtime(r.arrived)) + f".{int(r.arrived % 1 * 1000):03d}"
        cells = (stamp, r.path.rsplit("/", 1)[-1][:8] + "…", f"{r.status} {r.answer}", text)
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return (
        "<!doctype html><meta charset=utf-8><meta http-equiv=refresh content=2><title>Slack receiver</title>"
        "<style>body{font:14px sans-serif}td{padding:2px 8px;vertical-align:top;border-bottom:1px solid #ddd}"
        "</style>"
        f"<h1>Received messages ({len(received)})</h1><table><tr><th>arrived<th>webhook<th>answer<th>text</tr>"
        + "".join(rows)
        + "</table>"
    )


def main(argv: list[str] | None = None) -> None:
    """Run the receiver until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(description="A Slack-compatible incoming-webhook receiver for tests and demos.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8750)
    parser.add_argument("--log", type=Path, default=None, help="append every request as a JSON line here")
    args = parser.parse_args(argv)
    receiver = SlackReceiver(host=args.host, port=args.port, log_path=args.log)

    def stop(_signum: int, _frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever, which runs in this thread: ask from another one.
        threading.Thread(target=receiver.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"slack receiver on {receiver.url}/services/... (messages: {receiver.url}/messages)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        receiver.serve_forever()
    receiver.close()


if __name__ == "__main__":
    main()
