//! `mqblk demo`: mqblk's main job on a built-in default.
//!
//! Serves a default disk image (a raw file, O_DIRECT where the filesystem allows it) on a
//! socket in a fresh temporary directory, drives real I/O through that socket with the built-in
//! vhost-user client (libblkio's `virtio-blk-vhost-user` driver, the same one fio's libblkio
//! engine uses), verifies the data, and prints what it did and what the backend counted.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context};

use mqblk::config::parse_export_spec;
use mqblk::daemon::{self, Export};
use mqblk::engine::OpenError;
use mqblk::io::IoCounters;
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

fn print_backend(label: &str, before: IoCounters, after: IoCounters) {
    let requests = after.requests - before.requests;
    let per_request = |x: u64| x as f64 / requests.max(1) as f64;
    let submits = after.submits - before.submits;
    println!(
        "  backend ({label}): {requests} requests, {:.1} requests per io_uring submit, {} merged, \
         {:.3} guest notifications and {:.3} kicks per request, {} errors",
        requests as f64 / submits.max(1) as f64,
        after.merges - before.merges,
        per_request(after.notifies - before.notifies),
        per_request(after.kicks - before.kicks),
        after.errors - before.errors,
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
        Err(daemon::Error::Open(OpenError::DirectRefused(_))) => {
            println!(
                "note: {} refuses O_DIRECT; serving with direct=off",
                dir.display()
            );
            let _ = std::fs::remove_file(&img);
            direct = "off";
            Export::start(parse_export_spec(&spec(direct))?)?
        }
        Err(e) => return Err(e.into()),
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
        export.device().config().num_threads(),
        export.device().config().mapping_name(),
        export.device().engine().name()
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
        let before = export.device().counters();
        let r = client::run(&w)?;
        println!("  {r}");
        print_backend("verify", before, export.device().counters());
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
        let before = export.device().counters();
        let r = client::run(&w)?;
        println!("  {r}");
        print_backend("randread", before, export.device().counters());
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
