# The two commands: `make report` (the main job: the autotune report on the built-in default
# model) and `make test` (the test suite). Each creates the virtual environment .venv on first
# use. `make demo` (a short DP training run) and `make bench` are there too.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: report demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned: on a CPU-only machine an unpinned torch pulls the CUDA build.
	$(PY) -m pip install --quiet "torch==$${DPGRAD_TORCH_VERSION:-2.13.0}"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# gpt2-small in bf16 on a CUDA GPU, the tiny preset in fp32 (eager fallback) otherwise.
report: $(STAMP)
	$(PY) -m dpgrad autotune-report

demo: $(STAMP)
	$(PY) -m dpgrad demo

test: $(STAMP)
	$(PY) -m pytest -q
	# Again with every sampler on the Triton kernels (Triton's interpreter when there is no GPU).
	DPGRAD_BACKEND=triton $(PY) -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(PY) -m pytest benchmarks -q --benchmark-enable

clean:
	rm -rf $(VENV) build *.egg-info
