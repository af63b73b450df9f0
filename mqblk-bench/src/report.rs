//! Results: per-sample numbers, per-point summaries (median and min–max), the printed table,
//! `results.json` and `report.md`.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use mqblk::io::IoCounters;

use super::{Backend, BenchOptions, PointConfig, Stat};

/// mqblk's own counters for one sample (from `mqblk serve --stats-file`, its exports
/// summed), and the ratios the report shows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MqblkCounters {
    /// I/O threads.
    pub threads: u64,
    /// The I/O threads' counters (the daemon's one definition of them).
    #[serde(flatten)]
    pub counters: IoCounters,
    /// submitted / submits.
    pub reqs_per_submit: Option<f64>,
    /// merges / requests.
    pub merges_per_io: Option<f64>,
    /// notifies / requests.
    pub notifies_per_io: Option<f64>,
    /// kicks / requests.
    pub kicks_per_io: Option<f64>,
    /// enters / requests: the I/O threads' io_uring_enter syscalls per I/O.
    pub enters_per_io: Option<f64>,
    /// Mean requests in flight at the engine while the client ran (all I/O threads): how
    /// full the backend kept the device, to compare with jobs × iodepth.
    pub in_flight: Option<f64>,
}

impl MqblkCounters {
    /// The counters of `threads` I/O threads, with the ratios.
    pub fn new(threads: u64, c: IoCounters) -> Self {
        let per = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
        MqblkCounters {
            threads,
            reqs_per_submit: per(c.submitted, c.submits),
            merges_per_io: per(c.merges, c.requests),
            notifies_per_io: per(c.notifies, c.requests),
            kicks_per_io: per(c.kicks, c.requests),
            enters_per_io: per(c.enters, c.requests),
            in_flight: None,
            counters: c,
        }
    }

    /// Sets `in_flight` from the counters, for a client that ran `elapsed_s`.
    pub fn with_elapsed(mut self, elapsed_s: f64) -> Self {
        self.in_flight =
            (elapsed_s > 0.0).then(|| self.counters.engine_in_flight_ns as f64 / (elapsed_s * 1e9));
        self
    }
}

/// One run of one point.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sample {
    /// Which repeat (0-based).
    pub repeat: usize,
    /// Why it failed, if it did (the numbers are then zero).
    pub error: Option<String>,
    /// Requests completed.
    pub ios: u64,
    /// Seconds the client ran.
    pub elapsed_s: f64,
    /// Requests per second.
    pub iops: f64,
    /// 10^6 bytes per second.
    pub mb_per_s: f64,
    /// Median latency, µs (issue to completion as the client sees it).
    pub p50_us: f64,
    /// 99th percentile latency, µs.
    pub p99_us: f64,
    /// 99.9th percentile latency, µs.
    pub p999_us: f64,
    /// Backend process CPU (user + system) during the run, s (from /proc/PID/stat).
    pub backend_cpu_s: Option<f64>,
    /// Client CPU during the run, s (this process; for native fio: fio's).
    pub client_cpu_s: Option<f64>,
    /// Backend CPU seconds per million I/Os.
    pub backend_cpu_s_per_mio: Option<f64>,
    /// Backend + client CPU seconds per million I/Os.
    pub total_cpu_s_per_mio: Option<f64>,
    /// CPU used by other processes on the machine during the run, % of all CPUs (from
    /// /proc/stat): a noise indicator.
    pub others_cpu_pct: Option<f64>,
    /// Backend's peak resident set (VmHWM), KiB.
    pub peak_rss_kib: Option<u64>,
    /// Backend's largest RssAnon seen during the run (sampled every 50 ms), KiB.
    pub rss_anon_kib: Option<u64>,
    /// mqblk's counters.
    pub mqblk: Option<MqblkCounters>,
}

/// Median and min–max of a point's successful samples.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Successful samples.
    pub samples: usize,
    /// Failed samples.
    pub failed: usize,
    /// IOPS.
    pub iops: Option<Stat>,
    /// MB/s.
    pub mb_per_s: Option<Stat>,
    /// p50 latency, µs.
    pub p50_us: Option<Stat>,
    /// p99 latency, µs.
    pub p99_us: Option<Stat>,
    /// p99.9 latency, µs.
    pub p999_us: Option<Stat>,
    /// Backend CPU s per million I/Os.
    pub backend_cpu_s_per_mio: Option<Stat>,
    /// Backend + client CPU s per million I/Os.
    pub total_cpu_s_per_mio: Option<Stat>,
    /// Other processes' CPU, % of all CPUs.
    pub others_cpu_pct: Option<Stat>,
    /// Peak RSS (VmHWM), MiB.
    pub peak_rss_mib: Option<Stat>,
    /// Largest RssAnon, MiB.
    pub rss_anon_mib: Option<Stat>,
    /// mqblk: requests per io_uring submit.
    pub reqs_per_submit: Option<Stat>,
    /// mqblk: merges per I/O.
    pub merges_per_io: Option<Stat>,
    /// mqblk: guest notifications per I/O.
    pub notifies_per_io: Option<Stat>,
    /// mqblk: io_uring_enter syscalls per I/O.
    pub enters_per_io: Option<Stat>,
    /// mqblk: mean requests in flight at the engine.
    pub in_flight: Option<Stat>,
}

impl Summary {
    /// Summarises samples.
    pub fn of(samples: &[Sample]) -> Summary {
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
        let st = |f: &dyn Fn(&Sample) -> Option<f64>| {
            Stat::of(&ok.iter().filter_map(|s| f(s)).collect::<Vec<_>>())
        };
        let mib = |k: Option<u64>| k.map(|k| k as f64 / 1024.0);
        Summary {
            samples: ok.len(),
            failed: samples.len() - ok.len(),
            iops: st(&|s| Some(s.iops)),
            mb_per_s: st(&|s| Some(s.mb_per_s)),
            p50_us: st(&|s| Some(s.p50_us)),
            p99_us: st(&|s| Some(s.p99_us)),
            p999_us: st(&|s| Some(s.p999_us)),
            backend_cpu_s_per_mio: st(&|s| s.backend_cpu_s_per_mio),
            total_cpu_s_per_mio: st(&|s| s.total_cpu_s_per_mio),
            others_cpu_pct: st(&|s| s.others_cpu_pct),
            peak_rss_mib: st(&|s| mib(s.peak_rss_kib)),
            rss_anon_mib: st(&|s| mib(s.rss_anon_kib)),
            reqs_per_submit: st(&|s| s.mqblk.as_ref().and_then(|m| m.reqs_per_submit)),
            merges_per_io: st(&|s| s.mqblk.as_ref().and_then(|m| m.merges_per_io)),
            notifies_per_io: st(&|s| s.mqblk.as_ref().and_then(|m| m.notifies_per_io)),
            enters_per_io: st(&|s| s.mqblk.as_ref().and_then(|m| m.enters_per_io)),
            in_flight: st(&|s| s.mqblk.as_ref().and_then(|m| m.in_flight)),
        }
    }
}

/// One point with its samples and summary.
#[derive(Debug, Clone, Serialize)]
pub struct PointResult {
    /// Series label, e.g. `mqblk per-queue`.
    pub label: String,
    /// The point.
    #[serde(flatten)]
    pub config: PointConfig,
    /// mqblk export keys added (empty: defaults).
    pub mqblk_opts: String,
    /// Workload name.
    pub workload_name: String,
    /// Virtqueues used.
    pub queues: usize,
    /// Every run, in run order.
    pub samples: Vec<Sample>,
    /// Median and min–max.
    pub summary: Summary,
}

/// A same-run comparison: one point against the references of its group (same workload,
/// iodepth and jobs).
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    /// Workload name.
    pub workload: String,
    /// Requests in flight per job.
    pub iodepth: usize,
    /// Jobs.
    pub jobs: usize,
    /// The point's label.
    pub label: String,
    /// The QSD point compared with (the one with the highest median IOPS in the group).
    pub qsd: Option<String>,
    /// Median IOPS / QSD's median IOPS.
    pub iops_vs_qsd: Option<f64>,
    /// Median backend CPU per I/O / QSD's.
    pub cpu_vs_qsd: Option<f64>,
    /// Median IOPS / native fio's median IOPS.
    pub iops_vs_native: Option<f64>,
    /// IOPS / native fio's IOPS within each repeat (the two ran next to each other in time,
    /// so slow drift of the machine cancels out): median and min–max over repeats.
    pub iops_vs_native_paired: Option<Stat>,
    /// With several `--mqblk-opts` variants: the first variant's point of the same mapping,
    /// which the next two fields compare against (an A/B of settings or of builds).
    pub first_variant: Option<String>,
    /// IOPS / the first variant's IOPS within each repeat: median and min–max over repeats.
    pub iops_vs_first_variant: Option<Stat>,
    /// Backend CPU per I/O / the first variant's, within each repeat.
    pub cpu_vs_first_variant: Option<Stat>,
}

/// Machine facts recorded with the results.
#[derive(Debug, Clone, Serialize)]
pub struct HostInfo {
    /// UTC date and time the run started.
    pub date: String,
    /// Online CPUs.
    pub nproc: usize,
    /// /proc/cpuinfo model name.
    pub cpu_model: String,
    /// Kernel release.
    pub kernel: String,
    /// /proc/loadavg at the start.
    pub loadavg: String,
    /// mqblk's version.
    pub mqblk_version: String,
}

impl HostInfo {
    /// Reads them now.
    pub fn collect() -> HostInfo {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu_model = read("/proc/cpuinfo")
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let loadavg = read("/proc/loadavg")
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        HostInfo {
            date: utc_now(),
            nproc: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            loadavg,
            mqblk_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format_utc(secs)
}

/// `YYYY-MM-DD HH:MM:SS UTC` for seconds since the epoch.
pub fn format_utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Everything a run produced.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResults {
    /// Format version of results.json.
    pub version: u32,
    /// The command line.
    pub command: String,
    /// The machine.
    pub host: HostInfo,
    /// The settings.
    pub options: BenchOptions,
    /// Disk size used, bytes.
    pub disk_size: u64,
    /// Every point.
    pub points: Vec<PointResult>,
    /// Same-run comparisons.
    pub ratios: Vec<Ratio>,
}

impl BenchResults {
    /// Assembles the results; `samples[i]` belong to `points[i]`.
    pub fn new(
        opts: &BenchOptions,
        command: &str,
        host: HostInfo,
        disk_size: u64,
        points: &[PointConfig],
        samples: Vec<Vec<Sample>>,
    ) -> BenchResults {
        let points: Vec<PointResult> = points
            .iter()
            .zip(samples)
            .map(|(p, s)| PointResult {
                label: opts.label(p),
                config: *p,
                mqblk_opts: if p.backend == Backend::Mqblk {
                    opts.mqblk_opts[p.variant].clone()
                } else {
                    String::new()
                },
                workload_name: opts.workloads[p.workload].name.clone(),
                queues: p.queues(),
                summary: Summary::of(&s),
                samples: s,
            })
            .collect();
        let ratios = ratios(&points);
        BenchResults {
            version: 1,
            command: command.to_string(),
            host,
            options: opts.clone(),
            disk_size,
            points,
            ratios,
        }
    }

    /// Groups of comparable points (same workload and iodepth), in order of first appearance.
    pub fn groups(&self) -> Vec<(String, usize, Vec<&PointResult>)> {
        let mut out: Vec<(String, usize, Vec<&PointResult>)> = Vec::new();
        for p in &self.points {
            let key = (p.workload_name.clone(), p.config.iodepth);
            match out.iter_mut().find(|g| (g.0.clone(), g.1) == key) {
                Some(g) => g.2.push(p),
                None => out.push((key.0, key.1, vec![p])),
            }
        }
        out
    }

    /// The plain-text table printed at the end of a run.
    pub fn table(&self) -> String {
        let mut s = String::new();
        for (w, qd, pts) in self.groups() {
            let _ = writeln!(
                s,
                "{w}, iodepth {qd} (median, min-max over {} runs)",
                self.options.repeat
            );
            let _ = writeln!(
                s,
                "  {:<34} {:>4} {:>26} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7}",
                "series",
                "jobs",
                "IOPS",
                "in flight",
                "MB/s",
                "p50 us",
                "p99 us",
                "p99.9us",
                "cpu s/MIO",
                "tot s/MIO",
                "RSS MiB",
                "req/sub",
                "notif/IO",
                "sys/IO"
            );
            for p in pts {
                let m = &p.summary;
                let med = |x: &Option<Stat>, prec: usize| {
                    x.map(|x| format!("{:.prec$}", x.median))
                        .unwrap_or_else(|| "-".into())
                };
                let iops = m
                    .iops
                    .map(|x| format!("{:.0} ({:.0}-{:.0})", x.median, x.min, x.max))
                    .unwrap_or_else(|| "FAILED".into());
                let _ = writeln!(
                    s,
                    "  {:<34} {:>4} {:>26} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7}",
                    p.label,
                    p.config.jobs,
                    iops,
                    med(&m.in_flight, 1),
                    med(&m.mb_per_s, 1),
                    med(&m.p50_us, 0),
                    med(&m.p99_us, 0),
                    med(&m.p999_us, 0),
                    med(&m.backend_cpu_s_per_mio, 2),
                    med(&m.total_cpu_s_per_mio, 2),
                    med(&m.peak_rss_mib, 1),
                    med(&m.reqs_per_submit, 1),
                    med(&m.notifies_per_io, 3),
                    med(&m.enters_per_io, 3),
                );
            }
        }
        if self
            .ratios
            .iter()
            .any(|r| r.iops_vs_qsd.is_some() || r.iops_vs_native.is_some())
        {
            let _ = writeln!(s, "ratios (medians, same run)");
            for r in &self.ratios {
                let f =
                    |x: Option<f64>| x.map(|x| format!("{x:.2}x")).unwrap_or_else(|| "-".into());
                let paired = r
                    .iops_vs_native_paired
                    .map(|p| format!(" (paired {:.2}x, {:.2}-{:.2})", p.median, p.min, p.max))
                    .unwrap_or_default();
                let _ = writeln!(
                    s,
                    "  {:<12} qd {:<3} jobs {:<2} {:<34} IOPS/qsd {:>6}  CPU per I/O/qsd {:>6}  IOPS/native {:>6}{paired}",
                    r.workload, r.iodepth, r.jobs, r.label,
                    f(r.iops_vs_qsd), f(r.cpu_vs_qsd), f(r.iops_vs_native)
                );
            }
        }
        let ab: Vec<&Ratio> = self
            .ratios
            .iter()
            .filter(|r| r.first_variant.is_some())
            .collect();
        if !ab.is_empty() {
            let _ = writeln!(
                s,
                "variants against the first --mqblk-opts (paired per repeat: median, min-max)"
            );
            for r in ab {
                let st = |x: Option<Stat>| {
                    x.map(|p| format!("{:.3}x ({:.3}-{:.3})", p.median, p.min, p.max))
                        .unwrap_or_else(|| "-".into())
                };
                let _ = writeln!(
                    s,
                    "  {:<12} qd {:<3} jobs {:<2} {:<34} IOPS {}  CPU per I/O {}",
                    r.workload,
                    r.iodepth,
                    r.jobs,
                    r.label,
                    st(r.iops_vs_first_variant),
                    st(r.cpu_vs_first_variant)
                );
            }
        }
        s
    }

    /// The markdown report.
    pub fn markdown(&self) -> String {
        let o = &self.options;
        let h = &self.host;
        let mut s = String::new();
        let _ = writeln!(s, "# mqblk bench report\n");
        let _ = writeln!(s, "- command: `{}`", self.command);
        let _ = writeln!(s, "- date: {}", h.date);
        let _ = writeln!(
            s,
            "- host: {} CPUs, {}, kernel {}, load average at start {}",
            h.nproc, h.cpu_model, h.kernel, h.loadavg
        );
        let _ = writeln!(
            s,
            "- engine: {}, disk {} MiB, {:.1} s per point, {} repeats interleaved (odd repeats in reverse order); client: built-in libblkio virtio-blk-vhost-user, {} queues",
            o.engine.name(),
            self.disk_size >> 20,
            o.runtime.as_secs_f64(),
            o.repeat,
            if o.client_poll { "poll" } else { "interrupt-driven" }
        );
        let _ = writeln!(
            s,
            "\nEach cell is the median with min–max in parentheses. Latency is issue-to-completion \
             as the client sees it. CPU is the backend process's user+system time (from \
             /proc/PID/stat) per million I/Os; *total* adds the client's (for native fio: fio's \
             own). RSS is the backend's VmHWM; RssAnon the largest sampled during the run. \
             *in flight* (the mean number of requests at the engine while the client ran, against \
             jobs × iodepth: how full the device was kept), req/submit (requests per \
             io_uring_enter that carried I/O), merges/I/O, notif/I/O and syscalls/I/O (the I/O \
             threads' io_uring_enter calls of any kind) are mqblk's own counters. *others' CPU* is the CPU \
             that other processes used meanwhile (from /proc/stat, in % of all CPUs): where it is \
             high, the point was disturbed.\n"
        );
        for (w, qd, pts) in self.groups() {
            let _ = writeln!(s, "## {w}, iodepth {qd}\n");
            let _ = writeln!(
                s,
                "| series | jobs | IOPS | in flight | MB/s | p50 µs | p99 µs | p99.9 µs | CPU s/M I/O | total CPU s/M I/O | peak RSS MiB | RssAnon MiB | req/submit | merges/I/O | notif/I/O | syscalls/I/O | others' CPU % |"
            );
            let _ = writeln!(
                s,
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for p in pts {
                let m = &p.summary;
                let c = |x: &Option<Stat>, prec: usize| {
                    x.map(|x| format!("{x:.prec$}"))
                        .unwrap_or_else(|| "–".into())
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    p.label,
                    p.config.jobs,
                    if m.samples == 0 {
                        "failed".to_string()
                    } else {
                        c(&m.iops, 0)
                    },
                    c(&m.in_flight, 1),
                    c(&m.mb_per_s, 1),
                    c(&m.p50_us, 0),
                    c(&m.p99_us, 0),
                    c(&m.p999_us, 0),
                    c(&m.backend_cpu_s_per_mio, 2),
                    c(&m.total_cpu_s_per_mio, 2),
                    c(&m.peak_rss_mib, 1),
                    c(&m.rss_anon_mib, 1),
                    c(&m.reqs_per_submit, 1),
                    c(&m.merges_per_io, 3),
                    c(&m.notifies_per_io, 3),
                    c(&m.enters_per_io, 3),
                    c(&m.others_cpu_pct, 0),
                );
            }
            let _ = writeln!(s);
        }
        let rel: Vec<&Ratio> = self
            .ratios
            .iter()
            .filter(|r| r.iops_vs_qsd.is_some() || r.iops_vs_native.is_some())
            .collect();
        if !rel.is_empty() {
            let _ = writeln!(s, "## Same-run ratios (medians)\n");
            let _ = writeln!(
                s,
                "QSD reference: the QSD mapping with the highest median IOPS at that point.\n"
            );
            let _ = writeln!(
                s,
                "*paired*: the IOPS ratio within each repeat (the two points ran next to each \
                 other), median and min–max over repeats.\n"
            );
            let _ = writeln!(s, "| workload | iodepth | jobs | series | IOPS / QSD | CPU per I/O / QSD | IOPS / native fio | paired IOPS / native fio |");
            let _ = writeln!(s, "|---|---:|---:|---|---:|---:|---:|---:|");
            for r in rel {
                let f =
                    |x: Option<f64>| x.map(|x| format!("{x:.2}x")).unwrap_or_else(|| "–".into());
                let paired = r
                    .iops_vs_native_paired
                    .map(|p| format!("{:.2}x ({:.2}–{:.2})", p.median, p.min, p.max))
                    .unwrap_or_else(|| "–".into());
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    r.workload,
                    r.iodepth,
                    r.jobs,
                    r.label,
                    f(r.iops_vs_qsd),
                    f(r.cpu_vs_qsd),
                    f(r.iops_vs_native),
                    paired
                );
            }
            let _ = writeln!(s);
        }
        let failed: Vec<(&PointResult, &Sample)> = self
            .points
            .iter()
            .flat_map(|p| {
                p.samples
                    .iter()
                    .filter(|s| s.error.is_some())
                    .map(move |s| (p, s))
            })
            .collect();
        if !failed.is_empty() {
            let _ = writeln!(s, "## Failed samples\n");
            for (p, f) in failed {
                let _ = writeln!(
                    s,
                    "- {}, {}, jobs {}, repeat {}: {}",
                    p.label,
                    p.workload_name,
                    p.config.jobs,
                    f.repeat + 1,
                    f.error.as_deref().unwrap_or("")
                );
            }
            let _ = writeln!(s);
        }
        let ab: Vec<&Ratio> = self
            .ratios
            .iter()
            .filter(|r| r.first_variant.is_some())
            .collect();
        if !ab.is_empty() {
            let _ = writeln!(s, "## Variants against the first `--mqblk-opts`\n");
            let _ = writeln!(
                s,
                "Each repeat's ratio to the first variant's point of the same mapping (they ran \
                 next to each other), median and min–max over repeats: the min–max is the run's \
                 own noise.\n"
            );
            let _ = writeln!(
                s,
                "| workload | iodepth | jobs | series | against | IOPS | backend CPU per I/O |"
            );
            let _ = writeln!(s, "|---|---:|---:|---|---|---:|---:|");
            for r in ab {
                let st = |x: Option<Stat>| {
                    x.map(|p| format!("{:.3}x ({:.3}–{:.3})", p.median, p.min, p.max))
                        .unwrap_or_else(|| "–".into())
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    r.workload,
                    r.iodepth,
                    r.jobs,
                    r.label,
                    r.first_variant.as_deref().unwrap_or(""),
                    st(r.iops_vs_first_variant),
                    st(r.cpu_vs_first_variant)
                );
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(
            s,
            "## Plot\n\n![IOPS against jobs](iops.png)\n\n`iops.png`: one panel per workload and \
             iodepth; x axis: jobs; y axis: IOPS (median, from 0); one line per series, with \
             min–max bars; the legend in each panel names the series."
        );
        s
    }

    /// Writes results.json and report.md into `dir`.
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_string_pretty(self).context("serialising the results")?;
        let p = dir.join("results.json");
        std::fs::write(&p, json + "\n").with_context(|| format!("writing {}", p.display()))?;
        let p = dir.join("report.md");
        std::fs::write(&p, self.markdown()).with_context(|| format!("writing {}", p.display()))?;
        Ok(())
    }
}

/// For each point, its IOPS and CPU against the best QSD point and against native fio of its
/// group (same workload, iodepth and jobs). Reference points themselves are left out.
/// Per-repeat ratios of `a`'s IOPS to `b`'s, over the repeats where both succeeded.
fn paired(a: &[Sample], b: &[Sample]) -> Option<Stat> {
    paired_by(a, b, |s| Some(s.iops))
}

/// Per-repeat ratios of `metric` of `a` to that of `b`, over the repeats where both succeeded
/// and have it.
fn paired_by(a: &[Sample], b: &[Sample], metric: impl Fn(&Sample) -> Option<f64>) -> Option<Stat> {
    let ok = |s: &&Sample| s.error.is_none() && s.iops > 0.0;
    let v: Vec<f64> = a
        .iter()
        .filter(ok)
        .filter_map(|x| {
            let y = b.iter().filter(ok).find(|y| y.repeat == x.repeat)?;
            let (mx, my) = (metric(x)?, metric(y)?);
            (my > 0.0).then(|| mx / my)
        })
        .collect();
    Stat::of(&v)
}

fn ratios(points: &[PointResult]) -> Vec<Ratio> {
    let med = |x: &Option<Stat>| x.map(|s| s.median);
    let mut out = Vec::new();
    for p in points {
        if p.config.backend != Backend::Mqblk {
            continue;
        }
        let same = |q: &&PointResult| {
            q.config.workload == p.config.workload
                && q.config.iodepth == p.config.iodepth
                && q.config.jobs == p.config.jobs
        };
        let qsd = points
            .iter()
            .filter(same)
            .filter(|q| q.config.backend == Backend::Qsd && q.summary.iops.is_some())
            .max_by(|a, b| {
                med(&a.summary.iops)
                    .partial_cmp(&med(&b.summary.iops))
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
        let native = points
            .iter()
            .filter(same)
            .find(|q| q.config.backend == Backend::Native);
        let first_variant = points.iter().filter(same).find(|q| {
            q.config.backend == Backend::Mqblk
                && q.config.mode == p.config.mode
                && q.config.variant == 0
                && p.config.variant > 0
        });
        let div = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        out.push(Ratio {
            workload: p.workload_name.clone(),
            iodepth: p.config.iodepth,
            jobs: p.config.jobs,
            label: p.label.clone(),
            qsd: qsd.map(|q| q.label.clone()),
            iops_vs_qsd: qsd.and_then(|q| div(med(&p.summary.iops), med(&q.summary.iops))),
            cpu_vs_qsd: qsd.and_then(|q| {
                div(
                    med(&p.summary.backend_cpu_s_per_mio),
                    med(&q.summary.backend_cpu_s_per_mio),
                )
            }),
            iops_vs_native: native.and_then(|q| div(med(&p.summary.iops), med(&q.summary.iops))),
            iops_vs_native_paired: native.and_then(|q| paired(&p.samples, &q.samples)),
            first_variant: first_variant.map(|q| q.label.clone()),
            iops_vs_first_variant: first_variant.and_then(|q| paired(&p.samples, &q.samples)),
            cpu_vs_first_variant: first_variant
                .and_then(|q| paired_by(&p.samples, &q.samples, |s| s.backend_cpu_s_per_mio)),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(iops: f64, cpu: f64) -> Sample {
        Sample {
            ios: 1000,
            iops,
            mb_per_s: iops * 4096.0 / 1e6,
            backend_cpu_s_per_mio: Some(cpu),
            ..Sample::default()
        }
    }

    #[test]
    fn paired_ratios_match_repeats_and_skip_failures() {
        let at = |repeat: usize, iops: f64| Sample {
            repeat,
            ..sample(iops, 1.0)
        };
        let mut failed = at(2, 0.0);
        failed.error = Some("x".into());
        let a = [at(0, 100.0), at(1, 200.0), failed];
        let b = [at(1, 100.0), at(0, 200.0), at(2, 50.0)];
        let p = paired(&a, &b).unwrap();
        assert_eq!((p.median, p.min, p.max), (1.25, 0.5, 2.0));
        assert!(paired(&a[2..], &b).is_none());
    }

    #[test]
    fn variants_compare_with_the_first_per_repeat() {
        use crate::{BenchArgs, BenchOptions};
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: BenchArgs,
        }
        let a = Cli::try_parse_from([
            "b",
            "--mode",
            "per-queue",
            "--jobs",
            "1",
            "--mqblk-opts",
            "",
            "--mqblk-opts",
            "poll=off",
        ])
        .unwrap()
        .a;
        let o = BenchOptions::from_args(&a).unwrap();
        let pts = o.points();
        assert_eq!(pts.len(), 2);
        let at = |repeat: usize, iops: f64, cpu: f64| Sample {
            repeat,
            ..sample(iops, cpu)
        };
        let samples = vec![
            vec![at(0, 100.0, 2.0), at(1, 200.0, 2.0)],
            vec![at(0, 110.0, 1.0), at(1, 180.0, 3.0)],
        ];
        let r = BenchResults::new(&o, "b", HostInfo::collect(), 1 << 30, &pts, samples);
        assert!(
            r.ratios[0].first_variant.is_none(),
            "the first variant is the reference"
        );
        let v = &r.ratios[1];
        assert_eq!(v.first_variant.as_deref(), Some(r.points[0].label.as_str()));
        let iops = v.iops_vs_first_variant.unwrap();
        assert_eq!((iops.min, iops.max), (0.9, 1.1));
        let cpu = v.cpu_vs_first_variant.unwrap();
        assert_eq!((cpu.min, cpu.max), (0.5, 1.5));
        assert!(r.markdown().contains("Variants against the first"));
        assert!(r.table().contains("variants against the first"));
    }

    #[test]
    fn utc_dates() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_utc(951_782_400 + 3661), "2000-02-29 01:01:01 UTC");
        assert_eq!(format_utc(1_767_225_599), "2025-12-31 23:59:59 UTC");
    }

    #[test]
    fn summary_skips_failed_samples() {
        let failed = Sample {
            error: Some("boom".into()),
            ..Sample::default()
        };
        let s = Summary::of(&[
            sample(100.0, 1.0),
            failed,
            sample(300.0, 3.0),
            sample(200.0, 2.0),
        ]);
        assert_eq!((s.samples, s.failed), (3, 1));
        assert_eq!(
            s.iops,
            Some(Stat {
                median: 200.0,
                min: 100.0,
                max: 300.0
            })
        );
        assert_eq!(s.backend_cpu_s_per_mio.unwrap().median, 2.0);
        assert_eq!(s.peak_rss_mib, None);
        let none = Summary::of(&[]);
        assert_eq!((none.samples, none.iops), (0, None));
    }

    #[test]
    fn ratios_against_best_qsd_and_native() {
        use crate::{BenchArgs, BenchOptions};
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: BenchArgs,
        }
        let a = Cli::try_parse_from([
            "b",
            "--backend",
            "mqblk,qsd,native",
            "--engine",
            "uring",
            "--mode",
            "baseline,per-queue",
            "--jobs",
            "2",
        ])
        .unwrap()
        .a;
        let o = BenchOptions::from_args(&a).unwrap();
        let pts = o.points();
        // mqblk baseline, mqblk per-queue, qsd baseline, qsd mq, native.
        assert_eq!(pts.len(), 5);
        let samples = vec![
            vec![sample(100.0, 4.0)],
            vec![sample(300.0, 2.0)],
            vec![sample(150.0, 8.0)],
            vec![sample(200.0, 5.0)],
            vec![sample(400.0, 0.0)],
        ];
        let host = HostInfo::collect();
        let r = BenchResults::new(&o, "mqblk bench", host, 1 << 30, &pts, samples);
        assert_eq!(r.ratios.len(), 2);
        let pq = &r.ratios[1];
        assert_eq!(pq.label, "mqblk per-queue");
        assert_eq!(pq.qsd.as_deref(), Some("qsd mq"));
        assert_eq!(pq.iops_vs_qsd, Some(1.5));
        assert_eq!(pq.cpu_vs_qsd, Some(0.4));
        assert_eq!(pq.iops_vs_native, Some(0.75));
        let paired = pq.iops_vs_native_paired.unwrap();
        assert_eq!((paired.median, paired.min, paired.max), (0.75, 0.75, 0.75));
        let md = r.markdown();
        assert!(md.contains("| mqblk per-queue | 2 | 300 |"), "{md}");
        assert!(md.contains("1.50x"), "{md}");
        let t = r.table();
        assert!(t.contains("qsd mq") && t.contains("native fio"), "{t}");
        // results.json round-trips through serde_json.
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(v["points"][1]["backend"], "mqblk");
        assert_eq!(v["points"][1]["mode"], "per-queue");
        assert_eq!(v["points"][1]["samples"][0]["ios"], 1000);
    }
}
