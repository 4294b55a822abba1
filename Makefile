# minishard — the two commands a newcomer needs:
#   make course   set everything up, then open the course in JupyterLab
#   make test     set everything up, then run the whole test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# torch is pinned here so pip takes the CPU wheel this machine keeps on disk (a bare "torch"
# can pull a multi-GB CUDA build); pyproject keeps a normal range. Override on a GPU box:
#   make setup TORCH_SPEC='torch>=2.6'
TORCH_SPEC ?= torch==2.13.0
PYTEST_NB = --nbval-lax --nbval-sanitize-with nbval_sanitize.cfg --nbval-cell-timeout=300

.PHONY: setup course demo test test-fast bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

course: setup
	$(BIN)/jupyter lab notebooks/

demo: setup
	$(BIN)/torchrun --standalone --nproc-per-node 4 -m minishard demo --strategy ddp --steps 3 --trace traces/ddp

test: setup
	$(BIN)/python -m pytest -q tests notebooks $(PYTEST_NB)

test-fast: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) traces .pytest_cache
