#!/usr/bin/env bash
# The GPU evidence in one command, run from the repository root on a CUDA machine:
#   scripts/gpu_suite.sh STAGE...    stages: build test sanitizer cpu-compat ops gemm attention optim e2e profile scaling
#                                    counters flops multiprocess train cli-scaling
# TEST_ARGS and BENCH_ARGS pass extra arguments to pytest and train.bench (COUNTERS_ARGS, FLOPS_ARGS and
# CLI_SCALING_ARGS to those suites, whose flags differ); *_TIMEOUT bound the stages.
# Everything printed also goes to $OUT/suite.log (OUT defaults to ./gpu-out); benchmark JSON lands in
# docs/results/ and is copied to $OUT. Wheels in .whl/ (packages the machine lacks) are installed first.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
touch "$OUT/.started"  # what the stages write after this is copied to $OUT at the end
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# A training step of the big models compiles for minutes, much of it GEMM autotuning; the stages (and later runs on a
# still-warm machine) reuse compiled steps and autotuning results instead. Every implementation gets the same
# flags, and benchmark JSON records them.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.xla_cache/jax}
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_per_fusion_autotune_cache_dir=$PWD/.xla_cache/autotune"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
exec > >(tee -a "$OUT/suite.log") 2>&1
status=0
stage() { echo; echo "=== $1 ($(date -u +%T))"; }
for name in "$@"; do
  stage "$name"
  case $name in
    build) python3 -m ffi_kernels.build || status=1 ;;
    test)
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -n 8 \
        -p no:cacheprovider --tb=short -rfE --durations=15 ${TEST_ARGS:-tests} || status=1 ;;
    sanitizer)  # GEMM autotuning under memcheck takes minutes per GEMM: the sanitizer checks kernels, not speed
      XLA_FLAGS="$XLA_FLAGS --xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout ${SANITIZER_TIMEOUT:-300} compute-sanitizer --tool memcheck \
        --target-processes application-only --error-exitcode 3 python3 scripts/sanitize_kernels.py || status=1 ;;
    cpu-compat) JAX_PLATFORMS=cpu python3 -m pytest -q -p no:cacheprovider tests/ops/test_ops_transforms.py || status=1 ;;
    counters)  # Nsight Compute replays every kernel once per metric pass: minutes, not seconds
      timeout ${COUNTERS_TIMEOUT:-540} python3 -m train.bench counters ${COUNTERS_ARGS:-} || status=1 ;;
    flops)  # one ncu run per implementation and batch size
      timeout ${FLOPS_TIMEOUT:-1300} python3 -m train.bench flops ${FLOPS_ARGS:-} || status=1 ;;
    ops|gemm|attention|optim|e2e|profile|scaling) timeout ${BENCH_TIMEOUT:-200} python3 -m train.bench "$name" ${BENCH_ARGS:-} || status=1 ;;
    multiprocess)  # N processes x 1 GPU against 1 process x N GPUs (MULTIPROCESS_ARGS=--gpus 0,1,2,3)
      timeout ${MULTIPROCESS_TIMEOUT:-400} python3 scripts/gpu_multiprocess_check.py ${MULTIPROCESS_ARGS:-} || status=1 ;;
    train) bash scripts/gpu_train_runs.sh || status=1 ;;
    cli-scaling)  # the training commands themselves at 1, 2, 4 ... GPUs: one compilation per run
      timeout ${CLI_SCALING_TIMEOUT:-900} python3 -m train.bench cli-scaling ${CLI_SCALING_ARGS:-} || status=1 ;;
    *) echo "unknown stage $name"; status=1 ;;
  esac
done
find docs/results -maxdepth 1 -newer "$OUT/.started" \( -name "*.json" -o -name "*.png" \) -exec cp {} "$OUT"/ \;
rm -f "$OUT/.started"
echo "=== done, status $status"
exit $status
