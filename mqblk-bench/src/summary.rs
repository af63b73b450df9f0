//! The metrics a point is summarised by, each defined once in the table below: its field in
//! [`Summary`] (and key under `summary` in results.json), what it is, how it is read from a
//! [`Sample`], and how the printed table and report.md show it. [`Stat`]: a metric's median and
//! min–max over a point's samples.

use std::fmt;

use serde::Serialize;

use crate::sample::{MqblkCounters, Sample};

/// How the tables show a metric.
#[derive(Debug, Clone, Copy)]
pub struct Show {
    /// Decimals shown.
    pub decimals: usize,
    /// Header and width of its column in the printed table; `None`: report.md only.
    pub table: Option<(&'static str, usize)>,
    /// Header of its column in report.md.
    pub report: &'static str,
    /// The headline (IOPS): the printed table shows its range, and where no sample of a point
    /// succeeded its cell says so.
    pub headline: bool,
}

impl Show {
    /// A column of both tables.
    const fn column(
        decimals: usize,
        table: &'static str,
        width: usize,
        report: &'static str,
    ) -> Show {
        Show {
            decimals,
            table: Some((table, width)),
            report,
            headline: false,
        }
    }

    /// This column as the headline's.
    const fn headline(self) -> Show {
        Show {
            headline: true,
            ..self
        }
    }

    /// A column of report.md only.
    const fn report_only(decimals: usize, report: &'static str) -> Show {
        Show {
            table: None,
            ..Show::column(decimals, "", 0, report)
        }
    }
}

/// One metric, as the tables use it: how it is shown, and its value in a [`Summary`].
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    /// How the tables show it.
    pub show: Show,
    /// Its median and min–max in a summary.
    pub of_summary: fn(&Summary) -> Option<Stat>,
}

/// Declares the metrics: generates [`Summary`] (a field per metric), [`Summary::of`] and
/// [`METRICS`] from one table, in the tables' column order.
macro_rules! metrics {
    ($($(#[doc = $doc:literal])* $key:ident: $of_sample:expr, $show:expr;)*) => {
        /// Median and min–max of a point's successful samples, a field per metric.
        #[derive(Debug, Clone, Default, Serialize)]
        pub struct Summary {
            /// Successful samples.
            pub samples: usize,
            /// Failed samples.
            pub failed: usize,
            $($(#[doc = $doc])* pub $key: Option<Stat>,)*
        }

        impl Summary {
            /// Summarises samples: each metric over those that succeeded and have it.
            pub fn of(samples: &[Sample]) -> Summary {
                let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
                Summary {
                    samples: ok.len(),
                    failed: samples.len() - ok.len(),
                    $($key: stat_of(&ok, $of_sample),)*
                }
            }
        }

        /// Every metric, in the tables' column order.
        pub const METRICS: &[Metric] = &[$(Metric {
            show: $show,
            of_summary: |s| s.$key,
        },)*];
    };
}

metrics! {
    /// Requests per second.
    iops: |s| Some(s.iops), Show::column(0, "IOPS", 26, "IOPS").headline();
    /// mqblk: mean requests in flight at the engine while the client ran.
    in_flight: |s| mqblk(s, |m| m.in_flight), Show::column(1, "in flight", 9, "in flight");
    /// 10^6 bytes per second.
    mb_per_s: |s| Some(s.mb_per_s), Show::column(1, "MB/s", 9, "MB/s");
    /// Median latency, µs.
    p50_us: |s| Some(s.p50_us), Show::column(0, "p50 us", 8, "p50 µs");
    /// 99th percentile latency, µs.
    p99_us: |s| Some(s.p99_us), Show::column(0, "p99 us", 8, "p99 µs");
    /// 99.9th percentile latency, µs.
    p999_us: |s| Some(s.p999_us), Show::column(0, "p99.9us", 8, "p99.9 µs");
    /// Backend CPU s per million I/Os.
    backend_cpu_s_per_mio: |s| s.backend_cpu_s_per_mio,
        Show::column(2, "cpu s/MIO", 9, "CPU s/M I/O");
    /// Backend + client CPU s per million I/Os.
    total_cpu_s_per_mio: |s| s.total_cpu_s_per_mio,
        Show::column(2, "tot s/MIO", 9, "total CPU s/M I/O");
    /// Peak RSS (VmHWM), MiB.
    peak_rss_mib: |s| mib(s.peak_rss_kib), Show::column(1, "RSS MiB", 7, "peak RSS MiB");
    /// Largest RssAnon, MiB.
    rss_anon_mib: |s| mib(s.rss_anon_kib), Show::report_only(1, "RssAnon MiB");
    /// mqblk: requests per io_uring submit.
    reqs_per_submit: |s| mqblk(s, |m| m.reqs_per_submit),
        Show::column(1, "req/sub", 7, "req/submit");
    /// mqblk: merges per I/O.
    merges_per_io: |s| mqblk(s, |m| m.merges_per_io), Show::report_only(3, "merges/I/O");
    /// mqblk: guest notifications per I/O.
    notifies_per_io: |s| mqblk(s, |m| m.notifies_per_io),
        Show::column(3, "notif/IO", 7, "notif/I/O");
    /// mqblk: io_uring_enter syscalls per I/O.
    enters_per_io: |s| mqblk(s, |m| m.enters_per_io), Show::column(3, "sys/IO", 7, "syscalls/I/O");
    /// Other processes' CPU, % of all CPUs.
    others_cpu_pct: |s| s.others_cpu_pct, Show::report_only(0, "others' CPU %");
    /// mqblk, qcow2: metadata-path requests per I/O.
    metadata_per_io: |s| mqblk(s, |m| m.metadata_per_io),
        Show::report_only(2, "metadata path/I/O");
    /// mqblk, qcow2: mean µs per write-back of the tables.
    write_back_us: |s| mqblk(s, |m| m.write_back_us), Show::report_only(0, "write-back µs");
    /// mqblk, qcow2: mean µs per sync of the image file.
    sync_us: |s| mqblk(s, |m| m.sync_us), Show::report_only(0, "sync µs");
}

/// The median and min–max of `of_sample` over `samples` (those that have it).
fn stat_of(samples: &[&Sample], of_sample: fn(&Sample) -> Option<f64>) -> Option<Stat> {
    Stat::of(
        &samples
            .iter()
            .filter_map(|s| of_sample(s))
            .collect::<Vec<_>>(),
    )
}

/// One of mqblk's ratios of a sample (none for other backends).
fn mqblk(s: &Sample, ratio: fn(&MqblkCounters) -> Option<f64>) -> Option<f64> {
    s.mqblk.as_ref().and_then(ratio)
}

fn mib(kib: Option<u64>) -> Option<f64> {
    kib.map(|k| k as f64 / 1024.0)
}

/// Median and range of some samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stat {
    /// Median (mean of the middle two for an even count).
    pub median: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Stat {
    /// `None` for no samples. NaNs are ignored.
    pub fn of(values: &[f64]) -> Option<Stat> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Stat {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }
}

impl fmt::Display for Stat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = f.precision().unwrap_or(0);
        let (med, lo, hi) = (
            format!("{:.p$}", self.median),
            format!("{:.p$}", self.min),
            format!("{:.p$}", self.max),
        );
        // The range only where it shows at this precision.
        if lo == hi {
            write!(f, "{med}")
        } else {
            write!(f, "{med} ({lo}–{hi})")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_skips_failed_samples() {
        let failed = Sample::failed(0, "boom".into());
        let s = Summary::of(&[
            Sample::test(100.0, 1.0),
            failed,
            Sample::test(300.0, 3.0),
            Sample::test(200.0, 2.0),
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
    fn stat_median_and_range() {
        assert_eq!(Stat::of(&[]), None);
        assert_eq!(
            Stat::of(&[3.0, 1.0, 2.0]),
            Some(Stat {
                median: 2.0,
                min: 1.0,
                max: 3.0
            })
        );
        assert_eq!(
            Stat::of(&[4.0, 1.0, 2.0, 10.0]),
            Some(Stat {
                median: 3.0,
                min: 1.0,
                max: 10.0
            })
        );
        assert_eq!(Stat::of(&[f64::NAN, 5.0]).unwrap().median, 5.0);
        assert_eq!(
            format!("{:.1}", Stat::of(&[1.0, 2.0, 4.0]).unwrap()),
            "2.0 (1.0–4.0)"
        );
        assert_eq!(format!("{:.0}", Stat::of(&[7.0]).unwrap()), "7");
        assert_eq!(format!("{:.1}", Stat::of(&[7.01, 7.02]).unwrap()), "7.0");
    }
}
