//! Same-run comparisons: each mqblk point against the best QSD point (serving the same image
//! format), SPDK's and native fio's of its group, and a `--mqblk-opts` variant against the
//! first, per repeat where they ran side by side.

use serde::Serialize;

use crate::report::PointResult;
use crate::sample::Sample;
use crate::summary::{Stat, Summary};
use crate::Backend;

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
    /// IOPS / QSD's IOPS within each repeat: median and min–max over repeats.
    pub iops_vs_qsd_paired: Option<Stat>,
    /// The SPDK point compared with (driven by the same client).
    pub spdk: Option<String>,
    /// IOPS / SPDK's IOPS within each repeat: median and min–max over repeats.
    pub iops_vs_spdk_paired: Option<Stat>,
    /// Backend CPU per I/O / SPDK's, within each repeat.
    pub cpu_vs_spdk_paired: Option<Stat>,
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

/// For each mqblk point, its IOPS and CPU against the best QSD point and against native fio of
/// its group (same workload, iodepth and jobs), and against its mapping's first variant.
/// Reference points themselves are left out.
pub(crate) fn ratios(points: &[PointResult]) -> Vec<Ratio> {
    points
        .iter()
        .filter(|p| p.config.backend == Backend::Mqblk)
        .map(|p| Ratio::of(p, points))
        .collect()
}

impl Ratio {
    /// Whether the point had a QSD point, SPDK or native fio to compare with.
    pub fn has_references(&self) -> bool {
        self.iops_vs_qsd.is_some()
            || self.iops_vs_spdk_paired.is_some()
            || self.iops_vs_native.is_some()
    }

    fn of(p: &PointResult, points: &[PointResult]) -> Ratio {
        let group = || {
            points.iter().filter(|q| {
                q.config.workload == p.config.workload
                    && q.config.iodepth == p.config.iodepth
                    && q.config.jobs == p.config.jobs
            })
        };
        let median_iops = |q: &PointResult| q.summary.iops.map(|s| s.median);
        // Driven by the same client and serving the same image format: a comparison of
        // backends, not of clients or formats.
        let qsd = group()
            .filter(|q| q.config.backend == Backend::Qsd && q.config.client == p.config.client)
            .filter(|q| q.format == p.format)
            .filter(|q| q.summary.iops.is_some())
            .max_by(|a, b| {
                median_iops(a)
                    .partial_cmp(&median_iops(b))
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
        let spdk = group()
            .find(|q| q.config.backend == Backend::Spdk && q.config.client == p.config.client);
        let native = group().find(|q| q.config.backend == Backend::Native);
        let first_variant = group().find(|q| {
            q.config.backend == Backend::Mqblk
                && q.config.mode == p.config.mode
                && q.config.client == p.config.client
                && q.config.variant == 0
                && p.config.variant > 0
        });
        let iops = |s: &Summary| s.iops;
        let cpu = |s: &Summary| s.backend_cpu_s_per_mio;
        Ratio {
            workload: p.workload_name.clone(),
            iodepth: p.config.iodepth,
            jobs: p.config.jobs,
            label: p.label.clone(),
            qsd: qsd.map(|q| q.label.clone()),
            iops_vs_qsd: qsd.and_then(|q| median_ratio(p, q, iops)),
            cpu_vs_qsd: qsd.and_then(|q| median_ratio(p, q, cpu)),
            iops_vs_qsd_paired: qsd.and_then(|q| paired(&p.samples, &q.samples)),
            spdk: spdk.map(|q| q.label.clone()),
            iops_vs_spdk_paired: spdk.and_then(|q| paired(&p.samples, &q.samples)),
            cpu_vs_spdk_paired: spdk
                .and_then(|q| paired_by(&p.samples, &q.samples, |s| s.backend_cpu_s_per_mio)),
            iops_vs_native: native.and_then(|q| median_ratio(p, q, iops)),
            iops_vs_native_paired: native.and_then(|q| paired(&p.samples, &q.samples)),
            first_variant: first_variant.map(|q| q.label.clone()),
            iops_vs_first_variant: first_variant.and_then(|q| paired(&p.samples, &q.samples)),
            cpu_vs_first_variant: first_variant
                .and_then(|q| paired_by(&p.samples, &q.samples, |s| s.backend_cpu_s_per_mio)),
        }
    }
}

/// `p`'s median of a metric over `q`'s.
fn median_ratio(
    p: &PointResult,
    q: &PointResult,
    metric: fn(&Summary) -> Option<Stat>,
) -> Option<f64> {
    let (a, b) = (metric(&p.summary)?.median, metric(&q.summary)?.median);
    (b > 0.0).then(|| a / b)
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::BenchResults;

    #[test]
    fn paired_ratios_match_repeats_and_skip_failures() {
        let at = |repeat: usize, iops: f64| Sample::test_at(repeat, iops, 1.0);
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
        let at = Sample::test_at;
        let samples = vec![
            vec![at(0, 100.0, 2.0), at(1, 200.0, 2.0)],
            vec![at(0, 110.0, 1.0), at(1, 180.0, 3.0)],
        ];
        let args = "--mode per-queue --jobs 1 --mqblk-opts= --mqblk-opts poll=off";
        let r = BenchResults::test(args, samples);
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
    fn qsd_is_compared_with_the_variants_of_its_format_only() {
        // mqblk raw, mqblk qcow2, qsd qcow2.
        let samples = vec![
            vec![Sample::test(100.0, 2.0)],
            vec![Sample::test(90.0, 2.0)],
            vec![Sample::test(60.0, 4.0)],
        ];
        let args = "--backend mqblk,qsd --engine uring --format qcow2 --mode mq --jobs 1 \
                    --mqblk-opts format=raw --mqblk-opts=";
        let r = BenchResults::test(args, samples);
        assert_eq!(r.ratios[0].label, "mqblk mq raw");
        assert_eq!(r.ratios[0].qsd, None);
        let q = &r.ratios[1];
        assert_eq!(q.label, "mqblk mq qcow2");
        assert_eq!(q.qsd.as_deref(), Some("qsd mq qcow2"));
        assert_eq!(q.iops_vs_qsd, Some(1.5));
        // The first variant (raw) is the reference: qcow2 / raw.
        assert_eq!(q.first_variant.as_deref(), Some("mqblk mq raw"));
        assert_eq!(q.iops_vs_first_variant.unwrap().median, 0.9);
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(v["options"]["format"], "qcow2");
        assert_eq!(v["points"][0]["format"], "raw");
        assert_eq!(v["points"][1]["format"], "qcow2");
        assert_eq!(v["points"][2]["format"], "qcow2");
        assert!(r.markdown().contains("format qcow2"), "{}", r.markdown());
    }

    #[test]
    fn spdk_is_compared_per_repeat_with_the_series_of_its_client() {
        let dir = crate::spdk::fake_build();
        let at = Sample::test_at;
        // mqblk per-queue, then spdk mq: two repeats each.
        let samples = vec![
            vec![at(0, 300.0, 1.0), at(1, 200.0, 2.0)],
            vec![at(0, 200.0, 2.0), at(1, 250.0, 2.0)],
        ];
        let args = format!(
            "--backend mqblk,spdk --spdk-dir {} --client frontend --mode per-queue --jobs 1",
            dir.path().display()
        );
        let r = BenchResults::test(&args, samples);
        let m = &r.ratios[0];
        assert_eq!(m.spdk.as_deref(), Some("spdk mq"));
        let iops = m.iops_vs_spdk_paired.unwrap();
        assert_eq!((iops.min, iops.max), (0.8, 1.5));
        let cpu = m.cpu_vs_spdk_paired.unwrap();
        assert_eq!((cpu.min, cpu.max), (0.5, 1.0));
        assert!(m.iops_vs_qsd.is_none());
        let md = r.markdown();
        assert!(md.contains("paired IOPS / SPDK"), "{md}");
        assert!(md.contains("1.15x (0.80–1.50)"), "{md}");
        let table = r.table();
        assert!(
            table.contains("IOPS/spdk paired 1.15x (0.80-1.50)"),
            "{table}"
        );
        assert!(
            table.contains("CPU per I/O/spdk paired 0.75x (0.50-1.00)"),
            "{table}"
        );
    }

    #[test]
    fn ratios_against_best_qsd_and_native() {
        // mqblk baseline, mqblk per-queue, qsd baseline, qsd mq, native.
        let samples = vec![
            vec![Sample::test(100.0, 4.0)],
            vec![Sample::test(300.0, 2.0)],
            vec![Sample::test(150.0, 8.0)],
            vec![Sample::test(200.0, 5.0)],
            vec![Sample::test(400.0, 0.0)],
        ];
        let args = "--backend mqblk,qsd,native --engine uring --mode baseline,per-queue --jobs 2";
        let r = BenchResults::test(args, samples);
        assert_eq!(r.ratios.len(), 2);
        let pq = &r.ratios[1];
        assert_eq!(pq.label, "mqblk per-queue");
        assert_eq!(pq.qsd.as_deref(), Some("qsd mq"));
        assert_eq!(pq.iops_vs_qsd, Some(1.5));
        assert_eq!(pq.cpu_vs_qsd, Some(0.4));
        assert_eq!(pq.iops_vs_native, Some(0.75));
        let paired = pq.iops_vs_native_paired.unwrap();
        assert_eq!((paired.median, paired.min, paired.max), (0.75, 0.75, 0.75));
        assert_eq!(pq.iops_vs_qsd_paired.unwrap().median, 1.5);
        assert!(pq.spdk.is_none() && pq.iops_vs_spdk_paired.is_none());
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
