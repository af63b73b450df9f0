#!/usr/bin/env bash
# What a crafted backing chain makes a daemon hold in memory (docs/RELIABILITY.md, "Not yet
# covered"): bash scripts/crafted-chain-memory.sh MQBLK_BINARY LAYERS [DIR]
#
# Builds LAYERS qemu-img overlays of 64 TiB with 2 MiB clusters over a 1 MiB raw base in DIR
# (default: a new temporary directory), and points each backing overlay's 128 L1 entries at
# distinct clusters past its end (its file stays a few MiB; imago reads zeros there and caches
# a 2 MiB L2 table for each). Serves the top read-only with MQBLK_BINARY, reads 4 KiB at 128
# offsets 512 GiB apart (one per L1 entry) with mqblk-client's read_spread example, and prints
# the daemon's resident memory before and after. A build with the chain's table bound refuses
# a chain past `table-memory-max` (default 2G: 8 such images) at start, and this prints its
# error instead. Needs qemu-img and python3; builds the example (release) first.
set -euo pipefail
bin=$(realpath "$1"); layers=$2
dir=${3:-$(mktemp -d)}
. "$(dirname "$0")/crafted-image-lib.sh"
crafted_setup read_spread "$dir"
truncate -s 1M base.raw
prev=base.raw; fmt=raw
for i in $(seq 1 "$layers"); do
    qemu-img create -q -f qcow2 -o cluster_size=2M -b "$prev" -F "$fmt" "l$i.qcow2" 64T
    prev=l$i.qcow2; fmt=qcow2
done
for i in $(seq 1 $((layers - 1))); do
    python3 - "l$i.qcow2" <<'PY'
import struct, sys
with open(sys.argv[1], 'r+b') as f:
    h = f.read(48)
    entries, l1 = struct.unpack('>I', h[36:40])[0], struct.unpack('>Q', h[40:48])[0]
    f.seek(l1)
    # COPIED flag, and cluster 64 + k: past the end of a file of a few MiB.
    f.write(b''.join(struct.pack('>Q', (1 << 63) | ((k + 64) << 21)) for k in range(entries)))
PY
done
sock=$PWD/chain.sock
crafted_serve "$bin" "$sock" "path=$PWD/l$layers.qcow2,format=qcow2,queues=1,readonly=on"
pid=$served
if ! [ -S "$sock" ]; then
    echo "not served: $(grep -m1 error serve.log || tail -n 1 serve.log)"
    kill $pid 2>/dev/null || true
    exit 0
fi
echo "$layers images served; daemon $(grep VmRSS /proc/$pid/status)"
"$client" "$sock" 128 $((512 << 30))
echo "after the reads: $(grep VmRSS /proc/$pid/status), $(grep VmHWM /proc/$pid/status)"
kill $pid; wait $pid 2>/dev/null || true
