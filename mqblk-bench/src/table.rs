//! The plain-text table printed at the end of a run: a row per point with the metrics that
//! have a column in it (`summary.rs`'s table), then the same-run ratios.

use std::fmt::Write as _;

use crate::ratio::Ratio;
use crate::report::{BenchResults, TEXT};
use crate::summary::{Metric, Stat, Summary, METRICS};

impl BenchResults {
    /// The plain-text table printed at the end of a run.
    pub fn table(&self) -> String {
        let mut s = String::new();
        for (w, qd, pts) in self.groups() {
            let _ = writeln!(
                s,
                "{w}, iodepth {qd} (median, min-max over {} runs)",
                self.options.repeat
            );
            let mut header = format!("  {:<34} {:>4}", "series", "jobs");
            for (_, (name, width)) in columns() {
                let _ = write!(header, " {name:>width$}");
            }
            let _ = writeln!(s, "{header}");
            for p in pts {
                let mut row = format!("  {:<34} {:>4}", p.label, p.config.jobs);
                for (m, (_, width)) in columns() {
                    let _ = write!(row, " {:>width$}", cell(m, &p.summary));
                }
                let _ = writeln!(s, "{row}");
            }
        }
        if !self.reference_ratios().is_empty() {
            let _ = writeln!(s, "ratios (medians, same run)");
            for r in &self.ratios {
                let paired = paired_text("paired", r.iops_vs_native_paired);
                let spdk = paired_text("IOPS/spdk paired", r.iops_vs_spdk_paired);
                let spdk_cpu = paired_text("CPU per I/O/spdk paired", r.cpu_vs_spdk_paired);
                let _ = writeln!(
                    s,
                    "{} IOPS/qsd {:>6}  CPU per I/O/qsd {:>6}{spdk}{spdk_cpu}  IOPS/native {:>6}{paired}",
                    ratio_key(r),
                    TEXT.times(r.iops_vs_qsd),
                    TEXT.times(r.cpu_vs_qsd),
                    TEXT.times(r.iops_vs_native)
                );
            }
        }
        let variants = self.variant_ratios();
        if !variants.is_empty() {
            let _ = writeln!(
                s,
                "variants against the first --mqblk-opts (paired per repeat: median, min-max)"
            );
            for r in variants {
                let _ = writeln!(
                    s,
                    "{} IOPS {}  CPU per I/O {}",
                    ratio_key(r),
                    TEXT.times_range(r.iops_vs_first_variant, 3),
                    TEXT.times_range(r.cpu_vs_first_variant, 3)
                );
            }
        }
        s
    }
}

/// `  LABEL 1.15x (0.80-1.50)` for a ratio taken per repeat, or nothing where there is none.
fn paired_text(label: &str, x: Option<Stat>) -> String {
    x.map(|x| format!("  {label} {}", TEXT.times_range(Some(x), 2)))
        .unwrap_or_default()
}

/// The metrics with a column in the printed table, with its header and width.
fn columns() -> impl Iterator<Item = (&'static Metric, (&'static str, usize))> {
    METRICS.iter().filter_map(|m| Some((m, m.show.table?)))
}

/// A metric's cell: the median; the headline's with its min-max, or FAILED where no sample
/// succeeded.
fn cell(m: &Metric, summary: &Summary) -> String {
    let d = m.show.decimals;
    match ((m.of_summary)(summary), m.show.headline) {
        (Some(x), true) => format!("{:.d$} ({:.d$}-{:.d$})", x.median, x.min, x.max),
        (None, true) => "FAILED".into(),
        (_, false) => TEXT.median(m, summary),
    }
}

/// The start of a ratio's line: the point's group and series.
fn ratio_key(r: &Ratio) -> String {
    format!(
        "  {:<12} qd {:<3} jobs {:<2} {:<34}",
        r.workload, r.iodepth, r.jobs, r.label
    )
}
