"""The DDP example as real gloo process groups: killed mid-run, resumed at other world sizes, bit-for-bit equal."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the DDP example is not tested")

SCRIPT = Path(__file__).resolve().parents[1] / "ddp_train.py"
SDK_TEST_FIXTURES = Path(__file__).resolve().parents[2] / "sdk" / "tests" / "conftest.py"
# run_gloo_ranks runs `python -c CODE ARGS...`: this CODE runs the script file given as the first argument.
RUN_FILE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
STEPS, EVERY, GLOBAL_BATCH = 24, 6, 64  # 8 micro-batches of 8 per step: 3 ranks get 3, 3 and 2
DIGEST = "params-sha256 "


def _run_gloo_ranks() -> Callable[..., list[str]]:
    """The SDK tests' helper that runs a script as every rank of a gloo group (one way to launch ranks)."""
    spec = importlib.util.spec_from_file_location("reprise_sdk_test_fixtures", SDK_TEST_FIXTURES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    helper: Callable[..., list[str]] = module._run_gloo_ranks
    return helper


run_gloo_ranks = _run_gloo_ranks()


def arguments(checkpoint_dir: Path, *extra: str) -> list[str]:
    """The example's command line: every run of this module trains the same model the same way."""
    return ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--global-batch", str(GLOBAL_BATCH),
            "--micro-batch", "8", "--checkpoint-dir", str(checkpoint_dir), *extra]  # fmt: skip


def train(world_size: int, checkpoint_dir: Path, *extra: str) -> str:
    """Run the example to the end with `world_size` ranks; what rank 0 printed."""
    return run_gloo_ranks(RUN_FILE, str(SCRIPT), *arguments(checkpoint_dir, *extra), world_size=world_size)[0]


def digest_in(output: str) -> str:
    """The final parameters' digest in what rank 0 printed."""
    return next(line.removeprefix(DIGEST) for line in output.splitlines() if line.startswith(DIGEST))


def start_ranks(world_size: int, *args: str) -> list[subprocess.Popen[bytes]]:
    """Start the example's ranks without waiting for them (run_gloo_ranks waits, and a killed run never ends well)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPRISE_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size))
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(world_size)
    ]


def committed_steps(checkpoint_dir: Path) -> list[Path]:
    """The checkpoints whose COMMITTED marker exists, oldest first."""
    return sorted(p.parent for p in checkpoint_dir.glob("step-*/COMMITTED"))


@dataclass(frozen=True)
class Reference:
    """An uninterrupted world-2 run: its checkpoints, its output file and the digest it printed."""

    digest: str
    checkpoint_dir: Path
    output: Path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    root = tmp_path_factory.mktemp("reference")
    digest = digest_in(train(2, root / "ckpt", "--output", str(root / "final.pt")))
    return Reference(digest, root / "ckpt", root / "final.pt")


@pytest.fixture(scope="module")
def killed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints of a world-2 run SIGKILLed after a commit."""
    root = tmp_path_factory.mktemp("killed")
    kill_after_a_checkpoint(root / "ckpt", root / "final.pt")
    return root / "ckpt"


def kill_after_a_checkpoint(checkpoint_dir: Path, output: Path) -> None:
    """Run the example with 2 ranks and SIGKILL both once a checkpoint is committed, before the run ends."""
    # Slow steps (the sleep changes no number) leave time to kill the ranks after the first commit.
    ranks = start_ranks(2, *arguments(checkpoint_dir, "--step-sleep", "0.1", "--output", str(output)))
    try:
        deadline = time.monotonic() + 90
        while not committed_steps(checkpoint_dir) and time.monotonic() < deadline:
            assert all(rank.poll() is None for rank in ranks), "a rank exited before the first checkpoint"
            time.sleep(0.02)
    finally:
        for rank in ranks:
            rank.send_signal(signal.SIGKILL)
        for rank in ranks:
            rank.wait(timeout=30)
    assert committed_steps(checkpoint_dir), "no checkpoint was committed in 90 s"
    assert not output.exists(), "the run finished before it was killed: nothing was interrupted"


def test_output_holds_the_parameters_whose_digest_is_printed(reference: Reference) -> None:
    state = torch.load(reference.output, weights_only=True)
    flat = torch.cat([tensor.reshape(-1) for tensor in state.values()])
    assert hashlib.sha256(flat.numpy()).hexdigest() == reference.digest


def test_a_checkpoint_written_mid_run_is_complete_and_loadable(reference: Reference, killed_dir: Path) -> None:
    from reprise_sdk.torch import load_checkpoint

    first = committed_steps(killed_dir)[0]
    assert sorted(p.name for p in first.iterdir()) == ["COMMITTED", "rank-00000.pt", "rank-00001.pt"]
    ranks = [load_checkpoint(first, rank=rank) for rank in range(2)]
    expected = load_checkpoint(reference.checkpoint_dir / first.name, rank=0)
    for state in ranks:
        assert (state["step"], state["world_size"], state["data"]["next_sample"]) == (EVERY, 2, EVERY * GLOBAL_BATCH)
        assert state["scheduler"]["last_epoch"] == EVERY
        assert state["rng"]["torch"].dtype == torch.uint8 and len(state["rng"]["python"][1]) == 625
        # Same parameters and optimizer moments on both ranks, and as the uninterrupted run had at that step.
        for name, tensor in expected["model"].items():
            assert torch.equal(state["model"][name], tensor), name
        for index, moments in expected["optimizer"]["state"].items():
            assert torch.equal(state["optimizer"]["state"][index]["exp_avg_sq"], moments["exp_avg_sq"])


@pytest.mark.parametrize("world_size", [2, 1, 3], ids=["same-world", "shrunk-to-1", "grown-to-3-uneven"])
def test_a_killed_run_resumed_at_any_world_size_ends_bit_for_bit_equal(
    reference: Reference, killed_dir: Path, world_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    newest = committed_steps(killed_dir)[-1]
    step = int(newest.name.removeprefix("step-"))
    assert step < STEPS
    monkeypatch.setenv("REPRISE_RESUME_CHECKPOINT", str(newest))  # what the agent sets on a relaunch

    output = train(world_size, tmp_path / "ckpt")
    assert f"starting at step {step + 1} from {newest} (saved by 2 ranks)" in output  # not trained again from scratch
    assert digest_in(output) == reference.digest


def test_resume_latest_continues_from_the_newest_committed_checkpoint_on_disk(
    reference: Reference, tmp_path: Path
) -> None:
    """What a torchrun user's restarted script does: nothing handed over, so the newest committed save on disk."""
    checkpoints = tmp_path / "ckpt"
    for step in (EVERY, 2 * EVERY, 3 * EVERY):
        name = f"step-{step:08d}"
        shutil.copytree(reference.checkpoint_dir / name, checkpoints / name)
    (checkpoints / f"step-{3 * EVERY:08d}" / "COMMITTED").unlink()  # the newest save was cut short: never resumed
    newest = checkpoints / f"step-{2 * EVERY:08d}"

    output = train(3, checkpoints, "--resume-latest", "--log-steps")
    assert f"starting at step {2 * EVERY + 1} from {newest} (saved by 2 ranks)" in output
    logged = [int(m.group(1)) for m in re.finditer(r"^step (\d+) t=(\d+\.\d+)$", output, re.MULTILINE)]
    assert logged == list(range(2 * EVERY + 1, STEPS + 1))  # one timestamped line per step, from the resumed one
    assert digest_in(output) == reference.digest


def test_resume_latest_picks_committed_steps_and_yields_to_reprise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = load_example(monkeypatch)
    assert example.latest_committed(tmp_path / "absent") is None
    for step, committed in ((9, True), (100, True), (120, False)):
        directory = tmp_path / f"step-{step:08d}"
        directory.mkdir()
        if committed:
            (directory / "COMMITTED").touch()
    assert example.latest_committed(tmp_path) == str(tmp_path / "step-00000100")  # the highest committed step

    flagged = example.parse_args(["--checkpoint-dir", str(tmp_path), "--resume-latest"])
    assert example.resume_point(flagged, "/ckpt/handed-over") == "/ckpt/handed-over"  # Reprise's choice wins
    assert example.resume_point(example.parse_args(["--checkpoint-dir", str(tmp_path)]), None) is None


def load_example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The example script as a module, to call its functions in this process."""
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_an_uncommitted_or_foreign_checkpoint_is_refused(
    killed_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = load_example(monkeypatch)
    config = example.TrainConfig(STEPS, GLOBAL_BATCH, micro_batch=8, seed=0, lr=3e-3, dataset_size=4096)
    committed = committed_steps(killed_dir)[0]
    assert example.read_checkpoint(str(committed), config)["step"] == EVERY

    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "rank-00000.pt").write_bytes((committed / "rank-00000.pt").read_bytes())
    with pytest.raises(SystemExit, match="no COMMITTED marker"):
        example.read_checkpoint(str(torn), config)
    with pytest.raises(SystemExit, match="was written with"):
        example.read_checkpoint(str(committed), dataclasses.replace(config, seed=1))


def test_slow_steps_come_every_kth_step_at_2_to_slow_max_step_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    example = load_example(monkeypatch)
    args = example.parse_args(["--slow-every", "5", "--slow-max", "4", "--seed", "3"])
    factors = [example.slowdown(args, step) for step in range(1, 101)]
    slow = [f for step, f in enumerate(factors, start=1) if step % 5 == 0]
    assert all(f == 1.0 for step, f in enumerate(factors, start=1) if step % 5)
    assert len(slow) == 20 and all(2.0 <= f <= 4.0 for f in slow) and len(set(slow)) > 10
    assert slow == [example.slowdown(args, step) for step in range(5, 101, 5)]  # the same on every rank
    assert example.slowdown(example.parse_args([]), 5) == 1.0  # no slow steps unless asked
