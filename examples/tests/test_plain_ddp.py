"""The plain DDP example stays what it claims to be: a script with no Reprise import, and a job spec the orchestrator
takes as it is. Its crash and recovery on the real platform are tests/test_plain_ddp.py."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from reprise_orchestrator.jobs.models import JobCreate

EXAMPLES = Path(__file__).resolve().parents[1]


def test_the_plain_script_imports_nothing_of_reprise() -> None:
    tree = ast.parse((EXAMPLES / "plain_ddp.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "torch.distributed" in imported
    assert not [name for name in imported if name.split(".")[0].startswith("reprise")], imported


def test_its_job_spec_is_accepted_and_runs_the_script() -> None:
    spec = JobCreate.model_validate(yaml.safe_load((EXAMPLES / "jobs" / "plain_ddp.yaml").read_text()))
    assert "examples/plain_ddp.py" in spec.command and "--snapshot-path" in spec.command
