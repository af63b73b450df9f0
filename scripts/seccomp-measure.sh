#!/usr/bin/env bash
# Measures what each thread role of `mqblk serve` calls, to check or redo the seccomp
# allowlists of mqblk/src/sandbox/seccomp.rs (docs/RELIABILITY.md, "Security").
#
# Runs the given integration tests (default: all but soak; `rbd` builds with --features rbd)
# with the debug daemon under `strace -f -ff`, one file per thread, and with
# MQBLK_SECCOMP_LOG=1 (debug builds only: calls outside the allowlists are let through, the rest
# of the sandbox applies). Then scripts/seccomp-roles.py prints, per role, every call made after
# the role's filter went on. While it runs, target/debug/mqblk is a wrapper; it is restored at
# the end. Tests that signal the daemon or check its pid may fail under the wrapper: what they
# made the daemon call is recorded all the same.
#
#   scripts/seccomp-measure.sh                 # the default tests
#   scripts/seccomp-measure.sh rbd             # the rbd tests (needs Ceph, as they do)
set -euo pipefail
cd "$(dirname "$0")/.."
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(api blkio_client crash guest guest_reconnect guest_resize hostile
    lifecycle mechanisms metrics migration operator_errors qos readonly_raw reconnect_loop
    sandbox systemd)
features=()
[[ " ${tests[*]} " == *" rbd "* ]] && features=(--features rbd)
command -v strace > /dev/null || { echo "needs strace (apt-get install strace)" >&2; exit 1; }
cargo build "${features[@]}" --bin mqblk
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
cargo test "${features[@]}" --no-run "${args[@]}"

traces=$(mktemp -d /tmp/mqblk-seccomp.XXXXXX)
chmod 1777 "$traces" # tests run `mqblk ctl` as nobody
bin=target/debug/mqblk
real=$traces/mqblk.real
cp "$bin" "$real"
restore() { cp "$real" "$bin"; }
trap restore EXIT
cat > "$bin" <<WRAP
#!/usr/bin/env bash
d=$traces/\$(date +%s%N)
mkdir -p "\$d" && echo "\$@" > "\$d/args"
MQBLK_SECCOMP_LOG=1 strace -f -ff -qq -o "\$d/t" "$real" "\$@" &
s=\$!
forward() { for c in \$(pgrep -P \$s); do kill -\$1 \$c; done; }
trap 'forward TERM' TERM
trap 'forward INT' INT
# A forwarded signal interrupts wait: wait again until strace is gone, then take its status.
while kill -0 \$s 2> /dev/null; do wait \$s; done
wait \$s
WRAP
chmod +x "$bin"
for t in "${tests[@]}"; do
    exe=$(ls -t target/debug/deps/"$t"-* | grep -v '\.d$' | head -1)
    echo "== $t ($exe)"
    MQBLK_TEST_WATCHDOG_SECS=300 "$exe" > "$traces/$t.log" 2>&1 || true
    grep -E "^test result" "$traces/$t.log"
done
python3 scripts/seccomp-roles.py "$traces"
echo "traces kept in $traces"
