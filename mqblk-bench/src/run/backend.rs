//! Starting and stopping a backend: `mqblk serve`'s, qemu-storage-daemon's and SPDK's command
//! lines for a point (and SPDK's RPC calls), waiting for the socket, SIGTERM and a deadline to
//! stop.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use rustix::process::{kill_process, Pid, Signal};

use super::{RunEnv, BENCH_KEYS, QCOW2_CLUSTER};
use crate::spdk::{rpc_calls, SpdkBuild};
use crate::{EngineKind, ImageFormat, PointConfig};

/// How long a backend may take to start listening, and to exit after SIGTERM.
const START_TIMEOUT: Duration = Duration::from_secs(15);
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

impl RunEnv<'_> {
    pub(super) fn mqblk_command(&self, p: &PointConfig, sock: &Path, stats: &Path) -> Command {
        let o = self.opts;
        let mode = p.mode.expect("mqblk points have a mode");
        let mut spec = format!(
            "socket={},queues={},threads={}",
            sock.display(),
            p.queues(),
            mode.threads()
        );
        match (&self.image, o.engine, &o.rbd) {
            (Some(_), EngineKind::Uring, _) if o.served_format(p) != ImageFormat::Raw => {
                let qcow2 = self.qcow2.as_ref().expect("a qcow2 run has its image");
                spec.push_str(&format!(
                    ",engine=uring,format=qcow2,path={},direct=on",
                    qcow2.display()
                ));
                // The default covers 32 GiB; beyond, as much as maps the whole image (as for
                // QSD), unless the variant sets its own.
                if let Some(l2) = mqblk_l2_cache_size(self.size) {
                    if self.variant_value(p, "l2-cache-size").is_none() {
                        spec.push_str(&format!(",l2-cache-size={l2}"));
                    }
                }
            }
            (Some(img), EngineKind::Uring, _) => {
                spec.push_str(&format!(",engine=uring,path={},direct=on", img.display()))
            }
            // `img` is the namespace's block device; --path its character device.
            (Some(img), EngineKind::Nvme, _)
                if self.variant_value(p, "nvme-via") == Some("block") =>
            {
                spec.push_str(&format!(",engine=uring,path={},direct=on", img.display()))
            }
            (Some(_), EngineKind::Nvme, _) => {
                let ng = o.path.as_ref().expect("checked: --engine nvme has --path");
                spec.push_str(&format!(",engine=nvme,path={}", ng.display()))
            }
            (_, EngineKind::Rbd, Some(rbd)) => {
                // A variant's own value of one of these keys (direct=off, conf=...) wins.
                let variant = &o.mqblk_opts[p.variant];
                for kv in rbd.mqblk_keys().split(',') {
                    let key = kv.split('=').next().unwrap_or_default();
                    if !variant
                        .split(',')
                        .any(|v| v.starts_with(&format!("{key}=")))
                    {
                        spec.push(',');
                        spec.push_str(kv);
                    }
                }
            }
            _ => {
                spec.push_str(&format!(",engine=null,size={}", self.size));
                if !o.read_zeroes {
                    spec.push_str(",read-zeroes=off");
                }
            }
        }
        // `bin=PATH` picks the mqblk executable for this variant (A/B of two builds in one
        // run), `stats-dir=` where its stats file goes (see `run_point`), `sandbox=` its
        // `--sandbox` (given only when set, so that a build from before the sandbox runs);
        // every other key goes to the export.
        for kv in o.mqblk_opts[p.variant].split(',').filter(|k| !k.is_empty()) {
            if !BENCH_KEYS.iter().any(|k| kv.starts_with(&format!("{k}="))) {
                spec.push(',');
                spec.push_str(kv);
            }
        }
        let bin = self
            .variant_value(p, "bin")
            .map_or_else(|| o.mqblk_bin.clone(), PathBuf::from);
        let mut cmd = Command::new(&bin);
        cmd.arg("serve")
            .arg("--export")
            .arg(spec)
            .arg("--stats-file")
            .arg(stats)
            .arg("--log-level")
            .arg("warn");
        if let Some(mode) = self.variant_value(p, "sandbox") {
            cmd.arg("--sandbox").arg(mode);
        }
        if let Some(dir) = self.variant_value(p, "state-dir") {
            cmd.arg("--state-dir").arg(dir);
        }
        cmd
    }

    /// The value of the key `key` (one of [`BENCH_KEYS`], or an export key) in the point's
    /// `--mqblk-opts` variant, if it has one.
    pub(super) fn variant_value(&self, p: &PointConfig, key: &str) -> Option<&str> {
        self.opts.mqblk_opts[p.variant]
            .split(',')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
    }

    /// QSD's command line. With `--format qcow2` it serves the qcow2 image through a `qcow2`
    /// node over a `file` node (O_DIRECT, io_uring), with an `l2-cache-size` that maps the
    /// whole image ([`qsd_l2_cache_size`]; mqblk's per-thread mapping cache does by default up
    /// to 32 GiB), so that neither side is starved of mapping cache. With qcow2-overlay the
    /// overlay's backing file (the raw image its header names) is a `file` node of its own,
    /// opened like the top image: opened from the header it would be read through the page
    /// cache by QEMU's thread pool (cache.direct is not inherited from the `file` child, and
    /// aio never is), while mqblk reads its backing files with O_DIRECT.
    pub(super) fn qsd_command(&self, p: &PointConfig, sock: &Path) -> Command {
        let o = self.opts;
        // QEMU option syntax: a comma inside a value is written as two.
        let esc = |p: &Path| p.display().to_string().replace(',', ",,");
        let file_node = |node: &str, img: &Path| {
            use std::os::unix::fs::FileTypeExt;
            // QEMU's file driver refuses block devices: they take host_device.
            let dev = std::fs::metadata(img)
                .map(|m| m.file_type().is_block_device())
                .unwrap_or(false);
            format!(
                "driver={},node-name={node},filename={},cache.direct=on,aio=io_uring",
                if dev { "host_device" } else { "file" },
                esc(img)
            )
        };
        let blockdevs = match (&self.image, o.engine) {
            (_, EngineKind::Rbd) => vec![o
                .rbd
                .as_ref()
                .expect("checked: --engine rbd has --rbd")
                .qsd_blockdev()],
            (Some(img), EngineKind::Uring) if o.format != ImageFormat::Raw => {
                let qcow2 = self.qcow2.as_ref().expect("a qcow2 run has its image");
                let mut top = format!(
                    "driver=qcow2,node-name=n0,file=f0,l2-cache-size={}",
                    qsd_l2_cache_size(self.size)
                );
                let mut nodes = Vec::new();
                if o.format == ImageFormat::Qcow2Overlay {
                    nodes.push(file_node("b0", img) + ",read-only=on");
                    top.push_str(",backing=b0");
                }
                nodes.push(file_node("f0", qcow2));
                nodes.push(top);
                nodes
            }
            (Some(img), EngineKind::Uring | EngineKind::Nvme) => vec![file_node("n0", img)],
            _ => vec![format!(
                "driver=null-co,node-name=n0,size={},read-zeroes={}",
                self.size,
                if o.read_zeroes { "on" } else { "off" }
            )],
        };
        let mut export = format!(
            "type=vhost-user-blk,id=e0,node-name=n0,addr.type=unix,addr.path={},writable=on,num-queues={}",
            esc(sock),
            p.queues()
        );
        let mut cmd = Command::new(&o.qsd_bin);
        if o.qsd_iothread {
            cmd.arg("--object").arg("iothread,id=iot0");
            export.push_str(",iothread=iot0");
        }
        for b in blockdevs {
            cmd.arg("--blockdev").arg(b);
        }
        cmd.arg("--export").arg(export);
        cmd
    }
}

/// QSD's `l2-cache-size` for a qcow2 image of `size` bytes with the bench's clusters: 8 bytes
/// of mapping per cluster, rounded up to whole L2 tables (a cluster each), so that the cache
/// holds the whole image's mapping.
pub(super) fn qsd_l2_cache_size(size: u64) -> u64 {
    (size.div_ceil(QCOW2_CLUSTER) * 8).next_multiple_of(QCOW2_CLUSTER)
}

/// mqblk's `l2-cache-size` for a qcow2 image of `size` bytes where its default does not map
/// the whole image (its cache has a power of two of slots, one per cluster), else none.
pub(super) fn mqblk_l2_cache_size(size: u64) -> Option<u64> {
    use mqblk::config::qcow2::{DEFAULT_L2_CACHE_SIZE, MAX_L2_CACHE_SIZE};
    let need = size.div_ceil(QCOW2_CLUSTER).next_power_of_two() * 8;
    (need > DEFAULT_L2_CACHE_SIZE).then_some(need.min(MAX_L2_CACHE_SIZE))
}

impl RunEnv<'_> {
    fn spdk_build(&self) -> &SpdkBuild {
        self.opts
            .spdk
            .as_ref()
            .expect("checked: --backend spdk has its build")
    }

    /// SPDK's target, serving its vhost-user sockets in `sock`'s directory (the controller is
    /// named after `sock`'s file name, so that its socket is `sock`) and RPC on `rpc_sock`.
    pub(super) fn spdk_command(&self, sock: &Path, rpc_sock: &Path) -> Command {
        let dir = sock
            .parent()
            .expect("sockets are made in the run's directory");
        let argv = self
            .spdk_build()
            .vhost_argv(dir, rpc_sock, self.opts.spdk_cpu);
        let mut cmd = Command::new(&argv[0]);
        // In the run's temporary directory, so that a crash's core file is not left in the
        // user's.
        cmd.args(&argv[1..]).current_dir(dir);
        cmd
    }

    /// Once SPDK's target listens on `rpc_sock`: creates the bdev and the controller whose
    /// socket is `sock`, each `rpc.py` call's output going to `log`.
    pub(super) fn configure_spdk(
        &self,
        sock: &Path,
        rpc_sock: &Path,
        child: &mut Child,
        log: &std::fs::File,
    ) -> anyhow::Result<()> {
        use std::io::Write;
        wait_for_socket(rpc_sock, child)?;
        let ctrlr = sock
            .file_name()
            .and_then(|n| n.to_str())
            .expect("the run names its sockets in ASCII");
        let image = self.image.as_deref();
        for call in rpc_calls(
            self.opts.engine,
            self.size,
            image,
            ctrlr,
            self.opts.spdk_cpu,
        ) {
            let argv = self.spdk_build().rpc_argv(rpc_sock, &call);
            writeln!(&*log, "{argv:?}")?;
            let status = Command::new(&argv[0])
                .args(&argv[1..])
                .stdin(std::process::Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log.try_clone()?)
                .status()?;
            ensure!(status.success(), "rpc.py {} exited with {status}", call[0]);
        }
        Ok(())
    }

    /// Makes SPDK's target ready for SIGTERM once the client on `sock` is gone: without this
    /// it can hang or crash at exit (see `spdk.rs`).
    pub(super) fn prepare_spdk_stop(&self, sock: &Path, rpc_sock: &Path) -> anyhow::Result<()> {
        let ctrlr = sock
            .file_name()
            .and_then(|n| n.to_str())
            .expect("the run names its sockets in ASCII");
        self.spdk_build()
            .prepare_stop(rpc_sock, ctrlr, STOP_TIMEOUT)
            .map_err(anyhow::Error::msg)
    }
}

/// A backend process that is killed if not stopped (on an error path).
pub(super) struct BackendProcess {
    pub(super) child: Child,
    pub(super) name: &'static str,
    pub(super) stopped: bool,
}

impl BackendProcess {
    /// SIGTERM, then wait (SIGKILL after [`STOP_TIMEOUT`]).
    pub(super) fn stop(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        self.stopped = true;
        // Our own child's pid, which is not reaped yet (so not reused).
        let _ = kill_process(Pid::from_child(&self.child), Signal::TERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!(
                    "{} did not exit within {STOP_TIMEOUT:?} of SIGTERM",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for BackendProcess {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Waits until something accepts connections on `sock` (the probe connection is closed at
/// once), or the child exits, or [`START_TIMEOUT`].
pub(super) fn wait_for_socket(sock: &Path, child: &mut Child) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(st) = child.try_wait()? {
            bail!("it exited with {st}");
        }
        if UnixStream::connect(sock).is_ok() {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "no listener on {} after {START_TIMEOUT:?}",
            sock.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
