#!/usr/bin/env bash
# Runs every sanitizer driver (built by `make sanitize-build` into $1) side by
# side, $JOBS at a time, each with its output in a log of its own; prints
# every log in a fixed order, and fails if any run failed.
set -uo pipefail
bin=${1:?usage: run_all.sh BIN_DIR}
ops=${RANDOM_RUN_OPS:-1000000}
jobs=${JOBS:-2}
fake="$bin/libfakecuda.so"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

runs=(
  "random_run waterwave $ops 1"
  "random_run pytorch $ops 1"
  "stress_threads waterwave 4 100000 1"
  "stress_threads pytorch 4 100000 1"
  "stress_threads waterwave 4 50000 2 expandable_segments:True"
  "stress_threads pytorch 4 50000 2 expandable_segments:True"
  "stress_threads waterwave 4 50000 4 own_segments_first:True"
  "cuda_backend_run $fake waterwave 4 20000 1"
  "cuda_backend_run $fake pytorch 4 20000 1"
  "cuda_backend_run $fake waterwave 4 10000 2 expandable_segments:True"
  "cuda_backend_run $fake pytorch 4 10000 2 expandable_segments:True"
  "offset_search_run 400 1"
  "stress_threads_tsan waterwave 4 20000 3"
  "stress_threads_tsan pytorch 4 20000 3"
  "stress_threads_tsan waterwave 4 10000 5 own_segments_first:True"
  "cuda_backend_run_tsan $bin/libfakecuda_tsan.so waterwave 4 5000 2"
  "cuda_backend_run_tsan $bin/libfakecuda_tsan.so pytorch 4 5000 4 expandable_segments:True"
)

run_one() {  # index, then the command line
  local i=$1; shift
  local start=$SECONDS
  # ThreadSanitizer's runtime maps its shadow memory at fixed addresses,
  # which a kernel's high address randomization can collide with: its runs
  # go without it where setarch can turn it off. A report fails the run
  # (its exit status, 66).
  local prefix=()
  if [[ $1 == *_tsan ]] && command -v setarch > /dev/null &&
     setarch "$(uname -m)" -R true 2> /dev/null; then
    prefix=(setarch "$(uname -m)" -R)
  fi
  "${prefix[@]}" "$bin/$1" "${@:2}" > "$logs/$i.log" 2>&1
  echo $? > "$logs/$i.rc"
  echo "$((SECONDS - start))" > "$logs/$i.secs"
}
export -f run_one
export bin logs

for i in "${!runs[@]}"; do printf '%s\0' "$i ${runs[$i]}"; done |
  xargs -0 -P "$jobs" -I{} bash -c 'run_one {}'

failed=0
for i in "${!runs[@]}"; do
  rc=$(cat "$logs/$i.rc" 2>/dev/null || echo missing)
  echo "== ${runs[$i]}  (exit $rc, $(cat "$logs/$i.secs" 2>/dev/null || echo '?') s)"
  cat "$logs/$i.log"
  [ "$rc" = 0 ] || failed=$((failed + 1))
done
echo "sanitizers: $((${#runs[@]} - failed)) passed, $failed failed"
[ "$failed" -eq 0 ]
