"""Where a checkpoint's files may be: its directory inside a configured root, its files and marker inside that.

Every path that enters (REST bodies, checkpoint.saved events) is checked here, and checked again right before a file
is read (commit, validation, hashing) or removed (retention): a row stored before these checks existed, or a symlink
swapped in after them, must not make the registry read or delete anything outside its roots. Paths resolve with
os.path.realpath, so a symlink counts where it points; a path that does not exist yet resolves as far as it does.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from reprise_common.errors import RepriseError

FieldPath = tuple[str | int, ...]  # where the refused value sits in its request or event, e.g. ("files", 3, "path")


class PathRefusedError(RepriseError):
    """A checkpoint directory outside the roots, or a file or marker that leaves its checkpoint's directory."""

    def __init__(self, field: FieldPath, reason: str, value: str) -> None:
        super().__init__(f"{field_name(field)}: {reason}")
        self.field = field
        self.reason = reason
        self.value = value


def field_name(field: FieldPath) -> str:
    """A field path as people write it: files[3].path."""
    name = ""
    for part in field:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else part)
    return name


def checkpoint_directory(path: str, roots: Sequence[Path], *, field: FieldPath = ("path",)) -> Path:
    """A checkpoint's directory, resolved: absolute, without '..', strictly inside a root, a directory if it exists."""
    _printable(path, field)
    if not os.path.isabs(path):
        raise PathRefusedError(field, f"{path!r} is not an absolute path", path)
    if ".." in PurePosixPath(path).parts:
        raise PathRefusedError(field, f"{path!r} contains '..'", path)
    resolved = Path(os.path.realpath(path))
    if not any(resolved != root and resolved.is_relative_to(root) for root in roots):
        roots_text = ", ".join(str(root) for root in roots)
        raise PathRefusedError(field, f"{path} resolves outside the checkpoint roots ({roots_text})", path)
    if resolved.exists() and not resolved.is_dir():
        raise PathRefusedError(field, f"{path} is not a directory", path)
    return resolved


def reported_file(checkpoint_path: str, directory: Path, path: str, *, field: FieldPath) -> str:
    """A reported file as stored: relative to the checkpoint's directory (an absolute one must lie inside it)."""
    _printable(path, field)
    candidate = PurePosixPath(path)
    if candidate.is_absolute():
        inside = [
            base
            for base in (PurePosixPath(checkpoint_path), PurePosixPath(directory))
            if candidate.is_relative_to(base)
        ]
        if not inside:
            raise PathRefusedError(field, f"{path} is outside the checkpoint's directory {checkpoint_path}", path)
        candidate = candidate.relative_to(inside[0])
    relative = str(candidate)
    readable(directory, relative, field=field)
    return relative


def marker_file(directory: Path, marker: str, *, field: FieldPath = ("marker",)) -> str:
    """The commit marker: a relative path that stays inside the checkpoint's directory."""
    readable(directory, marker, field=field)
    return marker


def readable(directory: Path, relative: str, *, field: FieldPath) -> Path:
    """The file to open for `relative`: relative, without '..', and inside `directory` once symlinks are followed."""
    lexical = _relative(relative, field)
    target = directory / lexical
    if len(lexical.parts) == 1 and not _is_symlink(target):  # the common case, a tenth of realpath's cost
        return target
    resolved = Path(os.path.realpath(target))
    if resolved == directory or not resolved.is_relative_to(directory):
        raise PathRefusedError(field, f"{relative} resolves outside the checkpoint's directory (a symlink)", relative)
    return resolved


def removable(directory: Path, relative: str, *, field: FieldPath) -> Path:
    """The entry to unlink for `relative`: its parent resolved inside `directory`, its last component not followed."""
    lexical = _relative(relative, field)
    parent = Path(os.path.realpath(directory / lexical.parent))
    if not (parent == directory or parent.is_relative_to(directory)):
        raise PathRefusedError(field, f"{relative} resolves outside the checkpoint's directory (a symlink)", relative)
    return parent / lexical.name  # unlink removes a symlink itself, never what it points to


def marker_present(directory: Path, marker: str) -> bool:
    """The commit marker exists inside the checkpoint's resolved directory (PathRefusedError when it would leave)."""
    return readable(directory, marker, field=("marker",)).is_file()


def plain_relative(path: str) -> bool:
    """A cheap lexical test for hot loops: relative, no '..' segment, no NUL (symlinks are checked separately)."""
    return bool(path) and not path.startswith("/") and "\x00" not in path and ".." not in path.split("/")


def _is_symlink(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:  # not written yet: nothing to follow now, and it is checked again before any read
        return False
    except OSError:
        return True  # let realpath decide


def _relative(path: str, field: FieldPath) -> PurePosixPath:
    _printable(path, field)
    candidate = PurePosixPath(path)
    if candidate.is_absolute():
        raise PathRefusedError(
            field, f"{path} is absolute: name it relative to (inside) the checkpoint's directory", path
        )
    if not candidate.parts or ".." in candidate.parts:
        raise PathRefusedError(field, f"{path!r} points outside the checkpoint's directory ('..' or empty)", path)
    return candidate


def _printable(path: str, field: FieldPath) -> None:
    if not path or "\x00" in path:
        raise PathRefusedError(field, "an empty path or one with a NUL byte", path)
