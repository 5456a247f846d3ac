#!/usr/bin/env bash
# The training-harness evidence on one GPU, through the commands a user runs: each task with the fused kernels (ffi)
# and with plain XLA, then train.compare over the run logs (whole run and steady state):
#   imdb  bert-base, 32 x 512 tokens, 100 steps: a short run, where one-time work weighs most
#   wmt   transformer-big, 8192 tokens per step, 300 steps
# Each run's run.jsonl and config.json are packed into $OUT/train_logs.tar.gz as soon as it ends, the reports after
# them (checkpoints stay behind). TASKS selects a subset ("imdb", "wmt"); EXTRA_ARGS is added to every run.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
WORK=${WORK:-/tmp/ls_jax_runs}
LOGS=$WORK/logs
mkdir -p "$LOGS"
status=0
pack() { tar -czf "$OUT/train_logs.tar.gz" -C "$LOGS" .; }
keep_log() { mkdir -p "$LOGS/$1" && cp "$WORK/$1/run.jsonl" "$WORK/$1/config.json" "$LOGS/$1/"; pack; }
TASKS=" ${TASKS:-imdb wmt} "
COMMON="--no-progress --no-tensorboard --keep-checkpoints 1 ${EXTRA_ARGS:-}"
for backend in ffi xla; do
  [[ $TASKS == *" imdb "* ]] || break
  name=imdb-bert-base-512-$backend
  python3 -m train.imdb --preset bert-base --batch-size 32 --max-seq-len 512 --steps 100 --log-every 10 \
    --backend "$backend" --run-dir "$WORK/$name" $COMMON || status=1
  keep_log "$name"
done
for backend in ffi xla; do
  [[ $TASKS == *" wmt "* ]] || break
  name=wmt-transformer-big-$backend
  python3 -m train.wmt --preset transformer-big --max-tokens 8192 --dropout 0.1 --steps 300 --log-every 50 \
    --eval-every 0 --bleu-sentences 0 --checkpoint-every 100000 --backend "$backend" --run-dir "$WORK/$name" \
    $COMMON || status=1
  keep_log "$name"
done
for task in $TASKS; do
  for window in whole steady; do
    python3 -m train.compare "$LOGS"/"$task"-* --task "$task" --quality-threshold 0 --score-window "$window" \
      --out "$LOGS/report-$task-$window" || status=1
  done
done
pack
exit $status
