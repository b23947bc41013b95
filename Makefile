# The two commands: `make report` (the main job: the autotune report on the built-in default
# model, then the benchmark suites at small sizes and their dashboard) and `make test` (the
# test suite). Each creates the virtual environment .venv on first use. `make demo` (a short DP
# training run) and `make bench` (the full benchmark suites) are there too.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: report demo test test-fast bench zoo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned: on a CPU-only machine an unpinned torch pulls the CUDA build.
	$(PY) -m pip install --quiet "torch==$${DPGRAD_TORCH_VERSION:-2.13.0}"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

DASHBOARD := build/dashboard
# The test modules that go through the samplers: `make test`'s second pass runs those of their
# tests that tests/triton_pass.txt names (marked kernel_paths) on the Triton kernels.
BACKEND_TESTS := test_reference_models.py test_single_backward.py test_opacus_suite.py \
	test_hf_models.py test_opacus_training_step.py test_errors.py test_opacus_integration.py \
	test_mixed_precision.py test_gpu_dp_step.py test_gpu_graphs.py test_dp_optimizer.py test_fsdp.py test_clipping_groups.py \
	test_no_wrap.py test_conv.py test_vision_models.py test_shared_layers.py test_moe.py \
	test_picked_rows.py test_batch_dims.py

# The edit cycle's loop (`make test-fast`, under two minutes on two cores): what carries the
# guarantee, on the eager backend: the norms and clipped sums of every sampler against float64,
# the clipping coefficients of every clipping, the finish plan, the noise and the accountant's
# sample rate, the independence probes, the training loops' handling, the errors that refuse a
# silent wrong answer. `make test` stays the whole suite, and what CI runs.
FAST_TESTS := test_reference_kernels.py test_whole_layers.py test_reference_models.py test_single_backward.py \
	test_shared_layers.py test_conv.py test_clipping_groups.py test_adaptive_clipping.py test_automatic_clipping.py \
	test_dp_optimizer.py test_guarantee.py test_training_loops.py test_fixed_batches.py test_independence.py \
	test_independence_probes.py test_errors.py test_opacus_training_step.py test_picked_rows.py

# gpt2-small in bf16 on a CUDA GPU, the tiny preset in fp32 (eager fallback) otherwise; then
# the benchmark suites in quick mode (minutes on a CPU; a line per suite, pytest's output in
# build/benchmarks.log) and their dashboard with its summary.
report: $(STAMP)
	@mkdir -p build
	@$(PY) -m dpgrad autotune-report --json build/autotune-report.json
	@rm -f $(DASHBOARD)/*.json
	@DPGRAD_BENCH_QUICK=1 DPGRAD_RESULTS_DIR=$(DASHBOARD) $(PY) benchmarks/run_suites.py --log build/benchmarks.log \
		-q -p no:cacheprovider --benchmark-enable --benchmark-columns=median,rounds
	@$(PY) -m dpgrad dashboard $(DASHBOARD)/*.json -o $(DASHBOARD)/index.html --summary build/autotune-report.json

demo: $(STAMP)
	$(PY) -m dpgrad demo

# The test passes run on every core (pytest-xdist), test by test, but for the modules whose
# module-scoped fixtures (ranks spawned, a report, the kernels compiled) run once: their tests
# share a worker (pytest.mark.xdist_group).
# Each pytest process rewrites the test modules' assertions; with bytecode written, the later
# processes (the second pass, spawned ranks) read them back instead.
unexport PYTHONDONTWRITEBYTECODE
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
XDIST := -n $(JOBS) --dist loadgroup

# The first pass: the tests and the benchmark suites at small sizes, once each and untimed
# (collection and one round; a suite's cases that share built models and spawned ranks run on
# one worker: benchmarks/conftest.py groups them). The suites are named first, so that their
# long groups start first and no worker waits at the end for one.
test: $(STAMP)
	DPGRAD_BENCH_QUICK=1 $(PY) -m pytest -q $(XDIST) benchmarks tests
	# Again with every sampler on the Triton kernels (Triton's interpreter when there is no GPU):
	# the fewest tests of the wrappers and samplers that reach every kernel and dispatch path
	# to one (tests/triton_pass.py chooses them). The kernels' own tests choose their backend
	# and ran above; the tools, store and package tests do not reach a kernel.
	DPGRAD_BACKEND=triton $(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m kernel_paths $(addprefix tests/,$(BACKEND_TESTS))

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(addprefix tests/,$(FAST_TESTS))

# The full suites on a GPU (quick mode without one), into benchmarks/results and the README.
bench: $(STAMP)
	$(PY) -m pytest benchmarks -q -p no:cacheprovider --benchmark-enable
	$(PY) -m dpgrad dashboard benchmarks/results/*.json -o build/dashboard.html --update-readme docs/results.md

# Every Hugging Face architecture of transformers' auto mappings, built tiny, through dpgrad in four
# runs against float64 per-sample gradients: stores tests/data/hf_zoo.json and regenerates the
# tables made from it (docs/supported.md#models, the README's summary). Minutes on a CPU.
zoo: $(STAMP)
	$(PY) tests/hf_zoo.py --jobs $(JOBS) --write

clean:
	rm -rf $(VENV) build *.egg-info
