#!/usr/bin/env bash
# make gpu-check: on a machine with an NVIDIA GPU, the GPU tests (pytest -m gpu), then scripts/benchmark.py at
# Table 5's per-device shape (32 x 1024 tokens, bf16, the paper preset) for every Table 5 row, plus Baseline-24 with
# loss_chunk=0 (against the default 256) and with xla attention (against cudnn), into results/benchmark_<gpu>.json.
# Part profile: scripts/gpu_profile.py instead (the step's kernels by group and its A/B jobs, under 6 minutes).
#
#   scripts/gpu_check.sh [tests|bench|profile|all]      (default all: tests and bench; docs/gpu.md)
#
# PYTHON picks the interpreter (default .venv/bin/python where it exists, else python3). Where OUT names a folder
# (the device tool's), the JSON and the logs are copied there too. Exit status: non-zero if either part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
case $part in
  tests|bench|profile|all) ;;
  *) echo "error: part=$part: must be tests, bench, profile or all" >&2; exit 2;;
esac
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=python3
  [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# A GPU before anything is written: without one, jax's CUDA backend ends in a bare AssertionError.
gpu=$("$PYTHON" - 2>/dev/null <<'PY'
try:
  import jax
  print(jax.default_backend())
except Exception as e:  # no jax, no CUDA plug-in, no GPU, a driver too old
  reason = str(e).strip().splitlines()[:1]
  print(f"error: no NVIDIA GPU: JAX found no CUDA device{f' ({reason[0]})' if reason else ''}; make gpu-check "
        "needs one, with JAX's CUDA plug-in: pip install -e '.[cuda,test]', or PYTHON=an interpreter whose jax has "
        "it (docs/gpu.md)")
PY
)
if [[ $gpu != gpu ]]; then
  echo "${gpu:-error: PYTHON=$PYTHON: does not run}" >&2
  exit 1
fi
logs=${OUT:-results}
mkdir -p results "$logs"
status=0

# What it runs on, and every package the project imports, before the first compile (a missing one ends it here).
"$PYTHON" - <<'PY' 2>&1 | tee "$logs/versions.log" || exit 1
import importlib.metadata, jax
print(f'{jax.devices()[0].device_kind} x{jax.device_count()}, backend {jax.default_backend()}')
for name in ('jax', 'jaxlib', 'jax-cuda13-plugin', 'flax', 'optax', 'orbax-checkpoint', 'grain', 'array-record',
             'ml_collections', 'tensorboard', 'protobuf', 'numpy', 'pytest'):
  try:
    print(name, importlib.metadata.version(name))
  except importlib.metadata.PackageNotFoundError:
    print(name, '-')
import laurel.train, grain, ml_collections, array_record  # noqa
PY

if [[ $part == profile ]]; then
  "$PYTHON" scripts/gpu_profile.py --out='results/gpu_profile_{device}.json' 2>&1 | tee "$logs/gpu_profile.log" ||
    status=1
  [[ -n ${OUT:-} ]] && cp results/gpu_profile_*.json "$OUT"/ 2>/dev/null
  exit $status
fi

if [[ $part != bench ]]; then
  # -n 0: one process holds the GPU (jax takes most of its memory).
  "$PYTHON" -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/test_gpu.py tests/test_attention.py 2>&1 |
    tee "$logs/gpu_tests.log" || status=1
fi

if [[ $part != tests ]]; then
  # 9 compiles (7 rows, 2 variants) and 20 timed steps of each in rounds of 5; the measured shape is Table 5's
  # per-device shape, so no separate full-shape compile. auto attention is cudnn on Hopper and newer once a bound
  # on documents per row is set (the synthetic batch holds one document per row). A compilation cache lets the
  # rows share XLA's GEMM autotuning results (jax_persistent_cache_enable_xla_caches). --profile traces 3 more steps
  # of Baseline-24 and RW+LR and prints their ops by time: attention, loss, residual (LAuReL), optimizer.
  JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/laurel_gpu_check_cache} \
  "$PYTHON" scripts/benchmark.py --steps=20 --steps_per_round=5 --warmup=2 --nofull_shape_memory \
    --set=model.attention=auto --set=model.max_segments=16 \
    --variants=model.loss_chunk=0,model.attention=xla --profile="${TMPDIR:-/tmp}/laurel_gpu_profile" ${BENCH_ARGS:-} \
    --out='results/benchmark_{device}.json' 2>&1 | tee "$logs/benchmark.log" || status=1
  if [[ -n ${OUT:-} ]]; then
    cp results/benchmark_*.json "$OUT"/ 2>/dev/null || true
  fi
fi
exit $status
