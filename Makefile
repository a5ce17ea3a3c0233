# One command each: `make demo` (set-up + the main job on built-in data) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench clean

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	PYTHON=$(PY) bash scripts/demo.sh

bench: $(STAMP)
	$(PY) bench/bench_model.py --frames 9 17 --height 128 --width 128

clean:
	rm -rf $(VENV) .pytest_cache demo_output
