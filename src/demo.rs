//! `mqblk demo`: mqblk's main job on a built-in default, or on an export you name.
//!
//! Serves a default disk image (a raw file, O_DIRECT where the filesystem allows it), or the
//! export of `--export`, on a socket in a fresh temporary directory, drives real I/O through
//! that socket with the built-in vhost-user client (libblkio's `virtio-blk-vhost-user` driver,
//! the same one fio's libblkio engine uses), verifies the data, tries the device's other
//! requests ([`requests`]), and prints what it did and what the backend counted. With
//! `--connect` it serves nothing and drives the socket of a backend that runs already (an
//! `mqblk serve`, confined by its sandbox as in production), whose counters it cannot see.

mod requests;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context};

use mqblk::config::parse_export_spec;
use mqblk::daemon::{self, Export};
use mqblk::engine::OpenError;
use mqblk::io::IoCounters;
use mqblk_client::{self as client, Pattern, Workload};

/// The data pattern's seed when none is given ("mqblk").
pub const DEFAULT_SEED: u64 = 0x006d_7162_6c6b;

/// Settings of a demo run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Image size in bytes (the default image only).
    pub size: u64,
    /// Virtqueues (and I/O threads, one per queue) of the default image.
    pub queues: u16,
    /// Client jobs (threads), spread over the queues.
    pub jobs: usize,
    /// Requests in flight per job.
    pub iodepth: usize,
    /// Seconds of random reads after the verification pass.
    pub runtime: Duration,
    /// Directory for the image and socket (default: a new temporary directory).
    pub dir: Option<PathBuf>,
    /// Serve this export (an `mqblk serve --export` spec without `socket=`) instead of a new
    /// image; its capacity and queues are the disk's.
    pub export: Option<String>,
    /// Bytes per request of the verify, re-read and random-read steps.
    pub block_size: usize,
    /// Seeds the data pattern (and the random offsets): the verify step writes
    /// [`mqblk_client::fill_pattern`] under this seed, which is what a reader of the disk checks.
    pub seed: u64,
    /// Drive the backend already serving this socket instead of serving a disk.
    pub connect: Option<PathBuf>,
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
            export: None,
            block_size: 4096,
            seed: DEFAULT_SEED,
            connect: None,
        }
    }
}

fn print_backend(label: &str, before: IoCounters, after: IoCounters) {
    let requests = after.requests - before.requests;
    let per_request = |x: u64| x as f64 / requests.max(1) as f64;
    let submits = after.submits - before.submits;
    println!(
        "  backend ({label}): {requests} requests, {:.1} requests per io_uring submit, {} merged, \
         {:.3} guest notifications and {:.3} kicks per request, {} errors, \
         {} on registered buffers",
        requests as f64 / submits.max(1) as f64,
        after.merges - before.merges,
        per_request(after.notifies - before.notifies),
        per_request(after.kicks - before.kicks),
        after.errors - before.errors,
        after.fixed_buf_ios - before.fixed_buf_ios,
    );
}

/// A request size as the step titles show it: "4k", "128k", or bytes.
fn size_label(bytes: usize) -> String {
    if bytes.is_multiple_of(1024) {
        format!("{}k", bytes / 1024)
    } else {
        bytes.to_string()
    }
}

/// Serves a new raw image of `opts.size` bytes in `dir` on `sock`, with O_DIRECT unless the
/// filesystem refuses it. Returns the export and what it serves, for the last line.
fn serve_image(opts: &DemoOptions, dir: &Path, sock: &Path) -> anyhow::Result<(Export, String)> {
    let img = dir.join("disk.img");
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
    Ok((export, img.display().to_string()))
}

/// The keys of an export spec (`key=value` pairs separated by commas).
fn spec_keys(spec: &str) -> impl Iterator<Item = &str> {
    spec.split(',')
        .map(|item| item.split_once('=').map_or(item, |(k, _)| k).trim())
        .filter(|k| !k.is_empty())
}

/// Serves the export `spec` (without a socket: demo gives it `sock`). Returns the export and
/// what it serves, for the last line.
fn serve_export(spec: &str, sock: &Path) -> anyhow::Result<(Export, String)> {
    if let Some(k) = spec_keys(spec).find(|k| matches!(*k, "socket" | "fd")) {
        bail!("--export {spec}: leave out {k}=; demo serves the export on a socket of its own");
    }
    let cfg = parse_export_spec(&format!("socket={},{spec}", sock.display()))
        .with_context(|| format!("--export {spec}"))?;
    let path = cfg.path.clone();
    let export = Export::start(cfg).with_context(|| format!("--export {spec}"))?;
    let engine = export.device().engine();
    let served = match path {
        Some(p) => p.display().to_string(),
        None => format!("engine={}", engine.name()),
    };
    println!(
        "mqblk demo: serving {served} ({} bytes, {}-byte blocks) on {}",
        engine.capacity(),
        engine.block_size(),
        sock.display()
    );
    Ok((export, served))
}

/// The disk the steps drive: its size, block size and queues.
#[derive(Debug, Clone, Copy)]
struct Disk {
    capacity: u64,
    block_size: usize,
    queues: usize,
}

/// Runs the demo; returns an error if anything failed or any data did not verify.
pub fn run(opts: &DemoOptions) -> anyhow::Result<()> {
    if let Some(sock) = &opts.connect {
        return run_connected(opts, sock);
    }
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
    let sock = dir.join("mqblk.sock");
    let (export, served) = match &opts.export {
        None => serve_image(opts, &dir, &sock)?,
        Some(spec) => serve_export(spec, &sock)?,
    };
    let config = export.device().config().clone();
    let engine = export.device().engine();
    println!(
        "  export: {} queues, {} I/O threads ({} mapping), engine {}",
        config.queues,
        config.num_threads(),
        config.mapping_name(),
        engine.name()
    );
    let disk = Disk {
        capacity: engine.capacity(),
        block_size: engine.block_size() as usize,
        queues: config.queues as usize,
    };
    let result = drive(opts, &sock, disk, Some(&export));
    export.shutdown();
    result?;
    println!("demo OK: data verified, {served} served and drained cleanly");
    Ok(())
}

/// `--connect`: the steps on the backend serving `sock`, the disk as the device describes it.
fn run_connected(opts: &DemoOptions, sock: &Path) -> anyhow::Result<()> {
    let disk = {
        let client = client::Client::connect(sock, 1)
            .with_context(|| format!("--connect {}", sock.display()))?;
        let queues = client
            .prop_i32("max-queues")
            .context("the device does not say how many queues it has")?;
        Disk {
            capacity: client.capacity(),
            block_size: client.block_size() as usize,
            queues: queues.max(1) as usize,
        }
    };
    println!(
        "mqblk demo: driving the backend on {} ({} bytes, {}-byte blocks, {} queues)",
        sock.display(),
        disk.capacity,
        disk.block_size,
        disk.queues
    );
    drive(opts, sock, disk, None)?;
    println!("demo OK: data verified on {}", sock.display());
    Ok(())
}

/// Steps 1 to 4 on `disk`, served on `sock`; with the `export` that serves it (when demo
/// serves it itself), what the backend counted too.
fn drive(
    opts: &DemoOptions,
    sock: &Path,
    disk: Disk,
    export: Option<&Export>,
) -> anyhow::Result<()> {
    let bs = opts.block_size;
    ensure!(
        bs.is_multiple_of(disk.block_size),
        "--block-size {bs} is not a multiple of the disk's {}-byte blocks",
        disk.block_size
    );
    // What step 1 writes: each job's region, from the start of the disk (the tail that does
    // not divide evenly stays unwritten).
    let regions = client::job_regions(0, disk.capacity, opts.jobs, bs)?;
    let written: u64 = regions.iter().map(|&(_, len)| len).sum();
    let counters = || export.map(|e| e.device().counters());
    let show_backend = |label: &str, before: Option<IoCounters>| {
        if let (Some(before), Some(after)) = (before, counters()) {
            print_backend(label, before, after);
        }
    };

    let mut w = Workload::new(sock);
    w.num_queues = disk.queues;
    w.jobs = opts.jobs;
    w.iodepth = opts.iodepth;
    w.block_size = bs;
    w.seed = opts.seed;
    let label = size_label(bs);

    println!(
        "step 1: write a seeded pattern over the whole disk and read it back ({label}, {} jobs x iodepth {})",
        w.jobs, w.iodepth
    );
    w.pattern = Pattern::Verify;
    let before = counters();
    let r = client::run(&w)?;
    println!("  {r}");
    show_backend("verify", before);
    ensure!(
        r.clean() && r.mismatches == 0 && r.verified_bytes > 0,
        "verification failed: {r}"
    );

    println!("step 2: a new connection reads everything back and checks it");
    w.pattern = Pattern::Check;
    let r = client::run(&w)?;
    println!("  {r}");
    ensure!(
        r.clean() && r.mismatches == 0 && r.verified_bytes == written,
        "re-read failed: {r}"
    );

    println!(
        "step 3: {label} random reads for {} s",
        opts.runtime.as_secs_f64()
    );
    w.pattern = Pattern::RandRead;
    w.runtime = Some(opts.runtime);
    let before = counters();
    let r = client::run(&w)?;
    println!("  {r}");
    show_backend("randread", before);
    ensure!(r.clean(), "random reads failed: {r}");

    println!("step 4: the device's other requests, and reads past its end (which mqblk logs, rate-limited, as bad requests)");
    requests::run(sock, disk.queues, written, opts.seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_keys_name_each_key_once_in_order() {
        let keys: Vec<_> = spec_keys("engine=uring, path=/dev/x,,queues=2,readonly").collect();
        assert_eq!(keys, ["engine", "path", "queues", "readonly"]);
    }

    #[test]
    fn an_export_with_its_own_socket_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        for spec in [
            "engine=null,size=1M,socket=/tmp/x.sock",
            "fd=3,engine=null,size=1M",
        ] {
            let err = serve_export(spec, &sock)
                .err()
                .expect("refused")
                .to_string();
            assert!(err.contains("leave out"), "{err}");
        }
    }

    #[test]
    fn request_sizes_are_labelled_in_kib_where_they_divide() {
        assert_eq!(size_label(4096), "4k");
        assert_eq!(size_label(131072), "128k");
        assert_eq!(size_label(1536), "1536");
    }
}
