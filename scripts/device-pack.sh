#!/usr/bin/env bash
# Packs what the multi-core sweep (scripts/device-sweep.sh) needs on a machine without Rust or
# QEMU into target/device/ (about 18 MiB): a stripped release mqblk, and qemu-storage-daemon
# with the shared libraries it needs beyond glibc, behind a wrapper that points the loader at
# them. With SPDK_DIR set to a build from scripts/spdk-build.sh (or $MQBLK_SPDK_DIR), its vhost
# target goes in too, the same way, in target/device/spdk (about 8 MiB more), and the sweep
# adds SPDK. Carry target/device to the machine and run scripts/device-sweep.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/device
rm -rf "$out"
mkdir -p "$out/lib"
cargo build --release
strip -o "$out/mqblk" target/release/mqblk
qsd=$(command -v qemu-storage-daemon) || {
    echo "qemu-storage-daemon not installed (bash .ci/setup installs it)" >&2
    exit 1
}

# Copies binary $1 to $2.bin, the libraries it needs into directory $3 and writes $2 as a
# wrapper that points the loader at them (exec keeps the pid, which the bench's CPU count
# reads). Everything ldd resolves is copied except the C library itself: the target has its
# own, newer one.
wrap() {
    local bin=$1 dest=$2 libdir=$3
    mkdir -p "$libdir"
    strip -o "$dest.bin" "$bin"
    ldd "$bin" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
        case "$(basename "$lib")" in
        libc.so.* | libm.so.* | ld-linux* | libpthread.so.* | libdl.so.* | librt.so.*) ;;
        *) cp -L "$lib" "$libdir/" ;;
        esac
    done
    local rel
    rel=$(realpath --relative-to="$(dirname "$dest")" "$libdir")
    cat > "$dest" <<WRAP
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH="\$here/$rel\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/$(basename "$dest").bin" "\$@"
WRAP
    chmod +x "$dest"
}

wrap "$qsd" "$out/qemu-storage-daemon" "$out/lib"
"$out/qemu-storage-daemon" --version | head -1

spdk=${SPDK_DIR:-${MQBLK_SPDK_DIR:-}}
if [ -n "$spdk" ]; then
    [ -x "$spdk/bin/vhost" ] && [ -f "$spdk/scripts/rpc.py" ] || {
        echo "SPDK_DIR=$spdk: not a build from scripts/spdk-build.sh (no bin/vhost, scripts/rpc.py)" >&2
        exit 1
    }
    mkdir -p "$out/spdk/bin" "$out/spdk/scripts" "$out/spdk/python"
    wrap "$spdk/bin/vhost" "$out/spdk/bin/vhost" "$out/spdk/lib"
    cp "$spdk/scripts/rpc.py" "$out/spdk/scripts/"
    cp -r "$spdk/python/spdk" "$out/spdk/python/"
    cp "$spdk/VERSIONS" "$out/spdk/" 2> /dev/null || true
    head -1 "$out/spdk/VERSIONS" 2> /dev/null || true
fi
du -sh "$out"
