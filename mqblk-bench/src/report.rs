//! A run's results ([`BenchResults`]: every point with its samples and summary, the same-run
//! ratios, the machine), written as `results.json` here, as the printed table by `table.rs` and
//! as `report.md` by `markdown.rs`; and how both tables write a cell.

use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use crate::host::HostInfo;
use crate::ratio::{ratios, Ratio};
use crate::sample::Sample;
use crate::summary::{Metric, Stat, Summary};
use crate::{Backend, BenchOptions, ImageFormat, PointConfig};

/// One point with its samples and summary.
#[derive(Debug, Clone, Serialize)]
pub struct PointResult {
    /// Series label, e.g. `mqblk per-queue`.
    pub label: String,
    /// The point.
    #[serde(flatten)]
    pub config: PointConfig,
    /// The image format served: `--format`'s, or raw (native fio, a mqblk variant with
    /// `format=raw`).
    pub format: ImageFormat,
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
                format: opts.served_format(p),
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

    /// The comparisons of points with a QSD point or native fio.
    pub fn reference_ratios(&self) -> Vec<&Ratio> {
        self.ratios.iter().filter(|r| r.has_references()).collect()
    }

    /// The comparisons of `--mqblk-opts` variants with the first.
    pub fn variant_ratios(&self) -> Vec<&Ratio> {
        self.ratios
            .iter()
            .filter(|r| r.first_variant.is_some())
            .collect()
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

/// How one of the outputs writes what it has no value for, and a range.
pub(crate) struct Style {
    /// In place of a missing value.
    pub(crate) none: &'static str,
    /// Between a range's ends.
    pub(crate) dash: &'static str,
}

/// The printed table's style: ASCII.
pub(crate) const TEXT: Style = Style {
    none: "-",
    dash: "-",
};

/// report.md's style.
pub(crate) const MARKDOWN: Style = Style {
    none: "–",
    dash: "–",
};

impl Style {
    /// A ratio, `1.50x`.
    pub(crate) fn times(&self, x: Option<f64>) -> String {
        x.map_or_else(|| self.none.into(), |x| format!("{x:.2}x"))
    }

    /// A ratio's median and range, `1.500x (1.250-2.000)`.
    pub(crate) fn times_range(&self, x: Option<Stat>, decimals: usize) -> String {
        let (d, dash) = (decimals, self.dash);
        x.map_or_else(
            || self.none.into(),
            |x| format!("{:.d$}x ({:.d$}{dash}{:.d$})", x.median, x.min, x.max),
        )
    }

    /// A metric's median in `summary`, with `decimals`.
    pub(crate) fn median(&self, m: &Metric, summary: &Summary) -> String {
        let d = m.show.decimals;
        (m.of_summary)(summary).map_or_else(|| self.none.into(), |x| format!("{:.d$}", x.median))
    }
}

#[cfg(test)]
impl BenchResults {
    /// The results of `mqblk bench ARGS` (as for [`crate::test_options`]) whose points, in
    /// order, measured `samples`.
    pub(crate) fn test(args: &str, samples: Vec<Vec<Sample>>) -> BenchResults {
        let o = crate::test_options(args).unwrap();
        let points = o.points();
        assert_eq!(points.len(), samples.len(), "samples for each point");
        BenchResults::new(
            &o,
            "mqblk bench",
            HostInfo::collect(),
            1 << 30,
            &points,
            samples,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The column layout of both tables is the format readers and scripts know: the metric
    /// table must keep generating exactly these headers, and a failed point says so.
    #[test]
    fn tables_keep_their_columns_and_mark_failed_points() {
        let failed = Sample::failed(0, "boom".into());
        let samples = vec![vec![Sample::test(1000.0, 2.0)], vec![failed]];
        let r = BenchResults::test("--backend mqblk,qsd --mode per-queue --jobs 1", samples);

        let t = r.table();
        let header = "  series                             jobs                       IOPS \
                      in flight      MB/s   p50 us   p99 us  p99.9us cpu s/MIO tot s/MIO \
                      RSS MiB req/sub notif/IO  sys/IO\n";
        assert!(t.contains(header), "{t}");
        let row = "  mqblk per-queue                       1           1000 (1000-1000)         \
                   -       4.1        0        0        0      2.00         -       -       \
                   -       -       -\n";
        assert!(t.contains(row), "{t}");
        assert!(
            t.contains("  qsd mq                                1                     FAILED"),
            "{t}"
        );

        let md = r.markdown();
        let header = "| series | jobs | IOPS | in flight | MB/s | p50 µs | p99 µs | p99.9 µs | \
                      CPU s/M I/O | total CPU s/M I/O | peak RSS MiB | RssAnon MiB | req/submit \
                      | merges/I/O | notif/I/O | syscalls/I/O | others' CPU % | metadata path/I/O \
                      | write-back µs | sync µs |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\
                      ---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        assert!(md.contains(header), "{md}");
        assert!(
            md.contains("| mqblk per-queue | 1 | 1000 | – | 4.1 | 0 | 0 | 0 | 2.00 | – |"),
            "{md}"
        );
        assert!(md.contains("| qsd mq | 1 | failed | – |"), "{md}");
        assert!(
            md.contains("- qsd mq, randread-4k, jobs 1, repeat 1: boom"),
            "{md}"
        );
    }
}
