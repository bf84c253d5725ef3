# Reprise: `make demo` runs the platform with a scripted fault; `make test` runs lint, types and the tests.
# Both create .venv and install everything they need on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := libs/common sdk services/agent services/detector services/orchestrator services/checkpoint-registry \
	services/notifier services/dashboard cli
STAMP := $(VENV)/.installed-stamp
MYPY_TARGETS := libs/common/reprise_common services/agent/reprise_agent services/detector/reprise_detector \
	services/orchestrator/reprise_orchestrator services/checkpoint-registry/reprise_registry cli/reprise_cli \
	sdk/reprise_sdk services/notifier/reprise_notifier examples/ddp_train.py examples/plain_ddp.py \
	examples/lightning_train.py examples/hf_train.py services/dashboard/reprise_dashboard bench
NODES ?= 4
SPARES ?= 1
# agents (the default): the platform's own agent on each simulated node; slurm: a local Slurm cluster runs the jobs;
# kubernetes: a local API server runs them, each job's agents in pods (docs/kubernetes.md)
SCHEDULER ?= agents
# auto (the default): surviving ranks restart in place, replacements on warm standbys; cold: every recovery restarts
# every rank as a new process, with no standbys (make demo RESTART=cold)
RESTART ?= auto
# process (the default): ranks run as processes of their agent; docker: the stack starts a dockerd of its own and
# the demo's ranks run in containers of a base image built from Debian's packages (docs/containers.md)
RUNTIME ?= process

.PHONY: venv slurm-deps netns-deps docker-deps compose-images kube-deps test lint typecheck pytest chaos soak up demo clean bench-agent bench-sdk bench-registry bench-detector bench-orchestrator \
	bench-orchestrator-concurrent bench-vs-torchrun bench-hang-limits bench-standby bench-recovery bench-ettr bench-slurm \
	bench-kubernetes bench-checkpoint

venv: $(STAMP)

$(STAMP): constraints.txt requirements-dev.txt $(foreach p,$(PACKAGES),$(p)/pyproject.toml)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade "pip==$$(grep '^pip==' constraints.txt | cut -d= -f3)"
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/python -m pip install -q --disable-pip-version-check \
		-c constraints.txt -r requirements-dev.txt \
		--config-settings editable_mode=compat \
		-e "libs/common[db]" $(foreach p,$(filter-out libs/common,$(PACKAGES)),-e $(p))
	@touch $@

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy $(MYPY_TARGETS)

# A local Slurm cluster for the tests and the demo (docs/slurm.md): Debian's slurm-wlm (22.05) and munge, installed
# with apt-get when slurmctld is missing and we are root. It never fails: where it cannot install, the Slurm tests are
# skipped with the reason.
slurm-deps:
	@if command -v slurmctld >/dev/null 2>&1 || test -x /usr/sbin/slurmctld; then :; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "slurm-deps: Slurm is not installed and this is not root: the Slurm tests will be skipped"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "slurm-deps: Slurm is not installed and there is no apt-get: the Slurm tests will be skipped"; \
	else \
		echo "slurm-deps: installing slurm-wlm and munge with apt-get"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; } \
			|| echo "slurm-deps: apt-get could not install slurm-wlm and munge: the Slurm tests will be skipped"; \
	fi

# Namespaced test hosts (tests/partitions, docs/reliability.md): iproute2 and iptables, installed with apt-get when
# missing and we are root. Like slurm-deps it never fails: where it cannot install, those tests are skipped.
netns-deps:
	@if command -v iptables >/dev/null 2>&1 && command -v ip >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "netns-deps: iptables or iproute2 missing and this is not root: the partition tests will be skipped"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "netns-deps: iptables or iproute2 missing and no apt-get: the partition tests will be skipped"; \
	else \
		echo "netns-deps: installing iptables and iproute2 with apt-get"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables iproute2 >/dev/null; } \
			|| echo "netns-deps: apt-get could not install iptables and iproute2: the partition tests will be skipped"; \
	fi

# A Docker Engine for the container launcher's tests (docs/containers.md) and the compose topology's (docs/compose.md):
# Debian's docker.io, debootstrap and docker-compose (1.29), installed with apt-get when one is missing and we are root.
# The tests start a dockerd of their own and build their images from Debian's packages once (cached under
# ~/.cache/reprise). Like slurm-deps it never fails: where it cannot install, those tests are skipped with the reason.
docker-deps:
	@if command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 \
		&& command -v docker-compose >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "docker-deps: dockerd or docker-compose is not installed and this is not root: the container tests will be skipped"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "docker-deps: dockerd or docker-compose is not installed and there is no apt-get: the container tests will be skipped"; \
	else \
		echo "docker-deps: installing docker.io, debootstrap and docker-compose with apt-get"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			docker.io debootstrap docker-compose >/dev/null; } \
			|| echo "docker-deps: apt-get could not install docker.io: the container tests will be skipped"; \
	fi

# What `docker-compose -p reprise up --build` needs that no registry gives (docs/compose.md): the platform image built
# from Debian's packages and the services' wheels, into the Docker Engine at $DOCKER_HOST (default: the system's).
compose-images: $(STAMP) docker-deps
	$(BIN)/python -m reprise_cli.compose_images

# The real Kubernetes API server of services/orchestrator/tests/kubernetes (docs/kubernetes.md): kube-apiserver built
# once from Debian's source package, cached under /var/cache/reprise (about 5 min the first time). Never fails: where
# it cannot build, it says why and those tests are skipped with the reason.
kube-deps: $(STAMP)
	$(BIN)/python -m reprise_cli.kube

pytest: $(STAMP) slurm-deps netns-deps docker-deps kube-deps
	$(BIN)/pytest

test: lint typecheck pytest

# The chaos suite at full size (its cases also run in `make test`, smaller): the platform's own servers and services
# killed under load; what held is tabled in docs/reliability.md.
chaos: $(STAMP) slurm-deps netns-deps
	REPRISE_CHAOS_EVENTS=10000 REPRISE_CHAOS_REDIS_AWAY_S=60 $(BIN)/pytest -m chaos -p no:cacheprovider -rA

# The soak (not in CI): 30 minutes, 10 jobs, a random fault every 30 s → bench/results/soak.json (SOAK_ARGS to change)
soak: $(STAMP)
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

up: $(STAMP) $(if $(filter slurm,$(SCHEDULER)),slurm-deps) $(if $(filter kubernetes,$(SCHEDULER)),kube-deps)
	$(BIN)/reprise up --nodes $(NODES) --spares $(SPARES) --scheduler $(SCHEDULER)

# SCHEDULER=slurm: the same job and faults on a local Slurm cluster (Slurm installed first, as root with apt);
# SCHEDULER=kubernetes: on a local kube-apiserver with a kubelet double (built once and cached by kube-deps)
demo: $(STAMP) $(if $(filter slurm,$(SCHEDULER)),slurm-deps) $(if $(filter kubernetes,$(SCHEDULER)),kube-deps) \
	$(if $(filter docker,$(RUNTIME)),docker-deps)
	$(BIN)/reprise demo --scheduler $(SCHEDULER) --restart-mode $(RESTART) --runtime $(RUNTIME)

bench-agent: $(STAMP)
	$(BIN)/python -m bench.bench_agent

bench-sdk: $(STAMP)
	$(BIN)/python -m bench.bench_sdk

bench-registry: $(STAMP)
	$(BIN)/python -m bench.bench_registry

bench-detector: $(STAMP)
	$(BIN)/python -m bench.bench_detector

# Both scenarios (fleet sizes, and many jobs faulted at once on 1 and 3 replicas) → bench/results/orchestrator.json
bench-orchestrator: $(STAMP)
	$(BIN)/python -m bench.bench_orchestrator

# Only the concurrent scenario → bench/results/orchestrator-concurrent.json (orchestrator.json is left as it is)
bench-orchestrator-concurrent: $(STAMP)
	$(BIN)/python -m bench.bench_orchestrator --scenario concurrent

# Hang limits without a job's own: no false alarm over 32 min of training, and how soon a frozen rank is called hung;
# then the same for scripts without the SDK (timed by their stack samples) → bench/results/hang-limits-no-sdk.json
bench-hang-limits: $(STAMP)
	$(BIN)/python -m bench.hang_limits
	$(BIN)/python -m bench.hang_limits --no-sdk --minutes 30

bench-vs-torchrun: $(STAMP)
	$(BIN)/python -m bench.bench_vs_torchrun

clean:
	rm -rf $(VENV) .state .mypy_cache .ruff_cache .pytest_cache

# A rank's start cold against warm (a standby that imported torch): medians side by side → bench/results/standby.json
bench-standby: $(STAMP)
	$(BIN)/python -m bench.bench_standby

# A checkpoint's cost to training: a synchronous save against a background save of the same 1 GiB state
bench-checkpoint: $(STAMP)
	$(BIN)/python -m bench.bench_checkpoint

# Recovery side by side: Reprise cold, Reprise's fast path (in place, warm standbys) and a torchrun shell loop, the
# same faults (5 of each kind per cell) → bench/results/recovery.json and a table in docs/benchmarks.md
bench-recovery: $(STAMP)
	$(BIN)/python -m bench.bench_recovery $(RECOVERY_ARGS)

# What the measured overheads mean for ETTR at 1,024 to 131,072 GPUs (reads recovery.json) → bench/results/ettr.json
bench-ettr: $(STAMP)
	$(BIN)/python -m bench.ettr

# The demo's job and faults on the built-in backend and on a local Slurm cluster, alternating (BENCH_SLURM_ARGS,
# e.g. --rounds 5) -> bench/results/slurm.json and the table in docs/slurm.md
bench-slurm: $(STAMP) slurm-deps
	$(BIN)/python -m bench.bench_slurm $(BENCH_SLURM_ARGS)

# The same on a local kube-apiserver with the kubelet double (BENCH_KUBERNETES_ARGS, e.g. --rounds 3)
# -> bench/results/kubernetes.json and the table in docs/kubernetes.md
bench-kubernetes: $(STAMP) kube-deps
	$(BIN)/python -m bench.bench_schedulers --scheduler kubernetes $(BENCH_KUBERNETES_ARGS)
