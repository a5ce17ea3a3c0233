#!/usr/bin/env bash
# Launch TAEHV training on 1, 8 or 16 GPUs (DeepSpeed ZeRO-2), or on CPU processes.
# Run with --help for usage.
set -euo pipefail
# the run's clock starts here: a time budget (--max_train_time) counts the checks and the start-up too
EPOCH_NOW=${EPOCHREALTIME:-}
export TAEHV_STARTED_AT="${TAEHV_STARTED_AT:-${EPOCH_NOW/,/.}}"
# Paths the user types (--data, a custom config, --resume PATH) are relative to the folder the
# script is run from; the script then works in the repository, where the presets' own
# relative paths (output/, checkpoints/, data/) lead.
CALLER_DIR=$PWD
cd "$(dirname "$0")"
REPO_DIR=$PWD
SCRIPT="$REPO_DIR/$(basename "$0")"
# a typed path as the training sees it: from the caller's folder when it exists there, else as
# it is (relative to the repository)
typed_path() { if [[ -n "$1" && "$1" != /* && -e "$CALLER_DIR/$1" ]]; then echo "$CALLER_DIR/$1"; else echo "$1"; fi; }

if [[ -t 1 ]]; then RED=$'\e[31m'; GREEN=$'\e[32m'; YELLOW=$'\e[33m'; BOLD=$'\e[1m'; RESET=$'\e[0m'
else RED=""; GREEN=""; YELLOW=""; BOLD=""; RESET=""; fi
ok()   { echo "${GREEN}[ok]${RESET} $*"; }
warn() { echo "${YELLOW}[warn]${RESET} $*"; }
# a problem the user fixes: one line "error: ..." on stderr, exit status 2 (docs/training.md)
die()  { if [[ -t 2 ]]; then echo $'\e[31m'"error:"$'\e[0m'" $*"; else echo "error: $*"; fi >&2; exit 2; }

# the presets: training/configs/taehv_config_<name>.py
PRESETS=()
for preset in training/configs/taehv_config_*.py; do preset=${preset##*/taehv_config_}; PRESETS+=("${preset%.py}"); done

usage() {
  cat <<EOF
${BOLD}Usage:${RESET} ./train_taehv_h100.sh NUM_GPUS CONFIG_TYPE [custom CONFIG_PATH] [options] [--key=value ...]

  NUM_GPUS      total processes (GPUs) across all nodes: 1, 8, 16, ...
  CONFIG_TYPE   a preset of training/configs/taehv_config_<CONFIG_TYPE>.py, one of
                ${PRESETS[*]};
                or custom, which takes a config path

Options:
  --resume PATH|NAME|latest  continue a run with its own config, --key=value changes on top
                             (latest: the newest unfinished run of this config; a finished
                             run is extended by PATH or NAME with a higher --max_train_steps)
  --data DIR                 train on your own clips: annotates DIR (new files only), splits off a
                             validation set and trains on them (python -m taehv_train.training.own_data);
                             a folder or URL of shards (make_annotations --to_shards) is trained on as it is
  --debug                    a few verbose steps with anomaly detection and full tracebacks (into output/debug)
  --profile                  torch profiler trace of a few steps (into output/profile)
  --help                     this text
  --key=value                any training config override, e.g. --learning_rate=3e-4

Multi-node (run the same command on every node):
  MASTER_ADDR, MASTER_PORT (default 29500), NNODES, NODE_RANK (RANK is accepted too)

Without CUDA GPUs, NUM_GPUS CPU processes are started (gloo); meant for test and demo.

Examples:
  ./train_taehv_h100.sh 1 1gpu_h100
  ./train_taehv_h100.sh 8 h100 --resume latest
  ./train_taehv_h100.sh 8 custom training/configs/my_config.py --max_train_steps=5000
  MASTER_ADDR=node1 NNODES=2 NODE_RANK=0 ./train_taehv_h100.sh 16 16gpu_h100   # node 1
  MASTER_ADDR=node1 NNODES=2 NODE_RANK=1 ./train_taehv_h100.sh 16 16gpu_h100   # node 2
EOF
}

[[ $# -eq 0 ]] && { usage; exit 2; }
for arg in "$@"; do [[ "$arg" == "--help" || "$arg" == "-h" ]] && { usage; exit 0; }; done
[[ $# -ge 2 ]] || die "need NUM_GPUS and CONFIG_TYPE (see --help)"

NUM_GPUS=$1; CONFIG_TYPE=$2; shift 2
TYPED=("$NUM_GPUS" "$CONFIG_TYPE")   # the arguments, typed paths made absolute: training prints them back in its resume command
[[ "$NUM_GPUS" =~ ^[1-9][0-9]*$ ]] || die "NUM_GPUS must be a positive integer, got '$NUM_GPUS'"
if [[ "$CONFIG_TYPE" == custom ]]; then
  [[ $# -ge 1 && "$1" != --* ]] || die "custom needs a config path: ./train_taehv_h100.sh N custom PATH"
  CONFIG=$(typed_path "$1"); TYPED+=("$CONFIG"); shift
elif [[ " ${PRESETS[*]} " == *" $CONFIG_TYPE "* ]]; then
  CONFIG=training/configs/taehv_config_${CONFIG_TYPE}.py
else
  die "unknown CONFIG_TYPE '$CONFIG_TYPE' (${PRESETS[*]}, custom)"
fi
[[ -f "$CONFIG" ]] || die "config file $CONFIG not found"

# "; did you mean --X?" for a mistyped option of this script (edit distance at most 2), else nothing
closest_option() {
  awk -v given="$1" 'function distance(a, b,   i, j, m, n, d, cost) {
      m = length(a); n = length(b)
      for (i = 0; i <= m; i++) d[i, 0] = i
      for (j = 0; j <= n; j++) d[0, j] = j
      for (i = 1; i <= m; i++) for (j = 1; j <= n; j++) {
        cost = substr(a, i, 1) != substr(b, j, 1)
        d[i, j] = d[i - 1, j] + 1
        if (d[i, j - 1] + 1 < d[i, j]) d[i, j] = d[i, j - 1] + 1
        if (d[i - 1, j - 1] + cost < d[i, j]) d[i, j] = d[i - 1, j - 1] + cost
      }
      return d[m, n]
    }
    BEGIN {
      best = 3; split("--resume --debug --profile --help", options, " ")
      for (k in options) if ((e = distance(given, options[k])) < best) { best = e; found = options[k] }
      if (found) printf "; did you mean %s?", found
    }'
}

EXTRA=()
while [[ $# -gt 0 ]]; do
  [[ "$1" == --resume || "$1" == --data ]] || TYPED+=("$1")
  case "$1" in
    --resume)
      [[ $# -ge 2 ]] || die "--resume needs PATH, NAME or latest"
      EXTRA+=("--resume_from_checkpoint=$(typed_path "$2")"); TYPED+=(--resume "$(typed_path "$2")"); shift 2 ;;
    --resume=*) EXTRA+=("--resume_from_checkpoint=$(typed_path "${1#--resume=}")"); shift ;;
    --debug)
      EXTRA+=(--debug --detect_anomaly=true --log_every=1 --max_train_steps=4 --validation_every=4
              --checkpointing_steps=4 --output_dir=output/debug)
      export TORCH_DISTRIBUTED_DEBUG=DETAIL; shift ;;
    --profile)
      EXTRA+=(--profile_steps=3 --max_train_steps=6 --validation_every=6 --checkpointing_steps=6
              --output_dir=output/profile)
      shift ;;
    --data)
      [[ $# -ge 2 ]] || die "--data needs a folder of videos"
      DATA_DIR=$(typed_path "$2"); TYPED+=("--data=$DATA_DIR"); shift 2 ;;
    --data=*) DATA_DIR=$(typed_path "${1#--data=}"); TYPED[-1]="--data=$DATA_DIR"; shift ;;
    --*_path=*|--*_file=*|--*_root=*|--*_dir=*)   # a path override: typed from the caller's folder too
      TYPED[-1]="${1%%=*}=$(typed_path "${1#*=}")"; EXTRA+=("${TYPED[-1]}"); shift ;;
    --*=*) EXTRA+=("$1"); shift ;;
    --*) die "unexpected argument '$1'$(closest_option "$1") (overrides look like --key=value; see --help)" ;;
    *) die "unexpected argument '$1' (overrides look like --key=value; see --help)" ;;
  esac
done

# -- pre-flight -------------------------------------------------------------------------
if [[ -n "${PYTHON:-}" ]]; then :; elif [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
if [[ -n "${DATA_DIR:-}" ]]; then   # own videos: annotate (new files only), split, train on them with validation
  DATA_OVERRIDES=$(mktemp)
  # its refusals are one "error: ..." line on stderr and exit 2, as the pre-flight's
  "$PYTHON" -m taehv_train.training.own_data "$DATA_DIR" --config "$CONFIG" --overrides_file "$DATA_OVERRIDES" "${EXTRA[@]}" \
    || exit $?
  mapfile -t DATA_ARGS < "$DATA_OVERRIDES"; rm -f "$DATA_OVERRIDES"
  EXTRA=("${DATA_ARGS[@]}" "${EXTRA[@]}")
  ok "data: $DATA_DIR (${DATA_ARGS[*]})"
fi
# One Python start-up for every check (imports take seconds): exit 3 = packages missing;
# the line "gpus=N" = the visible CUDA devices; exit 2 = a problem the user fixes (the
# config, its paths, the resume), its message from the line "error: ..." on; another
# status = a crash (its traceback is the report).
CHECK_OUT=$("$PYTHON" - "$CONFIG" "${EXTRA[@]}" 2>&1 <<'EOF'
import importlib.util
import sys
if any(importlib.util.find_spec(name) is None for name in ("taehv_train", "torch", "accelerate", "deepspeed", "diffusers")):
    sys.exit(3)
import torch
print(f"gpus={torch.cuda.device_count()}", flush=True)
from taehv_train.common.config import load_config
from taehv_train.base.errors import EXIT_USER_ERROR, USER_ERRORS
from taehv_train.training.loop.feed import feed_notes
from taehv_train.training.loop.memory import check_fits
from taehv_train.training.preflight import check
from taehv_train.training.state.run_config import describe_start, start_of
try:
    overrides = [arg for arg in sys.argv[2:] if arg != "--debug"]
    # a resume takes the run's own config (a damaged checkpoint or a finished run stops here)
    start = start_of(load_config(sys.argv[1], overrides), overrides)
    config = start.config
    for note in [*check(config), *check_fits(config), *feed_notes(config)]:
        print(f"  note: {note}")
except USER_ERRORS as err:
    print(f"error: {err}", flush=True)
    sys.exit(EXIT_USER_ERROR)
if start.done:
    print(f"done={describe_start(start)}")
elif start.checkpoint is not None:
    print(f"resume=from {describe_start(start)}")
print(f"  data: {config.annotation_file or config.data_root}; reference VAE: {config.ref_vae_path or 'none (plain autoencoder)'}")
EOF
) && CHECK_STATUS=0 || CHECK_STATUS=$?
LOCAL_GPUS=$(sed -n 's/^gpus=//p' <<<"$CHECK_OUT")
(( CHECK_STATUS == 126 || CHECK_STATUS == 127 )) && die "cannot run the Python interpreter $PYTHON (set PYTHON to one, or run 'make setup')"
if (( CHECK_STATUS == 3 )) || [[ -z "$LOCAL_GPUS" ]]; then
  (( CHECK_STATUS == 3 )) || echo "$CHECK_OUT" >&2
  die "the Python environment ($PYTHON) lacks this package or torch/accelerate/deepspeed/diffusers: run 'make setup' (or 'pip install -e .' in $REPO_DIR)"
fi
ok "python environment: $PYTHON"

NODE_RANK=${NODE_RANK:-${RANK:-}}
if [[ -n "$NODE_RANK" && -z "${NNODES:-}" ]]; then
  die "NODE_RANK/RANK is set but NNODES is not: set NNODES (e.g. NNODES=2) so the nodes form one job"
fi
NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}
(( NUM_GPUS % NNODES == 0 )) || die "NUM_GPUS=$NUM_GPUS is not divisible by NNODES=$NNODES"
PER_NODE=$(( NUM_GPUS / NNODES ))

if (( LOCAL_GPUS == 0 )); then
  warn "no CUDA GPU: starting $NUM_GPUS CPU process(es) (fine for test/demo, far too slow for real training)"
  case "$CONFIG_TYPE" in test|demo|scratch|custom) ;; *) warn "$CONFIG_TYPE is sized for GPUs: on a CPU use scratch, demo or test" ;; esac
  CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)   # the cores this process may use
  (( NUM_GPUS <= CORES )) \
    || warn "$NUM_GPUS processes on $CORES CPU core(s): they share the cores and every step waits for the slowest; start at most $CORES"
  (( NNODES == 1 )) || die "multi-node runs need GPUs"
elif (( PER_NODE > LOCAL_GPUS )); then
  die "asked for $PER_NODE GPU(s) on this node but only $LOCAL_GPUS are visible (NUM_GPUS=$NUM_GPUS, NNODES=$NNODES)"
else
  ok "$LOCAL_GPUS GPU(s) visible, using $PER_NODE on this node ($NNODES node(s))"
fi

if (( CHECK_STATUS == 2 )); then   # the notes before it on stdout, the error alone on stderr
  grep -v '^gpus=' <<<"$CHECK_OUT" | sed '/^error: /,$d' || true
  sed -n '/^error: /,$p' <<<"$CHECK_OUT" >&2
  exit 2
elif (( CHECK_STATUS != 0 )); then
  grep -v '^gpus=' <<<"$CHECK_OUT" >&2 || true
  echo "the configuration check crashed (exit status $CHECK_STATUS; the traceback above): please report it" >&2
  exit "$CHECK_STATUS"
fi
grep -v -e '^gpus=' -e '^resume=' -e '^done=' <<<"$CHECK_OUT" || true
DONE=$(sed -n 's/^done=//p' <<<"$CHECK_OUT")
[[ -z "$DONE" ]] || { ok "$DONE"; exit 0; }
RESUME=$(sed -n 's/^resume=//p' <<<"$CHECK_OUT")
if [[ -n "$RESUME" ]]; then
  ok "config: the run's own, saved in its checkpoint, with the changes below (data, reference VAE, frame counts and resume checked)"
  echo "${BOLD}[resume]${RESET} $RESUME"
else
  ok "config $CONFIG (data, reference VAE, frame counts and resume checked)"
fi

# -- launch -----------------------------------------------------------------------------
TRAIN=(-m taehv_train.training.taehv_train --config "$CONFIG" "${EXTRA[@]}")
MASTER_PORT=${MASTER_PORT:-29500}
if (( NUM_GPUS == 1 && LOCAL_GPUS == 0 )); then
  CMD=("$PYTHON" "${TRAIN[@]}")
elif (( LOCAL_GPUS == 0 )); then
  CMD=("$PYTHON" -m taehv_train.training.launch --use_deepspeed --zero_stage 2 --num_machines 1 --num_processes "$NUM_GPUS"
       --main_process_port "$MASTER_PORT" "${TRAIN[@]}")
elif (( NNODES > 1 )); then
  [[ -n "${MASTER_ADDR:-}" ]] || die "multi-node runs need MASTER_ADDR (the address of node 0)"
  CMD=("$PYTHON" -m taehv_train.training.launch --config_file accelerate_configs/deepspeed_16gpu.yaml --num_machines "$NNODES"
       --num_processes "$NUM_GPUS" --machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR"
       --main_process_port "$MASTER_PORT" "${TRAIN[@]}")
elif (( NUM_GPUS == 1 )); then
  CMD=("$PYTHON" -m taehv_train.training.launch --config_file accelerate_configs/deepspeed_1gpu.yaml --num_processes 1
       --main_process_port "$MASTER_PORT" "${TRAIN[@]}")
else
  CMD=("$PYTHON" -m taehv_train.training.launch --config_file accelerate_configs/deepspeed_8gpu.yaml --num_processes "$NUM_GPUS"
       --main_process_port "$MASTER_PORT" "${TRAIN[@]}")
fi
echo "${BOLD}launch:${RESET} ${CMD[*]}"

# SIGTERM/SIGINT reach the training processes themselves: each finishes its step, they
# save a checkpoint together and exit 0 (a signal during start-up stops them before the
# first step). The script passes a signal it receives on to them, not to the launcher,
# which would kill them. A scheduler that signals the whole job (scancel, preemption,
# kill -TERM -- -PGID) reaches the launcher too: it gives the training processes
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to save before it kills them, and
# training.launch then exits with training's own status.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-900}
TAEHV_LAUNCH_COMMAND=$(printf '%q ' "$SCRIPT" "${TYPED[@]}")
export TAEHV_LAUNCH_COMMAND
"${CMD[@]}" &
CHILD=$!
forward() {
  warn "SIG$1: asking training to stop at the next step (it saves a checkpoint once training has started)"
  if (( NUM_GPUS > 1 || LOCAL_GPUS > 0 )); then pkill "-$1" -P "$CHILD" || true; else kill "-$1" "$CHILD" || true; fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT
STATUS=0
while kill -0 "$CHILD" 2>/dev/null; do   # wait returns early when a trapped signal arrives
  wait "$CHILD" && STATUS=0 || STATUS=$?
done
exit "$STATUS"
