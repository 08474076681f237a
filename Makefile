# Targets match what CI runs (.ci/run). Every target works on a fresh machine with nothing done before it:
# it creates a virtual environment of its own ($(VENV)) and installs into it. torch is pinned and installed
# first, on its own, so that pip never resolves another (multi-GB CUDA) build while installing the rest.
#
#   make demo                  runtime dependencies only, then the quick start
#   make test                  the dev extra too, then the whole suite (PYTEST_ARGS="-k docs" for a part)
#   make docs                  the docs extra, then the site into docs/_build/html, warnings as errors
#   make docs-check            make docs, then every page rendered in headless Chromium: no clipped table
#   make fault-matrix          every cell of the fault matrix (make test runs a fixed sample of it)
#   make updates-preemption    a job by updates signalled at random updates of every stream (make test: a quick set)
#   make exit-stress           200 clean two-process exits under launch and under torchrun, with a busy loop
#   VENV=path                  another environment folder (default .venv)
#   TORCH_SPEC=torch==2.6.0    another torch
#   TORCH_INDEX=URL            the index torch comes from (default: pip's own configuration; on a Linux
#                              machine with internet access, PyPI's torch is the multi-GB CUDA build, so
#                              give PyTorch's CPU index here for a CPU-only build, see the README)
BASE_PYTHON ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
DOCS_OUT ?= docs/_build/html

.PHONY: venv install install-runtime install-docs demo test test-fast fields-full lint gen check-gen graph bench \
	bench-instructions bench-memory bench-snapshots docs docs-check clean fault-matrix exit-stress updates-preemption

# ---- environments: one stamp per install level, redone when pyproject.toml changes ----
$(PYTHON):
	$(BASE_PYTHON) -m venv $(VENV)

$(VENV)/.torch.stamp: | $(PYTHON)
	$(PIP) install -q "$(TORCH_SPEC)" $(if $(strip $(TORCH_INDEX)),--index-url $(TORCH_INDEX))
	touch $@

$(VENV)/.runtime.stamp: pyproject.toml $(VENV)/.torch.stamp
	$(PIP) install -q -e .
	touch $@

$(VENV)/.dev.stamp: pyproject.toml $(VENV)/.runtime.stamp
	$(PIP) install -q -e ".[dev]"
	touch $@

$(VENV)/.docs.stamp: pyproject.toml $(VENV)/.runtime.stamp
	$(PIP) install -q -e ".[docs]"
	touch $@

venv: $(PYTHON)
install-runtime: $(VENV)/.runtime.stamp
install: $(VENV)/.dev.stamp
install-docs: $(VENV)/.docs.stamp

# ---- the two README commands ----
demo: install-runtime
	$(PYTHON) examples/01-basic.py

# -rfEs: the failures and errors, then the reason of every skipped test (a SLURM or GPU test that could not
# run says why)
test: install
	$(PYTHON) -m pytest -q -rfEs $(PYTEST_ARGS)

# ---- everything else ----
test-fast: install
	$(PYTHON) -m pytest -q -m "not distributed and not slow" $(PYTEST_ARGS)

# the fault matrix in full: every state each stage enters x every fault kind (tests/test_fault_matrix.py)
fault-matrix: install
	DEEPEPOCHS_FAULT_MATRIX=full $(PYTHON) -m pytest -q tests/test_fault_matrix.py $(PYTEST_ARGS)

# clean two-process exits repeated under load: 0 hangs and 0 aborts expected (benchmarks/exit_stress.py)
exit-stress: install
	$(PYTHON) benchmarks/exit_stress.py --launcher launch --runs 200 --load
	$(PYTHON) benchmarks/exit_stress.py --launcher torchrun --runs 200 --load

# a job by updates signalled at several random updates of every stream kind (make test runs a quick set)
updates-preemption: install
	DEEPEPOCHS_UPDATES_PREEMPTION=full $(PYTHON) -m pytest -q tests/preemption/test_updates_preemption.py $(PYTEST_ARGS)

# every leaf of every file a run writes, damaged with every replacement (CI damages each field once): an hour
fields-full: install
	DEEPEPOCHS_FIELD_MUTATIONS=all $(PYTHON) -m pytest -q tests/test_checkpoint_fields.py $(PYTEST_ARGS)

# ruff, then the import contracts of pyproject.toml ([tool.importlinter]); --no-cache: nothing left in the tree
lint: install
	$(PYTHON) -m ruff check deepepochs spec tests examples benchmarks
	$(VENV)/bin/lint-imports --no-cache --no-logo

gen: install-runtime
	$(PYTHON) -m spec

check-gen: install-runtime
	$(PYTHON) -m spec --check

# The documentation site; -W: a warning fails the build, as in CI. -E: no stale pages from an older build.
docs: install-docs
	$(PYTHON) -m sphinx -W --keep-going -E -q -b html docs $(DOCS_OUT)
	@echo "open $(DOCS_OUT)/index.html"

# The site built, then every page rendered in headless Chromium at 1280 px: fails on a table that does not
# fit the page (needs chromium, e.g. apt-get install chromium). SCREENSHOTS=dir also saves two pages' PNGs.
docs-check: docs
	$(PYTHON) docs/check_pages.py $(DOCS_OUT) $(if $(SCREENSHOTS),--screenshot $(SCREENSHOTS) index.html coming-from.html)

# docs/state-graph.*: every state; docs/img/state-graph-<level>.svg: one picture per level (needs Graphviz)
GRAPH_LEVELS := fit epoch task batch full
graph: install-runtime
	$(PYTHON) -m deepepochs graph --level full --format mermaid --output docs/state-graph.mmd
	$(PYTHON) -m deepepochs graph --level full --format dot --output docs/state-graph.dot
	-$(PYTHON) -m deepepochs graph --level full --format svg --output docs/state-graph.svg
	-for level in $(GRAPH_LEVELS); do \
	  $(PYTHON) -m deepepochs graph --level $$level --format svg --output docs/img/state-graph-$$level.svg || exit 1; \
	done

# loop_overhead: both feeds, raw loop / deepepochs / ignite / Lightning interleaved, the summary table for the
# docs; then the per-call breakdown (tiny model, MLP) and the finite check's cost per update (~8 min in all)
bench: install
	$(PIP) install -q -e ".[bench]"
	$(PYTHON) benchmarks/loop_overhead.py
	$(PYTHON) benchmarks/batch_segments.py
	$(PYTHON) benchmarks/batch_segments.py --model mlp
	$(PYTHON) benchmarks/finite_check.py

# Instructions per batch under callgrind (needs valgrind and gcc: apt-get install valgrind gcc), each loop in
# its own process: the raw loop, deepepochs, pytorch-ignite, Lightning (~12 min on a 2-core machine)
bench-instructions: install
	$(PIP) install -q -e ".[bench]"
	nice -n 10 $(PYTHON) benchmarks/instructions.py

# The loop's stall per snapshot (sync, async_write=True, a plain torch.save + fsync, a plain host copy) for MLPs
# of ~25M and ~100M parameters with Adam on the CPU (a few minutes; several GB of memory and of disk in /tmp)
bench-snapshots: install-runtime
	$(PYTHON) benchmarks/snapshot_stall.py
	$(PYTHON) benchmarks/snapshot_parts.py

bench-memory: install-runtime
	$(PYTHON) benchmarks/memory_steady.py
	$(PYTHON) benchmarks/metric_memory.py

clean:
	rm -rf build dist *.egg-info .install.stamp .pytest_cache .ruff_cache docs/_build
