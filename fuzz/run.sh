#!/usr/bin/env bash
# Runs every fuzz target for a bounded time: bash fuzz/run.sh [SECONDS per target, default 30]
#
# Installs cargo-fuzz if it is missing (idempotent; about 1 minute the first time), builds the
# targets optimised with debug assertions, overflow checks and AddressSanitizer on the stable
# toolchain (RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its -Z flags; about 5 minutes from clean on
# 2 cores), and runs each from the committed seed corpus in fuzz/corpus/<target>. New inputs go
# to a scratch corpus (fuzz/target/corpus-run/<target>), never into the committed one.
# A crash, a panic, an ASan report, a timeout (-timeout) or an out-of-memory (-rss_limit_mb)
# fails the run; the reproducer is saved under fuzz/artifacts/<target>/ and its path printed.
# Reproduce one: RUSTC_BOOTSTRAP=1 cargo fuzz run <target> fuzz/artifacts/<target>/<file>
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-30}"
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

targets=(parse_request raw_bytes dirty_log memory_table qcow2_image)
# dirty_log: its LogInput decodes from 600 bytes; more is ignored.
# memory_table: 16 actions of at most 4 regions each fit well within 2 KiB.
# qcow2_image: an image of 512-byte clusters (the seeds') has its tables within 16 KiB. Its
# exports' metadata worker threads end on their own once the export is dropped, so the last
# one may still hold its image when the process exits, which LeakSanitizer's exit check would
# report: leaks are not checked for it (a leak per input would show as growing RSS instead,
# which -rss_limit_mb bounds).
declare -A extra=([qcow2_image]="-detect_leaks=0")
declare -A max_len=([parse_request]=1024 [raw_bytes]=1100 [dirty_log]=640 [memory_table]=2048 [qcow2_image]=16384)

start=$(date +%s)
mkdir -p target
if ! cargo fuzz build >target/fuzz-build.log 2>&1; then
    echo "fuzz: build failed:"
    tail -n 40 target/fuzz-build.log
    exit 1
fi
echo "fuzz: build took $(( $(date +%s) - start )) s"

for t in "${targets[@]}"; do
    work="target/corpus-run/$t"
    mkdir -p "$work" "artifacts/$t"
    log="target/fuzz-$t.log"
    echo "fuzz: $t for ${secs} s"
    set +e
    cargo fuzz run "$t" "$work" "corpus/$t" -- \
        -max_total_time="$secs" -max_len="${max_len[$t]}" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 ${extra[$t]:-} >"$log" 2>&1
    rc=$?
    set -e
    execs=$(grep -m1 '^stat::number_of_executed_units' "$log" | awk '{print $2}')
    rate=$(grep -m1 '^stat::average_exec_per_sec' "$log" | awk '{print $2}')
    cov=$(grep -E '#[0-9]+.*(DONE|pulse|NEW|REDUCE)' "$log" | tail -n 1 | grep -o 'cov: [0-9]*' || true)
    echo "fuzz: $t: ${execs:-?} executions (${rate:-?}/s) in ${secs} s, ${cov:-cov: ?}, exit $rc"
    if [ "$rc" -ne 0 ]; then
        echo "fuzz: $t FAILED; last lines of $log:"
        tail -n 40 "$log"
        exit 1
    fi
done
# qcow2_image's image files (one per fuzzing process).
rm -f /dev/shm/mqblk-fuzz-qcow2-*.img /tmp/mqblk-fuzz-qcow2-*.img
echo "fuzz: all targets ran clean in $(( $(date +%s) - start )) s"
