#!/usr/bin/env bash
# Builds the initramfs of the NVMe test guest (tests/nvme_guest.rs), in which mqblk itself runs:
# `mkinitramfs-nvme.sh MQBLK` writes target/guest/initramfs-nvme.cpio.zst (zstd; gzip,
# .cpio.gz, where zstd is missing), holding
#   /init                       tests/guest/init-nvme
#   /bin/busybox                the static busybox from Debian's busybox-static package
#   /bin/mqblk                  MQBLK (the test's build of mqblk), without its debug info
#   the libraries mqblk needs   every library `ldd` lists and the dynamic loader, at the same
#                               paths as on the host (libc, libm, libgcc_s, ld-linux)
# The guest kernel has NVMe and io_uring built in: no module is needed.
# Idempotent: does nothing when the output is newer than all of its inputs (and this script).
# Prints the output's path on stdout. Needs cpio, ldd, strip (binutils), and zstd or gzip.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
guest="$root/target/guest"
init="$here/init-nvme"
name=initramfs-nvme
busybox="${MQBLK_BUSYBOX:-/bin/busybox}"

die() {
	echo "mkinitramfs-nvme: $*" >&2
	exit 1
}
# resolve_libs, install_libs, pack.
# shellcheck source=tests/guest/initramfs-lib.sh
. "$here/initramfs-lib.sh"

[ $# -eq 1 ] || die "usage: mkinitramfs-nvme.sh PATH-TO-MQBLK"
mqblk="$1"

# zstd decompresses several times faster than gzip in the TCG guest.
if command -v zstd >/dev/null; then
	out="$guest/$name.cpio.zst"
	compress() { zstd -q -T0 -9 -c; }
else
	command -v gzip >/dev/null || die "neither zstd nor gzip found"
	out="$guest/$name.cpio.gz"
	compress() { gzip -6 -n; }
fi

[ -f "$init" ] || die "missing $init"
[ -x "$mqblk" ] || die "missing $mqblk (build mqblk first: cargo build)"
[ -x "$busybox" ] || die "missing $busybox; run: bash .ci/setup (installs busybox-static)"
command -v cpio >/dev/null || die "cpio not found; run: bash .ci/setup"
command -v ldd >/dev/null || die "ldd not found"
command -v strip >/dev/null || die "strip not found (binutils)"
if command -v file >/dev/null && ! file -L "$busybox" | grep -q 'statically linked'; then
	die "$busybox is not statically linked; install busybox-static (bash .ci/setup)"
fi

# The libraries mqblk needs (resolved by the host's loader), and the loader itself.
resolve_libs "$mqblk"

mkdir -p "$guest"
if [ -f "$out" ]; then
	stale=0
	for input in "$init" "$busybox" "$mqblk" "$0" "$here/initramfs-lib.sh" "${libs[@]}"; do
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
mkdir -p "$stage/bin" "$stage/dev" "$stage/proc" "$stage/sys" "$stage/tmp"
install -m 0755 "$init" "$stage/init"
install -m 0755 "$busybox" "$stage/bin/busybox"
# A debug build is ~85 MB, ~19 MB without its debug info (symbols stay, for backtraces).
strip --strip-debug -o "$stage/bin/mqblk" "$mqblk"
install_libs "$stage"
pack "$stage" "$tmp_out" "$out"
echo "$out"
