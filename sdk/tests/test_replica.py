"""Peer recovery between real ranks of a gloo group: the vote, the transfer, and every fallback to the checkpoint."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed: peer recovery is not tested")

RANK = """
import json, os, sys, torch, torch.distributed as dist
from reprise_sdk.torch import replica
spec = json.loads(sys.argv[1])
rank = int(os.environ["RANK"])
held = spec["held"].get(str(rank))
if held is not None:  # a survivor restarted in place: its state is at step `held` (each rank's own, to see who sent)
    weights = torch.full((3,), float(held * 10 + rank))
    replica.hold(held, lambda: {"w": weights, "step": held, "rng": torch.get_rng_state()})
if rank in spec.get("refuse", []):  # this rank cannot take what it receives
    torch.load = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("unreadable"))
os.environ.update(spec.get("env", {}))
dist.init_process_group("gloo")
got = replica.restore()
state = got.state or {}
after = torch.ones(1)
dist.all_reduce(after)  # whatever the path, the group trains on: a failed transfer leaves it usable
print(json.dumps({"rank": rank, "path": got.path, "step": got.step, "reason": got.reason, "source": got.source_rank,
                  "w": state["w"].tolist() if "w" in state else None, "held_after": replica.step,
                  "group_after": after.item()}))
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


def restore(gloo_ranks: Callable[..., list[str]], **spec: Any) -> list[dict[str, Any]]:
    outputs = gloo_ranks(RANK, json.dumps(spec), world_size=3)
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def test_joining_ranks_take_the_lowest_survivors_state(gloo_ranks: Callable[..., list[str]]) -> None:
    results = restore(gloo_ranks, held={"1": 5, "2": 5})  # rank 0 is new (a standby or a cold start)
    assert {r["path"] for r in results} == {"peer"} and {r["step"] for r in results} == {5}
    assert {r["source"] for r in results} == {1}
    assert [r["w"] for r in results] == [[51.0, 51.0, 51.0]] * 3  # rank 1's state, on every rank


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"held": {"0": 5, "1": 6}}, "the survivors disagree on the step they hold (5, 6)"),
        ({"held": {}}, "no rank survived holding a replica"),
        ({"held": {"0": 5, "1": 5}, "env": {"REPRISE_PEER_RESTORE": "0"}}, "peer recovery is off"),
        ({"held": {"0": 5, "1": 5}, "env": {"REPRISE_SKIP_STEPS": "4-5"}}, "rolls back past bad data"),
    ],
)
def test_every_rank_falls_back_to_the_checkpoint_together(
    gloo_ranks: Callable[..., list[str]], spec: dict[str, Any], reason: str
) -> None:
    results = restore(gloo_ranks, **spec)
    assert {r["path"] for r in results} == {"checkpoint"}
    assert all(reason in r["reason"] for r in results), results
    assert {r["held_after"] for r in results} == {-1}  # what was held is not what training goes on from


def test_a_rank_that_cannot_take_the_transfer_sends_everyone_to_the_checkpoint(
    gloo_ranks: Callable[..., list[str]],
) -> None:
    results = restore(gloo_ranks, held={"0": 5, "1": 5}, refuse=[2])
    assert {r["path"] for r in results} == {"checkpoint"} and {r["group_after"] for r in results} == {3.0}
    assert all("the transfer failed on rank 2: RuntimeError: unreadable" in r["reason"] for r in results)
