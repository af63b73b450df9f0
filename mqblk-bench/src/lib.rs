//! `mqblk bench`: runs a grid of workloads against mqblk (in each thread mapping),
//! qemu-storage-daemon and host-native fio, and reports them side by side.
//!
//! Every point of the grid (backend, mapping, workload, jobs, iodepth) gets a fresh backend
//! process, started here and stopped after the point, so that what `/proc/<pid>` says about CPU
//! time and memory belongs to that backend and that point alone. Points run interleaved across
//! repeats (every point once, then every point again in reverse order, ...) and are reported as
//! median and min–max, because shared machines are noisy and drift.
//!
//! The parts:
//! - this module: options, the grid, the run order (pure, unit-tested);
//! - [`run`]: starting and stopping backends, measuring one point;
//! - `sample`: what one run of a point measured ([`Sample`]);
//! - `summary`: **the metric table**: each metric once, from which [`Summary`] (median and
//!   min–max over a point's samples, [`Stat`]) and both tables' columns are generated;
//! - `ratio`: same-run comparisons with QSD, native fio and the first `--mqblk-opts` variant;
//! - `host`: the machine, recorded with the results;
//! - `report`: [`BenchResults`] and `results.json`; `table` the printed table, `markdown`
//!   `report.md`;
//! - `plot`: the PNG (IOPS against jobs, one line per backend/mode).

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use serde::Serialize;

use mqblk_client::Pattern;

mod host;
mod markdown;
mod plot;
mod ratio;
pub mod rbd;
mod report;
pub mod run;
mod sample;
mod summary;
mod table;

pub use report::{BenchResults, PointResult};
pub use sample::Sample;
pub use summary::{Stat, Summary};

/// `mqblk bench` command-line arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Backends, comma-separated: mqblk, qsd (qemu-storage-daemon), native (fio with io_uring
    /// directly on --path; uring engine only).
    #[arg(long, default_value = "mqblk")]
    pub backend: String,
    /// mqblk thread mappings, comma-separated: baseline (1 queue, 1 thread), mq (one queue per
    /// job, 1 thread), per-queue (one queue and one thread per job). qsd runs baseline and/or mq
    /// (one AioContext serves all queues: per-queue maps to its mq).
    #[arg(long, default_value = "baseline,mq,per-queue")]
    pub mode: String,
    /// Storage engine: null (completes at once, reads give zeros; QSD: null-co with
    /// read-zeroes=on), uring (io_uring on --path with O_DIRECT; QSD: file, aio=io_uring,
    /// cache.direct=on) or rbd (the Ceph RBD image --rbd, librbd's cache off; QSD: rbd,
    /// cache.direct=on; mqblk must be built with --features rbd).
    #[arg(long, default_value = "null")]
    pub engine: String,
    /// The RBD image for the rbd engine, as POOL/IMAGE. Created at --size and filled with data
    /// (by the rbd tool) if missing; an existing image is used at its size.
    #[arg(long, value_name = "POOL/IMAGE")]
    pub rbd: Option<String>,
    /// ceph.conf of the rbd engine's cluster (default: librados's search, /etc/ceph/ceph.conf).
    #[arg(long, value_name = "PATH")]
    pub ceph_conf: Option<PathBuf>,
    /// Keyring for mqblk and the rbd tool (QSD's rbd driver reads the keyring ceph.conf names).
    #[arg(long, value_name = "PATH")]
    pub ceph_keyring: Option<PathBuf>,
    /// Ceph client name, without `client.`.
    #[arg(long, default_value = "admin", value_name = "NAME")]
    pub ceph_user: String,
    /// Raw image for the uring engine (default OUT/disk.img). Created and filled with data at
    /// --size if missing; an existing file is used at its size.
    #[arg(long, value_name = "FILE")]
    pub path: Option<PathBuf>,
    /// Disk size (K/M/G suffixes) for the null engine or a new image.
    #[arg(long, default_value = "1G")]
    pub size: String,
    /// Workloads, comma-separated: randread|randwrite|read|write, dash, block size
    /// (read and write are sequential), e.g. randread-4k,write-32k.
    #[arg(long, default_value = "randread-4k")]
    pub workloads: String,
    /// Job counts, comma-separated. Each job is a client thread with its own slice of the disk;
    /// in mq and per-queue mappings each job has its own virtqueue.
    #[arg(long, default_value = "1,2")]
    pub jobs: String,
    /// Requests in flight per job, comma-separated.
    #[arg(long, default_value = "32")]
    pub iodepth: String,
    /// Seconds per point.
    #[arg(long, default_value_t = 5.0)]
    pub runtime: f64,
    /// Runs of each point (interleaved).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Output directory for results.json, report.md, iops.png and the backends' logs.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// Extra export keys for mqblk, e.g. poll=off,merge=off. Repeat the option to compare
    /// variants in one run (an empty value is the defaults). `bin=PATH` among them runs that
    /// variant with another mqblk executable (compare two builds in one run); `stats-dir=DIR`
    /// puts its stats file in DIR instead of the run's temporary directory (on /dev/shm where
    /// there is one), e.g. on the image's filesystem to see what rewriting a file there every
    /// 100 ms costs (docs/PERFORMANCE.md 1a).
    #[arg(long = "mqblk-opts", value_name = "KEYS")]
    pub mqblk_opts: Vec<String>,
    /// Client: use libblkio poll queues (busy-poll completions) instead of waiting on
    /// interrupts (eventfds).
    #[arg(long)]
    pub client_poll: bool,
    /// Run QSD's export in a dedicated IOThread (`--object iothread` + `iothread=`) instead of
    /// its main loop. Either way one thread serves all of the export's queues: QSD's
    /// vhost-user-blk export takes a single iothread.
    #[arg(long)]
    pub qsd_iothread: bool,
    /// qemu-storage-daemon binary.
    #[arg(long, default_value = "qemu-storage-daemon", value_name = "BIN")]
    pub qsd_bin: PathBuf,
    /// fio binary (for --backend native).
    #[arg(long, default_value = "fio", value_name = "BIN")]
    pub fio_bin: PathBuf,
    /// mqblk binary to serve with (default: this executable).
    #[arg(long, value_name = "BIN")]
    pub mqblk_bin: Option<PathBuf>,
}

/// A backend under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// mqblk, started as `mqblk serve`.
    Mqblk,
    /// qemu-storage-daemon's vhost-user-blk export.
    Qsd,
    /// fio with io_uring straight on the file: no vhost-user at all.
    Native,
}

impl Backend {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Mqblk => "mqblk",
            Backend::Qsd => "qsd",
            Backend::Native => "native",
        }
    }
}

impl FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mqblk" => Ok(Backend::Mqblk),
            "qsd" => Ok(Backend::Qsd),
            "native" | "fio" => Ok(Backend::Native),
            _ => Err(format!("unknown backend {s:?}: use mqblk, qsd or native")),
        }
    }
}

/// A queue-to-thread mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// One queue, one thread; all jobs share queue 0.
    Baseline,
    /// One queue per job, one thread.
    Mq,
    /// One queue and one thread per job.
    PerQueue,
}

impl Mode {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Baseline => "baseline",
            Mode::Mq => "mq",
            Mode::PerQueue => "per-queue",
        }
    }

    /// Virtqueues for `jobs` jobs.
    pub fn queues(self, jobs: usize) -> usize {
        match self {
            Mode::Baseline => 1,
            Mode::Mq | Mode::PerQueue => jobs,
        }
    }

    /// mqblk's `threads=` value.
    pub fn threads(self) -> &'static str {
        match self {
            Mode::Baseline | Mode::Mq => "1",
            Mode::PerQueue => "per-queue",
        }
    }
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "baseline" => Ok(Mode::Baseline),
            "mq" => Ok(Mode::Mq),
            "per-queue" | "perqueue" => Ok(Mode::PerQueue),
            _ => Err(format!("unknown mode {s:?}: use baseline, mq or per-queue")),
        }
    }
}

/// Storage engine of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// Completes at once; reads give zeros.
    Null,
    /// io_uring on a raw file with O_DIRECT.
    Uring,
    /// A Ceph RBD image through librbd.
    Rbd,
}

impl EngineKind {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Null => "null",
            EngineKind::Uring => "uring",
            EngineKind::Rbd => "rbd",
        }
    }
}

impl FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "null" => Ok(EngineKind::Null),
            "uring" => Ok(EngineKind::Uring),
            "rbd" => Ok(EngineKind::Rbd),
            _ => Err(format!("unknown engine {s:?}: use null, uring or rbd")),
        }
    }
}

/// A workload: access pattern and block size, e.g. `randread-4k`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkloadSpec {
    /// As given, e.g. `randread-4k`.
    pub name: String,
    /// The client's pattern.
    #[serde(serialize_with = "ser_pattern")]
    pub pattern: Pattern,
    /// Bytes per request.
    pub block_size: usize,
}

fn ser_pattern<S: serde::Serializer>(p: &Pattern, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(p.name())
}

impl WorkloadSpec {
    /// fio's `--rw` for this workload.
    pub fn fio_rw(&self) -> &'static str {
        match self.pattern {
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::SeqRead => "read",
            _ => "write",
        }
    }
}

impl FromStr for WorkloadSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "invalid workload {s:?}: KIND-SIZE with KIND randread, randwrite, read or write \
                 and SIZE a multiple of 512 up to 1M, e.g. randread-4k"
            )
        };
        let (kind, size) = s.split_once('-').ok_or_else(bad)?;
        let pattern = match kind {
            "randread" => Pattern::RandRead,
            "randwrite" => Pattern::RandWrite,
            "read" | "seqread" => Pattern::SeqRead,
            "write" | "seqwrite" => Pattern::SeqWrite,
            _ => return Err(bad()),
        };
        let block_size = mqblk::config::parse_size(&size.to_ascii_uppercase())
            .filter(|b| *b >= 512 && *b <= 1 << 20 && b % 512 == 0)
            .ok_or_else(bad)? as usize;
        Ok(WorkloadSpec {
            name: s.to_string(),
            pattern,
            block_size,
        })
    }
}

/// Splits a comma-separated list, trims, drops empty items and duplicates (keeping the first).
pub fn parse_list<T: FromStr<Err = String> + PartialEq>(
    what: &str,
    s: &str,
) -> Result<Vec<T>, String> {
    let mut out: Vec<T> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let v = item.parse::<T>().map_err(|e| format!("--{what}: {e}"))?;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    if out.is_empty() {
        return Err(format!("--{what}: the list is empty"));
    }
    Ok(out)
}

/// A comma-separated list of counts within `1..=max`.
pub fn parse_counts(what: &str, s: &str, max: usize) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let n: usize = item
            .parse()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| format!("--{what}: {item:?} is not a count from 1 to {max}"))?;
        if !out.contains(&n) {
            out.push(n);
        }
    }
    if out.is_empty() {
        return Err(format!("--{what}: the list is empty"));
    }
    Ok(out)
}

/// Validated settings of a bench run.
#[derive(Debug, Clone, Serialize)]
pub struct BenchOptions {
    /// Backends to run.
    pub backends: Vec<Backend>,
    /// mqblk mappings to run.
    pub modes: Vec<Mode>,
    /// Storage engine.
    pub engine: EngineKind,
    /// Image file (uring engine).
    pub path: Option<PathBuf>,
    /// The RBD image (rbd engine).
    pub rbd: Option<rbd::RbdTarget>,
    /// Disk size in bytes (null engine, or a new image).
    pub size: u64,
    /// Workloads.
    pub workloads: Vec<WorkloadSpec>,
    /// Job counts.
    pub jobs: Vec<usize>,
    /// Queue depths.
    pub iodepths: Vec<usize>,
    /// Time per point.
    #[serde(serialize_with = "ser_secs")]
    pub runtime: Duration,
    /// Repeats of every point.
    pub repeat: usize,
    /// Output directory.
    pub out: PathBuf,
    /// mqblk export-key variants (at least one; "" is the defaults).
    pub mqblk_opts: Vec<String>,
    /// Client poll queues.
    pub client_poll: bool,
    /// QSD export in an IOThread.
    pub qsd_iothread: bool,
    /// qemu-storage-daemon binary.
    pub qsd_bin: PathBuf,
    /// fio binary.
    pub fio_bin: PathBuf,
    /// mqblk binary.
    pub mqblk_bin: PathBuf,
}

fn ser_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Export keys the bench sets itself: `--mqblk-opts` may not override them.
const RESERVED_KEYS: [&str; 8] = [
    "socket", "path", "engine", "size", "queues", "threads", "pool", "image",
];

impl BenchOptions {
    /// Validates the command line.
    pub fn from_args(a: &BenchArgs) -> Result<BenchOptions, String> {
        let backends: Vec<Backend> = parse_list("backend", &a.backend)?;
        let modes: Vec<Mode> = parse_list("mode", &a.mode)?;
        let engine: EngineKind = a.engine.parse().map_err(|e| format!("--engine: {e}"))?;
        let workloads: Vec<WorkloadSpec> = parse_list("workloads", &a.workloads)?;
        let jobs = parse_counts("jobs", &a.jobs, 64)?;
        let iodepths = parse_counts("iodepth", &a.iodepth, 1024)?;
        let size = mqblk::config::parse_size(&a.size)
            .filter(|s| *s >= 1 << 20 && s % 4096 == 0)
            .ok_or_else(|| format!("--size {}: a multiple of 4K, at least 1M, e.g. 1G", a.size))?;
        if !(a.runtime > 0.0 && a.runtime <= 3600.0) {
            return Err(format!(
                "--runtime {}: more than 0, at most 3600 s",
                a.runtime
            ));
        }
        if !(1..=1000).contains(&a.repeat) {
            return Err(format!("--repeat {}: 1 to 1000", a.repeat));
        }
        if engine != EngineKind::Uring && backends.contains(&Backend::Native) {
            return Err("--backend native runs fio on a file: it needs --engine uring".into());
        }
        if engine != EngineKind::Uring && a.path.is_some() {
            return Err("--path is for --engine uring".into());
        }
        let rbd = match (engine, &a.rbd) {
            (EngineKind::Rbd, Some(spec)) => Some(rbd::RbdTarget::parse(
                spec,
                a.ceph_conf.clone(),
                a.ceph_keyring.clone(),
                &a.ceph_user,
            )?),
            (EngineKind::Rbd, None) => {
                return Err(
                    "--engine rbd needs --rbd POOL/IMAGE (and --ceph-conf PATH unless \
                            /etc/ceph/ceph.conf names the cluster)"
                        .into(),
                )
            }
            (_, Some(_)) => return Err("--rbd is for --engine rbd".into()),
            (_, None) => None,
        };
        if !backends.contains(&Backend::Qsd) && a.qsd_iothread {
            return Err("--qsd-iothread without --backend qsd".into());
        }
        if !backends.contains(&Backend::Mqblk) && !a.mqblk_opts.is_empty() {
            return Err("--mqblk-opts without --backend mqblk".into());
        }
        let mut mqblk_opts: Vec<String> = Vec::new();
        for o in &a.mqblk_opts {
            let o = o.trim().trim_matches(',').to_string();
            for kv in o.split(',').filter(|k| !k.is_empty()) {
                let key = kv.split('=').next().unwrap_or("");
                if RESERVED_KEYS.contains(&key) {
                    return Err(format!(
                        "--mqblk-opts {o}: {key}= is set by the bench (see --engine, --path, \
                         --size, --mode)"
                    ));
                }
                if let Some(dir) = kv.strip_prefix("stats-dir=") {
                    if !Path::new(dir).is_dir() {
                        return Err(format!(
                            "--mqblk-opts {o}: stats-dir={dir} is not a directory"
                        ));
                    }
                }
            }
            if !mqblk_opts.contains(&o) {
                mqblk_opts.push(o);
            }
        }
        if mqblk_opts.is_empty() {
            mqblk_opts.push(String::new());
        }
        let mqblk_bin = match &a.mqblk_bin {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .map_err(|e| format!("cannot find the mqblk executable: {e}"))?,
        };
        Ok(BenchOptions {
            backends,
            modes,
            engine,
            path: a.path.clone(),
            rbd,
            size,
            workloads,
            jobs,
            iodepths,
            runtime: Duration::from_secs_f64(a.runtime),
            repeat: a.repeat,
            out: a.out.clone(),
            mqblk_opts,
            client_poll: a.client_poll,
            qsd_iothread: a.qsd_iothread,
            qsd_bin: a.qsd_bin.clone(),
            fio_bin: a.fio_bin.clone(),
            mqblk_bin,
        })
    }

    /// Every point of the grid, in the order of the first repeat: comparable points (same
    /// workload, iodepth and jobs) next to each other in time.
    pub fn points(&self) -> Vec<PointConfig> {
        let mut out = Vec::new();
        for (wi, _) in self.workloads.iter().enumerate() {
            for &iodepth in &self.iodepths {
                for &jobs in &self.jobs {
                    for &backend in &self.backends {
                        let mut push = |mode: Option<Mode>, variant: usize| {
                            out.push(PointConfig {
                                backend,
                                mode,
                                variant,
                                workload: wi,
                                jobs,
                                iodepth,
                            })
                        };
                        match backend {
                            Backend::Mqblk => {
                                for &m in &self.modes {
                                    for v in 0..self.mqblk_opts.len() {
                                        push(Some(m), v);
                                    }
                                }
                            }
                            Backend::Qsd => {
                                for m in qsd_modes(&self.modes) {
                                    push(Some(m), 0);
                                }
                            }
                            Backend::Native => push(None, 0),
                        }
                    }
                }
            }
        }
        out
    }

    /// The series label of a point: backend, mapping and (if several or any) mqblk options.
    pub fn label(&self, p: &PointConfig) -> String {
        let mut s = p.backend.name().to_string();
        if let Some(m) = p.mode {
            s.push(' ');
            s.push_str(m.name());
        }
        if p.backend == Backend::Mqblk {
            let o = &self.mqblk_opts[p.variant];
            if !o.is_empty() {
                s.push_str(&format!(" [{o}]"));
            } else if self.mqblk_opts.len() > 1 {
                s.push_str(" [defaults]");
            }
        }
        if p.backend == Backend::Qsd && self.qsd_iothread {
            s.push_str(" [iothread]");
        }
        if p.backend == Backend::Native {
            s = "native fio".into();
        }
        s
    }
}

/// The mappings QSD can express from those asked for: baseline (1 queue) and mq (one queue
/// per job, all served by one AioContext). per-queue has no QSD equivalent: it maps to mq.
pub fn qsd_modes(modes: &[Mode]) -> Vec<Mode> {
    let mut out = Vec::new();
    if modes.contains(&Mode::Baseline) {
        out.push(Mode::Baseline);
    }
    if modes.contains(&Mode::Mq) || modes.contains(&Mode::PerQueue) {
        out.push(Mode::Mq);
    }
    out
}

/// One point of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PointConfig {
    /// Backend.
    pub backend: Backend,
    /// Mapping (none for native fio).
    pub mode: Option<Mode>,
    /// Index into [`BenchOptions::mqblk_opts`] (0 for other backends).
    pub variant: usize,
    /// Index into [`BenchOptions::workloads`].
    pub workload: usize,
    /// Jobs.
    pub jobs: usize,
    /// Requests in flight per job.
    pub iodepth: usize,
}

impl PointConfig {
    /// Virtqueues the client uses (and the export offers).
    pub fn queues(&self) -> usize {
        self.mode.map(|m| m.queues(self.jobs)).unwrap_or(1)
    }
}

/// The run order: `(repeat, point index)` pairs. Every repeat runs every point once; odd
/// repeats run them in reverse, so that slow drift (thermal, other tenants) does not always
/// favour the points that come first.
pub fn schedule(points: usize, repeat: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(points * repeat);
    for r in 0..repeat {
        if r % 2 == 0 {
            out.extend((0..points).map(|p| (r, p)));
        } else {
            out.extend((0..points).rev().map(|p| (r, p)));
        }
    }
    out
}

/// `arg` as a POSIX shell word: as is when that is unambiguous, else single-quoted (so that a
/// recorded command line, empty `--mqblk-opts ''` included, can be pasted back).
pub fn shell_quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./,=:+@%".contains(c));
    if plain {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// Runs `mqblk bench`: every point, interleaved; prints the table; writes the reports.
/// Fails if any sample failed (after writing what was measured).
pub fn bench(opts: &BenchOptions, command: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating --out {}", opts.out.display()))?;
    run::check_tools(opts)?;
    let image = match opts.engine {
        EngineKind::Uring => Some(run::prepare_image(opts)?),
        EngineKind::Null | EngineKind::Rbd => None,
    };
    let (image_path, size) = match (&image, &opts.rbd) {
        (Some((p, s)), _) => (Some(p.clone()), *s),
        (None, Some(rbd)) => (None, rbd.prepare(opts.size)?),
        (None, None) => (None, opts.size),
    };
    let points = opts.points();
    ensure!(!points.is_empty(), "nothing to run");
    let order = schedule(points.len(), opts.repeat);
    let host = host::HostInfo::collect();
    println!(
        "mqblk bench: {} points x {} repeats, {:.1} s each (about {:.0} s); {} CPUs ({}), load {}",
        points.len(),
        opts.repeat,
        opts.runtime.as_secs_f64(),
        order.len() as f64 * (opts.runtime.as_secs_f64() + 0.3),
        host.nproc,
        host.cpu_model,
        host.loadavg
    );
    let env = run::RunEnv::new(opts, image_path, size)?;
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); points.len()];
    let mut failures = 0usize;
    for (n, &(rep, pi)) in order.iter().enumerate() {
        let p = &points[pi];
        let label = opts.label(p);
        let w = &opts.workloads[p.workload];
        let s = env.run_point(p, rep);
        match &s.error {
            None => println!(
                "[{}/{}] {label}, {}, jobs {}, iodepth {}: {:.0} IOPS, {:.1} MB/s, p99 {:.0} us, \
                 backend CPU {} s/M I/O, others' CPU {}%",
                n + 1,
                order.len(),
                w.name,
                p.jobs,
                p.iodepth,
                s.iops,
                s.mb_per_s,
                s.p99_us,
                s.backend_cpu_s_per_mio
                    .map(|c| format!("{c:.2}"))
                    .unwrap_or_else(|| "-".into()),
                s.others_cpu_pct
                    .map(|c| format!("{c:.0}"))
                    .unwrap_or_else(|| "-".into())
            ),
            Some(e) => {
                failures += 1;
                println!(
                    "[{}/{}] {label}, {}, jobs {}, iodepth {}: FAILED: {e}",
                    n + 1,
                    order.len(),
                    w.name,
                    p.jobs,
                    p.iodepth
                );
            }
        }
        samples[pi].push(s);
    }
    let results = BenchResults::new(opts, command, host, size, &points, samples);
    println!();
    print!("{}", results.table());
    results.write(&opts.out)?;
    let png = opts.out.join("iops.png");
    let font = plot::find_font();
    plot::draw(&results, &png, font.as_deref()).context("drawing iops.png")?;
    println!(
        "\nwrote {}, {} and {}",
        opts.out.join("results.json").display(),
        opts.out.join("report.md").display(),
        png.display()
    );
    if failures > 0 {
        bail!(
            "{failures} of {} samples failed (see the lines above and the logs in {})",
            order.len(),
            opts.out.join("logs").display()
        );
    }
    Ok(())
}

/// The options of `mqblk bench ARGS` (words split at whitespace; `--opt=` for an empty value),
/// for tests.
#[cfg(test)]
pub(crate) fn test_options(args: &str) -> Result<BenchOptions, String> {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchArgs,
    }
    let cli = Cli::try_parse_from(std::iter::once("bench").chain(args.split_whitespace()))
        .map_err(|e| e.to_string())?;
    BenchOptions::from_args(&cli.a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_trim_and_dedupe() {
        let b: Vec<Backend> = parse_list("backend", "mqblk, qsd,mqblk,").unwrap();
        assert_eq!(b, vec![Backend::Mqblk, Backend::Qsd]);
        let m: Vec<Mode> = parse_list("mode", "per-queue,baseline").unwrap();
        assert_eq!(m, vec![Mode::PerQueue, Mode::Baseline]);
        assert!(parse_list::<Mode>("mode", "bogus")
            .unwrap_err()
            .contains("bogus"));
        assert!(parse_list::<Mode>("mode", " , ")
            .unwrap_err()
            .contains("empty"));
        assert_eq!(parse_counts("jobs", "1,2,4,2", 64).unwrap(), vec![1, 2, 4]);
        assert!(parse_counts("jobs", "0", 64).is_err());
        assert!(parse_counts("jobs", "65", 64).is_err());
        assert!(parse_counts("jobs", "x", 64).is_err());
    }

    #[test]
    fn workloads_parse() {
        let w: WorkloadSpec = "randread-4k".parse().unwrap();
        assert_eq!((w.pattern, w.block_size), (Pattern::RandRead, 4096));
        let w: WorkloadSpec = "write-32k".parse().unwrap();
        assert_eq!(
            (w.pattern, w.block_size, w.fio_rw()),
            (Pattern::SeqWrite, 32768, "write")
        );
        let w: WorkloadSpec = "read-32K".parse().unwrap();
        assert_eq!((w.pattern, w.fio_rw()), (Pattern::SeqRead, "read"));
        let w: WorkloadSpec = "randwrite-512".parse().unwrap();
        assert_eq!((w.pattern, w.block_size), (Pattern::RandWrite, 512));
        for bad in ["randread", "randread-3", "randread-2M", "trim-4k", "-4k"] {
            assert!(bad.parse::<WorkloadSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn options_validate() {
        let o = test_options("").unwrap();
        assert_eq!(o.backends, vec![Backend::Mqblk]);
        assert_eq!(o.modes, vec![Mode::Baseline, Mode::Mq, Mode::PerQueue]);
        assert_eq!(o.mqblk_opts, vec![String::new()]);
        assert_eq!(o.size, 1 << 30);
        let e = test_options("--backend native").unwrap_err();
        assert!(e.contains("--engine uring"), "{e}");
        let e = test_options("--mqblk-opts queues=4").unwrap_err();
        assert!(e.contains("queues="), "{e}");
        let e = test_options("--runtime 0").unwrap_err();
        assert!(e.contains("--runtime"), "{e}");
        let o = test_options(
            "--mqblk-opts poll=off, --mqblk-opts= --engine uring --backend native,mqblk",
        )
        .unwrap();
        assert_eq!(o.mqblk_opts, vec!["poll=off".to_string(), String::new()]);
        assert_eq!(o.engine, EngineKind::Uring);
        let e = test_options("--engine rbd").unwrap_err();
        assert!(e.contains("--rbd POOL/IMAGE"), "{e}");
        let e = test_options("--rbd rbd/x").unwrap_err();
        assert!(e.contains("--engine rbd"), "{e}");
        let o = test_options("--engine rbd --rbd rbd/bench --ceph-conf /c --backend mqblk,qsd")
            .unwrap();
        assert_eq!(
            o.rbd.as_ref().map(|r| r.spec()).as_deref(),
            Some("rbd/bench")
        );
    }

    #[test]
    fn grid_and_labels() {
        let o = test_options("--backend mqblk,qsd --mode baseline,per-queue --jobs 1,2 --workloads randread-4k,write-32k")
        .unwrap();
        let p = o.points();
        // per (workload, jobs): mqblk x 2 modes + qsd baseline + qsd mq.
        assert_eq!(p.len(), 2 * 2 * 4);
        let labels: Vec<String> = p[..4].iter().map(|x| o.label(x)).collect();
        assert_eq!(
            labels,
            [
                "mqblk baseline",
                "mqblk per-queue",
                "qsd baseline",
                "qsd mq"
            ]
        );
        assert!(p[..4].iter().all(|x| x.jobs == 1 && x.workload == 0));
        assert!(p[4..8].iter().all(|x| x.jobs == 2 && x.workload == 0));
        assert_eq!(p[5].queues(), 2);
        assert_eq!(p[4].queues(), 1);
        assert_eq!(qsd_modes(&[Mode::PerQueue]), vec![Mode::Mq]);
        assert_eq!(qsd_modes(&[Mode::Mq, Mode::PerQueue]), vec![Mode::Mq]);

        let o =
            test_options("--mode per-queue --mqblk-opts poll=off --mqblk-opts= --jobs 1").unwrap();
        let p = o.points();
        assert_eq!(p.len(), 2);
        assert_eq!(o.label(&p[0]), "mqblk per-queue [poll=off]");
        assert_eq!(o.label(&p[1]), "mqblk per-queue [defaults]");
    }

    #[test]
    fn shell_words() {
        assert_eq!(shell_quote("--mqblk-opts"), "--mqblk-opts");
        assert_eq!(shell_quote("poll=off,merge=off"), "poll=off,merge=off");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn schedule_interleaves_and_alternates() {
        assert_eq!(
            schedule(3, 3),
            vec![
                (0, 0),
                (0, 1),
                (0, 2),
                (1, 2),
                (1, 1),
                (1, 0),
                (2, 0),
                (2, 1),
                (2, 2)
            ]
        );
        // Every point runs once per repeat.
        let s = schedule(5, 4);
        for p in 0..5 {
            let reps: Vec<usize> = s.iter().filter(|x| x.1 == p).map(|x| x.0).collect();
            assert_eq!(reps, vec![0, 1, 2, 3]);
        }
        assert!(schedule(0, 3).is_empty());
    }
}
