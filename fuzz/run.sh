#!/usr/bin/env bash
# Runs every fuzz target of a `make fuzz` build for SECONDS seconds each on
# its committed corpus (read only: new inputs go to a scratch corpus under
# OUT) with its dictionary. A crash, leak, timeout or failed invariant fails
# the run: the input is saved as OUT/artifacts/fuzz_<input>-crash-<sha1>,
# printed (base64), and reproduced by
#   build-fuzz/fuzz/fuzz_<input> OUT/artifacts/fuzz_<input>-crash-<sha1>
# (or the gcc-built build/fuzz/fuzz_<input>_replay on the same file).
# At the end a table gives, per target, the executions, wall time, exec/s,
# coverage (cov: edges, ft: features) and corpus size of libFuzzer's last
# status line, and whether it passed.
# FUZZ_RUNS=N also stops each target after N executions (whichever comes
# first), e.g. a long run: FUZZ_RUNS=10000000 nice -n 19 fuzz/run.sh ... 3600.
# usage: fuzz/run.sh BUILD_DIR/fuzz SECONDS [OUT [TARGET...]]
set -uo pipefail
bin=${1:?usage: fuzz/run.sh BUILD_DIR/fuzz SECONDS [OUT [TARGET...]]}
secs=${2:-30}
out=${3:-$(dirname "$bin")/fuzz-run}
shift $(( $# < 3 ? $# : 3 ))
src=$(cd "$(dirname "$0")" && pwd)
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in "$src"/fuzz_*.c; do
    n=$(basename "$f" .c)
    [ -x "$bin/$n" ] && targets+=("$n")
  done
fi
mkdir -p "$out/artifacts"
failed=()
summary=()
for t in "${targets[@]}"; do
  corpus="$src/corpus/$t"
  scratch="$out/corpus/$t"
  mkdir -p "$scratch"
  args=(-max_total_time="$secs" -timeout=20 -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$out/artifacts/$t-")
  [ -f "$src/dict/$t.dict" ] && args+=(-dict="$src/dict/$t.dict")
  [ -n "${FUZZ_RUNS:-}" ] && args+=(-runs="$FUZZ_RUNS")
  case "$t" in
    fuzz_store_scan|fuzz_model_header) args+=(-max_len=16384) ;;
    fuzz_tokenizer_file) args+=(-max_len=8192) ;;
  esac
  log="$out/$t.log"
  echo "== $t: ${secs}s"
  t0=$(date +%s)
  "$bin/$t" "${args[@]}" "$scratch" "$corpus" >"$log" 2>&1
  rc=$?
  el=$(( $(date +%s) - t0 ))
  # the last status line: "#N DONE cov: C ft: F corp: K/SIZE ... exec/s: E"
  last=$(grep -E "^#[0-9]+" "$log" | tail -n 1)
  summary+=("$(printf '%-24s %12s %6s %8s %6s %6s %10s %s' "$t" "$(sed -nE 's/^#([0-9]+).*/\1/p' <<<"$last")" "${el}s" \
    "$(sed -nE 's/.*exec\/s: ([0-9]+).*/\1/p' <<<"$last")" "$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")" \
    "$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$last")" "$(sed -nE 's/.* corp: ([0-9]+\/[0-9A-Za-z]+).*/\1/p' <<<"$last")" \
    "$([ $rc -eq 0 ] && echo ok || echo FAILED)")")
  grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|^#[0-9]+.*DONE" "$log" | tr '\n' ' '
  echo
  if [ $rc -ne 0 ]; then
    failed+=("$t")
    echo "!! $t failed (exit $rc); the end of its log ($log):"
    tail -n 40 "$log"
    for a in "$out/artifacts/$t-"*; do
      [ -f "$a" ] || continue
      echo "!! input saved as $a ($(stat -c %s "$a") bytes), base64:"
      base64 -w 100 "$a" | head -n 60
    done
  fi
done
printf '%-24s %12s %6s %8s %6s %6s %10s %s\n' target executions time exec/s cov ft corpus result
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz: ${#failed[@]} target(s) failed: ${failed[*]}"
  exit 1
fi
echo "fuzz: ${#targets[@]} targets ran ${secs}s each, no failure"
