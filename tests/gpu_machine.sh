#!/bin/bash
# jaxring's GPU checks on a lent GPU machine (no network there, device time counted in minutes).
#
# Here, on a machine with a network and nvcc (builds the CUDA 13 / Python 3.12 native libraries
# for sm_90 into gpubuild/ and fetches the wheels that machine lacks into .whl/; both are ignored
# by git through .git/info/exclude, and travel with `carry`):
#     PY312=/path/to/py312-venv/bin/python tests/gpu_machine.sh prepare
#     (that venv: jax==0.11.2 jaxlib==0.11.2 nanobind mpich mpi4py cython setuptools wheel)
# There (the device tool: carry ["gpubuild", ".whl"]; logs come back as $OUT/logs.tgz):
#     bash tests/gpu_machine.sh run tests        # kernels, WaveNet kernel, suites side by side
#     bash tests/gpu_machine.sh run sanitizers   # compute-sanitizer: kernels and two processes
#     bash tests/gpu_machine.sh run bench        # allreduce_gpu.py on 2 and 4 processes
#     bash tests/gpu_machine.sh run bench-mps    # the same under CUDA MPS, if it starts there
#     bash tests/gpu_machine.sh run sampling     # benchmarks/sampling.py on the GPU
# Several stages in one call: `run tests bench`. On an H100 (2026-11-26): setup 5 s; six of the
# suites side by side 130 s; bench 100 s; a machine's start about 30 s.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

prepare() {
  local py=${PY312:?set PY312 to a Python 3.12 interpreter with jax 0.11.2, nanobind, mpich, mpi4py, cython, setuptools and wheel}
  local bin; bin=$(dirname "$py")
  grep -qx "/gpubuild/" .git/info/exclude || echo "/gpubuild/" >> .git/info/exclude
  grep -qx "/.whl/" .git/info/exclude || echo "/.whl/" >> .git/info/exclude
  rm -rf /tmp/jaxring-gpubuild gpubuild && mkdir -p /tmp/jaxring-gpubuild gpubuild .whl
  (cd /tmp/jaxring-gpubuild && PATH=$bin:$PATH cmake -G Ninja "$ROOT/xla_ffi" \
     -DPython_EXECUTABLE="$py" -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release >/dev/null \
   && ninja) || exit 1
  cp /tmp/jaxring-gpubuild/*.so gpubuild/
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
    -d .whl "mpich==$("$py" -c 'import importlib.metadata as m; print(m.version("mpich"))')" \
    "mpi4py==$("$py" -c 'import mpi4py; print(mpi4py.__version__)')"
  PATH=$bin:$PATH CUDA_PATH=/usr/local/cuda "$py" -m pip wheel -q --no-deps --no-build-isolation \
    mpi4jax -w .whl
  ls -la gpubuild .whl
}

T0=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
LOGS=/tmp/jaxring-gpu-logs

setup() {
  mkdir -p $LOGS
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | grep -v WARN
  cp gpubuild/*.so jaxring/
  local prefix; prefix=$(python3 -c "import sys; print(sys.prefix)")
  export PATH=$prefix/bin:$PATH PYTHONPATH=$ROOT PYTHONUNBUFFERED=1 MPI4JAX_USE_CUDA_MPI=0 \
    LD_LIBRARY_PATH=$prefix/lib:$prefix/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/cuda/lib64
  # As tests/test_mpi.py's mpiexec() sets them, with processes that share the GPU.
  export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS= \
    JAXRING_TIMEOUT_SECONDS=60 JAXRING_MPI_TRANSPORT=auto JAXRING_MPI_RANKS_PER_NODE=0
  timeout 90 python3 -c "import jax, jaxring.mpi; from jaxring._src import native
print(jax.__version__, jax.devices(), native.cuda_library()); print(jaxring.mpi.world())" \
    || { echo "jaxring does not load on this machine"; exit 1; }
}

suite() {  # name ranks gpu_transport [VAR=value ...]: tests/mpi under mpiexec, one log each
  local name=$1 n=$2 transport=$3; shift 3
  env JAXRING_GPU_TRANSPORT="$transport" JAXRING_EXPECT_GPU_TRANSPORT="$transport" "$@" \
    timeout 200 mpiexec -n "$n" python3 -m pytest -q -p no:cacheprovider --maxfail=3 -rfE \
    --tb=short tests/mpi > $LOGS/suite-$name.log 2>&1
  echo "suite $name: rc=$? [$(( $(date +%s) - T0 ))s] $(grep -E '(passed|failed)' \
    $LOGS/suite-$name.log | tail -1)"
}

tests() {
  stamp "tests"
  (timeout 120 python3 tests/gpu_kernels_check.py --quick > $LOGS/kernels.log 2>&1
   echo "kernels: rc=$? $(tail -1 $LOGS/kernels.log)") &
  (timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gpu.py -m gpu -k wavenet \
     > $LOGS/wavenet.log 2>&1; echo "wavenet: rc=$? $(tail -1 $LOGS/wavenet.log)") &
  suite n1-ipc 1 ipc &
  suite n2-ipc 2 ipc &
  suite n2-staged 2 staged &
  suite n2-host 2 host &
  suite n4-ipc 4 ipc &
  suite n2-ipc-tiny-slots 2 ipc JAXRING_GPU_WORKSPACE_BYTES=4096 &
  suite n4-staged-over-mpi 4 staged JAXRING_GPU_STAGING_BYTES=65536 JAXRING_MPI_TRANSPORT=mpi &
  suite n4-auto-two-nodes 4 staged JAXRING_GPU_TRANSPORT=auto JAXRING_MPI_RANKS_PER_NODE=2 &
  wait
}

sanitizers() {
  stamp "sanitizers"
  local tool
  for tool in memcheck racecheck initcheck synccheck; do
    (timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 python3 \
       tests/gpu_kernels_check.py --quick > $LOGS/$tool-kernels.log 2>&1
     echo "$tool kernels: rc=$? $(grep -h 'ERROR SUMMARY\|agree' $LOGS/$tool-kernels.log | tr '\n' ' ')") &
  done
  for transport in ipc staged; do
    (JAXRING_GPU_TRANSPORT=$transport JAXRING_GPU_WORKSPACE_BYTES=65536 \
       JAXRING_GPU_STAGING_BYTES=65536 JAXRING_TIMEOUT_SECONDS=600 timeout 150 mpiexec -n 2 \
       compute-sanitizer --tool memcheck --error-exitcode 99 python3 tests/gpu_collectives_check.py \
       > $LOGS/memcheck-$transport.log 2>&1
     echo "memcheck $transport: rc=$? $(grep -h 'ERROR SUMMARY\|agree' $LOGS/memcheck-$transport.log | tr '\n' ' ')") &
  done
  wait
}

bench() {  # alone on the GPU: timings; $1: a suffix for the logs
  local n tag=${1:-}
  for n in 2 4; do
    stamp "allreduce_gpu.py, $n processes $tag"
    timeout 150 mpiexec -n $n python3 benchmarks/allreduce_gpu.py > $LOGS/bench-n$n$tag.log 2>&1
    echo "rc=$?"; grep "^n=\|^wrote" $LOGS/bench-n$n$tag.log
  done
  cp benchmarks/results/allreduce_gpu-* $LOGS/ 2>/dev/null
}

bench-mps() {  # the same under CUDA MPS (the processes' kernels share the GPU at once), if it
  # starts here: results as allreduce_gpu-<gpu>-n{N}-mps, beside the time-sliced ones
  command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d \
    || { echo "no MPS here"; return; }
  bench -mps
  echo quit | nvidia-cuda-mps-control
}

sampling() {  # each config in its own results file, so that one that runs out of time loses
  # only itself (its log keeps the rows printed so far); GPU timings are unknown so far
  local config
  for config in 64/256/20 32/128/20 128/256/20; do
    stamp "sampling.py --configs $config"
    timeout 180 python3 benchmarks/sampling.py --configs $config \
      --name "sampling-gpu-${config//\//-}" > "$LOGS/sampling-${config//\//-}.log" 2>&1
    echo "rc=$?"
  done
  grep -h "real time" $LOGS/sampling-*.log
  cp benchmarks/results/sampling-gpu* $LOGS/ 2>/dev/null
}

case "${1:-}" in
  prepare) prepare ;;
  run)
    shift
    setup
    for stage in "$@"; do
      case $stage in tests|sanitizers|bench|bench-mps|sampling) $stage ;; *) echo "unknown stage $stage" ;; esac
    done
    tar czf "${OUT:-/tmp}/logs.tgz" -C $LOGS .
    stamp "done: logs in ${OUT:-/tmp}/logs.tgz" ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
