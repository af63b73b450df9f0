#!/usr/bin/env bash
# The multi-core sweep of docs/PERFORMANCE.md section 0: null engine, 4k random read,
# iodepth 32, jobs 1-16. Needs target/device from scripts/device-pack.sh. Writes under $OUT
# (default sweep-out), one directory per run:
#   spdk-sweep   (when target/device/spdk was packed) mqblk per-queue, qemu-storage-daemon and
#                SPDK's vhost target, all driven by mqblk's frontend client (SPDK refuses
#                libblkio), the same work on each (reads leave the buffers as they are)
#   null-sweep   mqblk in every thread mapping against qemu-storage-daemon, libblkio client
#   pinned       (PINNED=1, 16 CPUs or more) per-queue with the I/O threads pinned
# About 7 minutes with the defaults on 16 CPUs (4.5 without SPDK). JOBS, REPEAT and RUNTIME
# override the grid.
set -euo pipefail
cd "$(dirname "$0")/.."
d=target/device
out=${OUT:-sweep-out}
jobs=${JOBS:-1,2,4,8,16}
repeat=${REPEAT:-3}
runtime=${RUNTIME:-3}
mkdir -p "$out"
# Each run's per-point logs go into one archive: a directory of hundreds of small files is more
# than a machine lent for the sweep may hand back.
pack_logs() {
    [ -d "$1/logs" ] && tar -C "$1" -czf "$1/logs.tar.gz" logs && rm -rf "$1/logs"
    return 0
}
{
    date -u +%FT%TZ
    nproc
    uname -r
    grep -m1 'model name' /proc/cpuinfo || true
    cat /proc/loadavg
} | tee "$out/machine.txt"
# SPDK first: it is what an earlier sweep lacks, and a run cut short by a time limit keeps it.
if [ -x "$d/spdk/bin/vhost" ]; then
    if python3 -c 'import json, socket' 2> /dev/null; then
        head -1 "$d/spdk/VERSIONS" 2> /dev/null | tee -a "$out/machine.txt" || true
        "$d/mqblk" bench --backend mqblk,qsd,spdk --qsd-bin "$d/qemu-storage-daemon" \
            --mqblk-bin "$d/mqblk" --spdk-dir "$d/spdk" --client frontend --read-zeroes off \
            --engine null --mode per-queue --workloads randread-4k --jobs "$jobs" \
            --iodepth 32 --runtime "$runtime" --repeat "$repeat" --out "$out/spdk-sweep" 2>&1 |
            tee "$out/spdk-sweep.log" ||
            echo "the SPDK run failed (its log: $out/spdk-sweep.log); the sweep goes on"
        pack_logs "$out/spdk-sweep"
    else
        echo "no python3 here: SPDK's rpc.py cannot configure its target; SPDK left out" |
            tee -a "$out/machine.txt"
    fi
fi
"$d/mqblk" bench --backend mqblk,qsd --qsd-bin "$d/qemu-storage-daemon" --mqblk-bin "$d/mqblk" \
    --engine null --mode baseline,mq,per-queue --workloads randread-4k --jobs "$jobs" \
    --iodepth 32 --runtime "$runtime" --repeat "$repeat" --out "$out/null-sweep" 2>&1 |
    tee "$out/null-sweep.log"
pack_logs "$out/null-sweep"
# Pinned: I/O thread i on CPU n-1-i (clear of the client threads, which the scheduler places),
# with polling, which the pinning turns on.
n=$(nproc)
if [ "${PINNED:-0}" = 1 ] && [ "$n" -ge 16 ]; then
    "$d/mqblk" bench --backend mqblk --mqblk-bin "$d/mqblk" --engine null --mode per-queue \
        --workloads randread-4k --jobs 8 --iodepth 32 --runtime "$runtime" --repeat "$repeat" \
        --mqblk-opts '' --mqblk-opts "cpus=$((n - 8))-$((n - 1))" \
        --mqblk-opts "cpus=$((n - 8))-$((n - 1)),poll=off" \
        --out "$out/pinned" 2>&1 | tee "$out/pinned.log"
    pack_logs "$out/pinned"
fi
