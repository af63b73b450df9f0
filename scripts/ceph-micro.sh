#!/usr/bin/env bash
# A single-node Ceph cluster for trying the rbd engine and for `mqblk bench --engine rbd`: one
# monitor and one memstore OSD with cephx, on a free loopback port, everything under DIR, and a
# pool `rbd`. The tests' helper (tests/support/ceph.rs) builds its clusters with this script's
# `prepare` and `osd-mkfs` steps, so the two make the same cluster; the helper starts the
# daemons itself (it must own them, to stop and restart them in its tests).
#
#   scripts/ceph-micro.sh start DIR      # prints the conf and keyring to pass (conf=, keyring=)
#   scripts/ceph-micro.sh stop DIR
#   scripts/ceph-micro.sh prepare DIR    # the steps of start before the monitor runs: DIR/ceph.conf,
#                                        # the keys, the monitor's store
#   scripts/ceph-micro.sh osd-mkfs DIR   # with the monitor running: registers osd.0, makes its store
#
# MEMSTORE_BYTES sets the size of the OSD's memory store (default 4 GiB).
# Needs Debian's ceph-mon and ceph-osd (bash .ci/setup installs them).
set -euo pipefail
usage() { echo "usage: $0 start|stop|prepare|osd-mkfs DIR" >&2; exit 2; }
cmd=${1:-}; d=${2:-}
[ -n "$cmd" ] && [ -n "$d" ] || usage

# The cluster's ceph.conf: everything under DIR, loopback only, one replica; the OSD keeps its
# objects in memory and writes them to DIR/osd when it stops cleanly (osd_fast_shutdown off),
# so that a stopped and restarted OSD keeps its data.
write_conf() {
  local d=$1 port=$2 fsid=$3
  cat > "$d/ceph.conf" <<EOC
[global]
fsid = $fsid
mon_host = v2:127.0.0.1:$port
public_addr = 127.0.0.1
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
keyring = $d/admin.keyring
run_dir = $d/run
admin_socket = $d/run/\$name.asok
log_file = $d/\$name.log
pid_file = $d/\$type.pid
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
mon_data_avail_warn = 2
mon_data_avail_crit = 1
auth_allow_insecure_global_id_reclaim = false
[mon]
mon_data = $d/mon
[osd]
osd_data = $d/osd
keyring = $d/osd/keyring
osd_objectstore = memstore
memstore_device_bytes = ${MEMSTORE_BYTES:-4294967296}
osd_fast_shutdown = false
EOC
}

for t in ceph-mon ceph-osd ceph-authtool monmaptool ceph rbd; do
  command -v "$t" >/dev/null || { echo "$t not found: apt-get install ceph-mon ceph-osd (or bash .ci/setup)" >&2; exit 1; }
done
q() { "$@" >/dev/null; }

# DIR/ceph.conf on a free port, the keys of the monitor, client.admin and osd.0 (all in the
# monitor's initial auth database: no `ceph auth add` round trips), the monitor's store.
prepare() {
  [ ! -e "$d/ceph.conf" ] || { echo "$d already holds a cluster: stop it and remove $d first" >&2; exit 1; }
  mkdir -p "$d"/{run,mon,osd}
  d=$(cd "$d" && pwd)
  local port fsid
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  fsid=$(cat /proc/sys/kernel/random/uuid)
  write_conf "$d" "$port" "$fsid"
  q ceph-authtool "$d/mon.keyring" --create-keyring --gen-key -n mon. --cap mon 'allow *'
  q ceph-authtool "$d/admin.keyring" --create-keyring --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *'
  q ceph-authtool "$d/osd/keyring" --create-keyring --gen-key -n osd.0 \
    --cap mon 'allow profile osd' --cap osd 'allow *'
  q ceph-authtool "$d/mon.keyring" --import-keyring "$d/admin.keyring"
  q ceph-authtool "$d/mon.keyring" --import-keyring "$d/osd/keyring"
  q monmaptool --create --addv a "[v2:127.0.0.1:$port]" --fsid "$fsid" "$d/monmap"
  ceph-mon -c "$d/ceph.conf" --mkfs -i a --monmap "$d/monmap" --keyring "$d/mon.keyring"
}

# osd.0 in the cluster's map and its (memstore) store; needs the monitor.
osd_mkfs() {
  local uuid
  uuid=$(cat /proc/sys/kernel/random/uuid)
  q ceph -c "$d/ceph.conf" osd new "$uuid" 0
  ceph-osd -c "$d/ceph.conf" -i 0 --mkfs --osd-uuid "$uuid" 2>/dev/null
}

case "$cmd" in
  prepare) prepare; exit 0 ;;
  osd-mkfs) osd_mkfs; exit 0 ;;
  stop)
    for p in osd mon; do
      [ -f "$d/$p.pid" ] && kill "$(cat "$d/$p.pid")" 2>/dev/null || true
    done
    exit 0 ;;
  start) ;;
  *) usage ;;
esac
prepare
ceph-mon -c "$d/ceph.conf" -i a
osd_mkfs
ceph-osd -c "$d/ceph.conf" -i 0 2>/dev/null
# Up to 60 s for the OSD to join (a deadline: each query may itself wait 5 s); then say so,
# with the end of its log, instead of waiting on.
osd_up() { ceph -c "$d/ceph.conf" --connect-timeout 5 osd stat -f json | tr -d ' ' | grep -q '"num_up_osds":1'; }
deadline=$((SECONDS + 60))
until osd_up || ((SECONDS >= deadline)); do sleep 0.2; done
osd_up || {
  echo "the OSD did not come up within 60 s; its log ($d/osd.0.log):" >&2
  tail -n 20 "$d/osd.0.log" >&2 || true
  exit 1
}
q ceph -c "$d/ceph.conf" osd pool create rbd 8
rbd -c "$d/ceph.conf" pool init rbd
echo "ceph cluster up: conf=$d/ceph.conf keyring=$d/admin.keyring pool=rbd"
