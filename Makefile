# One command each: `make demo` (set-up + the main job on built-in data) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup browser lint test test-fast demo bench bench-speed bench-gpu gpu-check clean

# The package itself is installed editable (pyproject.toml): `import taehv_train.models.taehv`
# works from any folder and the repository's files stay the ones that run.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

# Debian's Chromium, for the test that renders the HTML report: installed when neither
# chromium nor chromium-browser is on PATH (needs root; otherwise it says what to run).
browser:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then \
		echo "chromium: $$(command -v chromium || command -v chromium-browser)"; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "chromium is missing: installing Debian's chromium with apt-get"; \
		export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq chromium; \
	else \
		echo "chromium is missing and installing it needs root: run 'sudo apt-get install chromium', then make test" >&2; \
		exit 1; \
	fi

# Lint and format check (ruff.toml); `make test` runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest-xdist workers (TEST_WORKERS=N for another count; 1 runs in one process): each file
# whole on one worker, the longest files first, a test marked `alone` with no other test
# beside it (tests/README.md).
TEST_WORKERS ?= 2
test: $(STAMP) browser lint
	$(PY) -m pytest -q $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The inner loop: pure-Python and single-process tests, one pytest-xdist worker per core.
# Tests that start training processes, benchmarks or a browser are marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n auto --dist loadfile

demo: $(STAMP)
	PYTHON=$(PY) bash scripts/demo.sh

bench: $(STAMP)
	$(PY) -m bench.bench_model --frames 9 17 --height 128 --width 128

# The GPU path: ours against the published TAEHV, eager and compiled, bf16 and fp16, 81
# frames of 480x832, plus the 1gpu_h100 preset trained by ./train_taehv_h100.sh against the
# same engine fed on-device batches (plain and with cached latents): make bench-gpu
# ARGS="--videos_dir DIR" (the clips to train on); JSON on stdout (--out FILE: also a file).
bench-gpu: $(STAMP)
	$(PY) -m bench.bench_gpu $(ARGS)

# Every pending GPU figure of docs/benchmarks.md in at most 8 minutes on one H100/H200:
# run it first on a new GPU machine and paste its table (device and date on top) into
# docs/benchmarks.md. Writes output/gpu_check.json and .md. make gpu-check ARGS=--tiny: its
# CPU test, seconds per row.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check $(ARGS)

# Ours against the published TAEHV on CPU: taecvx, T = 9/17/49 at 128x128 and
# T = 9 at 256x256, encode/decode, parallel/sequential, 2 threads; JSON, then a Markdown table.
bench-speed: $(STAMP)
	$(PY) -m bench.bench_speed --markdown

clean:
	rm -rf $(VENV) .pytest_cache demo_output
