//! Host-native fio on the image, the reference without vhost-user: its command line and the
//! sample read out of its JSON output.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{ensure, Context};

use super::usage::{host_busy_secs, others_pct, wait_rusage};
use super::RunEnv;
use crate::sample::Sample;
use crate::{Backend, PointConfig, WorkloadSpec};

impl RunEnv<'_> {
    /// Host-native fio on the image: io_uring, O_DIRECT, each job on its own slice like the
    /// built-in client's jobs.
    pub(super) fn run_fio(
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
