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
# The notebooks are executed with this CPU's kernels and tested with other float kernels in each
# library a rank computes with — ATen's vectorised kernels (no AVX2/AVX-512), MKL's reproducible generic
# GEMMs, oneDNN capped at AVX2. Each changes the low bits of a training step (docs/testing.md).
# A checked cell must print the same text both ways, as it must on a reader's machine.
SECOND_KERNEL_PATH = ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2
# A third: the AVX2 kernels most laptops and CI machines run (ATen and MKL both capped at AVX2).
AVX2_KERNEL_PATH = ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2

.PHONY: setup browser-deps course demo test test-portability test-fast test-nb-second test-nb-native bench site clean

setup: $(VENV)/.installed

# DeepSpeed builds from source against the torch installed first (--no-build-isolation), without
# its C++/CUDA ops (DS_BUILD_OPS=0: on a CPU it needs none, and the course's CPU AdamW is
# torch's); the one op it compiles at its first start (its shared-memory all-reduce, ~30 s with
# ninja) is compiled here once, so that no test or notebook pays for it.
DEEPSPEED_SPEC ?= deepspeed==0.19.8    # (pyproject's deepspeed extra pins the same)
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "$(DEEPSPEED_SPEC)"
	$(BIN)/pip install -q -e ".[dev,deepspeed]"
	$(BIN)/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)"
	touch $@

# The browser tests (tests/test_browser.py, tests/test_site.py) drive Debian's chromium through
# Playwright's Python client (never `playwright install`: it would download browsers of its own).
# The Chinese pages need a CJK font (a fresh Debian has none: Chinese shows as boxes): WenQuanYi
# Micro Hei, 1.6 MB (fonts-noto-cjk, the font the site's CSS names first, is 57 MB).
# Quick when all are there; installs what is missing (apt needs root or passwordless sudo).
# Without them the browser tests skip and say why; .ci/run sets MINISHARD_REQUIRE_BROWSER=1,
# which turns a failed install here, and a skip there, into an error.
CHROMIUM ?= /usr/bin/chromium
CJK_FONT ?= fonts-wqy-microhei
has_cjk_font = command -v fc-list >/dev/null && fc-list :lang=zh | grep -q .
browser-deps: setup
	@PKGS=; test -x $(CHROMIUM) || PKGS=chromium; $(has_cjk_font) || PKGS="$$PKGS $(CJK_FONT)"; \
	test -z "$$PKGS" || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else SUDO=none; fi; \
	  if [ "$$SUDO" != none ] && command -v apt-get >/dev/null; then \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$PKGS >/dev/null; \
	  fi; \
	  { test -x $(CHROMIUM) && $(has_cjk_font); } || { \
	    echo "browser-deps: could not install$$PKGS (apt-get install -y$$PKGS as root)"; \
	    test "$$MINISHARD_REQUIRE_BROWSER" != 1; }; }
	@$(BIN)/python -c "import playwright" 2>/dev/null || $(BIN)/pip install -q -e ".[browser]"

# JupyterLab refuses to start as root ("Running as root is not recommended"), and containers and
# many cloud machines run as root: there the flag that lets it is passed, nowhere else.
USER_ID ?= $(shell id -u)
JUPYTER_AS_ROOT = $(if $(filter 0,$(USER_ID)),--allow-root)
course: setup
	$(BIN)/jupyter lab $(JUPYTER_AS_ROOT) notebooks/

demo: setup
	$(BIN)/torchrun --standalone --nproc-per-node 4 -m minishard demo --strategy ddp --steps 3 --trace traces/ddp

# The tests and the notebooks run at the same time (scripts/alongside.py prints the notebooks'
# output when the tests are done; both must pass), and the tests themselves in TEST_WORKERS
# processes (pytest-xdist, one test file to a worker at a time): ranks rendezvousing, kernels and
# browsers starting, collectives waiting out a timeout leave two cores idle much of the time (a
# fresh clone's make test in two lanes used 8.5 CPU-minutes of the 28 its 14 wall-minutes had).
# The notebooks run once, under the second kernel path: their stored outputs come from this CPU's
# own kernels (scripts/execute_notebooks.py), so every run compares two kernel paths. The static
# site's tests (AFTER_NOTEBOOKS, about a minute) run after the notebooks, in their lane.
# Last, the one-process step beside the suite's time (set-up included): the budget scales with it.
AFTER_NOTEBOOKS = tests/test_site.py
TEST_WORKERS ?= 2
MAKE_STARTED := $(shell date +%s)
test: setup browser-deps
	$(BIN)/python scripts/alongside.py artifacts/test-notebooks.log '$(NB_THEN_SITE)' \
	  $(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile tests --ignore=$(AFTER_NOTEBOOKS); \
	rc=$$?; $(BIN)/python benchmarks/bench.py --alone --suite-started $(MAKE_STARTED); exit $$rc

# both run, whatever the first did; the status is the first failure's (single-quoted above, so
# that the shell alongside.py starts reads $$? and $$nb, not make's shell)
NB_THEN_SITE = $(NB_SECOND); nb=$$?; $(BIN)/python -m pytest -q -p no:cacheprovider $(AFTER_NOTEBOOKS) || exit 1; exit $$nb

NB_SECOND = env $(SECOND_KERNEL_PATH) $(BIN)/python -m pytest -q -p no:cacheprovider notebooks $(PYTEST_NB)

# The tests that compare numbers of two computations (parity with one process and with PyTorch,
# bit-identity, resume, quantization, the collectives' sums), under the two other kernel paths:
# a comparison tuned on this CPU's kernels fails here before it fails on a reader's machine.
# Not in `make test` (about 7 minutes); run it after changing a tolerance, a bit-identity claim,
# or the order in which something sums (docs/testing.md, "Exact comparisons").
PORTABILITY_TESTS = tests/test_model.py tests/test_parity.py tests/test_ddp.py tests/test_api.py \
  tests/test_accumulation.py tests/test_zero.py tests/test_zeropp.py tests/test_fsdp.py \
  tests/test_reshard_after_forward.py tests/test_replicated_dtype.py tests/test_precision_on_the_wire.py \
  tests/test_clipping.py tests/test_comm.py tests/test_properties.py tests/test_checkpoint.py \
  tests/test_checkpoint_dropin.py tests/test_checkpoint_format.py tests/test_tp.py tests/test_offload.py \
  tests/test_cli.py tests/test_readme_examples.py tests/test_from_deepspeed.py tests/test_deepspeed.py \
  tests/test_zero_vs_fsdp.py

test-portability: setup
	env $(SECOND_KERNEL_PATH) $(BIN)/python -m pytest -q -p no:cacheprovider $(PORTABILITY_TESTS)
	env $(AVX2_KERNEL_PATH) $(BIN)/python -m pytest -q -p no:cacheprovider $(PORTABILITY_TESTS)

# the notebooks alone, under the second CPU kernel path (see SECOND_KERNEL_PATH)
test-nb-second: setup
	$(NB_SECOND)

# the notebooks alone, under this CPU's own kernels (what executed them)
test-nb-native: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider notebooks $(PYTEST_NB)

test-fast: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python benchmarks/bench.py

# The course as static HTML that needs no kernel and no network: open site/index.html
site: setup
	$(BIN)/python scripts/build_site.py site

clean:
	rm -rf $(VENV) traces site artifacts .pytest_cache
