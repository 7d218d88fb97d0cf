# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch==2.13.0 (the torch extra) installs its CPU build from a local wheel where there is one
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml setup.py switchml/worker/_fastengine.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(FIND_LINKS) -e '.[test,bench,torch,examples,metrics,integrations]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/switchml demo
	@echo "--- a short DDP training through the switchml backend (examples/train_ddp.py) ---"
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 4 \
		examples/train_ddp.py --backend switchml --epochs 5

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/allreduce.py --workers 2 4 8 --mib 64 --repeats 5 --gloo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
