# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch==2.13.0 (the torch extra) installs its CPU build from a local wheel where there is one
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
# make test runs the suite on this many processes, then the tests marked alone one by one
TEST_PROCESSES ?= 2

.PHONY: demo test install bench clean nft xdp-toolchain conformance docs

# the compiled cores (setup.py) are built by the editable install: a change rebuilds them
# (not the XDP program, *.bpf.c: switch/xdp/pipeline.py builds it with clang when it is used)
$(STAMP): pyproject.toml setup.py $(filter-out %.bpf.c,$(wildcard switchml/*.[ch] switchml/*/*/*.[ch]))
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(FIND_LINKS) -e '.[test,bench,torch,auth,examples,metrics,integrations,docs]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/switchml demo
	@echo "--- a short DDP training through the switchml backend (examples/train_ddp.py);"
	@echo "    SWITCHML_LOCAL_STAGE=0 makes each rank a host of its own, so the gradients"
	@echo "    cross the switch (on one host its ranks would combine in shared memory) ---"
	SWITCHML_LOCAL_STAGE=0 OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone \
		--nproc-per-node 4 examples/train_ddp.py --backend switchml --epochs 5

test: $(STAMP) nft xdp-toolchain
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(MAKE) --no-print-directory docs
	@status=0; \
	$(PY) -m pytest -q -m "not alone" -n $(TEST_PROCESSES) --dist worksteal || status=1; \
	$(PY) -m pytest -q -m alone || status=1; \
	exit $$status

# The API reference (docs/api, from the docstrings) into build/docs, warnings as
# errors and every reference resolved; then the Markdown docs' links and paths.
docs: $(STAMP)
	$(PY) -m sphinx -W -n --keep-going -q -b html docs/api build/docs
	$(PY) docs/check_links.py

# torch's own DistributedTest on gloo and on switchml, compared test by test, at
# WORLD_SIZE=3 and at 8 (where torch runs its subgroup tests): docs/conformance.md.
# Fails when a test passes on gloo and not on switchml without a listed reason.
conformance: $(STAMP)
	@status=0; \
	$(PY) tests/conformance/run.py --world 3 --out conformance-results/world3 || status=1; \
	$(PY) tests/conformance/run.py --world 8 --out conformance-results/world8 || status=1; \
	exit $$status

# The testbed's loss tests need nftables: as root, install it when it is missing
# (elsewhere those tests skip and say why).
nft:
	@if [ "$$(id -u)" = 0 ] && ! command -v nft >/dev/null 2>&1; then \
		echo "installing nftables for the testbed's loss tests"; \
		(apt-get update -qq && apt-get install -y -qq --no-install-recommends nftables) \
			>/dev/null 2>&1 || echo "could not install nftables: the loss tests will skip"; \
	fi

# The XDP data plane's tests (tests/test_xdp.py) build its program with clang and
# load it with libbpf: as root, install clang, llvm and libbpf-dev when one is
# missing, and bpftool (to look at a loaded program) where the distribution has it;
# elsewhere those tests skip and say why.
xdp-toolchain:
	@if [ "$$(id -u)" = 0 ] && { ! command -v clang >/dev/null 2>&1 || \
		! command -v llvm-objdump >/dev/null 2>&1 || [ ! -e /usr/include/bpf/bpf_helpers.h ]; }; then \
		echo "installing clang, llvm and libbpf-dev for the XDP data plane's tests"; \
		(apt-get update -qq && apt-get install -y -qq --no-install-recommends clang llvm libbpf-dev) \
			>/dev/null 2>&1 || echo "could not install clang, llvm, libbpf-dev: the XDP tests will skip"; \
		apt-get install -y -qq --no-install-recommends bpftool >/dev/null 2>&1 || true; \
	fi

bench: $(STAMP)
	$(PY) bench/allreduce.py --workers 2 4 8 --mib 64 --repeats 5 --gloo

clean:
	rm -rf $(VENV) build conformance-results *.egg-info .pytest_cache .hypothesis switchml/*/*/*.so
