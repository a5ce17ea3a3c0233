#!/usr/bin/env bash
# `make demo`: train a small TAEHV on built-in procedural clips (or on your own videos) and
# evaluate it on held-out clips. Runs on a 2-core CPU in about 12 minutes, set-up included; uses a GPU when present.
#   DEMO_VIDEOS=/path/to/mp4s make demo     # train on real videos instead
#   DEMO_STEPS=1000 make demo               # train longer
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
DATA=demo_output/data
CONFIG=training/configs/taehv_config_demo.py

if [[ -n "${DEMO_VIDEOS:-}" ]]; then
  DATA=demo_output/your_videos  # never mixed with the built-in clips' annotations
  echo "== indexing your videos in $DEMO_VIDEOS"
  "$PYTHON" -m taehv_train.training.make_annotations "$DEMO_VIDEOS" -o "$DATA/annotations.json" --val_fraction 0.2
  DATA_ARGS=(--data_root="$DEMO_VIDEOS" --annotation_file="$DATA/annotations_train.json"
             --val_annotation_file="$DATA/annotations_val.json")
else
  if [[ ! -f "$DATA/annotations_train.json" ]]; then
    echo "== generating built-in demo clips in $DATA"
    "$PYTHON" -m taehv_train.training.demo_data "$DATA" --num_clips 48 --frames 24 --height 96 --width 144
  fi
  DATA_ARGS=()
fi

echo "== training (demo config: $CONFIG)"
rm -rf demo_output/runs/demo
PYTHON="$PYTHON" ./train_taehv_h100.sh 1 demo --run_name=demo ${DEMO_STEPS:+--max_train_steps=$DEMO_STEPS} "${DATA_ARGS[@]}"

echo "== evaluating on held-out clips"
EVAL_DATA=(--config "$CONFIG")
[[ -n "${DEMO_VIDEOS:-}" ]] && EVAL_DATA+=(--data_root "$DEMO_VIDEOS" --annotation_file "$DATA/annotations_val.json")
"$PYTHON" inference.py --model_path demo_output/runs/demo --num_samples 6 --output_dir demo_output/results "${EVAL_DATA[@]}"
echo "== done: TensorBoard logs in demo_output/runs/demo/logs (tensorboard --logdir demo_output/runs),"
echo "   report in demo_output/results/summary_report.html"
