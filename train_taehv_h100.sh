#!/usr/bin/env bash
# Launch TAEHV training on 1, 8 or 16 GPUs (DeepSpeed ZeRO-2), or on CPU processes.
# Run with --help for usage. The work is Python's (training/launch_script.py); this script
# starts the clock, picks the interpreter and hands over to it.
set -euo pipefail
# the run's clock starts here: a time budget (--max_train_time) counts the checks and the start-up too
EPOCH_NOW=${EPOCHREALTIME:-}
export TAEHV_STARTED_AT="${TAEHV_STARTED_AT:-${EPOCH_NOW/,/.}}"
export TAEHV_CALLER_DIR=$PWD   # the paths the user types are relative to it
cd "$(dirname "$0")"           # the launch runs in the repository, where the presets' paths lead
export TAEHV_LAUNCH_SCRIPT="$PWD/$(basename "$0")"
if [[ -n "${PYTHON:-}" ]]; then :; elif [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
export PYTHON
# a problem the user fixes: one line "error: ..." on stderr, exit status 2 (docs/training.md)
"$PYTHON" -c "import taehv_train" 2>/dev/null && STATUS=0 || STATUS=$?
if (( STATUS == 126 || STATUS == 127 )); then
  echo "error: cannot run the Python interpreter $PYTHON (set PYTHON to one, or run 'make setup')" >&2; exit 2
elif (( STATUS != 0 )); then
  echo "error: the Python environment ($PYTHON) lacks this package or torch/accelerate/deepspeed/diffusers: run 'make setup' (or 'pip install -e .' in $PWD)" >&2
  exit 2
fi
exec "$PYTHON" -m taehv_train.training.launch_script "$@"
