#!/usr/bin/env bash
# The training-harness evidence on one GPU: train.wmt (transformer-big) and train.imdb (bert-base) each with the
# fused kernels and with plain XLA, then train.compare over the four run logs. The run logs and the report are
# packed into $OUT/train_runs.tar.gz (checkpoints stay behind: they are gigabytes).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
WORK=${WORK:-/tmp/ls_jax_runs}
STEPS=${STEPS:-300}
rm -rf "$WORK" && mkdir -p "$WORK/logs"
status=0
for kernels in ffi xla; do
  python3 -m train.wmt --preset transformer-big --max-tokens 8192 --dropout 0.1 --steps "$STEPS" --log-every 50 \
    --eval-every 0 --bleu-sentences 0 --checkpoint-every 100000 --keep-checkpoints 1 --no-progress \
    --backend "$kernels" --run-dir "$WORK/wmt-transformer-big-$kernels" || status=1
done
for kernels in ffi xla; do
  python3 -m train.imdb --preset bert-base --steps "$STEPS" --batch-size 32 --max-seq-len 128 --no-progress \
    --backend "$kernels" --run-dir "$WORK/imdb-bert-base-$kernels" ${IMDB_ARGS:-} || status=1
done
for run in "$WORK"/*/; do
  name=$(basename "$run")
  mkdir -p "$WORK/logs/$name" && cp "$run/run.jsonl" "$run/config.json" "$WORK/logs/$name/" 2>/dev/null
done
for task in wmt imdb; do
  python3 -m train.compare "$WORK/logs" --task "$task" --baseline xla --out "$WORK/logs/report-$task" || status=1
done
tar -czf "$OUT/train_runs.tar.gz" -C "$WORK" logs
exit $status
