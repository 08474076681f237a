# Targets match what CI runs (.ci/run). torch is pinned and installed first, on its own, so that pip
# never resolves a newer (multi-GB CUDA) build while installing the other dependencies.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_SPEC ?= torch==2.13.0
STAMP := .install.stamp

.PHONY: install demo test test-fast lint gen check-gen graph bench clean

$(STAMP): pyproject.toml
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PYTHON) examples/01-basic.py

test: install
	$(PYTHON) -m pytest -q

test-fast: install
	$(PYTHON) -m pytest -q -m "not distributed and not slow"

# ruff, then the import contracts of pyproject.toml ([tool.importlinter]); --no-cache: nothing left in the tree
lint: install
	$(PYTHON) -m ruff check deepepochs spec tests examples benchmarks
	lint-imports --no-cache --no-logo

gen: install
	$(PYTHON) -m spec

check-gen: install
	$(PYTHON) -m spec --check

graph: install
	$(PYTHON) -m deepepochs graph --format mermaid --output docs/state-graph.mmd
	$(PYTHON) -m deepepochs graph --format dot --output docs/state-graph.dot
	-$(PYTHON) -m deepepochs graph --format svg --output docs/state-graph.svg

bench: install
	$(PYTHON) benchmarks/loop_overhead.py
	$(PYTHON) benchmarks/batch_segments.py

.PHONY: bench-memory
bench-memory: install
	$(PYTHON) benchmarks/memory_steady.py
	$(PYTHON) benchmarks/metric_memory.py

clean:
	rm -rf build dist *.egg-info $(STAMP) .pytest_cache .ruff_cache
