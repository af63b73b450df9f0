#!/usr/bin/env bash
# The multi-core sweep of docs/PERFORMANCE.md section 0: null engine, 4k random read, jobs
# 1-16. Needs target/device from scripts/device-pack.sh. Writes under $OUT (default
# sweep-out), one directory per run. RUNS (comma-separated) picks the runs, in this order:
#   spdk     (default; needs target/device/spdk) iodepth 32: mqblk per-queue,
#            qemu-storage-daemon and SPDK's vhost target, all driven by mqblk's frontend client
#            (SPDK refuses libblkio), the same work on each (reads leave the buffers as they
#            are): about 3 minutes on 16 CPUs
#   null     (default) iodepth 32: mqblk in every thread mapping against qemu-storage-daemon,
#            libblkio client: about 4 minutes
#   qd1      as spdk, at iodepth 1, jobs 1,2,4: about 1.5 minutes
#   polled   as spdk with a polling client, iodepth 32 and 1, jobs 1,4: about 2 minutes
#   pinned   (16 CPUs or more) per-queue, 8 jobs, the I/O threads pinned, with and without
#            polling: about 40 seconds
# A machine lent for 10 minutes a call takes the defaults in one call and RUNS=qd1,polled in a
# second. REPEAT and RUNTIME override every run's, JOBS the job counts of spdk and null.
set -euo pipefail
cd "$(dirname "$0")/.."
d=target/device
out=${OUT:-sweep-out}
runs=",${RUNS:-spdk,null},"
jobs=${JOBS:-1,2,4,8,16}
repeat=${REPEAT:-3}
runtime=${RUNTIME:-3}
mkdir -p "$out"

wants() { [[ $runs == *",$1,"* ]]; }

# Each run's per-point logs go into one archive: a directory of hundreds of small files is more
# than a machine lent for the sweep may hand back.
pack_logs() {
    [ -d "$1/logs" ] && tar -C "$1" -czf "$1/logs.tar.gz" logs && rm -rf "$1/logs"
    return 0
}

# `mqblk bench` against SPDK with the frontend client, writing $out/NAME and $out/NAME.log; a
# failure is reported and the sweep goes on to its next run.
spdk_run() {
    local name=$1
    shift
    "$d/mqblk" bench --backend mqblk,qsd,spdk --qsd-bin "$d/qemu-storage-daemon" \
        --mqblk-bin "$d/mqblk" --spdk-dir "$d/spdk" --client frontend --read-zeroes off \
        --engine null --mode per-queue --workloads randread-4k "$@" --out "$out/$name" 2>&1 |
        tee "$out/$name.log" ||
        echo "the $name run failed (its log: $out/$name.log); the sweep goes on"
    pack_logs "$out/$name"
}

{
    date -u +%FT%TZ
    nproc
    uname -r
    grep -m1 'model name' /proc/cpuinfo || true
    cat /proc/loadavg
} | tee "$out/machine.txt"

spdk=no
if [ -x "$d/spdk/bin/vhost" ]; then
    if python3 -c 'import json, socket' 2> /dev/null; then
        spdk=yes
        head -1 "$d/spdk/VERSIONS" 2> /dev/null | tee -a "$out/machine.txt" || true
    else
        echo "no python3 here: SPDK's rpc.py cannot configure its target; SPDK left out" |
            tee -a "$out/machine.txt"
    fi
elif wants spdk || wants qd1 || wants polled; then
    echo "target/device/spdk not packed (SPDK_DIR=... scripts/device-pack.sh): SPDK left out" |
        tee -a "$out/machine.txt"
fi

# SPDK first: it is what an earlier sweep lacks, and a run cut short by a time limit keeps it.
if [ $spdk = yes ] && wants spdk; then
    spdk_run spdk-sweep --jobs "$jobs" --iodepth 32 --runtime "$runtime" --repeat "$repeat"
fi
if wants null; then
    "$d/mqblk" bench --backend mqblk,qsd --qsd-bin "$d/qemu-storage-daemon" --mqblk-bin "$d/mqblk" \
        --engine null --mode baseline,mq,per-queue --workloads randread-4k --jobs "$jobs" \
        --iodepth 32 --runtime "$runtime" --repeat "$repeat" --out "$out/null-sweep" 2>&1 |
        tee "$out/null-sweep.log"
    pack_logs "$out/null-sweep"
fi
if [ $spdk = yes ] && wants qd1; then
    spdk_run qd1 --jobs 1,2,4 --iodepth 1 --runtime "$runtime" --repeat "$repeat"
fi
if [ $spdk = yes ] && wants polled; then
    spdk_run polled --client-poll --jobs 1,4 --iodepth 32,1 --runtime "$runtime" --repeat "$repeat"
fi
# Pinned: I/O thread i on CPU n-1-i (clear of the client threads, which the scheduler places),
# with polling, which the pinning turns on.
n=$(nproc)
if wants pinned && [ "$n" -ge 16 ]; then
    "$d/mqblk" bench --backend mqblk --mqblk-bin "$d/mqblk" --engine null --mode per-queue \
        --workloads randread-4k --jobs 8 --iodepth 32 --runtime "$runtime" --repeat "$repeat" \
        --mqblk-opts '' --mqblk-opts "cpus=$((n - 8))-$((n - 1))" \
        --mqblk-opts "cpus=$((n - 8))-$((n - 1)),poll=off" \
        --out "$out/pinned" 2>&1 | tee "$out/pinned.log"
    pack_logs "$out/pinned"
fi
