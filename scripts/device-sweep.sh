#!/usr/bin/env bash
# The multi-core sweep of issue #3 / docs/PERFORMANCE.md: null engine, 4k random read,
# iodepth 32, jobs 1-16, mqblk in every thread mapping against qemu-storage-daemon, in one
# interleaved run; then per-queue with the I/O threads pinned to CPUs of their own.
# Needs target/device from scripts/device-pack.sh. Writes under $OUT (default sweep-out).
# About 4.5 minutes with the defaults on 16 CPUs. JOBS, REPEAT and RUNTIME override the grid.
set -euo pipefail
cd "$(dirname "$0")/.."
d=target/device
out=${OUT:-sweep-out}
jobs=${JOBS:-1,2,4,8,16}
repeat=${REPEAT:-3}
runtime=${RUNTIME:-3}
mkdir -p "$out"
{
    date -u +%FT%TZ
    nproc
    uname -r
    grep -m1 'model name' /proc/cpuinfo || true
    cat /proc/loadavg
} | tee "$out/machine.txt"
"$d/mqblk" bench --backend mqblk,qsd --qsd-bin "$d/qemu-storage-daemon" --mqblk-bin "$d/mqblk" \
    --engine null --mode baseline,mq,per-queue --workloads randread-4k --jobs "$jobs" \
    --iodepth 32 --runtime "$runtime" --repeat "$repeat" --out "$out/null-sweep" 2>&1 |
    tee "$out/null-sweep.log"
# Pinned: I/O thread i on CPU n-1-i (clear of the client threads, which the scheduler places),
# with polling, which the pinning turns on.
n=$(nproc)
if [ "$n" -ge 16 ]; then
    "$d/mqblk" bench --backend mqblk --mqblk-bin "$d/mqblk" --engine null --mode per-queue \
        --workloads randread-4k --jobs 8 --iodepth 32 --runtime "$runtime" --repeat "$repeat" \
        --mqblk-opts '' --mqblk-opts "cpus=$((n - 8))-$((n - 1))" \
        --mqblk-opts "cpus=$((n - 8))-$((n - 1)),poll=off" \
        --out "$out/pinned" 2>&1 | tee "$out/pinned.log"
fi
