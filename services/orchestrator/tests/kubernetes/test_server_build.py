"""Where kube-apiserver comes from: the machine's cache when it was built there, and otherwise a build that says
plainly why it cannot happen (the fixture then skips with that reason) instead of failing deep inside apt or make."""

from __future__ import annotations

from pathlib import Path

import pytest

from reprise_cli import kube
from reprise_common.errors import ConfigError


def test_a_machine_that_cannot_build_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REPRISE_KUBE_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(kube.os, "geteuid", lambda: 1000)
    reason = kube.build_unavailable_reason()
    assert reason is not None and "needs root" in reason
    with pytest.raises(ConfigError, match="needs root"):
        kube.ensure_apiserver()
    assert not kube.apiserver_path().exists()


def test_a_cached_binary_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REPRISE_KUBE_CACHE", str(tmp_path))
    cached = kube.apiserver_path()
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\n")
    monkeypatch.setattr(kube.os, "geteuid", lambda: 1000)  # a build would be refused: none is attempted
    if kube.shutil.which("etcd") is None:
        pytest.skip("etcd-server is not installed here")
    assert kube.ensure_apiserver() == cached
    assert kube.build_unavailable_reason() is None
