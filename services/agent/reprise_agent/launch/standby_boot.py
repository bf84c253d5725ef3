"""What a warm standby interpreter runs (given to it with ``-c``, so the job's interpreter needs no Reprise package).

It imports the heavy modules once (argv: the module names) at idle CPU priority where it may return to normal priority
afterwards (``import torch`` takes seconds of CPU, which the node's training ranks need more), says it is ready on
stdout, then waits for its assignment:
one JSON line on stdin, ``{"argv": [...], "env": {...}, "cwd": "..."}``. It takes that environment, directory and
command line and runs the script (or ``-m module``) as ``__main__``, exactly as ``python <script>`` would, so its exit
code and output are the rank's. Only the standard library is used here.
"""

import importlib
import json
import os
import resource
import runpy
import sys

READY = "reprise-standby ready"
CAP_SYS_NICE = 23


def preload(modules: list[str]) -> list[str]:
    """Import each module; the ones that failed, with why (the standby serves anyway)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing module makes the standby less warm, not useless
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return failed


def can_restore_priority() -> bool:
    """Whether leaving SCHED_IDLE will be allowed: CAP_SYS_NICE (root, but not in a container without it), or an
    RLIMIT_NICE that permits nice 0."""
    if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20:
        return True
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            effective = next(line for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return os.geteuid() == 0
    return bool(int(effective.split()[1], 16) >> CAP_SYS_NICE & 1)


def set_policy(policy: int) -> bool:
    """Put this process's scheduling policy to `policy`; False when the kernel refused."""
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except (OSError, AttributeError):
        return False
    return True


def become(assignment: dict) -> None:
    """Take the rank's environment, directory, argv and stdin, then run its script or module as __main__."""
    os.environ.clear()
    os.environ.update(assignment["env"])
    if assignment.get("cwd"):
        os.chdir(assignment["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # a rank reads nothing from its agent
    os.close(devnull)
    args = assignment["argv"][1:]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(args[0])  # sys.argv[0] and __file__ are then absolute, as __file__ is under python
        sys.argv = [script, *args[1:]]
        sys.path[0] = os.path.dirname(script)  # what `python script.py` puts first
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    """Preload (at idle priority where it can be undone), announce readiness, wait for one assignment and run it."""
    idle = can_restore_priority() and set_policy(os.SCHED_IDLE)
    failed = preload(sys.argv[1:])
    if idle and not set_policy(os.SCHED_OTHER):
        sys.exit("the standby could not leave idle priority")
    print(json.dumps({"ready": READY, "failed": failed, "idle_import": idle}), flush=True)
    line = sys.stdin.readline()
    if not line:  # the agent closed our stdin without an assignment: it no longer needs us
        sys.exit(0)
    become(json.loads(line))


if __name__ == "__main__":
    main()
