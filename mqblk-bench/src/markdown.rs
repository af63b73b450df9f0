//! `report.md`: the run's settings and machine, a table per workload and iodepth with a column
//! per metric (`summary.rs`'s table), the same-run ratios, failed samples, variants and the plot.

use std::fmt::Write as _;

use crate::grid::Backend;
use crate::ratio::Ratio;
use crate::report::{BenchResults, PointResult, MARKDOWN};
use crate::sample::Sample;
use crate::summary::{Metric, Summary, METRICS};
use crate::{EngineKind, ImageFormat};
use mqblk_client::Driver;

impl BenchResults {
    /// The markdown report.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        self.settings(&mut s);
        self.point_tables(&mut s);
        self.same_run_ratios(&mut s);
        self.failed_samples(&mut s);
        self.variants(&mut s);
        let _ = writeln!(
            s,
            "## Plot\n\n![IOPS against jobs](iops.png)\n\n`iops.png`: one panel per workload and \
             iodepth; x axis: jobs; y axis: IOPS (median, from 0); one line per series, with \
             min–max bars; the legend in each panel names the series."
        );
        s
    }

    /// The command, the machine, the settings, and what the columns mean.
    fn settings(&self, s: &mut String) {
        let o = &self.options;
        let h = &self.host;
        let _ = writeln!(s, "# mqblk bench report\n");
        let _ = writeln!(s, "- command: `{}`", self.command);
        let _ = writeln!(s, "- date: {}", h.date);
        let _ = writeln!(
            s,
            "- host: {} CPUs, {}, kernel {}, load average at start {}",
            h.nproc, h.cpu_model, h.kernel, h.loadavg
        );
        let format = match o.engine {
            EngineKind::Uring => format!(", format {}", o.format.name()),
            EngineKind::Null if !o.read_zeroes => {
                ", reads leave the buffers as they are (`--read-zeroes off`: mqblk's and QSD's \
                 `read-zeroes=off`; SPDK's null bdev never zeroes)"
                    .to_string()
            }
            EngineKind::Null if o.backends.contains(&Backend::Spdk) => {
                ", reads zero the buffers on mqblk and QSD (SPDK's null bdev leaves them as they \
                 are; `--read-zeroes off` compares the same work)"
                    .to_string()
            }
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "- engine: {}{format}, disk {} MiB, {:.1} s per point, {} repeats interleaved (odd repeats in reverse order); client: {}, {} queues",
            o.engine.name(),
            self.disk_size >> 20,
            o.runtime.as_secs_f64(),
            o.repeat,
            client_names(&o.clients, o.backends.contains(&Backend::Spdk)),
            if o.client_poll { "poll" } else { "interrupt-driven" }
        );
        if o.read_first {
            let _ = writeln!(
                s,
                "- the raw image was read once from end to end (O_DIRECT) before the first \
                 sample (`--read-first`), so that the caches below it held the same in every repeat"
            );
        }
        let image = match o.format {
            ImageFormat::Raw => None,
            ImageFormat::Qcow2 => Some(
                "qcow2: disk.qcow2, converted from the raw image by `qemu-img convert -S 0` \
                 (64 KiB clusters, every one allocated)",
            ),
            ImageFormat::Qcow2Overlay => Some(
                "qcow2-overlay: an empty overlay.qcow2 (64 KiB clusters) over the raw image, \
                 made anew before every sample",
            ),
            ImageFormat::Qcow2Empty => Some(
                "qcow2-empty: an empty empty.qcow2 (64 KiB clusters) of the raw image's size, \
                 without a backing file, made anew before every sample",
            ),
            ImageFormat::Qcow2Metadata => Some(
                "qcow2-metadata: a new metadata.qcow2 (64 KiB clusters) of the raw image's size, \
                 without a backing file, every cluster mapped over a sparse file \
                 (`preallocation=metadata`), made anew before every sample",
            ),
            ImageFormat::Qcow2Falloc => Some(
                "qcow2-falloc: a new falloc.qcow2 (64 KiB clusters) of the raw image's size, \
                 without a backing file, every cluster mapped and the file's space reserved \
                 (`preallocation=falloc`), made anew before every sample",
            ),
        };
        if let Some(image) = image {
            let _ = writeln!(
                s,
                "- image: {image}; the label says which format a series served (a mqblk variant \
                 with `format=raw` serves the raw image); QSD with an l2-cache-size that maps \
                 the whole image, mqblk's per-thread mapping cache likewise; a sample that \
                 served a qcow2 image failed if `qemu-img check` found it inconsistent (or \
                 leaking clusters) afterwards"
            );
        }
        let _ = writeln!(
            s,
            "\nEach cell is the median with min–max in parentheses. Latency is issue-to-completion \
             as the client sees it. CPU is the backend process's user+system time (from \
             /proc/PID/stat) per million I/Os; *total* adds the client's (for native fio: fio's \
             own). RSS is the backend's VmHWM; RssAnon the largest sampled during the run. \
             *in flight* (the mean number of requests at the engine while the client ran, against \
             jobs × iodepth: how full the device was kept), req/submit (requests per \
             io_uring_enter that carried I/O), merges/I/O, notif/I/O and syscalls/I/O (the I/O \
             threads' io_uring_enter calls of any kind and the write(2) of each notification sent outside the ring) are mqblk's own counters, and so, for a qcow2 image, are \
             metadata path/I/O (requests its metadata worker served, per request), write-back \
             µs (the mean time of a group commit's write-back of the tables, which the \
             requests in it wait for) and sync µs (the mean time of a sync of the image file). \
             *others' CPU* is the CPU \
             that other processes used meanwhile (from /proc/stat, in % of all CPUs): where it is \
             high, the point was disturbed.\n"
        );
    }

    /// A table per workload and iodepth: a row per point, a column per metric.
    fn point_tables(&self, s: &mut String) {
        for (w, qd, pts) in self.groups() {
            let _ = writeln!(s, "## {w}, iodepth {qd}\n");
            let headers = METRICS.iter().map(|m| m.show.report.to_string());
            let header = row(["series".to_string(), "jobs".to_string()]
                .into_iter()
                .chain(headers));
            let _ = writeln!(s, "{header}\n|---|---:|{}", "---:|".repeat(METRICS.len()));
            for p in pts {
                let cells = METRICS.iter().map(|m| cell(m, &p.summary));
                let first = [p.label.clone(), p.config.jobs.to_string()];
                let _ = writeln!(s, "{}", row(first.into_iter().chain(cells)));
            }
            let _ = writeln!(s);
        }
    }

    /// The samples that failed, and why.
    fn failed_samples(&self, s: &mut String) {
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
    }

    /// The points compared with QSD and native fio.
    fn same_run_ratios(&self, s: &mut String) {
        ratio_section(
            s,
            &self.reference_ratios(),
            "## Same-run ratios (medians)",
            &[
                "QSD reference: the QSD mapping with the highest median IOPS at that point; \
                 SPDK's: its point driven by the same client.",
                "*paired*: the ratio within each repeat (the two points ran next to each \
                 other), median and min–max over repeats.",
            ],
            (
                "IOPS / QSD | CPU per I/O / QSD | paired IOPS / QSD | paired IOPS / SPDK | \
                 paired CPU per I/O / SPDK | IOPS / native fio | paired IOPS / native fio |",
                "---:|---:|---:|---:|---:|---:|---:|",
            ),
            |r| {
                [
                    MARKDOWN.times(r.iops_vs_qsd),
                    MARKDOWN.times(r.cpu_vs_qsd),
                    MARKDOWN.times_range(r.iops_vs_qsd_paired, 2),
                    MARKDOWN.times_range(r.iops_vs_spdk_paired, 2),
                    MARKDOWN.times_range(r.cpu_vs_spdk_paired, 2),
                    MARKDOWN.times(r.iops_vs_native),
                    MARKDOWN.times_range(r.iops_vs_native_paired, 2),
                ]
            },
        );
    }

    /// The `--mqblk-opts` variants against the first.
    fn variants(&self, s: &mut String) {
        ratio_section(
            s,
            &self.variant_ratios(),
            "## Variants against the first `--mqblk-opts`",
            &[
                "Each repeat's ratio to the first variant's point of the same mapping (they ran \
               next to each other), median and min–max over repeats: the min–max is the run's \
               own noise.",
            ],
            ("against | IOPS | backend CPU per I/O |", "---|---:|---:|"),
            |r| {
                [
                    r.first_variant.clone().unwrap_or_default(),
                    MARKDOWN.times_range(r.iops_vs_first_variant, 3),
                    MARKDOWN.times_range(r.cpu_vs_first_variant, 3),
                ]
            },
        );
    }
}

/// A section of ratios, unless there are none: its title and notes, then a table with a row
/// per ratio: the point's group and series, then `values` in the `columns` (headers, rule).
fn ratio_section<const N: usize>(
    s: &mut String,
    ratios: &[&Ratio],
    title: &str,
    notes: &[&str],
    columns: (&str, &str),
    values: impl Fn(&Ratio) -> [String; N],
) {
    if ratios.is_empty() {
        return;
    }
    let _ = writeln!(s, "{title}\n");
    for note in notes {
        let _ = writeln!(s, "{note}\n");
    }
    let _ = writeln!(
        s,
        "| workload | iodepth | jobs | series | {}\n|---|---:|---:|---|{}",
        columns.0, columns.1
    );
    for r in ratios {
        let key = [
            r.workload.clone(),
            r.iodepth.to_string(),
            r.jobs.to_string(),
            r.label.clone(),
        ];
        let _ = writeln!(s, "{}", row(key.into_iter().chain(values(r))));
    }
    let _ = writeln!(s);
}

/// A metric's cell: the median with its min–max where it shows at the metric's decimals; the
/// headline says "failed" where no sample succeeded.
fn cell(m: &Metric, summary: &Summary) -> String {
    if m.show.headline && summary.samples == 0 {
        return "failed".into();
    }
    let d = m.show.decimals;
    (m.of_summary)(summary).map_or_else(|| MARKDOWN.none.into(), |x| format!("{x:.d$}"))
}

/// A table row: `| a | b | c |`.
fn row(cells: impl IntoIterator<Item = String>) -> String {
    let mut s = "|".to_string();
    for c in cells {
        let _ = write!(s, " {c} |");
    }
    s
}

/// What drove the backends, for the report's header: the `--client` list, and SPDK's own
/// (always the frontend, which libblkio cannot replace there).
fn client_names(clients: &[Driver], spdk: bool) -> String {
    let name = |d: &Driver| match d {
        Driver::Libblkio => "libblkio's virtio-blk-vhost-user driver",
        Driver::Frontend => "mqblk's own frontend (SET_MEM_TABLE)",
    };
    let mut s = clients.iter().map(name).collect::<Vec<_>>().join(" and ");
    if spdk && !clients.contains(&Driver::Frontend) {
        s.push_str("; SPDK by mqblk's own frontend (libblkio refuses it)");
    }
    s
}
