"""docs/architecture.md shows every rule of the recovery state machine and every method of the compute backend.

The expectations are read from the code (recoveries/rules.py POLICY, compute/backend.py ComputeBackend), so a rule or
a backend method added without a row in the document fails here, naming what is missing.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from reprise_orchestrator.compute.backend import ComputeBackend
from reprise_orchestrator.recoveries.rules import POLICY

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def rows() -> list[str]:
    """The table rows of docs/architecture.md."""
    return [line for line in DOC.read_text().splitlines() if line.startswith("|")]


@pytest.mark.parametrize("rule", [rule.name for rule in POLICY])
def test_every_transition_rule_has_a_row(rows: list[str], rule: str) -> None:
    assert any(row.startswith(f"| {rule} |") for row in rows), f"docs/architecture.md has no row for rule {rule!r}"


def test_the_rules_are_listed_in_the_order_the_policy_asks_them(rows: list[str]) -> None:
    names = [rule.name for rule in POLICY]
    listed = [row.split("|")[1].strip() for row in rows if row.split("|")[1].strip() in names]
    assert listed == names


@pytest.mark.parametrize(
    "method", [name for name, _ in inspect.getmembers(ComputeBackend, inspect.isfunction) if not name.startswith("_")]
)
def test_every_backend_method_has_a_row(rows: list[str], method: str) -> None:
    assert any(row.startswith(f"| `{method}(") for row in rows), f"docs/architecture.md has no row for `{method}()`"
