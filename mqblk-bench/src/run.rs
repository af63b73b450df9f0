//! Running one point: start the backend process (and, for SPDK, create its bdev and controller
//! over RPC), drive it with the built-in client (or run fio for the host-native comparison),
//! read what `/proc` says about the backend, stop it.
//!
//! Here: the tools check, the image, [`RunEnv`] and one point's run, mqblk's stats file. In
//! `run/`: `backend.rs` (the backends' command lines, starting and stopping them), `fio.rs`
//! (native fio and its output), `usage.rs` (CPU and memory from /proc).

use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};

use mqblk::daemon::stats::StatsFile;
use mqblk::engine::qcow2::MetadataCounters;
use mqblk::io::IoCounters;

use crate::sample::{MqblkCounters, Sample};
use crate::{Backend, BenchOptions, ImageFormat, PointConfig};
use mqblk_client::{self as client, Workload};

mod backend;
mod fio;
mod usage;

use self::backend::{wait_for_socket, BackendProcess};
pub use self::fio::parse_fio_json;
use self::usage::measure;
pub use self::usage::{parse_host_busy_ticks, parse_stat_ticks, parse_status, ProcMem};

/// Keys of a `--mqblk-opts` variant that the bench takes for itself (the others are export
/// keys): the mqblk executable, the directory of its stats file, its `--sandbox` and
/// `--state-dir`, which device an nvme run serves, and `format=raw` (serve the raw image in a
/// qcow2 run).
const BENCH_KEYS: [&str; 6] = [
    "bin",
    "stats-dir",
    "sandbox",
    "state-dir",
    "nvme-via",
    "format",
];

/// The cluster size of the qcow2 images the bench makes (qemu-img's default).
const QCOW2_CLUSTER: u64 = 64 << 10;

/// Checks that the binaries the chosen backends need are there.
pub fn check_tools(opts: &BenchOptions) -> anyhow::Result<()> {
    let check = |bin: &Path, what: &str, hint: &str| -> anyhow::Result<()> {
        let ok = Command::new(bin)
            .arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        ensure!(ok, "{what} ({}) does not run: {hint}", bin.display());
        Ok(())
    };
    for b in &opts.backends {
        match b {
            Backend::Mqblk => check(&opts.mqblk_bin, "mqblk", "pass --mqblk-bin")?,
            Backend::Qsd => check(
                &opts.qsd_bin,
                "qemu-storage-daemon",
                "install qemu-utils (bash .ci/setup does), or pass --qsd-bin",
            )?,
            Backend::Native => check(
                &opts.fio_bin,
                "fio",
                "install fio (bash .ci/setup does), or pass --fio-bin",
            )?,
            // Its build was found when the options were checked; rpc.py needs python3.
            Backend::Spdk => check(Path::new("python3"), "python3", "SPDK's rpc.py needs it")?,
        }
    }
    if opts.format != ImageFormat::Raw {
        check(
            Path::new("qemu-img"),
            "qemu-img",
            "a qcow2 --format makes its image with it; install qemu-utils \
             (bash .ci/setup does)",
        )?;
    }
    Ok(())
}

/// The qcow2 image a `--format` other than raw serves, in OUT: disk.qcow2, overlay.qcow2,
/// empty.qcow2, metadata.qcow2 or falloc.qcow2.
pub fn qcow2_image(opts: &BenchOptions) -> Option<PathBuf> {
    match opts.format {
        ImageFormat::Raw => None,
        ImageFormat::Qcow2 => Some(opts.out.join("disk.qcow2")),
        ImageFormat::Qcow2Overlay => Some(opts.out.join("overlay.qcow2")),
        ImageFormat::Qcow2Empty => Some(opts.out.join("empty.qcow2")),
        ImageFormat::Qcow2Metadata => Some(opts.out.join("metadata.qcow2")),
        ImageFormat::Qcow2Falloc => Some(opts.out.join("falloc.qcow2")),
    }
}

/// Makes the qcow2 image of `--format` from the raw image `raw` (see [`qcow2_image`]; every
/// sample that served it is followed by a `qemu-img check`, [`check_qcow2`]): for
/// qcow2 a copy with every cluster allocated (`qemu-img convert -S 0`: zero blocks are
/// written too), made anew on every run so that it holds the raw image's data; for
/// qcow2-overlay, qcow2-empty, qcow2-metadata and qcow2-falloc a first new image (made anew
/// before every sample, [`create_empty`]).
pub fn prepare_qcow2(opts: &BenchOptions, raw: &Path) -> anyhow::Result<()> {
    let Some(image) = qcow2_image(opts) else {
        return Ok(());
    };
    if opts.format.made_per_sample() {
        return create_empty(opts.format, raw, &image).map(drop);
    }
    println!(
        "converting {} into {} (qcow2, 64 KiB clusters, every cluster allocated)",
        raw.display(),
        image.display()
    );
    let mut cmd = Command::new("qemu-img");
    cmd.args(["convert", "-S", "0", "-f", "raw", "-O", "qcow2", "-o"])
        .arg(format!("cluster_size={QCOW2_CLUSTER}"))
        .arg(raw)
        .arg(&image);
    run_qemu_img(cmd)?;
    // qemu-img writes through the page cache, and the dirty pages would stay for half a
    // minute: an O_DIRECT read asked not to block (as io_uring first asks) refuses a range
    // with dirty pages, and the ring hands it to a worker thread. The samples would measure
    // that writeback, not the image, while the raw image (synced when it is made) did not.
    File::open(&image)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", image.display()))
}

/// Makes `image` anew, holding no data, for `format` (qcow2-overlay, qcow2-empty,
/// qcow2-metadata or qcow2-falloc): over the raw image `raw` (by its absolute path, so that the
/// overlay opens from anywhere), or of its size without a backing file (every cluster mapped,
/// for qcow2-metadata and qcow2-falloc). Returns the command, for the log.
pub fn create_empty(format: ImageFormat, raw: &Path, image: &Path) -> anyhow::Result<String> {
    let raw = std::path::absolute(raw).with_context(|| format!("{}", raw.display()))?;
    match std::fs::remove_file(image) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", image.display()))
        }
        _ => {}
    }
    let mut cmd = Command::new("qemu-img");
    let preallocation = match format {
        ImageFormat::Qcow2Metadata => "metadata",
        ImageFormat::Qcow2Falloc => "falloc",
        _ => "off",
    };
    cmd.args(["create", "-q", "-f", "qcow2", "-o"]).arg(format!(
        "cluster_size={QCOW2_CLUSTER},preallocation={preallocation}"
    ));
    match format {
        ImageFormat::Qcow2Overlay => cmd.args(["-F", "raw", "-b"]).arg(&raw).arg(image),
        _ => {
            let size = std::fs::metadata(&raw)
                .with_context(|| format!("{}", raw.display()))?
                .len();
            cmd.arg(image).arg(size.to_string())
        }
    };
    let line = format!("{cmd:?}");
    run_qemu_img(cmd)?;
    Ok(line)
}

/// `qemu-img check` of `image`: refuses corruption and leaked clusters (which an exit that
/// did not write back all metadata leaves).
fn check_qcow2(image: &Path) -> anyhow::Result<()> {
    let mut cmd = Command::new("qemu-img");
    cmd.args(["check", "-f", "qcow2"]).arg(image);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if out.status.success() {
        return Ok(());
    }
    // The first findings (on stderr, a line per cluster) and the summary (on stdout).
    let text = String::from_utf8_lossy(&out.stderr) + String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let shown = if lines.len() > 5 {
        [&lines[..2], &["..."], &lines[lines.len() - 3..]].concat()
    } else {
        lines
    };
    bail!(
        "qemu-img check {} exited with {}: {}",
        image.display(),
        out.status,
        shown.join("; ")
    )
}

/// Runs a qemu-img command; its output is in the error if it fails.
fn run_qemu_img(mut cmd: Command) -> anyhow::Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} exited with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// The block device of the NVMe namespace whose character device is `--path` (`/dev/ng0n1`'s
/// is `/dev/nvme0n1`), and its size: QSD and native fio measure the block path on it.
pub fn prepare_namespace(opts: &BenchOptions) -> anyhow::Result<(PathBuf, u64)> {
    use std::os::unix::fs::FileTypeExt;
    let ng = opts
        .path
        .as_ref()
        .context("checked: --engine nvme has --path")?;
    let meta = std::fs::metadata(ng).with_context(|| format!("--path {}", ng.display()))?;
    ensure!(
        meta.file_type().is_char_device(),
        "--path {}: --engine nvme takes the namespace's character device (/dev/ngXnY)",
        ng.display()
    );
    let block = namespace_block_device(ng).with_context(|| {
        format!(
            "--path {}: not named like an NVMe namespace's character device (ngXnY)",
            ng.display()
        )
    })?;
    reads_only(opts, ng, "")?;
    let f = File::open(&block).with_context(|| format!("opening {}", block.display()))?;
    let size =
        mqblk::engine::blockdev_size(&f).with_context(|| format!("size of {}", block.display()))?;
    Ok((block, size & !4095))
}

/// A device is measured as it is: reads only, so that its data survives. Refuses write
/// workloads on `device`, suggesting `alternative` too.
fn reads_only(opts: &BenchOptions, device: &Path, alternative: &str) -> anyhow::Result<()> {
    let writes: Vec<&str> = opts
        .workloads
        .iter()
        .filter(|w| w.pattern.writes())
        .map(|w| w.name.as_str())
        .collect();
    ensure!(
        writes.is_empty(),
        "--path {}: a device is only read by the bench; drop the write workloads ({}){alternative}",
        device.display(),
        writes.join(", ")
    );
    Ok(())
}

/// `/dev/ngXnY` -> `/dev/nvmeXnY`.
pub fn namespace_block_device(ng: &Path) -> Option<PathBuf> {
    let name = ng.file_name()?.to_str()?;
    let rest = name.strip_prefix("ng")?;
    Some(ng.with_file_name(format!("nvme{rest}")))
}

/// The uring engine's image: `--path` or OUT/disk.img. A missing file is created at `--size`
/// and filled with data (so that reads hit real blocks, not holes); an existing one is used at
/// its size. Returns the path and the size.
pub fn prepare_image(opts: &BenchOptions) -> anyhow::Result<(PathBuf, u64)> {
    let path = opts
        .path
        .clone()
        .unwrap_or_else(|| opts.out.join("disk.img"));
    if let Ok(meta) = std::fs::metadata(&path) {
        use std::os::unix::fs::FileTypeExt;
        if meta.file_type().is_block_device() {
            reads_only(opts, &path, " or use an image file")?;
            let f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            let size = mqblk::engine::blockdev_size(&f)
                .with_context(|| format!("size of {}", path.display()))?;
            ensure!(
                size >= 1 << 20,
                "--path {}: {size} bytes; at least 1M is needed",
                path.display()
            );
            return Ok((path, size & !4095));
        }
        ensure!(
            meta.is_file(),
            "--path {}: not a regular file or block device",
            path.display()
        );
        let size = meta.len();
        ensure!(
            size >= 1 << 20 && size % 4096 == 0,
            "--path {}: {size} bytes; a raw image of at least 1M and a multiple of 4K is needed",
            path.display()
        );
        return Ok((path, size));
    }
    println!(
        "creating {} ({} MiB) and filling it with data",
        path.display(),
        opts.size >> 20
    );
    let mut f = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < opts.size {
        let n = ((opts.size - at) as usize).min(buf.len());
        client::fill_pattern(&mut buf[..n], at, 0x62_656e_6368);
        f.write_all(&buf[..n])
            .with_context(|| format!("writing {}", path.display()))?;
        at += n as u64;
    }
    f.sync_all()
        .with_context(|| format!("syncing {}", path.display()))?;
    Ok((path, opts.size))
}

/// Reads the raw image `path` once from end to end with O_DIRECT (`--read-first`): the reads
/// reach the device, and whatever caches it (a VM's host page cache, a device's own cache)
/// holds the image as it will for every sample, while this machine's page cache is left as it
/// was. Returns the bytes read and how long it took.
pub fn read_first(path: &Path) -> anyhow::Result<(u64, Duration)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    const CHUNK: usize = 1 << 20;
    const ALIGN: usize = 4096;
    let started = Instant::now();
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("--read-first: opening {} with O_DIRECT", path.display()))?;
    // O_DIRECT wants an aligned buffer: the aligned part of a larger one.
    let mut backing = vec![0u8; CHUNK + ALIGN];
    let skip = backing.as_ptr().align_offset(ALIGN);
    let buf = &mut backing[skip..skip + CHUNK];
    let mut total = 0u64;
    loop {
        let n = f
            .read(buf)
            .with_context(|| format!("--read-first: reading {} at {total}", path.display()))?;
        if n == 0 {
            return Ok((total, started.elapsed()));
        }
        total += n as u64;
    }
}

/// Where a run keeps its sockets, stats files and logs (sockets and stats files in a tmpfs
/// when the machine has /dev/shm).
pub struct RunEnv<'a> {
    opts: &'a BenchOptions,
    image: Option<PathBuf>,
    /// The qcow2 image of a `--format` other than raw ([`qcow2_image`]).
    qcow2: Option<PathBuf>,
    size: u64,
    /// Short path for unix sockets (108-byte limit).
    tmp: tempfile::TempDir,
    logs: PathBuf,
    seq: Cell<usize>,
}

impl<'a> RunEnv<'a> {
    /// Prepares the socket and log directories.
    pub fn new(opts: &'a BenchOptions, image: Option<PathBuf>, size: u64) -> anyhow::Result<Self> {
        // On a tmpfs when there is one: mqblk rewrites its stats file here every 100 ms, and
        // on the image's ext4 each rewrite's journal commit stalls the O_DIRECT writes under
        // test (their mtime update waits for it; a variant's `stats-dir=` shows what it costs,
        // docs/PERFORMANCE.md 1a).
        let shm = Path::new("/dev/shm");
        let mut builder = tempfile::Builder::new();
        builder.prefix("mqblk-bench");
        let tmp = if shm.is_dir() {
            builder.tempdir_in(shm).or_else(|_| builder.tempdir())
        } else {
            builder.tempdir()
        }
        .context("creating a temporary directory for sockets and stats files")?;
        let logs = opts.out.join("logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        Ok(RunEnv {
            opts,
            image,
            qcow2: qcow2_image(opts),
            size,
            tmp,
            logs,
            seq: Cell::new(0),
        })
    }

    /// Runs one point; a failure is recorded in the sample's `error`.
    pub fn run_point(&self, p: &PointConfig, repeat: usize) -> Sample {
        let n = self.seq.get() + 1;
        self.seq.set(n);
        match self.try_run(p, repeat, n) {
            Ok(s) => s,
            Err(e) => Sample::failed(repeat, format!("{e:#}")),
        }
    }

    fn log_file(&self, backend: Backend, n: usize, header: &str) -> anyhow::Result<File> {
        let path = self.logs.join(format!("{}.log", backend.name()));
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        writeln!(f, "=== sample {n}: {header}")?;
        Ok(f)
    }

    fn try_run(&self, p: &PointConfig, repeat: usize, n: usize) -> anyhow::Result<Sample> {
        let o = self.opts;
        let w = &o.workloads[p.workload];
        let header = format!(
            "{}, {}, jobs {}, iodepth {}, repeat {}",
            o.label(p),
            w.name,
            p.jobs,
            p.iodepth,
            repeat + 1
        );
        if p.backend == Backend::Native {
            return self.run_fio(p, w, repeat, n, &header);
        }
        let sock = self.tmp.path().join(format!("s{n}.sock"));
        let stats_dir = (p.backend == Backend::Mqblk)
            .then(|| self.variant_value(p, "stats-dir"))
            .flatten()
            .map(PathBuf::from);
        let stats = (stats_dir.as_deref())
            .unwrap_or(self.tmp.path())
            .join(format!("stats{n}.json"));
        let log = self.log_file(p.backend, n, &header)?;
        // Every sample starts from an empty image.
        if let (format, Some(image), Some(raw)) = (o.served_format(p), &self.qcow2, &self.image) {
            if format.made_per_sample() {
                let line = create_empty(format, raw, image)?;
                writeln!(&log, "{line}")?;
            }
        }
        let rpc_sock = self.tmp.path().join(format!("s{n}.rpc"));
        let mut cmd = match p.backend {
            Backend::Mqblk => self.mqblk_command(p, &sock, &stats),
            Backend::Spdk => self.spdk_command(&sock, &rpc_sock),
            _ => self.qsd_command(p, &sock),
        };
        writeln!(&log, "{cmd:?}")?;
        let rpc_log = log.try_clone()?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", p.backend.name()))?;
        let mut backend = BackendProcess {
            child,
            name: p.backend.name(),
            stopped: false,
        };
        let log_path = self.logs.join(format!("{}.log", p.backend.name()));
        if p.backend == Backend::Spdk {
            self.configure_spdk(&sock, &rpc_sock, &mut backend.child, &rpc_log)
                .with_context(|| {
                    format!("setting up SPDK's controller (see {})", log_path.display())
                })?;
        }
        wait_for_socket(&sock, &mut backend.child).with_context(|| {
            format!(
                "{} did not start listening (see {})",
                p.backend.name(),
                log_path.display()
            )
        })?;

        let mut wl = Workload::new(&sock);
        wl.driver = p.client;
        wl.num_queues = p.queues();
        wl.jobs = p.jobs;
        wl.iodepth = p.iodepth;
        wl.block_size = w.block_size;
        wl.pattern = w.pattern;
        wl.runtime = Some(o.runtime);
        wl.poll = o.client_poll;
        wl.seed = 0x6d71_626c_6b00 + repeat as u64;
        let pid = backend.child.id() as i32;
        let (report, usage) = measure(pid, || client::run(&wl))?;
        let report = report.with_context(|| {
            format!(
                "client run against {} (see {})",
                p.backend.name(),
                log_path.display()
            )
        })?;
        if p.backend == Backend::Spdk {
            self.prepare_spdk_stop(&sock, &rpc_sock)?;
        }
        let status = backend.stop()?;
        if p.backend == Backend::Mqblk {
            ensure!(
                status.success(),
                "mqblk exited with {status} after the run (see {})",
                log_path.display()
            );
        }
        // A backend that left its qcow2 image inconsistent measured nothing worth keeping.
        if let (true, Some(image)) = (o.served_format(p) != ImageFormat::Raw, &self.qcow2) {
            check_qcow2(image).with_context(|| {
                format!("after {} served {}", p.backend.name(), image.display())
            })?;
        }
        ensure!(
            report.errors == 0,
            "{} of {} requests failed; first: {}",
            report.errors,
            report.ios,
            report
                .first_error
                .as_ref()
                .map(|e| e.to_string())
                .unwrap_or_default()
        );
        ensure!(report.ios > 0, "no request completed");
        let mqblk = if p.backend == Backend::Mqblk {
            Some(read_stats(&stats)?.with_elapsed(report.elapsed.as_secs_f64()))
        } else {
            None
        };
        let ios = report.ios as f64;
        let backend_cpu = usage.backend_cpu_s;
        Ok(Sample {
            repeat,
            error: None,
            ios: report.ios,
            elapsed_s: report.elapsed.as_secs_f64(),
            iops: report.iops(),
            mb_per_s: report.mb_per_s(),
            p50_us: report.p50_us,
            p99_us: report.p99_us,
            p999_us: report.p999_us,
            backend_cpu_s: backend_cpu,
            client_cpu_s: Some(usage.client_cpu_s),
            backend_cpu_s_per_mio: backend_cpu.map(|c| c / ios * 1e6),
            total_cpu_s_per_mio: Some(
                (backend_cpu.unwrap_or(0.0) + usage.client_cpu_s) / ios * 1e6,
            ),
            others_cpu_pct: usage.others_cpu_pct,
            peak_rss_kib: usage.vm_hwm_kib,
            rss_anon_kib: usage.rss_anon_kib,
            mqblk,
        })
    }
}

/// Reads `mqblk serve --stats-file` output (its single export).
fn read_stats(path: &Path) -> anyhow::Result<MqblkCounters> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading mqblk's stats file {}", path.display()))?;
    parse_stats(&text)
}

/// Parses the stats file, summing its exports.
pub fn parse_stats(text: &str) -> anyhow::Result<MqblkCounters> {
    let file: StatsFile = serde_json::from_str(text).context("mqblk's stats file")?;
    let mut total = IoCounters::default();
    let mut threads = 0;
    let mut metadata: Option<MetadataCounters> = None;
    for e in &file.exports {
        threads += e.threads as u64;
        total.add(&e.counters);
        if let Some(m) = &e.metadata {
            metadata
                .get_or_insert_with(MetadataCounters::default)
                .add(m);
        }
    }
    Ok(MqblkCounters::new(threads, total, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_nvme_run_serves_the_character_device_and_compares_the_block_device() {
        assert_eq!(
            namespace_block_device(Path::new("/dev/ng1n2")),
            Some(PathBuf::from("/dev/nvme1n2"))
        );
        assert_eq!(namespace_block_device(Path::new("/dev/sda")), None);
        let o = crate::options::test_options(
            "--backend mqblk,qsd --engine nvme --path /dev/ng0n1 --mode per-queue \
             --mqblk-opts poll=on --mqblk-opts poll=on,nvme-via=block --workloads randread-4k",
        )
        .unwrap();
        let env = RunEnv::new(&o, Some(PathBuf::from("/dev/nvme0n1")), 1 << 30).unwrap();
        let points = o.points();
        let spec_of = |variant: usize| {
            let p = points
                .iter()
                .find(|p| p.backend == Backend::Mqblk && p.variant == variant)
                .unwrap();
            let cmd = env.mqblk_command(p, Path::new("/s"), Path::new("/st"));
            cmd.get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .find(|a| a.starts_with("socket="))
                .unwrap()
        };
        let passthrough = spec_of(0);
        assert!(
            passthrough.contains(",engine=nvme,path=/dev/ng0n1"),
            "{passthrough}"
        );
        let block = spec_of(1);
        assert!(
            block.contains(",engine=uring,path=/dev/nvme0n1,direct=on")
                && !block.contains("nvme-via"),
            "{block}"
        );
        let qsd = points.iter().find(|p| p.backend == Backend::Qsd).unwrap();
        let args: Vec<String> = env
            .qsd_command(qsd, Path::new("/s"))
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(
            args.iter().any(|a| a.contains("filename=/dev/nvme0n1")),
            "{args:?}"
        );
        // Writes would destroy the device's data; no --path is refused at once.
        assert!(crate::options::test_options("--engine nvme").is_err());
        assert!(crate::options::test_options("--engine null --mqblk-opts nvme-via=block").is_err());
    }

    #[test]
    fn read_zeroes_off_reaches_mqblk_and_qsd_and_only_the_null_engine_takes_it() {
        let spec_and_qsd = |flags: &str| {
            let o = crate::options::test_options(&format!(
                "--backend mqblk,qsd --engine null --mode mq --jobs 1 {flags}"
            ))
            .unwrap();
            let env = RunEnv::new(&o, None, 1 << 30).unwrap();
            let points = o.points();
            let arg_of = |cmd: std::process::Command, prefix: &str| {
                cmd.get_args()
                    .map(|a| a.to_string_lossy().into_owned())
                    .find(|a| a.starts_with(prefix))
                    .unwrap()
            };
            let mqblk = points.iter().find(|p| p.backend == Backend::Mqblk).unwrap();
            let qsd = points.iter().find(|p| p.backend == Backend::Qsd).unwrap();
            (
                arg_of(
                    env.mqblk_command(mqblk, Path::new("/s"), Path::new("/st")),
                    "socket=",
                ),
                arg_of(env.qsd_command(qsd, Path::new("/s")), "driver=null-co"),
            )
        };
        let (spec, qsd) = spec_and_qsd("");
        assert!(!spec.contains("read-zeroes"), "{spec}");
        assert!(qsd.ends_with(",read-zeroes=on"), "{qsd}");
        let (spec, qsd) = spec_and_qsd("--read-zeroes off");
        assert!(
            spec.ends_with(",engine=null,size=1073741824,read-zeroes=off"),
            "{spec}"
        );
        assert!(qsd.ends_with(",read-zeroes=off"), "{qsd}");
        assert!(crate::options::test_options("--engine null --read-zeroes maybe").is_err());
        let uring = crate::options::test_options("--engine uring --read-zeroes off")
            .err()
            .unwrap();
        assert!(
            uring.contains("--read-zeroes off: for --engine null"),
            "{uring}"
        );
    }

    #[test]
    fn qcow2_runs_serve_the_qcow2_image_and_raw_variants_the_raw_one() {
        let args = |format: &str| {
            format!(
                "--backend mqblk,qsd --engine uring --format {format} --mode mq --jobs 1 \
                 --out /o --mqblk-opts= --mqblk-opts poll=off,format=raw"
            )
        };
        let o = crate::options::test_options(&args("qcow2")).unwrap();
        let env = RunEnv::new(&o, Some(PathBuf::from("/o/disk.img")), 1 << 30).unwrap();
        let points = o.points();
        let mqblk = |env: &RunEnv, p: &PointConfig| {
            let cmd = env.mqblk_command(p, Path::new("/s"), Path::new("/st"));
            cmd.get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .find(|a| a.starts_with("socket="))
                .unwrap()
        };
        let qsd = |env: &RunEnv, p: &PointConfig| -> Vec<String> {
            env.qsd_command(p, Path::new("/s"))
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        };
        let spec = mqblk(&env, &points[0]);
        assert!(
            spec.ends_with(",engine=uring,format=qcow2,path=/o/disk.qcow2,direct=on"),
            "{spec}"
        );
        let spec = mqblk(&env, &points[1]);
        assert!(
            spec.ends_with(",engine=uring,path=/o/disk.img,direct=on,poll=off"),
            "{spec}"
        );
        // 1 GiB: 16384 clusters, 128 KiB of mapping, two L2 tables.
        assert_eq!(
            qsd(&env, &points[2]),
            [
                "--blockdev",
                "driver=file,node-name=f0,filename=/o/disk.qcow2,cache.direct=on,aio=io_uring",
                "--blockdev",
                "driver=qcow2,node-name=n0,file=f0,l2-cache-size=131072",
                "--export",
                "type=vhost-user-blk,id=e0,node-name=n0,addr.type=unix,addr.path=/s,writable=on,num-queues=1",
            ]
        );
        let o = crate::options::test_options(&args("qcow2-overlay")).unwrap();
        let env = RunEnv::new(&o, Some(PathBuf::from("/o/disk.img")), 1 << 30).unwrap();
        let spec = mqblk(&env, &o.points()[0]);
        assert!(
            spec.contains(",format=qcow2,path=/o/overlay.qcow2,direct=on"),
            "{spec}"
        );
        let args = qsd(&env, &o.points()[2]);
        assert_eq!(
            args[1],
            "driver=file,node-name=b0,filename=/o/disk.img,cache.direct=on,aio=io_uring,read-only=on"
        );
        assert_eq!(
            args[3],
            "driver=file,node-name=f0,filename=/o/overlay.qcow2,cache.direct=on,aio=io_uring"
        );
        assert_eq!(
            args[5],
            "driver=qcow2,node-name=n0,file=f0,l2-cache-size=131072,backing=b0"
        );
    }

    #[test]
    fn l2_caches_map_the_whole_image() {
        use self::backend::{mqblk_l2_cache_size, qsd_l2_cache_size};
        assert_eq!(qsd_l2_cache_size(256 << 20), 64 << 10);
        assert_eq!(qsd_l2_cache_size(3 << 30), 384 << 10);
        assert_eq!(qsd_l2_cache_size((64 << 30) + 4096), (8 << 20) + (64 << 10));
        // mqblk's default (4 MiB: 512 Ki clusters, 32 GiB) is enough up to there.
        assert_eq!(mqblk_l2_cache_size(32 << 30), None);
        assert_eq!(mqblk_l2_cache_size((32 << 30) + 4096), Some(8 << 20));
        assert_eq!(mqblk_l2_cache_size(48 << 30), Some(8 << 20));
    }

    #[test]
    fn stats_file_sums_exports() {
        let t = r#"{"exports":[{"socket":"a","threads":2,"requests":100,"submits":10,"submitted":90,
            "notifies":5,"merges":20,"kicks":3,"errors":0},{"socket":"b","threads":1,"requests":100,
            "submits":10,"submitted":90,"notifies":5,"merges":0,"kicks":1,"errors":1}]}"#;
        let c = parse_stats(t).unwrap();
        assert_eq!(
            (
                c.threads,
                c.counters.requests,
                c.counters.submits,
                c.counters.merges,
                c.counters.errors
            ),
            (3, 200, 20, 20, 1)
        );
        assert_eq!(c.reqs_per_submit, Some(9.0));
        assert_eq!(c.merges_per_io, Some(0.1));
        assert_eq!(c.notifies_per_io, Some(0.05));
        assert_eq!(
            (c.metadata, c.write_back_us),
            (None, None),
            "no qcow2 export"
        );
        assert!(parse_stats("{}").is_err());
    }

    #[test]
    fn a_qcow2_export_s_metadata_counters_give_the_mean_write_back_and_sync() {
        let t = r#"{"exports":[{"socket":"a","threads":1,"requests":400,"metadata":
            {"requests":300,"write_backs":10,"write_back_ns":8000000,"syncs":12,
            "sync_ns":6000000}}]}"#;
        let c = parse_stats(t).unwrap();
        assert_eq!(c.metadata.map(|m| m.requests), Some(300));
        assert_eq!(c.metadata_per_io, Some(0.75));
        assert_eq!(c.write_back_us, Some(800.0));
        assert_eq!(c.sync_us, Some(500.0));
        // Two exports: each counter summed.
        let t = r#"{"exports":[{"socket":"a","threads":1,"requests":400,"metadata":
            {"requests":300,"write_backs":10,"write_back_ns":8000000,"syncs":12,
            "sync_ns":6000000}},{"socket":"b","threads":1,"requests":400,"metadata":
            {"requests":100,"write_backs":6,"write_back_ns":4800000,"syncs":8,
            "sync_ns":4000000}}]}"#;
        let c = parse_stats(t).unwrap();
        let m = c.metadata.unwrap();
        assert_eq!(
            (
                m.requests,
                m.write_backs,
                m.write_back_ns,
                m.syncs,
                m.sync_ns
            ),
            (400, 16, 12_800_000, 20, 10_000_000)
        );
        assert_eq!(c.metadata_per_io, Some(0.5));
        assert_eq!(c.write_back_us, Some(800.0));
        assert_eq!(c.sync_us, Some(500.0));
    }
}
