#!/usr/bin/env bash
# Packs what the multi-core sweep (scripts/device-sweep.sh) needs on a machine without Rust or
# QEMU into target/device/ (about 30 MiB): a stripped release mqblk, and qemu-storage-daemon
# with the shared libraries it needs beyond glibc, behind a wrapper that points the loader at
# them. Carry target/device to the machine and run scripts/device-sweep.sh there.
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
cp "$qsd" "$out/qemu-storage-daemon.bin"
# Everything ldd resolves except the C library itself (the target has its own, newer one).
ldd "$qsd" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
    libc.so.* | libm.so.* | ld-linux* | libpthread.so.* | libdl.so.* | librt.so.*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
    esac
done
cat > "$out/qemu-storage-daemon" <<'WRAP'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/qemu-storage-daemon.bin" "$@"
WRAP
chmod +x "$out/qemu-storage-daemon"
"$out/qemu-storage-daemon" --version | head -1
du -sh "$out"
