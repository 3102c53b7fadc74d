# Instruction counts under callgrind, sourced by overhead.sh and tpcb.sh.
#
# bench_bin NAME: the path of bench NAME's executable (built if needed).
# compare BASE OTHER LABEL CASES...: for each case (the bench's arguments
# between the mode and the operation count, as one word list), runs modes
# BASE and OTHER interleaved ROUNDS times at N1 and N2 operations and prints
# the marginal main-thread instructions per operation, (I(N2) - I(N1)) /
# (N2 - N1), the lowest of each mode (the run with the fewest wasted polls)
# with the spread, and OTHER's over BASE's.
#
# Counted on the main thread, where shardkit, SeaORM and the drivers' client
# side run (the programs use a current-thread runtime). How often a future
# is polled before the database answers depends on timing, so counts of
# identical runs differ by a few percent: hence the rounds and the minimum.
# Needs: n1, n2, rounds.

bench_bin() {
  cargo bench -p shardkit-tests --bench "$1" --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])' "$1"
}

callgrind_out=$(mktemp -d)
trap 'rm -rf "$callgrind_out"' EXIT

count() { # bench-args... -> main-thread instructions
  valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$callgrind_out/cg.%p" \
    "$bin" "$@" >/dev/null 2>"$callgrind_out/log"
  grep -h "^summary:" "$callgrind_out"/cg.*-01 | awk '{s+=$2} END {print s}'
  rm -f "$callgrind_out"/cg.*
}

compare() { # base other label cases...
  local base=$1 other=$2 label=$3; shift 3
  printf '%-18s %22s %22s %7s\n' case "$base/op (min..max)" "$other/op (min..max)" "$label"
  for case in "$@"; do
    samples=""
    for _ in $(seq 1 "$rounds"); do
      for mode in "$base" "$other"; do
        # shellcheck disable=SC2086 # a case is a word list
        a=$(count "$mode" $case "$n1")
        # shellcheck disable=SC2086
        b=$(count "$mode" $case "$n2")
        samples="$samples $mode:$(( (b - a) / (n2 - n1) ))"
      done
    done
    python3 - "$case" "$base" "$other" $samples <<'PY'
import sys
case, base, other, *samples = sys.argv[1:]
per = {base: [], other: []}
for s in samples:
    mode, n = s.split(":")
    per[mode].append(int(n))
p, k = per[base], per[other]
print(f"{case:<18} {min(p):>9} ({min(p)}..{max(p)}) {min(k):>9} ({min(k)}..{max(k)}) {min(k)/min(p):7.3f}")
PY
  done
}
