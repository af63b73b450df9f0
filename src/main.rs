//! The `mqblk` command line.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{ensure, Context};
use clap::{Parser, Subcommand};

use mqblk::config::qcow2::BackingFormat;
use mqblk::config::{self, ExportConfig};
use mqblk::daemon::ServeOptions;
use mqblk::sandbox::SandboxOptions;

mod ctl;
mod demo;
mod logging;

#[derive(Parser)]
#[command(
    name = "mqblk",
    version,
    about = "A multi-queue vhost-user-blk backend daemon"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve one or more disks, each on its own vhost-user socket.
    #[command(after_help = config::keys::spec_help())]
    Serve {
        /// An export: key=value pairs separated by commas (see below). Repeatable.
        #[arg(long = "export", value_name = "SPEC")]
        exports: Vec<String>,
        /// A TOML file with [[export]] tables (same keys as SPEC).
        #[arg(long, value_name = "FILE.toml")]
        config: Option<PathBuf>,
        /// Log level: error, warn, info, debug or trace (or a tracing filter).
        #[arg(long, value_name = "LEVEL")]
        log_level: Option<String>,
        /// Rewrite this file with the exports' counters (JSON) every 100 ms, and at exit. Put
        /// it on a tmpfs (/run): on an image's filesystem its rewrites stall that image's
        /// writes (mqblk warns).
        #[arg(long, value_name = "PATH")]
        stats_file: Option<PathBuf>,
        /// Serve the management API (JSON-RPC 2.0, one object per line) on this unix socket,
        /// created 0600; with it, serve may start with no export and take them from
        /// `export_add`.
        #[arg(long, value_name = "PATH")]
        api_socket: Option<PathBuf>,
        /// Serve Prometheus metrics over HTTP at http://ADDR:PORT/metrics (off by default;
        /// e.g. 127.0.0.1:9189: nothing authenticates the endpoint, keep it on loopback or a
        /// trusted network).
        #[arg(long, value_name = "ADDR:PORT", value_parser = parse_metrics_addr)]
        metrics: Option<SocketAddr>,
        /// Confinement, entered before any export starts: Landlock (only the paths the
        /// configuration names and --allow-dir), seccomp allowlists (a narrower one on I/O
        /// threads), io_uring opcode allowlists, no capabilities, no new privileges. auto: every
        /// layer the kernel supports, warning about each one it lacks; strict: refuse to start
        /// without all of them; off: none.
        #[arg(long, value_name = "MODE", default_value = "auto")]
        sandbox: mqblk::sandbox::Mode,
        /// A directory where exports added through the management API may keep their images,
        /// sockets and Ceph files (the sandbox reaches only what the configuration names).
        /// Repeatable.
        #[arg(long = "allow-dir", value_name = "DIR")]
        allow_dirs: Vec<PathBuf>,
        /// Run as this user (name or number) once confined; images and socket directories
        /// must be reachable by it. Its group unless --group is given.
        #[arg(long, value_name = "USER")]
        user: Option<String>,
        /// Run as this group (name or number) once confined.
        #[arg(long, value_name = "GROUP")]
        group: Option<String>,
        /// The most memory the qcow2 exports' tables may take in imago together: the sum of
        /// each chain's bound as table-memory-max= counts it (8 MiB an image at 64 KiB
        /// clusters). An export, or a snapshot, that would pass it is refused in one line.
        /// Default: half the host's memory.
        #[arg(long, value_name = "BYTES", value_parser = parse_table_memory_total)]
        table_memory_total: Option<u64>,
        /// Where the daemon keeps what must outlive it: the qcow2 exports' metadata journals
        /// (qcow2-journals/), which a daemon serving an image after a crash of mqblk replays,
        /// so every mqblk on the host must use the same one. Default: $STATE_DIRECTORY
        /// (systemd's StateDirectory=), else /var/lib/mqblk.
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
    },
    /// Replay the metadata journal of a qcow2 image that a crash of mqblk left marked dirty
    /// under metadata-commit=journal, without serving it: afterwards the image is unmarked and
    /// holds every write its guest was told was done, for QEMU's tools (`qemu-img check -r all`
    /// on the marked image would drop them) or an export in another mode. Nothing is done to
    /// an image the journal did not mark; one another program marked is refused.
    ReplayJournal {
        /// The qcow2 image.
        image: PathBuf,
        /// The backing file's format, where the image's header does not record it: raw or
        /// qcow2.
        #[arg(long, value_name = "FORMAT", value_parser = parse_backing_format)]
        backing_format: Option<BackingFormat>,
        /// The state directory of the daemon that served the image, where its journal is (as
        /// mqblk serve's --state-dir; the same default).
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
    },
    /// Talk to a running daemon's management API: prints the reply as JSON.
    #[command(after_help = ctl::HELP)]
    Ctl(ctl::CtlArgs),
    /// Serve a default disk image and drive real, verified I/O through it with the built-in
    /// vhost-user client (libblkio's virtio-blk-vhost-user driver).
    Demo(DemoArgs),
    /// Benchmark mqblk's thread mappings against qemu-storage-daemon and host-native fio:
    /// starts each backend itself, runs every point interleaved across repeats, prints a table
    /// and writes results.json, report.md and iops.png.
    Bench(Box<mqblk_bench::BenchArgs>),
}

/// `mqblk demo`'s options.
#[derive(clap::Args)]
struct DemoArgs {
    /// Image size (K/M/G suffixes).
    #[arg(long, default_value = "256M")]
    size: String,
    /// Virtqueues, one I/O thread each.
    #[arg(long, default_value_t = 2)]
    queues: u16,
    /// Client jobs.
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// Requests in flight per job.
    #[arg(long, default_value_t = 32)]
    iodepth: usize,
    /// Seconds of random reads.
    #[arg(long, default_value_t = 3.0)]
    runtime: f64,
    /// Directory for the image and socket (default: a new temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Serve this export instead of a new image: an `mqblk serve --export` spec without
    /// socket= (demo serves it on a socket in its directory), e.g.
    /// engine=uring,path=/dev/nvme0n1,queues=2. The disk's size and queues are the export's.
    #[arg(long, value_name = "SPEC", conflicts_with_all = ["size", "queues"])]
    export: Option<String>,
    /// Bytes per request of the verify, re-read and random-read steps (K/M suffixes): a
    /// multiple of the disk's block size.
    #[arg(long, value_name = "BYTES", default_value = "4096")]
    block_size: String,
    /// Seed of the data pattern the verify step writes (each 8-byte word a hash of its disk
    /// offset and the seed), so that a reader of the disk can check it afterwards.
    #[arg(long, default_value_t = demo::DEFAULT_SEED)]
    seed: u64,
    /// Serve nothing: drive the backend already serving this vhost-user socket (e.g. an
    /// `mqblk serve`, confined by its sandbox). Its disk is overwritten; its size and queues are
    /// the device's, and the backend's counters are not shown.
    #[arg(long, value_name = "SOCKET", conflicts_with_all = ["size", "queues", "export", "dir"])]
    connect: Option<PathBuf>,
}

/// The exports of `--config` and every `--export`, checked against each other, and the
/// config file's log level.
fn load_exports(
    specs: &[String],
    config_file: Option<&PathBuf>,
    allow_none: bool,
) -> anyhow::Result<(Vec<ExportConfig>, Option<String>)> {
    let mut exports = Vec::new();
    let mut level = None;
    if let Some(path) = config_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read --config {}", path.display()))?;
        let (ex, lvl) = config::parse_config_file(&text)
            .with_context(|| format!("--config {}", path.display()))?;
        exports.extend(ex);
        level = lvl;
    }
    for s in specs {
        exports.push(config::parse_export_spec(s).with_context(|| format!("--export {s}"))?);
    }
    config::check_exports(&exports, allow_none)?;
    Ok((exports, level))
}

/// `--metrics`: an IP address and a port.
fn parse_metrics_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse().map_err(|_| {
        format!(
            "{s} is not an IP address and port: give ADDR:PORT, e.g. 127.0.0.1:9189 or [::1]:9189"
        )
    })
}

fn parse_table_memory_total(s: &str) -> Result<u64, String> {
    let min = mqblk::engine::qcow2::table_budget::MIN_TOTAL;
    config::parse_size(s).filter(|&n| n >= min).ok_or_else(|| {
        format!(
            "{s} is not a size of at least {}M: give BYTES with an optional K, M, G or T, e.g. 8G",
            min >> 20
        )
    })
}

fn serve(
    exports: &[String],
    config: Option<&PathBuf>,
    log_level: Option<String>,
    opts: ServeOptions,
) -> anyhow::Result<()> {
    let (exports, file_level) = load_exports(exports, config, opts.api_socket.is_some())?;
    logging::init(&log_level.or(file_level).unwrap_or_else(|| "info".into()))?;
    mqblk::daemon::serve(exports, &opts)?;
    Ok(())
}

/// Largest `--block-size`: what the client maps per request slot stays modest.
const MAX_DEMO_BLOCK_SIZE: u64 = 16 << 20;

fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    let size = config::parse_size(&args.size)
        .filter(|s| *s >= 1 << 20 && s % 4096 == 0)
        .with_context(|| {
            format!(
                "invalid --size {}: a multiple of 4K, at least 1M, e.g. 256M",
                args.size
            )
        })?;
    let block_size = config::parse_size(&args.block_size)
        .filter(|b| *b >= 512 && b % 512 == 0 && *b <= MAX_DEMO_BLOCK_SIZE)
        .with_context(|| {
            format!(
                "invalid --block-size {}: a multiple of 512 up to 16M, e.g. 4096 or 128K",
                args.block_size
            )
        })?;
    let queues = args.queues;
    ensure!(
        (1..=64).contains(&queues),
        "invalid --queues {queues}: 1 to 64"
    );
    let (jobs, iodepth, runtime) = (args.jobs, args.iodepth, args.runtime);
    ensure!(
        jobs > 0 && iodepth > 0 && runtime > 0.0 && runtime <= 3600.0,
        "--jobs and --iodepth must be at least 1, --runtime 0 to 3600 s"
    );
    logging::init("warn")?;
    demo::run(&demo::DemoOptions {
        size,
        queues,
        jobs,
        iodepth,
        runtime: std::time::Duration::from_secs_f64(runtime),
        dir: args.dir,
        export: args.export,
        block_size: block_size as usize,
        seed: args.seed,
        connect: args.connect,
    })
}

fn run_bench(args: &mqblk_bench::BenchArgs) -> anyhow::Result<()> {
    let opts = mqblk_bench::BenchOptions::from_args(args).map_err(anyhow::Error::msg)?;
    logging::init("warn")?;
    let command = std::env::args()
        .map(|a| mqblk_bench::shell_quote(&a))
        .collect::<Vec<_>>()
        .join(" ");
    mqblk_bench::bench(&opts, &command)
}

/// `--backing-format`, read as the export key `backing-format=` reads it.
fn parse_backing_format(value: &str) -> Result<BackingFormat, String> {
    let key = config::keys::key("backing-format").expect("an export key");
    let mut cfg = ExportConfig::default();
    key.apply(&mut cfg, value)
        .and(cfg.qcow2.backing_format)
        .ok_or_else(|| key.allowed.to_string())
}

/// `mqblk replay-journal`.
fn replay_journal(image: &Path, backing_format: Option<BackingFormat>) -> anyhow::Result<()> {
    logging::init("info")?;
    let marked = mqblk::engine::qcow2::replay_journal(image, backing_format)?;
    match marked {
        true => println!(
            "{}: marked by mqblk's metadata journal; recovered as logged above, and unmarked",
            image.display()
        ),
        false => println!(
            "{}: not marked dirty by mqblk's metadata journal; nothing to replay",
            image.display()
        ),
    }
    Ok(())
}

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Serve {
            exports,
            config,
            log_level,
            stats_file,
            api_socket,
            metrics,
            sandbox,
            allow_dirs,
            user,
            group,
            table_memory_total,
            state_dir,
        } => serve(
            &exports,
            config.as_ref(),
            log_level,
            ServeOptions {
                stats_file,
                api_socket,
                metrics,
                table_memory_total,
                state_dir,
                sandbox: SandboxOptions {
                    mode: sandbox,
                    allow_dirs,
                    user,
                    group,
                },
            },
        ),
        Cmd::ReplayJournal {
            image,
            backing_format,
            state_dir,
        } => {
            mqblk::config::state_dir::set(state_dir);
            replay_journal(&image, backing_format)
        }
        Cmd::Ctl(args) => ctl::run(&args),
        Cmd::Demo(args) => run_demo(args),
        Cmd::Bench(args) => run_bench(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mqblk: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
