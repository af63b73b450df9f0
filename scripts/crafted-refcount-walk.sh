#!/usr/bin/env bash
# How long a crafted qcow2 image's refcounts hold an export's first write (docs/RELIABILITY.md):
# bash scripts/crafted-refcount-walk.sh MQBLK_BINARY MIB [DIR]
#   CLUSTER=2M: 2 MiB clusters; TERM_AFTER=S: SIGTERM the daemon S seconds into the write, and
#   print how long it took to exit (its shutdown drains the export first).
#
# Makes a 256 TiB qcow2 image with 1-bit refcounts in DIR (default: a new temporary directory)
# and appends MIB MiB of refcount blocks, every bit set, named by the first entries of its
# refcount table: each block counts 8 clusters a byte in use (a 64 KiB one 512 Ki clusters,
# 32 GiB), so the file counts MIB * 8 Mi clusters, all but the first few past its end. Serves it with
# MQBLK_BINARY and times a 4 KiB write at offset 0 (mqblk-client's timed_write example), which
# allocates: imago's allocator walks every counted cluster from the first. A build that bounds
# what may be counted past the end of the file refuses the image when its queue starts, and
# this prints that error instead. Needs qemu-img and python3; builds the example (release).
set -euo pipefail
bin=$(realpath "$1"); mib=$2
dir=${3:-$(mktemp -d)}
. "$(dirname "$0")/crafted-image-lib.sh"
crafted_setup timed_write "$dir"
rm -f walk.qcow2
cluster=$(numfmt --from=iec "${CLUSTER:-64K}")
qemu-img create -q -f qcow2 -o refcount_bits=1,cluster_size=$cluster walk.qcow2 256T
python3 - walk.qcow2 "$mib" "$cluster" <<'PY'
import os, struct, sys
path, mib, cluster = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, 'r+b') as f:
    f.seek(48)
    reftable = struct.unpack('>Q', f.read(8))[0]
    end = (os.path.getsize(path) + cluster - 1) // cluster * cluster
    blocks = mib * (1 << 20) // cluster
    f.seek(end)
    f.write(b'\xff' * cluster * blocks)
    f.seek(reftable)
    f.write(b''.join(struct.pack('>Q', end + i * cluster) for i in range(blocks)))
PY
sock=$PWD/walk.sock
crafted_serve "$bin" "$sock" "path=$PWD/walk.qcow2,format=qcow2,queues=1"
pid=$served
echo "$(du -h walk.qcow2 | cut -f1) image, $mib MiB of refcount blocks"
"$client" "$sock" > write.log 2>&1 &
writing=$!
if [ -n "${TERM_AFTER:-}" ]; then
    sleep "$TERM_AFTER"
    began=$(date +%s.%N)
    kill -TERM $pid
    while kill -0 $pid 2>/dev/null; do sleep 0.05; done
    echo "SIGTERM ${TERM_AFTER} s into the write: the daemon took $(echo "$(date +%s.%N) - $began" | bc) s to exit"
fi
# The write never completes where the queue was refused: the log says so.
while kill -0 $writing 2>/dev/null && ! grep -q "queue not started" serve.log; do
    sleep 0.2
done
if kill -0 $writing 2>/dev/null; then
    kill $writing
    echo "refused: $(grep -m1 -o 'the image.*' serve.log)"
else
    cat write.log
fi
kill $pid 2>/dev/null; wait $pid 2>/dev/null || true
