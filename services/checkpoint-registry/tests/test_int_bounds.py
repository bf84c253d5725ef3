"""Numbers past 64 bits anywhere in a request are a 422 naming the field, never an overflow in the database (500)."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

BIG = 2**70


def _integer_params(client: TestClient) -> list[tuple[str, str, str, str]]:
    """(method, path, where, name) of every integer path or query parameter in the registry's OpenAPI."""
    found = []
    for path, operations in client.app.openapi()["paths"].items():  # type: ignore[attr-defined]
        for method, operation in operations.items():
            for param in operation.get("parameters", []):
                schema = param.get("schema", {})
                kinds = {schema.get("type"), *(option.get("type") for option in schema.get("anyOf", []))}
                if "integer" in kinds:
                    found.append((method.upper(), path, param["in"], param["name"]))
    return found


def test_every_integer_parameter_past_64_bits_is_a_422(sqlite_client: TestClient) -> None:
    params = _integer_params(sqlite_client)
    assert len(params) >= 10, params
    for method, path, where, name in params:
        concrete = re.sub(r"\{[^}]+\}", "1", path.replace(f"{{{name}}}", str(BIG)))
        others = {other: 1 for m, p, w, other in params if (m, p, w) == (method, path, "query") and other != name}
        query = others | ({name: BIG} if where == "query" else {})
        answer = sqlite_client.request(method, concrete, params=query, json={})
        assert answer.status_code == 422, (method, path, name, answer.status_code, answer.text[:300])
        assert any(err["loc"][-1] == name for err in answer.json()["detail"]), (method, path, answer.text[:300])


@pytest.mark.parametrize("field", ["step", "restart_epoch"])
def test_a_body_number_past_64_bits_is_a_422(sqlite_client: TestClient, tmp_path: object, field: str) -> None:
    body = {"job_id": "j", "step": 1, "path": str(tmp_path), field: BIG}
    answer = sqlite_client.post("/v1/checkpoints", json=body)
    assert answer.status_code == 422, answer.text[:300]
    assert ["body", field] in [err["loc"] for err in answer.json()["detail"]]
