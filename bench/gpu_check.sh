#!/usr/bin/env bash
# One short check of the real NVML backend on a GPU machine (a few minutes): the gpu-marked tests, then what NVML
# returned for every GPU as JSON ($OUT/nvml.json when OUT is set, else bench/results/nvml.json).
# Offline machines: fill a wheelhouse first (Python 3.12, manylinux x86_64) and point WHEELHOUSE at it (default .whl/);
# when that folder exists pip installs from it alone.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/reprise-gpu-venv}
WHEELHOUSE=${WHEELHOUSE:-.whl}
RESULT=${OUT:+$OUT/nvml.json}
RESULT=${RESULT:-bench/results/nvml.json}

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv || echo "nvidia-smi: not available"
python3 -m venv "$VENV" || exit 1
pip_args=(-q --disable-pip-version-check -c constraints.txt)
[ -d "$WHEELHOUSE" ] && pip_args+=(--no-index --find-links "$WHEELHOUSE")
# the cli package and libs/common[db] only so that the agent's other test modules and the root conftest import
"$VENV/bin/python" -m pip install "${pip_args[@]}" nvidia-ml-py pytest pytest-asyncio pytest-timeout \
  -e "libs/common[db]" -e services/agent -e cli || exit 1

PYTHONUNBUFFERED=1 "$VENV/bin/python" -m pytest -m gpu services/agent -v -p no:cacheprovider
tests=$?

"$VENV/bin/python" bench/gpu_check.py "$RESULT"
dump=$?
echo "gpu tests exit $tests, NVML dump exit $dump, JSON at $RESULT"
exit $((tests != 0 ? tests : dump))
