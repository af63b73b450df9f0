//! `mqblk demo`: mqblk's main job on a built-in default.
//!
//! Serves a default disk image (a raw file, O_DIRECT where the filesystem allows it) on a
//! socket in a fresh temporary directory, drives real I/O through that socket with the built-in
//! vhost-user client (libblkio's `virtio-blk-vhost-user` driver, the same one fio's libblkio
//! engine uses), verifies the data, and prints what it did and what the backend counted.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{ensure, Context};

use mqblk::config::parse_export_spec;
use mqblk::daemon::Export;
use mqblk_client::{self as client, Pattern, Workload};

/// Settings of a demo run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Image size in bytes.
    pub size: u64,
    /// Virtqueues (and I/O threads, one per queue).
    pub queues: u16,
    /// Client jobs (threads), spread over the queues.
    pub jobs: usize,
    /// Requests in flight per job.
    pub iodepth: usize,
    /// Seconds of 4k random reads after the verification pass.
    pub runtime: Duration,
    /// Directory for the image and socket (default: a new temporary directory).
    pub dir: Option<PathBuf>,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            size: 256 << 20,
            queues: 2,
            jobs: 2,
            iodepth: 32,
            runtime: Duration::from_secs(3),
            dir: None,
        }
    }
}

/// Sums the I/O threads' counters of an export.
fn totals(export: &Export) -> [u64; 6] {
    let mut t = [0u64; 6];
    for w in &export.shared().workers {
        let s = &w.stats;
        t[0] += s.requests.load(Ordering::Relaxed);
        t[1] += s.submits.load(Ordering::Relaxed);
        t[2] += s.merges.load(Ordering::Relaxed);
        t[3] += s.notifies.load(Ordering::Relaxed);
        t[4] += s.errors.load(Ordering::Relaxed);
        t[5] += s.kicks.load(Ordering::Relaxed);
    }
    t
}

fn print_backend(label: &str, before: [u64; 6], after: [u64; 6]) {
    let d: Vec<u64> = before.iter().zip(after).map(|(b, a)| a - b).collect();
    let per = |x: u64| {
        if d[0] == 0 {
            0.0
        } else {
            x as f64 / d[0] as f64
        }
    };
    println!(
        "  backend ({label}): {} requests, {:.1} requests per io_uring submit, {} merged, \
         {:.3} guest notifications and {:.3} kicks per request, {} errors",
        d[0],
        if d[1] == 0 {
            0.0
        } else {
            d[0] as f64 / d[1] as f64
        },
        d[2],
        per(d[3]),
        per(d[5]),
        d[4]
    );
}

/// Runs the demo; returns an error if anything failed or any data did not verify.
pub fn run(opts: &DemoOptions) -> anyhow::Result<()> {
    let tmp;
    let dir = match &opts.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::Builder::new()
                .prefix("mqblk-demo")
                .tempdir()
                .context("creating a temporary directory")?;
            tmp.path().to_path_buf()
        }
    };
    let img = dir.join("disk.img");
    let sock = dir.join("mqblk.sock");
    let _ = std::fs::remove_file(&img);
    let spec = |direct: &str| {
        format!(
            "socket={},path={},size={},queues={},direct={direct}",
            sock.display(),
            img.display(),
            opts.size,
            opts.queues
        )
    };
    let mut direct = "on";
    let export = match Export::start(parse_export_spec(&spec(direct))?) {
        Ok(e) => e,
        Err(msg) if msg.contains("refuses O_DIRECT") => {
            println!(
                "note: {} refuses O_DIRECT; serving with direct=off",
                dir.display()
            );
            let _ = std::fs::remove_file(&img);
            direct = "off";
            Export::start(parse_export_spec(&spec(direct))?).map_err(anyhow::Error::msg)?
        }
        Err(msg) => anyhow::bail!(msg),
    };
    println!(
        "mqblk demo: serving {} ({} MiB raw image, direct={direct}) on {}",
        img.display(),
        opts.size >> 20,
        sock.display()
    );
    println!(
        "  export: {} queues, {} I/O threads ({} mapping), engine {}",
        opts.queues,
        export.shared().cfg.num_threads(),
        export.shared().cfg.mapping_name(),
        export.shared().engine.name()
    );
    let result = (|| -> anyhow::Result<()> {
        let mut w = Workload::new(&sock);
        w.num_queues = opts.queues as usize;
        w.jobs = opts.jobs;
        w.iodepth = opts.iodepth;
        w.block_size = 4096;
        w.seed = 0x006d_7162_6c6b;

        println!("step 1: write a seeded pattern over the whole disk and read it back (4k, {} jobs x iodepth {})", w.jobs, w.iodepth);
        w.pattern = Pattern::Verify;
        let before = totals(&export);
        let r = client::run(&w)?;
        println!("  {r}");
        print_backend("verify", before, totals(&export));
        ensure!(
            r.clean() && r.mismatches == 0 && r.verified_bytes > 0,
            "verification failed: {r}"
        );

        println!("step 2: a new connection reads everything back and checks it");
        w.pattern = Pattern::Check;
        let r = client::run(&w)?;
        println!("  {r}");
        ensure!(
            r.clean() && r.mismatches == 0 && r.verified_bytes == opts.size,
            "re-read failed: {r}"
        );

        println!(
            "step 3: 4k random reads for {} s",
            opts.runtime.as_secs_f64()
        );
        w.pattern = Pattern::RandRead;
        w.runtime = Some(opts.runtime);
        let before = totals(&export);
        let r = client::run(&w)?;
        println!("  {r}");
        print_backend("randread", before, totals(&export));
        ensure!(r.clean(), "random reads failed: {r}");
        Ok(())
    })();
    export.shutdown();
    result?;
    println!(
        "demo OK: data verified, {} served and drained cleanly",
        img.display()
    );
    Ok(())
}
