"""A containerized rank's output file (docs/containers.md, "Exit and output"): made by the agent in the rank's inbox
directory, which its container mounts; pointed at by the rank's own process (the few lines a Python rank's container
runs before its command, or a standby's prelude); and the offset the agent copied of it, kept beside it for an agent
that adopts the container. Every process that could write it ends with the container's init, so once the init's exit
is known, what the file holds is all the rank wrote."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from reprise_agent.launch.container_group import FILE, grant

OUTPUT = "rank.out"  # in a rank's (or standby's) inbox directory: its stdout and stderr, which the agent reads
OUTPUT_ENV = "REPRISE_OUTPUT_FILE"  # its path in the container, for the process that points its output there
PYTHON = re.compile(r"python[0-9.]*")  # a rank's interpreter, or its shell: either points its own output at the file
SHELL = re.compile(r"(ba|da)?sh")

# Stdout and stderr into the output file, by the rank's process itself (os imported as _o): where the file cannot be
# opened, the output stays on stdout (the daemon's log), and the rank runs all the same.
POINT_OUTPUT = f"""try:
    _f = _o.open(_o.environ.pop('{OUTPUT_ENV}'), _o.O_WRONLY | _o.O_APPEND)
    _o.dup2(_f, 1)
    _o.dup2(_f, 2)
    _o.close(_f)
except (OSError, KeyError):
    pass
"""
# A Python rank's container runs `python -S -c REDIRECT <the rank's argv>`: its output pointed, then its own command
# in the same process (the pid the handle names). A standby's prelude points its output before its boot.
REDIRECT = f"import os as _o, sys\n{POINT_OUTPUT}_o.execvp(sys.argv[1], sys.argv[1:])\n"
# A shell rank's container runs `<its shell> -c SHELL_REDIRECT <its shell> <the rank's argv>`: the same, in its shell.
SHELL_REDIRECT = (
    f'f=${OUTPUT_ENV}; unset {OUTPUT_ENV}; if [ -n "$f" ] && [ -w "$f" ]; then exec >>"$f" 2>&1; fi; exec "$@"'
)


def pointing(argv: Sequence[str]) -> list[str] | None:
    """The container's command that points the rank's output at its file, then runs `argv` in the same process: by
    the rank's own interpreter (a Python rank) or shell (``sh``, ``bash``, ``dash``), which the image has since the rank
    needs it. None for any other command: whether the image has a shell to do it is not known, and its output stays in
    the daemon's log."""
    name = os.path.basename(argv[0]) if argv else ""
    if PYTHON.fullmatch(name):
        return [argv[0], "-S", "-c", REDIRECT, *argv]
    if SHELL.fullmatch(name):
        return [argv[0], "-c", SHELL_REDIRECT, argv[0], *argv]
    return None


def output_file(gid: int, inbox: Path | None, env: Mapping[str, str]) -> tuple[Path, str] | None:
    """The output file of a rank (or standby) in its inbox directory, made now for its container's group to write
    (launch/container_group.py): its path on the host and in the container. None where it has no inbox."""
    inner = env.get("REPRISE_SDK_INBOX_DIR")
    if inbox is None or not inner:
        return None
    path = inbox / OUTPUT
    path.touch(mode=0o600)
    grant(path, gid, FILE)
    return path, f"{inner}/{OUTPUT}"


def size(path: Path | None) -> int:
    """How long the file is now (0 when there is none)."""
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


class OffsetFile:
    """``<output file>.copied``: how many bytes of the output file were copied, for an agent that adopts the rank."""

    def __init__(self, output: Path) -> None:
        self.path = _copied_path(output)

    def __enter__(self) -> OffsetFile:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        return self

    def write(self, offset: int) -> None:
        os.pwrite(self.fd, b"%20d" % offset, 0)

    def __exit__(self, *_: object) -> None:
        os.close(self.fd)


def _copied_path(output: Path) -> Path:
    return output.with_name(output.name + ".copied")


def copied_offset(output: Path) -> int:
    """How much of a rank's output file an earlier agent copied (0 when it did not say)."""
    try:
        return int(_copied_path(output).read_text(encoding="ascii").strip() or 0)
    except (OSError, ValueError):
        return 0
