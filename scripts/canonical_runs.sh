#!/usr/bin/env bash
# The eight canonical runs, for checking that a change keeps every token's category and every
# request's accounting: run them before and after, then compare.
#
#   scripts/canonical_runs.sh OUT_DIR            # the runs, and OUT_DIR/<name>.tokens.json,
#                                                # OUT_DIR/<name>.requests.csv for each
#   scripts/canonical_runs.sh --compare A B      # every value of A's tables equal in B's
#
# KVTB (default: kvtb on PATH) and KVTB_DATA_DIR (default: the checkout's ../shared/data) may
# be set. The tables hold what a run's accounting is (token categories, per-request hits and
# causes), not times or random ids, so two runs of the same code give the same bytes.
set -euo pipefail

if [[ "${1:-}" == "--compare" ]]; then
  # Every category and column of A must hold the same values in B; categories or columns that
  # B adds (a new kind of hit or miss, 0 on these runs or not) are listed, not failed.
  exec "${PYTHON:-python3}" - "$2" "$3" <<'PY'
import csv, json, sys
from pathlib import Path

a, b = Path(sys.argv[1]), Path(sys.argv[2])
status = 0
for file in sorted(a.glob("*.tokens.json")) + sorted(a.glob("*.requests.csv")):
    other = b / file.name
    if not other.is_file():
        print(f"missing: {other}"); status = 1; continue
    if file.suffix == ".json":
        old, new = json.loads(file.read_text()), json.loads(other.read_text())
        rows_old, rows_new = [old], [new]
    else:
        rows_old = list(csv.DictReader(file.open())); rows_new = list(csv.DictReader(other.open()))
    keys = list(rows_old[0]) if rows_old else []
    added = sorted(set(rows_new[0]) - set(keys)) if rows_new else []
    same = len(rows_old) == len(rows_new) and all(
        {k: r[k] for k in keys} == {k: s.get(k) for k in keys} for r, s in zip(rows_old, rows_new))
    print(f"{'same' if same else 'differs'}: {file.name}" + (f" (added: {', '.join(added)})" if added else ""))
    status |= 0 if same else 1
sys.exit(status)
PY
fi

out=${1:?usage: scripts/canonical_runs.sh OUT_DIR | --compare A B}
here=$(cd "$(dirname "$0")/.." && pwd)
kvtb=${KVTB:-kvtb}
data=${KVTB_DATA_DIR:-$here/../shared/data}
mooncake="mooncake:$data/mooncake/conversation_trace.jsonl"
mkdir -p "$out"

run() {
  local name=$1; shift
  echo "== $name: kvtb run $*" >&2
  $kvtb run --no-progress --out "$out/$name" "$@" >"$out/$name.log" 2>&1 || {
    echo "$name failed (see $out/$name.log)" >&2; tail -20 "$out/$name.log" >&2; return 1; }
}

run chat --workload chat --requests 200
run rag_eviction --workload rag --requests 200 --capacity-tokens 20000
run tp2_mla --workload chat --requests 100 --tp 2 --mla
run faults --workload chat --requests 100 --fault-drop-fraction 0.2
run mooncake300 --workload "$mooncake" --requests 300
run oracle_mooncake2000 --engine oracle --workload "$mooncake" --requests 2000
run agentic_eviction --workload "agentic:$data/kv-cache-tester" --requests 200 \
  --capacity-tokens 300000
run fleet2 --engine fleet --instances 2 --workload chat --requests 200

"${PYTHON:-python3}" - "$out" <<'PY'
import json, sys
from pathlib import Path
import pandas as pd

KEEP = ("prompt_tokens", "engine_hit_tokens", "external_hit_tokens", "recomputed_tokens",
        "load_failed_tokens", "promised_tokens", "server_hit_tokens", "lookup_status")
out = Path(sys.argv[1])
for run_root in sorted(p for p in out.iterdir() if p.is_dir()):
    (run_dir,) = [p for p in run_root.iterdir() if (p / "summary.json").is_file()]
    summary = json.loads((run_dir / "summary.json").read_text())
    tokens = {k: summary["tokens"][k] for k in sorted(summary["tokens"])}
    (out / f"{run_root.name}.tokens.json").write_text(json.dumps(tokens, indent=1) + "\n")
    table = pd.read_parquet(run_dir / "metrics.parquet")
    key = "workload_request_id" if table.get("workload_request_id") is not None and table["workload_request_id"].notna().all() else "request_id"
    categories = [c for c in summary["tokens"] if c in table.columns]
    columns = [key, *[c for c in KEEP if c in table.columns], *sorted(categories)]
    table[columns].sort_values(key).to_csv(out / f"{run_root.name}.requests.csv", index=False)
    print(run_root.name, run_dir.name, tokens)
PY
