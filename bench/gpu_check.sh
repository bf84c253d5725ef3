#!/usr/bin/env bash
# One short check of the real NVML backend on a GPU machine (a few minutes): the gpu-marked tests (the agent's NVML
# backend, and the SDK's in-place restart with an NCCL process group: aborted at a park, rebuilt in the same process;
# it needs the machine's python3 to hold torch with CUDA), what NVML returned for every GPU as JSON (nvml.json), then
# bench-agent with the agent on the real GPUs (agent-nvml.json); both in $OUT when OUT is set, else in bench/results/.
# With internet: a virtual environment with the agent installed. Offline: fill a wheelhouse for that machine's Python
# first (the command is in bench/gpu_wheels.txt) and point WHEELHOUSE at it (default .whl/); when that folder exists
# the wheels go beside the machine's own python3 (which must have PyYAML, httpx, prometheus-client and Pygments) and
# the sources are imported from the checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/reprise-gpu-venv}
WHEELHOUSE=${WHEELHOUSE:-.whl}
SITE=${SITE:-/tmp/reprise-gpu-site}
RESULT=${OUT:+$OUT/nvml.json}
RESULT=${RESULT:-bench/results/nvml.json}

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv || echo "nvidia-smi: not available"
if [ -d "$WHEELHOUSE" ]; then
  PY=python3
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELHOUSE"/*.whl || exit 1
  # the orchestrator's sources only for its settings, which the root conftest imports
  export PYTHONPATH="$SITE:libs/common:services/agent:services/orchestrator:cli:sdk" PATH="$SITE/bin:$PATH"
else
  python3 -m venv "$VENV" || exit 1
  PY=$VENV/bin/python
  # the cli package and libs/common[db] only so that the agent's other test modules and the root conftest import
  "$PY" -m pip install -q --disable-pip-version-check -c constraints.txt nvidia-ml-py pytest pytest-asyncio \
    pytest-timeout -e "libs/common[db]" -e services/agent -e cli || exit 1
fi
"$PY" --version

PYTHONUNBUFFERED=1 "$PY" -m pytest -m gpu services/agent sdk/tests -v -p no:cacheprovider -rs
tests=$?

"$PY" bench/gpu_check.py "$RESULT"
dump=$?
PYTHONUNBUFFERED=1 "$PY" -m bench.bench_agent --gpu-backend nvml
agent=$?
if [ "$agent" -ne 0 ]; then  # one more try: a free port can be taken between choosing and binding it
  PYTHONUNBUFFERED=1 "$PY" -m bench.bench_agent --gpu-backend nvml
  agent=$?
fi
[ -n "${OUT:-}" ] && [ -f bench/results/agent-nvml.json ] && cp bench/results/agent-nvml.json "$OUT/"
echo "gpu tests exit $tests, NVML dump exit $dump, agent bench exit $agent, JSON at $RESULT"
[ "$tests" -ne 0 ] && exit "$tests"
[ "$dump" -ne 0 ] && exit "$dump"
exit "$agent"
