# Shared by the initramfs builders that carry a dynamically linked program
# (mkinitramfs-fio.sh, mkinitramfs-nvme.sh); sourced, not run. The caller defines die().

# resolve_libs BINARY: sets `libs` (every library the host's loader resolves for BINARY, and
# the loader itself) and `interp` (the loader), or dies saying what is missing.
resolve_libs() {
	local bin="$1" ldd_out
	ldd_out=$(ldd "$bin") || die "ldd $bin failed"
	if grep -q 'not found' <<<"$ldd_out"; then
		die "ldd $bin: some libraries are missing on this host:
$ldd_out"
	fi
	mapfile -t libs < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$ldd_out" | sort -u)
	[ "${#libs[@]}" -gt 0 ] || die "ldd $bin listed no libraries:
$ldd_out"
	interp=$(awk '$1 ~ /ld-linux/ { print $1; exit }' <<<"$ldd_out")
	[ -n "$interp" ] || die "ldd $bin shows no dynamic loader:
$ldd_out"
}

# install_libs STAGE: copies `libs` into STAGE, each at the path the loader found it (following
# symlinks for the content; /lib and /lib64 are real directories in the guest, so
# /lib/x86_64-linux-gnu/... paths work as they are).
install_libs() {
	local stage="$1" lib
	for lib in "${libs[@]}"; do
		mkdir -p "$stage$(dirname "$lib")"
		cp -L "$lib" "$stage$lib"
	done
	[ -f "$stage$interp" ] || die "the loader $interp was not copied"
}

# pack STAGE TMP OUT: the cpio of STAGE, through the caller's compress(), written to TMP and
# renamed to OUT (so that a concurrent reader never sees a half-written file).
pack() {
	local stage="$1" tmp="$2" out="$3"
	# No /dev/console node (creating one needs root): the kernel's built-in initramfs provides
	# it, and /init mounts devtmpfs and reopens its stdio on /dev/console anyway.
	(
		cd "$stage"
		find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0
	) | compress >"$tmp"
	mv -f "$tmp" "$out"
}
