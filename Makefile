# gpufleet — the two set-up commands are `make run` (the mesh with a sample workload) and
# `make test` (the whole suite). Both create .venv and install the project into it first.
VENV ?= .venv
PY := $(VENV)/bin/python
GPUFLEET := $(VENV)/bin/gpufleet
DATA_DIR ?= .gpufleet/run
SIM_NODES ?= 16

.PHONY: install run down test test-fast test-slow lint typecheck bench schema clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

run: install  ## start the embedded mesh and run a sample workload, showing live progress
	$(GPUFLEET) up --detach --data-dir $(DATA_DIR) --sim-nodes $(SIM_NODES) || true
	$(GPUFLEET) status --data-dir $(DATA_DIR)
	$(GPUFLEET) submit examples/batch-small.yaml --data-dir $(DATA_DIR)
	$(GPUFLEET) submit examples/gang-2x8.yaml --data-dir $(DATA_DIR)
	@JOB=$$($(GPUFLEET) submit examples/train-resnet.yaml --data-dir $(DATA_DIR) --json --yes \
	    | $(PY) -c 'import json, sys; print(json.loads(sys.stdin.readline())["job_id"])') && \
	  echo "+ gpufleet logs $$JOB -f   # the run's output, from the executor of its node" && \
	  $(GPUFLEET) logs $$JOB -f --data-dir $(DATA_DIR) && \
	  echo "+ gpufleet submit --from $$JOB --set sim.duration=3s --wait   # adjust and run again" && \
	  $(GPUFLEET) submit --from $$JOB --set sim.duration=3s --data-dir $(DATA_DIR) --yes --wait
	$(GPUFLEET) jobs --data-dir $(DATA_DIR)
	$(GPUFLEET) nodes --data-dir $(DATA_DIR) | head -8
	$(GPUFLEET) bill --data-dir $(DATA_DIR) --by job   # priced at public list prices unless the config lists its own
	@echo "the mesh keeps running: 'make down' (or gpufleet down --data-dir $(DATA_DIR)) stops it"

down: install
	$(GPUFLEET) down --data-dir $(DATA_DIR)

test: install  ## the whole suite, slow cases included
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

lint: install
	$(VENV)/bin/ruff check .

typecheck: install  ## mypy --strict on the gpufleet package (see scripts/typecheck.py)
	$(PY) scripts/typecheck.py

bench: install
	$(GPUFLEET) bench e2e --sim-nodes 5000 --jobs 20000

schema: install
	$(PY) -m gpufleet.shared.contract.schema docs/schemas

clean:
	rm -rf $(VENV) .gpufleet .pytest_cache .ruff_cache .mypy_cache .typecheck
