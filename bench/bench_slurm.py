"""Recovery on Slurm against the built-in backend (``make bench-slurm``): bench/bench_schedulers.py with
``--scheduler slurm``; saves bench/results/slurm.json and puts the table into docs/slurm.md."""

from __future__ import annotations

import sys

from bench.bench_schedulers import main

if __name__ == "__main__":
    raise SystemExit(main(["--scheduler", "slurm", *sys.argv[1:]]))
