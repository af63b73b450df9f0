#!/usr/bin/env bash
# Builds the initramfs of an end-to-end test guest: target/guest/initramfs.cpio.gz, holding
#   /init                       tests/guest/init
# or, with arguments `mkinitramfs.sh INIT NAME`, tests/guest/INIT as /init in
# target/guest/NAME.cpio.gz (the resize test's guest uses init-resize), and
#   /bin/busybox                the static busybox from Debian's busybox-static package
#   /lib/modules/virtio_blk.ko  target/guest/virtio_blk.ko (unpacked by .ci/setup)
# Idempotent: does nothing when the output is newer than all of its inputs (and this script).
# Prints the output's path on stdout. Needs cpio and gzip (installed by .ci/setup).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
guest="$root/target/guest"
out="$guest/${2:-initramfs}.cpio.gz"
init="$here/${1:-init}"
module="$guest/virtio_blk.ko"
busybox="${MQBLK_BUSYBOX:-/bin/busybox}"

die() {
	echo "mkinitramfs: $*" >&2
	exit 1
}

[ -f "$init" ] || die "missing $init"
[ -f "$module" ] || die "missing $module (the guest's virtio_blk module); run: bash .ci/setup"
[ -x "$busybox" ] || die "missing $busybox; run: bash .ci/setup (installs busybox-static)"
command -v cpio >/dev/null || die "cpio not found; run: bash .ci/setup"
command -v gzip >/dev/null || die "gzip not found"
if command -v file >/dev/null && ! file -L "$busybox" | grep -q 'statically linked'; then
	die "$busybox is not statically linked; install busybox-static (bash .ci/setup)"
fi

if [ -f "$out" ]; then
	stale=0
	for input in "$init" "$module" "$busybox" "$0"; do
		[ "$input" -nt "$out" ] && stale=1
	done
	if [ "$stale" = 0 ]; then
		echo "$out"
		exit 0
	fi
fi

stage=$(mktemp -d "$guest/initramfs.XXXXXX")
tmp_out="$stage.cpio.gz"
trap 'rm -rf "$stage" "$tmp_out"' EXIT
mkdir -p "$stage/bin" "$stage/lib/modules" "$stage/dev" "$stage/proc" "$stage/sys" "$stage/tmp"
install -m 0755 "$init" "$stage/init"
install -m 0755 "$busybox" "$stage/bin/busybox"
install -m 0644 "$module" "$stage/lib/modules/virtio_blk.ko"
# No /dev/console node (creating one needs root): the kernel's built-in initramfs provides it,
# and /init mounts devtmpfs and reopens its stdio on /dev/console anyway.
(
	cd "$stage"
	find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0
) | gzip -9 -n >"$tmp_out"
# Rename into place so that a concurrent reader never sees a half-written file.
mv -f "$tmp_out" "$out"
echo "$out"
