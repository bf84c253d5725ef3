"""The Lightning and Hugging Face callbacks with the real frameworks on CPU: tiny models built here from configs
(nothing downloaded), messages at a real Unix datagram socket standing in for the agent, checkpoints on disk."""

from __future__ import annotations

import hashlib
import importlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the framework integrations are not tested")

ENV = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "REPRISE_JOB_ID",
       "REPRISE_RESTART_EPOCH", "REPRISE_RESUME_CHECKPOINT", "REPRISE_RESUME_FILES", "REPRISE_SDK_SOCKET",
       "REPRISE_SDK_INTERVAL_S", "TORCHELASTIC_RUN_ID"]  # fmt: skip


class Agent:
    """The agent's end of the SDK socket, reduced to collecting what the callbacks send (read as it arrives, as the
    agent does: a socket's queue holds only a few datagrams)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.received: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.open = True
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self) -> None:
        while self.open:
            try:
                message = json.loads(self.sock.recv(256 * 1024))
            except (TimeoutError, OSError):
                continue
            with self.lock:
                self.received.append(message)

    def drain(self) -> list[dict[str, Any]]:
        """Every message received since the last drain."""
        time.sleep(0.2)
        with self.lock:
            messages, self.received = self.received, []
        return messages

    def close(self) -> None:
        self.open = False
        self.reader.join()
        self.sock.close()


@pytest.fixture
def agent(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    """A lone rank of a Reprise job whose every heartbeat is sent (no coalescing), and the socket it reports to."""
    from reprise_sdk import _client

    receiver = Agent(short_dir / "sdk.sock")
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("REPRISE_SDK_SOCKET", str(receiver.path))
    monkeypatch.setenv("REPRISE_SDK_INTERVAL_S", "0")
    monkeypatch.setenv("REPRISE_JOB_ID", "job-fw")
    _client._reset()
    yield receiver
    receiver.close()
    _client._reset()


def phases(messages: list[dict[str, Any]]) -> list[str]:
    return [m["phase"] for m in messages if m["k"] == "phase"]


def reported(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m["k"] == "ckpt"]


def digest_of(path: Path) -> list[Any]:
    content = path.read_bytes()
    return [len(content), hashlib.sha256(content).hexdigest()]


def assert_reported_as_written(report: dict[str, Any], directory: Path, step: int) -> None:
    """The report names the directory, the step and every file in it (but the marker) with its true digest."""
    on_disk = sorted(str(p) for p in directory.rglob("*") if p.is_file() and p.name != "COMMITTED")
    assert (report["path"], report["step"], report["files"]) == (str(directory), step, on_disk)
    assert report["sha256"] == {name: digest_of(Path(name)) for name in on_disk}
    assert (directory / "COMMITTED").is_file()


def restore(monkeypatch: pytest.MonkeyPatch, directory: Path, tmp_path: Path, *, flip: str | None = None) -> None:
    """Be a rank Reprise relaunched on `directory`: the registry's manifest in REPRISE_RESUME_FILES (`flip`: a file
    whose digest the registry validated differs from the one on disk now)."""
    entries = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "COMMITTED"):
        size, digest = digest_of(path)
        if path.name == flip:
            digest = "0" * 64
        entries.append({"path": path.relative_to(directory).as_posix(), "size_bytes": size, "algorithm": "sha256",
                        "digest": digest})  # fmt: skip
    manifest = tmp_path / "resume-files.json"
    manifest.write_text(json.dumps(entries))
    monkeypatch.setenv("REPRISE_RESUME_CHECKPOINT", str(directory))
    monkeypatch.setenv("REPRISE_RESUME_FILES", str(manifest))


def test_the_sdk_and_its_integrations_package_import_no_framework() -> None:
    frameworks = "{'torch', 'lightning', 'pytorch_lightning', 'transformers'}"
    code = f"import sys, reprise_sdk, reprise_sdk.integrations; print(sorted({frameworks} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"


# --- Lightning ------------------------------------------------------------------------------------------------
def tiny_lightning_module(base: type) -> Any:
    """A LightningModule of the given package: a linear layer fitting random targets, with a validation step."""

    class Tiny(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[Any], batch_idx: int) -> Any:
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def validation_step(self, batch: list[Any], batch_idx: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def fit_lightning(package: Any, callback: Any, steps: int, ckpt_path: str | None = None) -> Any:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = package.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, callbacks=[callback], val_check_interval=3,
        limit_val_batches=1, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, logger=False,
    )  # fmt: skip
    trainer.fit(tiny_lightning_module(package.LightningModule), loader, loader, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("package_name", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_callback_heartbeats_phases_and_reports_its_checkpoints(
    package_name: str, agent: Agent, tmp_path: Path
) -> None:
    package = pytest.importorskip(package_name, reason=f"{package_name} is not installed")
    integration = importlib.import_module(f"reprise_sdk.integrations.{package_name.partition('.')[0]}")
    assert isinstance(integration.RepriseCallback(tmp_path), package.Callback)

    fit_lightning(package, integration.RepriseCallback(tmp_path / "ckpt", every_n_train_steps=4), steps=8)
    messages = agent.drain()

    beats = [m for m in messages if m["k"] == "hb"]
    assert [m["step"] for m in beats] == list(range(1, 9))  # after each optimizer step, every one sent here
    assert all(isinstance(m["m"]["loss"], float) and m["m"]["loss"] >= 0 for m in beats)
    assert phases(messages) == ["validation", "", "checkpointing", "", "validation", "", "checkpointing", ""]
    first, second = reported(messages)
    assert_reported_as_written(first, tmp_path / "ckpt" / "step-00000004", 4)
    assert_reported_as_written(second, tmp_path / "ckpt" / "step-00000008", 8)
    assert first["files"] == [str(tmp_path / "ckpt" / "step-00000004" / "model.ckpt")]


def test_lightning_resumes_from_the_restore_point_and_refuses_a_corrupt_one(
    agent: Agent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning.pytorch as pl

    from reprise_sdk import CheckpointCorruptError
    from reprise_sdk.integrations.lightning import RepriseCallback, resume_checkpoint, trainer_args

    assert resume_checkpoint() is None and trainer_args() == {}  # a fresh start; outside a launch Lightning decides
    fit_lightning(pl, RepriseCallback(tmp_path / "ckpt", every_n_train_steps=4), steps=4)
    saved = tmp_path / "ckpt" / "step-00000004"

    restore(monkeypatch, saved, tmp_path)
    start = resume_checkpoint()
    assert start == str(saved / "model.ckpt")
    resumed = fit_lightning(pl, RepriseCallback(tmp_path / "again"), steps=6, ckpt_path=start)
    assert resumed.global_step == 6
    beats = [m["step"] for m in agent.drain() if m["k"] == "hb"]
    assert beats[-2:] == [5, 6]  # the resumed run went on from step 4, not from 0

    restore(monkeypatch, saved, tmp_path, flip="model.ckpt")
    with pytest.raises(CheckpointCorruptError, match=r"model\.ckpt"):
        resume_checkpoint()


def test_lightning_trainer_args_describe_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from reprise_sdk.integrations.lightning import RepriseEnvironment, trainer_args

    for name, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    args = trainer_args()
    assert (args["num_nodes"], args["devices"]) == (2, 2)
    [environment] = args["plugins"]
    assert isinstance(environment, RepriseEnvironment)
    assert (environment.global_rank(), environment.local_rank(), environment.world_size()) == (3, 1, 4)
    assert environment.creates_processes_externally


# --- Hugging Face Transformers -----------------------------------------------------------------------------------
def hf_trainer(output_dir: Path, callback: Any, steps: int, *, evaluate: bool = True) -> Any:
    """A two-layer GPT-2 of 32 dimensions from a config, on rule-following token sequences."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    tokens = (torch.arange(8).repeat(32, 1) + torch.arange(32)[:, None]) % 32
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=4, save_strategy="steps",
        save_steps=3, eval_strategy="steps" if evaluate else "no", eval_steps=3, logging_steps=1, report_to=[],
        use_cpu=True, disable_tqdm=True, logging_nan_inf_filter=False,
    )  # fmt: skip
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=32, n_layer=2, n_head=2))
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4], callbacks=[callback])


def test_transformers_callback_heartbeats_phases_and_reports_its_checkpoints(agent: Agent, tmp_path: Path) -> None:
    from transformers import TrainerCallback

    from reprise_sdk.integrations.transformers import RepriseCallback

    assert isinstance(RepriseCallback(), TrainerCallback)
    hf_trainer(tmp_path / "run", RepriseCallback(), steps=6).train()
    messages = agent.drain()

    with_loss = [m for m in messages if m["k"] == "hb" and "loss" in m.get("m", {})]
    assert [m["step"] for m in with_loss] == list(range(1, 7))  # logging_steps=1: the loss of every step
    assert all(set(m["m"]) == {"loss", "grad_norm", "lr"} and m["m"]["loss"] > 0 for m in with_loss)
    steps = sorted({m["step"] for m in messages if m["k"] == "hb"})
    assert steps == list(range(1, 7))
    assert phases(messages) == ["evaluation", "", "checkpointing", ""] * 2
    first, second = reported(messages)
    assert_reported_as_written(first, tmp_path / "run" / "checkpoint-3", 3)
    assert_reported_as_written(second, tmp_path / "run" / "checkpoint-6", 6)
    assert {Path(f).name for f in first["files"]} >= {"model.safetensors", "optimizer.pt", "trainer_state.json"}


def test_transformers_evaluation_outside_training_is_an_evaluation_phase(agent: Agent, tmp_path: Path) -> None:
    from reprise_sdk.integrations.transformers import RepriseCallback

    trainer = hf_trainer(tmp_path / "run", RepriseCallback(), steps=1)
    trainer.evaluate()
    trainer.predict(trainer.eval_dataset)
    assert phases(agent.drain()) == ["evaluation", "", "evaluation", ""]


def test_transformers_resumes_from_the_restore_point_and_refuses_a_corrupt_one(
    agent: Agent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprise_sdk import CheckpointCorruptError
    from reprise_sdk.integrations.transformers import RepriseCallback, resume_checkpoint

    assert resume_checkpoint() is None
    hf_trainer(tmp_path / "run", RepriseCallback(), steps=3, evaluate=False).train()
    saved = tmp_path / "run" / "checkpoint-3"
    agent.drain()

    restore(monkeypatch, saved, tmp_path)
    start = resume_checkpoint()
    assert start == str(saved)
    resumed = hf_trainer(tmp_path / "again", RepriseCallback(), steps=5, evaluate=False)
    resumed.train(resume_from_checkpoint=start)
    assert resumed.state.global_step == 5
    assert sorted({m["step"] for m in agent.drain() if m["k"] == "hb"}) == [4, 5]  # on from step 3, not from 0

    restore(monkeypatch, saved, tmp_path, flip="optimizer.pt")
    with pytest.raises(CheckpointCorruptError, match=r"optimizer\.pt"):
        resume_checkpoint()


def test_saving_again_over_a_step_forgets_the_old_commit(agent: Agent, tmp_path: Path) -> None:
    from reprise_sdk.integrations.transformers import RepriseCallback

    stale = tmp_path / "run" / "checkpoint-3"
    stale.mkdir(parents=True)
    (stale / "COMMITTED").touch()
    (stale / "leftover.bin").write_bytes(b"from an attempt that was restored away")
    seen: list[bool] = []

    class Watch(RepriseCallback):
        def on_save(self, *args: Any, **kwargs: Any) -> None:
            seen.append((stale / "COMMITTED").exists())  # the Trainer has written; the marker is not back yet
            super().on_save(*args, **kwargs)

    hf_trainer(tmp_path / "run", Watch(), steps=3, evaluate=False).train()
    assert seen == [False] and (stale / "COMMITTED").is_file()
    [report] = reported(agent.drain())
    assert report["step"] == 3
