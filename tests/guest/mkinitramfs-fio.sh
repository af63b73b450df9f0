#!/usr/bin/env bash
# Builds the initramfs of the reconnect test guest (tests/guest_reconnect.rs):
# target/guest/initramfs-fio.cpio.zst (zstd; gzip, .cpio.gz, where zstd is missing), holding
#   /init                       tests/guest/init-reconnect
# or, with arguments `mkinitramfs-fio.sh INIT NAME`, tests/guest/INIT as /init in
# target/guest/NAME.cpio.zst (the migration test's guest uses init-migration), and
#   /bin/busybox                the static busybox from Debian's busybox-static package
#   /usr/bin/fio                the host's fio (Debian's fio package), dynamically linked, with
#                               every library `ldd` lists and the dynamic loader, at the same
#                               paths as on the host (Debian's fio is linked with -z now against
#                               ceph, gluster, rdma, ...: all of them must be there, about 85 MB)
#   /lib/modules/virtio_blk.ko  target/guest/virtio_blk.ko (unpacked by .ci/setup)
# The first initramfs (mkinitramfs.sh, for tests/guest.rs) stays small and is not touched.
# Idempotent: does nothing when the output is newer than all of its inputs (and this script).
# Prints the output's path on stdout. Needs cpio, ldd, and zstd or gzip (installed by .ci/setup).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
guest="$root/target/guest"
init="$here/${1:-init-reconnect}"
name="${2:-initramfs-fio}"
module="$guest/virtio_blk.ko"
busybox="${MQBLK_BUSYBOX:-/bin/busybox}"
fio="${MQBLK_FIO:-/usr/bin/fio}"

die() {
	echo "mkinitramfs-fio: $*" >&2
	exit 1
}
# resolve_libs, install_libs, pack.
# shellcheck source=tests/guest/initramfs-lib.sh
. "$here/initramfs-lib.sh"

# zstd decompresses several times faster than gzip in the TCG guest; MQBLK_INITRAMFS_GZIP=1
# forces gzip (to try the fallback).
if [ "${MQBLK_INITRAMFS_GZIP:-0}" != 1 ] && command -v zstd >/dev/null; then
	out="$guest/$name.cpio.zst"
	compress() { zstd -q -T0 -9 -c; }
else
	command -v gzip >/dev/null || die "neither zstd nor gzip found"
	out="$guest/$name.cpio.gz"
	compress() { gzip -6 -n; }
fi

[ -f "$init" ] || die "missing $init"
[ -f "$module" ] || die "missing $module (the guest's virtio_blk module); run: bash .ci/setup"
[ -x "$busybox" ] || die "missing $busybox; run: bash .ci/setup (installs busybox-static)"
[ -x "$fio" ] || die "missing $fio; run: bash .ci/setup (installs fio)"
command -v cpio >/dev/null || die "cpio not found; run: bash .ci/setup"
command -v ldd >/dev/null || die "ldd not found"
if command -v file >/dev/null && ! file -L "$busybox" | grep -q 'statically linked'; then
	die "$busybox is not statically linked; install busybox-static (bash .ci/setup)"
fi

# The libraries fio needs (resolved by the host's loader), and the loader itself.
resolve_libs "$fio"

if [ -f "$out" ]; then
	stale=0
	for input in "$init" "$module" "$busybox" "$fio" "$0" "$here/initramfs-lib.sh" "${libs[@]}"; do
		[ "$input" -nt "$out" ] && stale=1
	done
	if [ "$stale" = 0 ]; then
		echo "$out"
		exit 0
	fi
fi

stage=$(mktemp -d "$guest/$name.XXXXXX")
tmp_out="$stage.cpio"
trap 'rm -rf "$stage" "$tmp_out"' EXIT
mkdir -p "$stage/bin" "$stage/usr/bin" "$stage/lib/modules" "$stage/dev" "$stage/proc" \
	"$stage/sys" "$stage/tmp"
install -m 0755 "$init" "$stage/init"
install -m 0755 "$busybox" "$stage/bin/busybox"
install -m 0755 "$fio" "$stage/usr/bin/fio"
install -m 0644 "$module" "$stage/lib/modules/virtio_blk.ko"
install_libs "$stage"
pack "$stage" "$tmp_out" "$out"
echo "$out"
