//! The grid a run measures: its axes ([`Backend`], [`Mode`], [`WorkloadSpec`], jobs,
//! iodepth), its points ([`PointConfig`], [`BenchOptions::points`]) and their labels, and the
//! order they run in ([`schedule`]).

use std::str::FromStr;

use serde::Serialize;

use mqblk_client::{Driver, Pattern};

use crate::options::{BenchOptions, ImageFormat};

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
    /// SPDK's vhost target (`scripts/spdk-build.sh`), one polling reactor.
    Spdk,
}

impl Backend {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Mqblk => "mqblk",
            Backend::Qsd => "qsd",
            Backend::Native => "native",
            Backend::Spdk => "spdk",
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
            "spdk" => Ok(Backend::Spdk),
            _ => Err(format!(
                "unknown backend {s:?}: use mqblk, qsd, spdk or native"
            )),
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

fn ser_driver<S: serde::Serializer>(d: &Driver, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
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

impl BenchOptions {
    /// Every point of the grid, in the order of the first repeat: comparable points (same
    /// workload, iodepth and jobs) next to each other in time.
    pub fn points(&self) -> Vec<PointConfig> {
        let mut out = Vec::new();
        for (wi, _) in self.workloads.iter().enumerate() {
            for &iodepth in &self.iodepths {
                for &jobs in &self.jobs {
                    for (backend, client) in self.backend_clients() {
                        let mut push = |mode: Option<Mode>, variant: usize| {
                            out.push(PointConfig {
                                backend,
                                client,
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
                            Backend::Qsd | Backend::Spdk => {
                                for m in single_thread_modes(&self.modes) {
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

    /// Each backend with each client that drives it, in the order given: SPDK's target only
    /// with mqblk's frontend (libblkio refuses it), native fio with none of them (the client
    /// recorded is a placeholder), the others with every `--client`.
    fn backend_clients(&self) -> Vec<(Backend, Driver)> {
        let mut out = Vec::new();
        for &backend in &self.backends {
            match backend {
                Backend::Spdk => out.push((backend, Driver::Frontend)),
                Backend::Native => out.push((backend, Driver::Libblkio)),
                _ => out.extend(self.clients.iter().map(|&c| (backend, c))),
            }
        }
        out
    }

    /// The image format a point serves: `--format`'s, but raw for native fio and for a mqblk
    /// variant with `format=raw`.
    pub fn served_format(&self, p: &PointConfig) -> ImageFormat {
        let raw_variant = || {
            self.mqblk_opts[p.variant]
                .split(',')
                .any(|kv| kv == "format=raw")
        };
        match p.backend {
            Backend::Native => ImageFormat::Raw,
            Backend::Mqblk if raw_variant() => ImageFormat::Raw,
            _ => self.format,
        }
    }

    /// The series label of a point: backend, mapping, the image format it serves (with a
    /// `--format` other than raw), (if several or any) mqblk options, and the client where it
    /// is not the only one.
    pub fn label(&self, p: &PointConfig) -> String {
        let mut s = p.backend.name().to_string();
        if let Some(m) = p.mode {
            s.push(' ');
            s.push_str(m.name());
        }
        let format = self.served_format(p);
        if self.format != ImageFormat::Raw && p.backend != Backend::Native {
            s.push(' ');
            s.push_str(format.name());
        }
        if p.backend == Backend::Mqblk {
            // The format is in the label already; `[defaults]` where other variants serve
            // the same format.
            let keys = |o: &str| -> String {
                o.split(',')
                    .filter(|kv| !kv.is_empty() && !kv.starts_with("format="))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let o = keys(&self.mqblk_opts[p.variant]);
            let same_format = (0..self.mqblk_opts.len())
                .filter(|&v| self.served_format(&PointConfig { variant: v, ..*p }) == format)
                .count();
            if !o.is_empty() {
                s.push_str(&format!(" [{o}]"));
            } else if same_format > 1 {
                s.push_str(" [defaults]");
            }
        }
        if p.backend == Backend::Qsd && self.qsd_iothread {
            s.push_str(" [iothread]");
        }
        if self.clients.len() > 1 && matches!(p.backend, Backend::Mqblk | Backend::Qsd) {
            s.push_str(&format!(" via {}", p.client.name()));
        }
        if p.backend == Backend::Native {
            s = "native fio".into();
        }
        s
    }
}

/// The mappings a backend with one serving thread (QSD's AioContext, SPDK's single reactor)
/// can express from those asked for: baseline (1 queue) and mq (one queue per job, all served
/// by that thread). per-queue has no equivalent there: it maps to mq.
pub fn single_thread_modes(modes: &[Mode]) -> Vec<Mode> {
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
    /// The vhost-user frontend that drives it (unused for native fio).
    #[serde(serialize_with = "ser_driver")]
    pub client: Driver,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_options;

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
        assert_eq!(single_thread_modes(&[Mode::PerQueue]), vec![Mode::Mq]);
        assert_eq!(
            single_thread_modes(&[Mode::Mq, Mode::PerQueue]),
            vec![Mode::Mq]
        );

        let o =
            test_options("--mode per-queue --mqblk-opts poll=off --mqblk-opts= --jobs 1").unwrap();
        let p = o.points();
        assert_eq!(p.len(), 2);
        assert_eq!(o.label(&p[0]), "mqblk per-queue [poll=off]");
        assert_eq!(o.label(&p[1]), "mqblk per-queue [defaults]");
    }

    #[test]
    fn labels_name_the_served_format() {
        let o = test_options(
            "--engine uring --format qcow2 --backend mqblk,qsd --mode per-queue --jobs 1 \
             --mqblk-opts= --mqblk-opts format=raw --mqblk-opts poll=off --mqblk-opts poll=off,format=raw",
        )
        .unwrap();
        let p = o.points();
        let labels: Vec<String> = p.iter().map(|x| o.label(x)).collect();
        assert_eq!(
            labels,
            [
                "mqblk per-queue qcow2 [defaults]",
                "mqblk per-queue raw [defaults]",
                "mqblk per-queue qcow2 [poll=off]",
                "mqblk per-queue raw [poll=off]",
                "qsd mq qcow2"
            ]
        );
        let formats: Vec<ImageFormat> = p.iter().map(|x| o.served_format(x)).collect();
        use ImageFormat::{Qcow2, Raw};
        assert_eq!(formats, [Qcow2, Raw, Qcow2, Raw, Qcow2]);
        let o = test_options(
            "--engine uring --format qcow2-overlay --mode mq --jobs 1 --mqblk-opts format=raw \
             --mqblk-opts=",
        )
        .unwrap();
        let labels: Vec<String> = o.points().iter().map(|x| o.label(x)).collect();
        assert_eq!(labels, ["mqblk mq raw", "mqblk mq qcow2-overlay"]);
        // A raw run's labels stay as they were.
        let o = test_options("--engine uring --backend mqblk,native --mode mq --jobs 1").unwrap();
        let labels: Vec<String> = o.points().iter().map(|x| o.label(x)).collect();
        assert_eq!(labels, ["mqblk mq", "native fio"]);
    }

    #[test]
    fn each_client_is_a_series_and_spdk_gets_the_frontend() {
        let dir = crate::spdk::fake_build();
        let o = test_options(&format!(
            "--backend mqblk,qsd,spdk --spdk-dir {} --client libblkio,frontend --mode mq --jobs 1",
            dir.path().display()
        ))
        .unwrap();
        let p = o.points();
        let labels: Vec<String> = p.iter().map(|x| o.label(x)).collect();
        assert_eq!(
            labels,
            [
                "mqblk mq via libblkio",
                "mqblk mq via frontend",
                "qsd mq via libblkio",
                "qsd mq via frontend",
                "spdk mq"
            ]
        );
        assert_eq!(p[4].client, Driver::Frontend);
        let o = test_options("--backend qsd").unwrap();
        assert_eq!(o.label(&o.points()[0]), "qsd baseline");
        assert_eq!(o.points()[0].client, Driver::Libblkio);
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
