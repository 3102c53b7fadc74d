#!/usr/bin/env bash
# Instruction ratios of shardkit over plain SeaORM (see overhead.rs): each
# variant runs under callgrind at two operation counts; the marginal
# instructions per operation are (I(N2) - I(N1)) / (N2 - N1). Counted on the
# main thread, where shardkit, SeaORM and the drivers' client side run (the
# program uses a current-thread runtime): SQLx's SQLite worker threads run the
# same SQLite work in both modes, and their wake-up spins make whole-process
# counts drift by several percent between identical runs.
# Usage: tests/benches/overhead.sh [N1 N2]   (PostgreSQL at SHARDKIT_PG_URL)
set -euo pipefail
cd "$(dirname "$0")/../.."
n1="${1:-100}"
n2="${2:-600}"
bin=$(cargo bench -p shardkit-tests --bench overhead --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "overhead" and m.get("executable"):
        print(m["executable"])')
out=$(mktemp -d)
count() { # mode backend op n -> instructions
  valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/cg.%p" \
    "$bin" "$@" >/dev/null 2>"$out/log"
  grep -h "^summary:" "$out"/cg.*-01 | awk '{s+=$2} END {print s}'
  rm -f "$out"/cg.*
}
printf '%-10s %-7s %14s %14s %8s\n' backend op plain/op shardkit/op ratio
for case in "sqlite read" "postgres read" "sqlite update" "postgres update"; do
  set -- $case
  declare -A per
  for mode in plain shardkit; do
    a=$(count "$mode" "$1" "$2" "$n1")
    b=$(count "$mode" "$1" "$2" "$n2")
    per[$mode]=$(( (b - a) / (n2 - n1) ))
  done
  ratio=$(python3 -c "print(f'{${per[shardkit]}/${per[plain]}:.3f}')")
  printf '%-10s %-7s %14s %14s %8s\n' "$1" "$2" "${per[plain]}" "${per[shardkit]}" "$ratio"
done
rm -rf "$out"
