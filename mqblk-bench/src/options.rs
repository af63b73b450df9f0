//! `mqblk bench`'s command line ([`BenchArgs`]) and its validated settings
//! ([`BenchOptions`]): what each option means, how lists are parsed, what is refused.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Serialize;

use mqblk_client::Driver;

use crate::grid::{Backend, Mode, WorkloadSpec};
use crate::rbd;
use crate::spdk::{SpdkBuild, SPDK_DIR_ENV};

/// `mqblk bench` command-line arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Backends, comma-separated: mqblk, qsd (qemu-storage-daemon), spdk (SPDK's vhost target,
    /// see --spdk-dir; a null bdev for the null engine, an aio bdev on the image for the uring
    /// engine), native (fio with io_uring directly on --path; uring engine only).
    #[arg(long, default_value = "mqblk")]
    pub backend: String,
    /// mqblk thread mappings, comma-separated: baseline (1 queue, 1 thread), mq (one queue per
    /// job, 1 thread), per-queue (one queue and one thread per job). qsd runs baseline and/or mq
    /// (one AioContext serves all queues: per-queue maps to its mq).
    #[arg(long, default_value = "baseline,mq,per-queue")]
    pub mode: String,
    /// Storage engine: null (completes at once, reads give zeros unless --read-zeroes off;
    /// QSD: null-co), uring (io_uring on --path with O_DIRECT; QSD: file, aio=io_uring,
    /// cache.direct=on) or rbd (the Ceph RBD image --rbd, librbd's cache off; QSD: rbd,
    /// cache.direct=on; mqblk must be built with --features rbd) or nvme (mqblk's NVMe
    /// passthrough engine on the namespace's character device --path /dev/ngXnY; QSD and native
    /// fio on its block device /dev/nvmeXnY; the `--mqblk-opts` key `nvme-via=block` serves the
    /// block device with mqblk's uring engine instead, for the comparison; reads only).
    #[arg(long, default_value = "null")]
    pub engine: String,
    /// Null engine: whether reads fill the client's buffers with zeroes, on mqblk
    /// (`read-zeroes=`) and QSD (null-co's `read-zeroes=`) alike. SPDK's null bdev never does:
    /// `off` compares the three on the same work.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = ["on", "off"])]
    pub read_zeroes: String,
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
    /// With --engine uring: read the raw image once from end to end (O_DIRECT) before the
    /// first sample, so that the caches below it (a VM's disk is a file its host caches; a
    /// device has its own) hold the same in every repeat. On this project's VM a file the host
    /// has not cached read about 40x slower, and a run would measure which blocks each repeat
    /// happened to read (docs/PERFORMANCE.md 12h).
    #[arg(long)]
    pub read_first: bool,
    /// Image format for --engine uring, served by mqblk and qsd: raw (the raw image itself),
    /// qcow2 (OUT/disk.qcow2, converted from the raw image by qemu-img with every cluster
    /// allocated: the mapping of each request is what it adds), qcow2-overlay (an empty
    /// OUT/overlay.qcow2 over the raw image, made anew before every sample: backing reads,
    /// cluster allocation and copy-on-write), qcow2-empty (an empty OUT/empty.qcow2 without
    /// a backing file, made anew before every sample: a new VM disk, whose new clusters are
    /// zeros around each first write), qcow2-metadata (the same new disk created with
    /// `preallocation=metadata`, OUT/metadata.qcow2: every cluster mapped over a sparse file, so
    /// no write allocates a cluster) or qcow2-falloc (`preallocation=falloc`,
    /// OUT/falloc.qcow2: mapped, and the file's space reserved). A `--mqblk-opts` variant with `format=raw`
    /// serves the raw image instead, to compare the two in one run; with qcow2, --backend native
    /// runs fio on the raw image (the store's own rate). QSD gets an l2-cache-size
    /// that maps the whole image, as mqblk's mapping cache does. Needs qemu-img.
    #[arg(long, default_value = "raw")]
    pub format: String,
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
    /// 100 ms costs (docs/PERFORMANCE.md 1a); `sandbox=auto|strict|off` serves that variant
    /// with `--sandbox` set so (what confinement costs); `state-dir=DIR` with `--state-dir`
    /// (where the qcow2 journals are); `format=raw` (with --format qcow2 or qcow2-overlay)
    /// serves that variant the raw image instead of the qcow2 one.
    #[arg(long = "mqblk-opts", value_name = "KEYS")]
    pub mqblk_opts: Vec<String>,
    /// Clients, comma-separated: libblkio (its virtio-blk-vhost-user driver, as fio's libblkio
    /// engine uses it) and/or frontend (mqblk's own vhost-user frontend, which shares memory
    /// with SET_MEM_TABLE). Each is a series of its own for mqblk and qsd; spdk is always
    /// driven by the frontend (libblkio requires CONFIGURE_MEM_SLOTS, which SPDK lacks).
    #[arg(long, default_value = "libblkio")]
    pub client: String,
    /// Client: busy-poll completions (libblkio's poll queues; the frontend's polled used rings)
    /// instead of waiting on interrupts (eventfds).
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
    /// SPDK build for --backend spdk, as `scripts/spdk-build.sh SPDK_SRC DIR` makes it (DIR/bin/vhost,
    /// DIR/scripts/rpc.py). Default: $MQBLK_SPDK_DIR.
    #[arg(long, value_name = "DIR")]
    pub spdk_dir: Option<PathBuf>,
    /// The CPU SPDK's one reactor runs on (and busy-polls).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub spdk_cpu: usize,
    /// fio binary (for --backend native).
    #[arg(long, default_value = "fio", value_name = "BIN")]
    pub fio_bin: PathBuf,
    /// mqblk binary to serve with (default: this executable).
    #[arg(long, value_name = "BIN")]
    pub mqblk_bin: Option<PathBuf>,
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
    /// An NVMe namespace: mqblk's NVMe passthrough engine on its character device, QSD and
    /// native fio on its block device.
    Nvme,
}

impl EngineKind {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Null => "null",
            EngineKind::Uring => "uring",
            EngineKind::Rbd => "rbd",
            EngineKind::Nvme => "nvme",
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
            "nvme" => Ok(EngineKind::Nvme),
            _ => Err(format!(
                "unknown engine {s:?}: use null, uring, rbd or nvme"
            )),
        }
    }
}

/// What the uring engine's export serves (`--format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ImageFormat {
    /// The raw image.
    Raw,
    /// A fully allocated qcow2 image with the raw image's data.
    Qcow2,
    /// An empty qcow2 overlay over the raw image, made anew before every sample.
    Qcow2Overlay,
    /// An empty qcow2 image without a backing file, made anew before every sample.
    Qcow2Empty,
    /// A new qcow2 image without a backing file whose clusters are all mapped
    /// (`preallocation=metadata`), made anew before every sample.
    Qcow2Metadata,
    /// The same, with the file's space reserved too (`preallocation=falloc`).
    Qcow2Falloc,
}

impl ImageFormat {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Raw => "raw",
            ImageFormat::Qcow2 => "qcow2",
            ImageFormat::Qcow2Overlay => "qcow2-overlay",
            ImageFormat::Qcow2Empty => "qcow2-empty",
            ImageFormat::Qcow2Metadata => "qcow2-metadata",
            ImageFormat::Qcow2Falloc => "qcow2-falloc",
        }
    }

    /// Whether every sample starts from an image made anew (empty).
    pub fn made_per_sample(self) -> bool {
        matches!(
            self,
            ImageFormat::Qcow2Overlay
                | ImageFormat::Qcow2Empty
                | ImageFormat::Qcow2Metadata
                | ImageFormat::Qcow2Falloc
        )
    }
}

/// The values `--format` takes, for error messages.
pub const FORMATS: &str = "raw, qcow2, qcow2-overlay, qcow2-empty, qcow2-metadata or qcow2-falloc";

impl FromStr for ImageFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "raw" => Ok(ImageFormat::Raw),
            "qcow2" => Ok(ImageFormat::Qcow2),
            "qcow2-overlay" => Ok(ImageFormat::Qcow2Overlay),
            "qcow2-empty" => Ok(ImageFormat::Qcow2Empty),
            "qcow2-metadata" => Ok(ImageFormat::Qcow2Metadata),
            "qcow2-falloc" => Ok(ImageFormat::Qcow2Falloc),
            _ => Err(format!("unknown format {s:?}: use {FORMATS}")),
        }
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
    /// Read the raw image once before the first sample.
    pub read_first: bool,
    /// Image format (uring engine).
    pub format: ImageFormat,
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
    /// The clients (vhost-user frontends) that drive mqblk and qsd.
    #[serde(serialize_with = "ser_drivers")]
    pub clients: Vec<Driver>,
    /// Null engine reads zero the buffers (mqblk and QSD).
    pub read_zeroes: bool,
    /// Client poll queues.
    pub client_poll: bool,
    /// QSD export in an IOThread.
    pub qsd_iothread: bool,
    /// qemu-storage-daemon binary.
    pub qsd_bin: PathBuf,
    /// SPDK's build (with --backend spdk).
    pub spdk: Option<SpdkBuild>,
    /// The CPU SPDK's reactor runs on.
    pub spdk_cpu: usize,
    /// fio binary.
    pub fio_bin: PathBuf,
    /// mqblk binary.
    pub mqblk_bin: PathBuf,
}

fn ser_drivers<S: serde::Serializer>(d: &[Driver], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(d.iter().map(|d| d.name()))
}

/// `--client`'s list.
fn parse_clients(s: &str) -> Result<Vec<Driver>, String> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let d: Driver = item.parse().map_err(|e| format!("--client: {e}"))?;
        if !out.contains(&d) {
            out.push(d);
        }
    }
    if out.is_empty() {
        return Err("--client: the list is empty".into());
    }
    Ok(out)
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
        let clients = parse_clients(&a.client)?;
        let engine: EngineKind = a.engine.parse().map_err(|e| format!("--engine: {e}"))?;
        let format: ImageFormat = a.format.parse().map_err(|e| format!("--format: {e}"))?;
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
        let on_storage = matches!(engine, EngineKind::Uring | EngineKind::Nvme);
        if !on_storage && backends.contains(&Backend::Native) {
            return Err(
                "--backend native runs fio on a file or device: it needs --engine uring or nvme"
                    .into(),
            );
        }
        if !on_storage && a.path.is_some() {
            return Err("--path is for --engine uring and nvme".into());
        }
        if a.read_first && engine != EngineKind::Uring {
            return Err(format!(
                "--read-first reads the image of --engine uring, not --engine {}",
                engine.name()
            ));
        }
        if engine == EngineKind::Nvme && a.path.is_none() {
            return Err(
                "--engine nvme needs --path /dev/ngXnY (the namespace's character device)".into(),
            );
        }
        if format != ImageFormat::Raw {
            if engine != EngineKind::Uring {
                return Err(format!(
                    "--format {}: for --engine uring (an image file), not --engine {}; \
                     --format takes {FORMATS}",
                    format.name(),
                    engine.name()
                ));
            }
            // Native fio reads and writes the raw image, of which `qcow2` is an allocated copy
            // on the same store: the store's own rate, for that format alone.
            if let Some(b) = backends.iter().find(|b| match b {
                Backend::Spdk => true,
                Backend::Native => format != ImageFormat::Qcow2,
                _ => false,
            }) {
                return Err(format!(
                    "--format {}: served by --backend mqblk and qsd only, not {} (native fio \
                     runs beside --format qcow2, on the raw image it was converted from)",
                    format.name(),
                    b.name()
                ));
            }
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
        let spdk = if backends.contains(&Backend::Spdk) {
            if !matches!(engine, EngineKind::Null | EngineKind::Uring) {
                return Err(format!(
                    "--backend spdk serves a null bdev (--engine null) or an aio bdev on a file \
                     (--engine uring), not --engine {}",
                    engine.name()
                ));
            }
            if engine == EngineKind::Null && size % (1 << 20) != 0 {
                return Err(format!(
                    "--size {}: --backend spdk's null bdev takes a whole number of MiB",
                    a.size
                ));
            }
            let dir = a
                .spdk_dir
                .clone()
                .or_else(|| std::env::var_os(SPDK_DIR_ENV).map(PathBuf::from));
            // The machine's CPUs, not the bench's affinity: the client may be kept off the
            // reactor's CPU with taskset.
            // SAFETY: sysconf takes an integer and reads nothing of ours.
            let cpus = usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) })
                .unwrap_or(1)
                .max(1);
            if a.spdk_cpu >= cpus {
                return Err(format!(
                    "--spdk-cpu {}: this machine's CPUs are 0 to {}",
                    a.spdk_cpu,
                    cpus - 1
                ));
            }
            Some(SpdkBuild::find(dir.as_deref())?)
        } else if a.spdk_dir.is_some() {
            return Err("--spdk-dir without --backend spdk".into());
        } else if a.spdk_cpu != 0 {
            return Err("--spdk-cpu without --backend spdk".into());
        } else {
            None
        };
        if engine != EngineKind::Null && a.read_zeroes != "on" {
            return Err(format!(
                "--read-zeroes {}: for --engine null, not --engine {}",
                a.read_zeroes,
                engine.name()
            ));
        }
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
                if let Some(via) = kv.strip_prefix("nvme-via=") {
                    if engine != EngineKind::Nvme || !["passthrough", "block"].contains(&via) {
                        return Err(format!(
                            "--mqblk-opts {o}: nvme-via={via}: passthrough or block, with --engine nvme"
                        ));
                    }
                }
                if let Some(f) = kv.strip_prefix("format=") {
                    if f != "raw" {
                        return Err(format!(
                            "--mqblk-opts {o}: format={f}: the only value is raw (that variant \
                             serves the raw image instead of --format's qcow2 one)"
                        ));
                    }
                    if format == ImageFormat::Raw {
                        return Err(format!(
                            "--mqblk-opts {o}: format=raw is for a --format other than raw \
                             (this run serves the raw image anyway)"
                        ));
                    }
                }
                if let Some(mode) = kv.strip_prefix("sandbox=") {
                    if !["auto", "strict", "off"].contains(&mode) {
                        return Err(format!(
                            "--mqblk-opts {o}: sandbox={mode}: auto, strict or off"
                        ));
                    }
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
            read_first: a.read_first,
            format,
            rbd,
            size,
            workloads,
            jobs,
            iodepths,
            runtime: Duration::from_secs_f64(a.runtime),
            repeat: a.repeat,
            out: a.out.clone(),
            mqblk_opts,
            clients,
            read_zeroes: a.read_zeroes == "on",
            client_poll: a.client_poll,
            qsd_iothread: a.qsd_iothread,
            qsd_bin: a.qsd_bin.clone(),
            spdk,
            spdk_cpu: a.spdk_cpu,
            fio_bin: a.fio_bin.clone(),
            mqblk_bin,
        })
    }
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
        let e = test_options("--mqblk-opts sandbox=maybe").unwrap_err();
        assert!(e.contains("auto, strict or off"), "{e}");
        assert!(test_options("--mqblk-opts sandbox=off").is_ok());
        let o = test_options(
            "--mqblk-opts poll=off, --mqblk-opts= --engine uring --backend native,mqblk",
        )
        .unwrap();
        assert_eq!(o.mqblk_opts, vec!["poll=off".to_string(), String::new()]);
        assert_eq!(o.engine, EngineKind::Uring);
        let e = test_options("--read-first").unwrap_err();
        assert!(e.contains("--engine uring") && e.contains("null"), "{e}");
        assert!(
            test_options("--engine uring --read-first")
                .unwrap()
                .read_first
        );
        assert!(!test_options("--engine uring").unwrap().read_first);
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
    fn qcow2_formats_need_uring_and_mqblk_or_qsd() {
        let o = test_options("--engine uring").unwrap();
        assert_eq!(o.format, ImageFormat::Raw);
        let o = test_options(
            "--engine uring --format qcow2 --backend mqblk,qsd --mqblk-opts= --mqblk-opts format=raw",
        )
        .unwrap();
        assert_eq!(o.format, ImageFormat::Qcow2);
        assert_eq!(o.mqblk_opts, vec![String::new(), "format=raw".to_string()]);
        let o =
            test_options("--engine uring --format qcow2-overlay --mqblk-opts poll=off,format=raw")
                .unwrap();
        assert_eq!(o.format, ImageFormat::Qcow2Overlay);
        let o = test_options("--engine uring --format qcow2-empty").unwrap();
        assert_eq!(o.format, ImageFormat::Qcow2Empty);
        let o = test_options("--engine uring --format qcow2-metadata").unwrap();
        assert_eq!(o.format, ImageFormat::Qcow2Metadata);
        let o = test_options("--engine uring --format qcow2-falloc").unwrap();
        assert_eq!(o.format, ImageFormat::Qcow2Falloc);
        let e = test_options("--engine uring --format vmdk").unwrap_err();
        assert!(e.contains("--format") && e.contains(FORMATS), "{e}");
        let e = test_options("--format qcow2").unwrap_err();
        assert!(
            e.contains("--format qcow2")
                && e.contains("--engine uring")
                && e.contains("not --engine null"),
            "{e}"
        );
        let e = test_options("--engine uring --format qcow2-overlay --backend mqblk,native")
            .unwrap_err();
        assert!(
            e.contains("--format qcow2-overlay") && e.contains("mqblk and qsd only, not native"),
            "{e}"
        );
        let e = test_options("--engine uring --format qcow2 --backend spdk").unwrap_err();
        assert!(e.contains("not spdk"), "{e}");
        // The variant key serves the raw image; it means nothing with a raw run.
        let e = test_options("--engine uring --mqblk-opts format=raw").unwrap_err();
        assert!(
            e.contains("format=raw") && e.contains("--format other than raw"),
            "{e}"
        );
        let e =
            test_options("--engine uring --format qcow2 --mqblk-opts format=qcow2").unwrap_err();
        assert!(e.contains("format=qcow2: the only value is raw"), "{e}");
        assert!(test_options("--engine uring --format raw --backend native,qsd").is_ok());
        assert!(test_options("--engine uring --format qcow2 --backend mqblk,native").is_ok());
    }

    #[test]
    fn spdk_needs_its_build_and_an_engine_it_has() {
        let dir = crate::spdk::fake_build();
        let d = dir.path().display();
        let o = test_options(&format!("--backend mqblk,spdk --spdk-dir {d} --jobs 2")).unwrap();
        assert_eq!(o.spdk.as_ref().unwrap().vhost, dir.path().join("bin/vhost"));
        let labels: Vec<String> = o.points().iter().map(|p| o.label(p)).collect();
        assert!(labels.contains(&"spdk baseline".to_string()), "{labels:?}");
        assert!(labels.contains(&"spdk mq".to_string()), "{labels:?}");
        let e = test_options(&format!("--backend spdk --spdk-dir {d}/none")).unwrap_err();
        assert!(e.contains("scripts/spdk-build.sh"), "{e}");
        let e = test_options(&format!(
            "--backend spdk --spdk-dir {d} --engine rbd --rbd r/i"
        ))
        .unwrap_err();
        assert!(e.contains("not --engine rbd"), "{e}");
        let e = test_options(&format!("--backend spdk --spdk-dir {d} --size 1500K")).unwrap_err();
        assert!(e.contains("MiB"), "{e}");
        let e = test_options(&format!("--spdk-dir {d}")).unwrap_err();
        assert!(e.contains("without --backend spdk"), "{e}");
        let e = test_options("--spdk-cpu 1").unwrap_err();
        assert!(e.contains("--spdk-cpu without --backend spdk"), "{e}");
        let e =
            test_options(&format!("--backend spdk --spdk-dir {d} --spdk-cpu 4096")).unwrap_err();
        assert!(
            e.contains("--spdk-cpu 4096: this machine's CPUs are 0 to"),
            "{e}"
        );
        let o = test_options(&format!("--backend spdk --spdk-dir {d} --spdk-cpu 0")).unwrap();
        assert_eq!(o.spdk_cpu, 0);
    }
}
