#!/usr/bin/env bash
# Builds SPDK's vhost target for `mqblk bench --backend spdk` from an SPDK source tree the user
# supplies (SPDK has no Debian package), and copies what the bench runs to DEST:
#
#   DEST/bin/vhost          the vhost-user target
#   DEST/scripts/rpc.py     SPDK's RPC client, unmodified: it finds its package at ../python
#   DEST/python/spdk        that package
#   DEST/VERSIONS           the SPDK, DPDK, ISA-L and ISA-L-crypto versions built
#
#   scripts/spdk-build.sh SRC DEST       # then: mqblk bench --backend spdk --spdk-dir DEST
#
# SRC is an SPDK checkout (tested: v26.05) with its submodules in place: dpdk/ (upstream DPDK
# v25.11 works), isa-l/ and isa-l-crypto/ (intel/isa-l and intel/isa-l_crypto at the commits
# SPDK pins: `git -C SRC submodule update --init dpdk isa-l isa-l-crypto`). Only the vhost app
# and the libraries it links are built, with every optional feature the bench does not use
# turned off (crypto, vfio-user, xnvme, ocf, fio, fsdev, uring, rbd, rdma, iscsi, usdt, ublk,
# raid5f, nvme-cuse, tests, examples): about 5 to 15 minutes on 2 cores. Run it as root (it
# installs the Debian packages the build needs, only those missing) or install them first.
# It never runs SPDK's scripts/setup.sh: the bench runs vhost with --no-huge, without
# hugepages or vfio. Heavy: run it under `nice` on a shared machine.
set -euo pipefail
usage() { echo "usage: $0 SRC DEST  (SRC: an SPDK source tree with dpdk/, isa-l/, isa-l-crypto/)" >&2; exit 2; }
[ $# -eq 2 ] || usage
src=$(cd "$1" && pwd) || usage
dest=$2

[ -x "$src/configure" ] && [ -f "$src/app/vhost/vhost.c" ] ||
  { echo "$src is not an SPDK source tree (no configure, no app/vhost)" >&2; exit 1; }
for sub in dpdk/meson.build isa-l/autogen.sh isa-l-crypto/autogen.sh; do
  [ -f "$src/$sub" ] || {
    echo "$src/${sub%%/*} is missing: run \`git -C $src submodule update --init dpdk isa-l isa-l-crypto\`" \
      "or place DPDK, intel/isa-l and intel/isa-l_crypto checkouts there" >&2
    exit 1
  }
done

# The Debian packages configure and make ask for: DPDK's meson build (meson, ninja, pyelftools,
# libnuma), ISA-L's autotools and nasm, SPDK's own libraries (uuid, ssl, aio, ncurses for
# spdk_top's headers) and its code generators (jinja2, tabulate).
packages=(build-essential pkg-config meson ninja-build nasm autoconf automake libtool
  python3 python3-pyelftools python3-jinja2 python3-tabulate
  libnuma-dev uuid-dev libssl-dev libaio-dev libncurses-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" > /dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing packages; as root run: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

# Debian's python3 first: DPDK's build imports pyelftools and SPDK's imports jinja2 and
# tabulate, which a pyenv or virtualenv python3 earlier on PATH would lack.
export PATH=/usr/bin:/bin:$PATH

cd "$src"
start=$(date +%s)
./configure --with-vhost \
  --without-crypto --without-vfio-user --without-xnvme --without-ocf --without-fio \
  --without-fsdev --without-aio-fsdev --without-uring --without-rbd --without-rdma \
  --without-iscsi-initiator --without-usdt --without-ublk --without-raid5f --without-nvme-cuse \
  --disable-tests --disable-unit-tests --disable-examples --disable-apps
# With the apps disabled the top-level make builds DPDK, ISA-L, every SPDK library and module
# and python/spdk/version.py (which rpc.py imports) but links no application; the vhost app is
# then the only one linked (SPDK has a dozen more). A top-level `make module` would not do:
# SPDK passes the goal on to every subdirectory, which have no such target.
jobs=$(nproc)
make -j"$jobs"
make -j"$jobs" -C app/vhost
took=$(($(date +%s) - start))

mkdir -p "$dest/bin" "$dest/scripts" "$dest/python"
install -m 0755 build/bin/vhost "$dest/bin/vhost"
install -m 0755 scripts/rpc.py "$dest/scripts/rpc.py"
rm -rf "$dest/python/spdk"
cp -r python/spdk "$dest/python/spdk"
describe() { git -C "$1" describe --tags --always 2> /dev/null || echo unknown; }
{
  echo "spdk $(describe .)"
  echo "dpdk $(describe dpdk)"
  echo "isa-l $(describe isa-l)"
  echo "isa-l-crypto $(describe isa-l-crypto)"
  echo "built $(date -u +%FT%TZ) in ${took}s on $(nproc) cores"
} > "$dest/VERSIONS"
cat "$dest/VERSIONS"
echo "done: mqblk bench --backend spdk --spdk-dir $dest"
