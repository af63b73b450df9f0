//! Running one point: start the backend process, drive it with the built-in client (or run fio
//! for the host-native comparison), read what `/proc` says about the backend, stop it.

use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};

use mqblk::daemon::stats::StatsFile;
use mqblk::io::IoCounters;

use super::{Backend, BenchOptions, EngineKind, PointConfig, WorkloadSpec};
use crate::sample::{MqblkCounters, Sample};
use mqblk_client::{self as client, Workload};

/// How long a backend may take to start listening, and to exit after SIGTERM.
const START_TIMEOUT: Duration = Duration::from_secs(15);
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// Keys of a `--mqblk-opts` variant that the bench takes for itself (the others are export
/// keys): the mqblk executable, and the directory of its stats file.
const BENCH_KEYS: [&str; 2] = ["bin", "stats-dir"];

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
        }
    }
    Ok(())
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
            // A device is measured as it is: reads only, so that its data survives.
            let writes: Vec<&str> = opts
                .workloads
                .iter()
                .filter(|w| w.pattern.writes())
                .map(|w| w.name.as_str())
                .collect();
            ensure!(
                writes.is_empty(),
                "--path {}: a block device is only read by the bench; drop the write workloads \
                 ({}) or use an image file",
                path.display(),
                writes.join(", ")
            );
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

/// Where a run keeps its sockets, stats files and logs (sockets and stats files in a tmpfs
/// when the machine has /dev/shm).
pub struct RunEnv<'a> {
    opts: &'a BenchOptions,
    image: Option<PathBuf>,
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
        let mut cmd = match p.backend {
            Backend::Mqblk => self.mqblk_command(p, &sock, &stats),
            _ => self.qsd_command(p, &sock),
        };
        writeln!(&log, "{cmd:?}")?;
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
        wait_for_socket(&sock, &mut backend.child).with_context(|| {
            format!(
                "{} did not start listening (see {})",
                p.backend.name(),
                log_path.display()
            )
        })?;

        let mut wl = Workload::new(&sock);
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
        let status = backend.stop()?;
        if p.backend == Backend::Mqblk {
            ensure!(
                status.success(),
                "mqblk exited with {status} after the run (see {})",
                log_path.display()
            );
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

    fn mqblk_command(&self, p: &PointConfig, sock: &Path, stats: &Path) -> Command {
        let o = self.opts;
        let mode = p.mode.expect("mqblk points have a mode");
        let mut spec = format!(
            "socket={},queues={},threads={}",
            sock.display(),
            p.queues(),
            mode.threads()
        );
        match (&self.image, o.engine, &o.rbd) {
            (Some(img), EngineKind::Uring, _) => {
                spec.push_str(&format!(",engine=uring,path={},direct=on", img.display()))
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
            _ => spec.push_str(&format!(",engine=null,size={}", self.size)),
        }
        // `bin=PATH` picks the mqblk executable for this variant (A/B of two builds in one
        // run), `stats-dir=` where its stats file goes (see `run_point`); every other key goes
        // to the export.
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
        cmd
    }

    /// The value of the bench's own key `key` (one of [`BENCH_KEYS`]) in the point's
    /// `--mqblk-opts` variant, if it has one.
    fn variant_value(&self, p: &PointConfig, key: &str) -> Option<&str> {
        self.opts.mqblk_opts[p.variant]
            .split(',')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
    }

    fn qsd_command(&self, p: &PointConfig, sock: &Path) -> Command {
        let o = self.opts;
        // QEMU option syntax: a comma inside a value is written as two.
        let esc = |p: &Path| p.display().to_string().replace(',', ",,");
        let blockdev = match (&self.image, o.engine) {
            (_, EngineKind::Rbd) => o
                .rbd
                .as_ref()
                .expect("checked: --engine rbd has --rbd")
                .qsd_blockdev(),
            (Some(img), EngineKind::Uring) => {
                use std::os::unix::fs::FileTypeExt;
                // QEMU's file driver refuses block devices: they take host_device.
                let dev = std::fs::metadata(img)
                    .map(|m| m.file_type().is_block_device())
                    .unwrap_or(false);
                format!(
                    "driver={},node-name=n0,filename={},cache.direct=on,aio=io_uring",
                    if dev { "host_device" } else { "file" },
                    esc(img)
                )
            }
            _ => format!(
                "driver=null-co,node-name=n0,size={},read-zeroes=on",
                self.size
            ),
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
        cmd.arg("--blockdev")
            .arg(blockdev)
            .arg("--export")
            .arg(export);
        cmd
    }

    /// Host-native fio on the image: io_uring, O_DIRECT, each job on its own slice like the
    /// built-in client's jobs.
    fn run_fio(
        &self,
        p: &PointConfig,
        w: &WorkloadSpec,
        repeat: usize,
        n: usize,
        header: &str,
    ) -> anyhow::Result<Sample> {
        let o = self.opts;
        let img = self.image.as_ref().context("native fio needs an image")?;
        let bs = w.block_size as u64;
        let slice = self.size / p.jobs as u64 / bs * bs;
        ensure!(slice >= bs, "the image is too small for {} jobs", p.jobs);
        let json = self.tmp.path().join(format!("fio{n}.json"));
        let log = self.log_file(Backend::Native, n, header)?;
        let mut cmd = Command::new(&o.fio_bin);
        cmd.arg("--name=native")
            .arg(format!(
                "--filename={}",
                img.display().to_string().replace(':', "\\:")
            ))
            .arg("--ioengine=io_uring")
            .arg("--direct=1")
            .arg(format!("--rw={}", w.fio_rw()))
            .arg(format!("--bs={bs}"))
            .arg(format!("--iodepth={}", p.iodepth))
            .arg(format!("--numjobs={}", p.jobs))
            .arg(format!("--size={slice}"))
            .arg(format!("--offset_increment={slice}"))
            .arg("--time_based")
            .arg(format!("--runtime={}ms", o.runtime.as_millis().max(1)))
            .arg("--group_reporting")
            .arg("--norandommap")
            .arg("--randrepeat=0")
            .arg("--lat_percentiles=1")
            .arg("--output-format=json")
            .arg(format!("--output={}", json.display()));
        writeln!(&log, "{cmd:?}")?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let host0 = host_busy_secs();
        let wall0 = Instant::now();
        let child = cmd.spawn().context("starting fio")?;
        let (status, cpu) = wait_rusage(child)?;
        let others = others_pct(host0, host_busy_secs(), cpu, wall0.elapsed());
        ensure!(
            status == 0,
            "fio failed (wait status {status}; see {})",
            self.logs.join("native.log").display()
        );
        let text = std::fs::read_to_string(&json)
            .with_context(|| format!("reading fio's output {}", json.display()))?;
        let mut s = parse_fio_json(&text, w)?;
        s.repeat = repeat;
        s.client_cpu_s = Some(cpu);
        s.total_cpu_s_per_mio = Some(cpu / s.ios as f64 * 1e6);
        s.others_cpu_pct = others;
        Ok(s)
    }
}

/// A backend process that is killed if not stopped (on an error path).
struct BackendProcess {
    child: Child,
    name: &'static str,
    stopped: bool,
}

impl BackendProcess {
    /// SIGTERM, then wait (SIGKILL after [`STOP_TIMEOUT`]).
    fn stop(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        self.stopped = true;
        // SAFETY: kill(2) on our own child's pid, which is not reaped yet (so not reused).
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
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
fn wait_for_socket(sock: &Path, child: &mut Child) -> anyhow::Result<()> {
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

/// Waits for a child with wait4(2); returns its wait status and the CPU seconds (user + system)
/// it and its reaped descendants used.
fn wait_rusage(child: Child) -> anyhow::Result<(i32, f64)> {
    let pid = child.id() as i32;
    let mut status = 0;
    // SAFETY: rusage is plain data; wait4 on our own unreaped child writes status and ru.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: as above; the pointers are to live locals.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e).context("waiting for fio");
        }
    }
    // The child is reaped: forget the handle without waiting again.
    drop(child);
    Ok((status, tv(ru.ru_utime) + tv(ru.ru_stime)))
}

fn tv(t: libc::timeval) -> f64 {
    t.tv_sec as f64 + t.tv_usec as f64 * 1e-6
}

/// What one run cost: the backend's CPU and memory from /proc, the client's CPU.
struct Usage {
    backend_cpu_s: Option<f64>,
    client_cpu_s: f64,
    others_cpu_pct: Option<f64>,
    vm_hwm_kib: Option<u64>,
    rss_anon_kib: Option<u64>,
}

/// Runs `f` (the client) while sampling the backend's memory every 50 ms; reads the backend's
/// and this process's CPU time before and after.
fn measure<T>(pid: i32, f: impl FnOnce() -> T) -> anyhow::Result<(T, Usage)> {
    let stat = PathBuf::from(format!("/proc/{pid}/stat"));
    let status = PathBuf::from(format!("/proc/{pid}/status"));
    let cpu0 = proc_cpu_secs(&stat);
    let self0 = self_cpu_secs();
    let host0 = host_busy_secs();
    let wall0 = Instant::now();
    let done = AtomicBool::new(false);
    let (out, max_anon) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut max_anon: Option<u64> = None;
            loop {
                if let Some(m) = proc_status(&status) {
                    max_anon = max_anon.max(m.rss_anon_kib);
                }
                if done.load(Ordering::Relaxed) {
                    return max_anon;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let out = f();
        done.store(true, Ordering::Relaxed);
        (out, sampler.join().unwrap_or(None))
    });
    let cpu1 = proc_cpu_secs(&stat);
    let self1 = self_cpu_secs();
    let host1 = host_busy_secs();
    let wall = wall0.elapsed();
    let mem = proc_status(&status);
    let backend_cpu_s = match (cpu0, cpu1) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let client_cpu_s = self1 - self0;
    Ok((
        out,
        Usage {
            backend_cpu_s,
            client_cpu_s,
            others_cpu_pct: others_pct(
                host0,
                host1,
                backend_cpu_s.unwrap_or(0.0) + client_cpu_s,
                wall,
            ),
            vm_hwm_kib: mem.as_ref().and_then(|m| m.vm_hwm_kib),
            rss_anon_kib: max_anon.max(mem.and_then(|m| m.rss_anon_kib)),
        },
    ))
}

/// Busy CPU time of the whole machine so far (all CPUs), in seconds, from /proc/stat.
fn host_busy_secs() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks = parse_host_busy_ticks(&text)?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Some(ticks as f64 / if hz > 0 { hz as f64 } else { 100.0 })
}

/// user + nice + system + irq + softirq + steal of the `cpu` line of /proc/stat (ticks):
/// everything but idle and iowait.
pub fn parse_host_busy_ticks(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<Vec<u64>>>()?;
    let g = |i: usize| f.get(i).copied().unwrap_or(0);
    Some(g(0) + g(1) + g(2) + g(5) + g(6) + g(7))
}

/// CPU used by everything else on the machine during a run, in percent of all CPUs: the
/// machine's busy time minus `ours` (backend + client), over `wall`.
fn others_pct(host0: Option<f64>, host1: Option<f64>, ours: f64, wall: Duration) -> Option<f64> {
    let (a, b) = (host0?, host1?);
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as f64;
    let secs = wall.as_secs_f64();
    (secs > 0.0).then(|| ((b - a - ours) / secs / cpus * 100.0).max(0.0))
}

/// utime + stime of a process (all its threads, live and exited), in seconds.
fn proc_cpu_secs(stat: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(stat).ok()?;
    let ticks = parse_stat_ticks(&text)?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Some(ticks as f64 / if hz > 0 { hz as f64 } else { 100.0 })
}

/// utime + stime (fields 14 and 15) from the text of /proc/PID/stat. The command name (field 2)
/// may contain spaces and parentheses, so fields are counted after its last ')'.
pub fn parse_stat_ticks(text: &str) -> Option<u64> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14, index 11.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

fn self_cpu_secs() -> f64 {
    // SAFETY: rusage is plain data; getrusage writes it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a pointer to a live local.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Memory lines of /proc/PID/status.
#[derive(Debug, Default, PartialEq)]
pub struct ProcMem {
    /// Peak resident set (VmHWM), KiB.
    pub vm_hwm_kib: Option<u64>,
    /// Resident anonymous memory (RssAnon), KiB.
    pub rss_anon_kib: Option<u64>,
}

fn proc_status(path: &Path) -> Option<ProcMem> {
    std::fs::read_to_string(path).ok().map(|t| parse_status(&t))
}

/// Parses VmHWM and RssAnon from the text of /proc/PID/status.
pub fn parse_status(text: &str) -> ProcMem {
    let mut m = ProcMem::default();
    for line in text.lines() {
        let kib = |l: &str| {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        };
        if line.starts_with("VmHWM:") {
            m.vm_hwm_kib = kib(line);
        } else if line.starts_with("RssAnon:") {
            m.rss_anon_kib = kib(line);
        }
    }
    m
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
    for e in &file.exports {
        threads += e.threads as u64;
        total.add(&e.counters);
    }
    Ok(MqblkCounters::new(threads, total))
}

/// Reads the sample out of fio's JSON output (one group-reported job).
pub fn parse_fio_json(text: &str, w: &WorkloadSpec) -> anyhow::Result<Sample> {
    // fio may print notes before the JSON object.
    let start = text.find('{').context("no JSON in fio's output")?;
    let v: serde_json::Value = serde_json::from_str(&text[start..]).context("fio's JSON output")?;
    let job = &v["jobs"][0];
    ensure!(job.is_object(), "fio's output has no job");
    let dir = if w.pattern.writes() { "write" } else { "read" };
    let d = &job[dir];
    let ios = d["total_ios"].as_u64().context("fio: no total_ios")?;
    let runtime_ms = d["runtime"].as_f64().context("fio: no runtime")?;
    ensure!(ios > 0 && runtime_ms > 0.0, "fio did no I/O");
    let errors = job["error"].as_i64().unwrap_or(0);
    ensure!(errors == 0, "fio reported error {errors}");
    let pct = |q: &str| -> f64 {
        for key in ["lat_ns", "clat_ns"] {
            if let Some(x) = d[key]["percentile"][q].as_f64() {
                return x / 1000.0;
            }
        }
        f64::NAN
    };
    let secs = runtime_ms / 1000.0;
    Ok(Sample {
        ios,
        elapsed_s: secs,
        iops: ios as f64 / secs,
        mb_per_s: d["io_bytes"].as_f64().unwrap_or(0.0) / secs / 1e6,
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        p999_us: pct("99.900000"),
        ..Sample::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_skip_odd_command_names() {
        let text = "1234 (my (odd) cmd) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 9 0 100 0 0";
        assert_eq!(parse_stat_ticks(text), Some(300));
        assert_eq!(parse_stat_ticks("garbage"), None);
        // The real thing for this process parses.
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(parse_stat_ticks(&own).is_some());
    }

    #[test]
    fn host_busy_excludes_idle_and_iowait() {
        let t = "cpu  100 5 50 1000 300 7 3 2 0 0\ncpu0 50 2 25 500 150 3 1 1 0 0\n";
        assert_eq!(parse_host_busy_ticks(t), Some(100 + 5 + 50 + 7 + 3 + 2));
        assert_eq!(parse_host_busy_ticks("intr 5\n"), None);
        let own = std::fs::read_to_string("/proc/stat").unwrap();
        assert!(parse_host_busy_ticks(&own).is_some());
    }

    #[test]
    fn status_memory_lines() {
        let t = "Name:\tmqblk\nVmHWM:\t   12345 kB\nVmRSS:\t 100 kB\nRssAnon:\t    2048 kB\n";
        assert_eq!(
            parse_status(t),
            ProcMem {
                vm_hwm_kib: Some(12345),
                rss_anon_kib: Some(2048)
            }
        );
        assert_eq!(parse_status(""), ProcMem::default());
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
        assert!(parse_stats("{}").is_err());
    }

    #[test]
    fn fio_json_read_and_write() {
        let t = r#"note: something
{"jobs":[{"error":0,"read":{"total_ios":1000,"runtime":500,"io_bytes":4096000,
  "lat_ns":{"percentile":{"50.000000":20000,"99.000000":80000,"99.900000":120000}}},
  "write":{"total_ios":0,"runtime":0,"io_bytes":0}}]}"#;
        let w: WorkloadSpec = "randread-4k".parse().unwrap();
        let s = parse_fio_json(t, &w).unwrap();
        assert_eq!(s.ios, 1000);
        assert_eq!(s.iops, 2000.0);
        assert!((s.mb_per_s - 8.192).abs() < 1e-9);
        assert_eq!((s.p50_us, s.p99_us, s.p999_us), (20.0, 80.0, 120.0));
        let w: WorkloadSpec = "write-32k".parse().unwrap();
        assert!(parse_fio_json(t, &w).is_err(), "no writes were done");
    }
}
