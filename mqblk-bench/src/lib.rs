//! `mqblk bench`: runs a grid of workloads against mqblk (in each thread mapping),
//! qemu-storage-daemon, SPDK's vhost target and host-native fio, and reports them side by side.
//!
//! Every point of the grid (backend, mapping, workload, jobs, iodepth) gets a fresh backend
//! process, started here and stopped after the point, so that what `/proc/<pid>` says about CPU
//! time and memory belongs to that backend and that point alone. Points run interleaved across
//! repeats (every point once, then every point again in reverse order, ...) and are reported as
//! median and min–max, because shared machines are noisy and drift.
//!
//! The parts:
//! - this module: [`bench()`], the run from start to end;
//! - `options`: the command line ([`BenchArgs`]) and its validated settings ([`BenchOptions`]);
//! - `grid`: backends, mappings, workloads, the points and their labels, the run order;
//! - [`run`]: starting and stopping backends, measuring one point;
//! - `spdk`: SPDK's vhost target: its build, command line and RPC calls;
//! - `sample`: what one run of a point measured ([`Sample`]);
//! - `summary`: **the metric table**: each metric once, from which [`Summary`] (median and
//!   min–max over a point's samples, [`Stat`]) and both tables' columns are generated;
//! - `ratio`: same-run comparisons with QSD, native fio and the first `--mqblk-opts` variant;
//! - `host`: the machine, recorded with the results;
//! - `report`: [`BenchResults`] and `results.json`; `table` the printed table, `markdown`
//!   `report.md`;
//! - `plot`: the PNG (IOPS against jobs, one line per backend/mode).

use anyhow::{bail, ensure, Context};

mod grid;
mod host;
mod markdown;
mod options;
mod plot;
mod ratio;
pub mod rbd;
mod report;
pub mod run;
mod sample;
pub mod spdk;
mod summary;
mod table;

pub use grid::{schedule, single_thread_modes, Backend, Mode, PointConfig, WorkloadSpec};
#[cfg(test)]
pub(crate) use options::test_options;
pub use options::{parse_counts, parse_list, BenchArgs, BenchOptions, EngineKind, ImageFormat};
pub use report::{BenchResults, PointResult};
pub use sample::Sample;
pub use summary::{Stat, Summary};

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
        EngineKind::Uring => {
            let (raw, size) = run::prepare_image(opts)?;
            if opts.read_first {
                let (bytes, took) = run::read_first(&raw)?;
                println!(
                    "read {} once ({} MiB in {:.1} s) before the first sample",
                    raw.display(),
                    bytes >> 20,
                    took.as_secs_f64()
                );
            }
            run::prepare_qcow2(opts, &raw)?;
            Some((raw, size))
        }
        EngineKind::Nvme => Some(run::prepare_namespace(opts)?),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_words() {
        assert_eq!(shell_quote("--mqblk-opts"), "--mqblk-opts");
        assert_eq!(shell_quote("poll=off,merge=off"), "poll=off,merge=off");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
