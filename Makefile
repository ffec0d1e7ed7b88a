# The README's two commands: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck pytest docs bench study policies clean

$(BIN)/.installed-demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[sim]'
	touch $@

$(BIN)/.installed-test: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@ $(BIN)/.installed-demo

# The main job: the seed benchmark on simulated GPUs, four policies, a comparison table and a plot.
demo: $(BIN)/.installed-demo
	$(BIN)/prefixroute simulate --plot out/seed.png

# Regenerates docs/study.md and its plots (every published claim, rerun in the simulator).
study: $(BIN)/.installed-demo
	$(BIN)/prefixroute study

# Regenerates docs/policies-benchmark.md and its plot: every built-in and baseline policy on every workload of the
# suite (six scenarios, two real traces, without and with engine metrics), the default judged against issue 9.
policies: $(BIN)/.installed-demo
	$(BIN)/prefixroute compare --suite

lint: $(BIN)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(BIN)/.installed-test
	$(BIN)/mypy

pytest: $(BIN)/.installed-test
	$(BIN)/pytest -q

docs: $(BIN)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(VENV)/site

test: lint typecheck pytest docs

bench: $(BIN)/.installed-test
	$(BIN)/python benchmarks/bench_route.py
	$(BIN)/python benchmarks/bench_events.py
	$(BIN)/python benchmarks/bench_sim.py

clean:
	rm -rf $(VENV) build dist .mypy_cache .pytest_cache .ruff_cache .hypothesis
