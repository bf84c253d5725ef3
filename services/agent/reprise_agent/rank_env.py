"""What a rank of a launch is handed: the variables it finds in its environment (torch.distributed's and Reprise's),
and the checkpoint's files it resumes from, written for it as JSON."""

from __future__ import annotations

from pathlib import Path

from pydantic import TypeAdapter

from reprise_common.events import LaunchArgs, RankAssignment, ResumeFile

RESUME_FILES = TypeAdapter(list[ResumeFile])


def write_resume_files(job_dir: Path, spec: LaunchArgs) -> Path | None:
    """The checkpoint's files and the registry's digests, as JSON for the ranks (REPRISE_RESUME_FILES)."""
    if not spec.resume_files:
        return None
    path = job_dir / f"epoch-{spec.restart_epoch}-resume-files.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(RESUME_FILES.dump_json(spec.resume_files).decode(), encoding="utf-8")
    return path


def rank_env(
    job_id: str,
    spec: LaunchArgs,
    assignment: RankAssignment,
    *,
    node_id: str,
    resume_files: Path | None,
    sdk_socket: Path | None,
    inbox_dir: Path | None,
) -> dict[str, str]:
    """What a rank of this launch finds in its environment on top of the agent's own."""
    env = {
        **spec.env,
        "RANK": str(assignment.rank),
        "LOCAL_RANK": str(assignment.local_rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(len(spec.ranks)),
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.master_port),
        "REPRISE_JOB_ID": job_id,
        "REPRISE_NODE_ID": node_id,
        "REPRISE_RESTART_EPOCH": str(spec.restart_epoch),
        "REPRISE_RESUME_CHECKPOINT": spec.resume_checkpoint or "",
        "REPRISE_RESUME_FILES": str(resume_files or ""),
        "REPRISE_SKIP_STEPS": f"{spec.skip_steps.first}-{spec.skip_steps.last}" if spec.skip_steps else "",
    }
    if assignment.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(assignment.gpu)
    if sdk_socket is not None:
        env["REPRISE_SDK_SOCKET"] = str(sdk_socket)
        if inbox_dir is not None:
            env["REPRISE_SDK_INBOX_DIR"] = str(inbox_dir)
    return env
