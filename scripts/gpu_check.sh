#!/usr/bin/env bash
# The GPU check in one command, on a machine with a CUDA device and no package registry:
# installs what the image lacks from the wheelhouse (scripts/gpu_wheelhouse.sh builds it),
# checks that CUDA IPC works between two processes (some sandboxes refuse it: then it says so
# and runs the in-process GPU checks only), runs the GPU tests and the GPU benchmark with its
# calibration, and writes everything under OUT. About 5 minutes on an H200.
#
#   bash scripts/gpu_check.sh [--out DIR] [--wheelhouse DIR] [--python PY] [--skip-bench]
#   bash scripts/gpu_check.sh --dry-run --python python3.12   (here: no GPU needed)
#
# Results: OUT/gpu_check.json (each step's status), OUT/gpu_tests.xml (JUnit), OUT/gpu_bench.json
# and OUT/h200_calibration.toml (testbed.bench.gpu_data_path), OUT/gpu_check.log (everything).
# --dry-run installs the wheelhouse into a fresh virtual environment of PY with --no-index
# (after the few image packages it stands in for, from the registry) and runs the steps that
# need no GPU: the install check, a server start, and the IPC probe's "no CUDA" answer.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-$REPO/gpu-check-out}
WHEELHOUSE=$REPO/.whl
PY=python3
DRY_RUN=0
BENCH=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR=$2; shift 2 ;;
    --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --skip-bench) BENCH=0; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log
STATUS=$OUT_DIR/gpu_check.json
echo "{" > "$STATUS"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: runs, logs, records the exit status
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local started=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "  \"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - started))}," >> "$STATUS"
  echo "== $name: exit $rc after $((SECONDS - started)) s"
  return $rc
}
finish() {
  echo "  \"done\": true" >> "$STATUS"
  echo "}" >> "$STATUS"
  echo "== results in $OUT_DIR"
  exit "${1:-0}"
}

ls "$WHEELHOUSE"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELHOUSE: run scripts/gpu_wheelhouse.sh first"; finish 2; }
echo "wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sm "$WHEELHOUSE" | cut -f1) MiB"
if [ "$DRY_RUN" = 1 ]; then
  VENV=$(mktemp -d)/venv
  step venv 300 "$PY" -m venv "$VENV" || finish 1
  PY=$VENV/bin/python
  # Stand-ins for what the GPU image already has (numpy, grpcio, requests, pytest...).
  step image-stand-ins 600 "$PY" -m pip install -q numpy grpcio requests typing-extensions \
    pytest pytest-timeout || finish 1
fi
SITE=$(mktemp -d)/site
step install 300 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target "$SITE" "$WHEELHOUSE"/*.whl || finish 1
export PYTHONPATH=$SITE
step install-check 120 bash -c "cd /tmp && '$PY' -c 'import server.app, connector.config, testbed.core.protocol, testbed.core.rpc; print(\"imports from\", server.app.__file__)' && '$PY' -m testbed.cli server --help >/dev/null" || finish 1
step server-start 120 "$PY" -c "
from server.launch import ServerProcess
with ServerProcess(['--capacity', '64MiB']).start() as server:
    print('server ready:', server.ready)
" || finish 1
step environment 60 bash -c "nvidia-smi -L; df -h /dev/shm; '$PY' -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.cuda.is_available())'"
step ipc-probe 180 bash -o pipefail -c "'$PY' -m testbed.engine.cuda_worker probe | tee '$OUT_DIR/ipc_probe.json'"
if ! grep -q '"ipc_works": true' "$OUT_DIR/ipc_probe.json" 2>/dev/null; then
  echo "CUDA IPC between two processes does not work here (see ipc_probe.json):"
  echo "running the in-process GPU checks only"
  [ "$DRY_RUN" = 1 ] && finish 0
  step gpu-tests-in-process 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/connector/test_kv_copy.py tests/core/test_torch_block_copy.py \
    --junitxml="$OUT_DIR/gpu_tests.xml"
  finish 3
fi
step gpu-tests 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu \
  tests/connector/test_kv_copy.py tests/core/test_torch_block_copy.py \
  --junitxml="$OUT_DIR/gpu_tests.xml"
tests_rc=$?
if [ "$BENCH" = 1 ]; then
  step gpu-bench 300 "$PY" -m testbed.bench.gpu_data_path --out "$OUT_DIR"
fi
finish $tests_rc
