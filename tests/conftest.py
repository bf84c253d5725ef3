"""The fuzz's summary: one line per service in pytest's terminal summary, so a plain `pytest` (make test) shows it."""

from __future__ import annotations

import pytest

_FUZZ_LINES = pytest.StashKey[list[str]]()


@pytest.fixture
def fuzz_report(request: pytest.FixtureRequest) -> list[str]:
    """Lines to show in the summary's "OpenAPI fuzz" section."""
    return request.config.stash.setdefault(_FUZZ_LINES, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Print each service's fuzz line (cases sent, server errors, failures) after the run."""
    lines = config.stash.get(_FUZZ_LINES, [])
    if lines:
        terminalreporter.section("OpenAPI fuzz")
        for line in lines:
            terminalreporter.write_line(line)
