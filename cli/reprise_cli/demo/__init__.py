"""`reprise demo`: the platform on real processes, a real PyTorch DDP job, and four faults it survives.

training.py (the job and the fault-free reference), scenario.py (faults one after another, each recovery followed),
sampler.py (rank 0's step over time), report.py (the numbers), timeline.py (the picture), run.py (the command).
"""

from reprise_cli.demo.run import run_demo

__all__ = ["run_demo"]
