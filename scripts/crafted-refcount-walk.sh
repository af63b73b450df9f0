#!/usr/bin/env bash
# How long a crafted qcow2 image's refcounts hold an export's first write (docs/RELIABILITY.md):
# bash scripts/crafted-refcount-walk.sh MQBLK_BINARY MIB [DIR]   (CLUSTER=2M: 2 MiB clusters)
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
cd "$(dirname "$0")/.."
cargo build --release -q -p mqblk-client --example timed_write
writer=$PWD/target/release/examples/timed_write
mkdir -p "$dir"; cd "$dir"
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
sock=$dir/walk.sock; rm -f "$sock"
"$bin" serve --export "socket=$sock,path=$dir/walk.qcow2,format=qcow2,queues=1" \
    > "$dir/serve.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
echo "$(du -h walk.qcow2 | cut -f1) image, $mib MiB of refcount blocks"
"$writer" "$sock" > "$dir/write.log" 2>&1 &
writing=$!
# The write never completes where the queue was refused: the log says so.
while kill -0 $writing 2>/dev/null && ! grep -q "queue not started" "$dir/serve.log"; do
    sleep 0.2
done
if kill -0 $writing 2>/dev/null; then
    kill $writing
    echo "refused: $(grep -m1 -o 'the image.*' "$dir/serve.log")"
else
    cat "$dir/write.log"
fi
kill $pid; wait $pid 2>/dev/null || true
