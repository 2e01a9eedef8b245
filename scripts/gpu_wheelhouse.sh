#!/usr/bin/env bash
# Builds the wheelhouse that scripts/gpu_check.sh installs on a GPU machine with no package
# registry: the packages its image lacks (the GPU image has Python 3.12 with torch, numpy,
# pandas, pyarrow, grpcio, requests, pytest and more, but not ZeroMQ, msgspec, blake3 or
# OpenTelemetry), at the versions this checkout's .venv uses, as cp312 manylinux wheels, plus
# this project's own wheel. Run here, where pip reaches the registry:
#
#   bash scripts/gpu_wheelhouse.sh [DIR]      (default: .whl, git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
VENV_PY=${VENV_PY:-.venv/bin/python}
# Exactly what the image lacks (protobuf too: the OpenTelemetry protos need a runtime at least
# as new as the one they were generated with, whatever the image carries).
PACKAGES=(pyzmq msgspec blake3 protobuf googleapis-common-protos
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
  opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
  opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-common
  opentelemetry-exporter-http-transport)
rm -rf "$DIR" && mkdir -p "$DIR"
pins=()
for name in "${PACKAGES[@]}"; do
  version=$("$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  pins+=("$name==$version")
done
"$VENV_PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DIR" "${pins[@]}"
"$VENV_PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DIR" .
count=$(ls "$DIR"/*.whl | wc -l)
size=$(du -sm "$DIR" | cut -f1)
echo "wheelhouse $DIR: $count wheels, ${size} MiB"
if [ "$size" -ge 60 ]; then
  echo "the wheelhouse must stay well under 60 MiB" >&2
  exit 1
fi
