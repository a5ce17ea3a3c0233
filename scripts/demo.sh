#!/usr/bin/env bash
# The main job on built-in defaults. For now (foundation only) it benchmarks the model's
# encode/decode on random weights; the training demo replaces this when it lands.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
echo "NOTE: training is not implemented yet; this demo only runs TAEHV encode/decode (random weights)."
"$PYTHON" bench/bench_model.py --frames 9 17 --height 128 --width 128 --repeats 1
