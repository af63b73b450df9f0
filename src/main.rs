//! The `mqblk` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use mqblk::config::{self, ExportConfig};

mod demo;

const SPEC_HELP: &str = "\
SPEC is key=value pairs separated by commas:
  socket=PATH            vhost-user unix socket to listen on (required)
  path=PATH              raw image file or block device (engine=uring); with size= it is created if missing
  engine=uring|null|mem  uring: io_uring on path (default); null: completes at once, reads give zeros;
                         mem: RAM disk
  size=BYTES             capacity, with K/M/G/T suffixes (needed for null and mem)
  queues=N               virtqueues offered to the guest (default 1, max 64)
  queue-size=N           maximum virtqueue size (default 1024)
  threads=per-queue|N    I/O threads: one per queue (default), or N threads with queues spread evenly
  cpus=LIST              pin I/O thread i to the i-th CPU of LIST, e.g. 2-5,8
  readonly=on|off        default off; advertises VIRTIO_BLK_F_RO and refuses writes
  direct=on|off          O_DIRECT (default on)
  serial=STRING          answer to GET_ID (at most 20 bytes)
  poll=off|on|adaptive   busy-poll the rings while busy, guest notifications suppressed (default adaptive; off suits CPUs shared by more busy threads than they have)
  poll-max-us=N          longest poll window in microseconds (default 32; 0 turns polling off)
  batch-wait-us=N        under heavy load, wait up to N us to grow a batch before submitting (default 0: off)
  merge=on|off           merge adjacent requests of a queue into one host I/O (default on)
  fixed-files=on|off     register the backing file with each io_uring (default on)
  fixed-buffers=on|off   register guest memory as io_uring fixed buffers; pins it (default off)
  sqpoll-idle-ms=N       kernel SQ polling thread per I/O thread, idle after N ms (default 0: off)
  coop-taskrun=on|off    completions never interrupt a running I/O thread (default on; kernel 6.0+)

Thread mappings: queues=1,threads=1 is baseline; queues=N,threads=1 is mq;
queues=N,threads=per-queue is per-queue (one I/O thread and io_uring per queue).
The TOML config file carries the same keys, one [[export]] table per disk.";

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
    #[command(after_help = SPEC_HELP)]
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
        /// Rewrite this file with the exports' counters (JSON) every 100 ms, and at exit.
        #[arg(long, value_name = "PATH")]
        stats_file: Option<PathBuf>,
    },
    /// Serve a default disk image and drive real, verified I/O through it with the built-in
    /// vhost-user client (libblkio's virtio-blk-vhost-user driver).
    Demo {
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
    },
    /// Benchmark mqblk's thread mappings against qemu-storage-daemon and host-native fio:
    /// starts each backend itself, runs every point interleaved across repeats, prints a table
    /// and writes results.json, report.md and iops.png.
    Bench(Box<mqblk_bench::BenchArgs>),
}

fn init_logging(level: &str) -> Result<(), String> {
    const LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];
    let filter = if LEVELS.contains(&level) {
        format!("mqblk={level},warn")
    } else if level.contains('=') {
        level.to_string()
    } else {
        return Err(format!(
            "invalid --log-level {level}: use error, warn, info, debug or trace"
        ));
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none(),
        )
        .with_target(false)
        .init();
    Ok(())
}

fn load_exports(
    specs: &[String],
    config_file: Option<&PathBuf>,
) -> Result<(Vec<ExportConfig>, Option<String>), String> {
    let mut exports = Vec::new();
    let mut level = None;
    if let Some(path) = config_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read --config {}: {e}", path.display()))?;
        let (ex, lvl) = config::parse_config_file(&text)
            .map_err(|e| format!("--config {}: {e}", path.display()))?;
        exports.extend(ex);
        level = lvl;
    }
    for s in specs {
        exports.push(config::parse_export_spec(s).map_err(|e| format!("--export {s}: {e}"))?);
    }
    config::check_exports(&exports)?;
    Ok((exports, level))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Serve {
            exports,
            config,
            log_level,
            stats_file,
        } => load_exports(&exports, config.as_ref()).and_then(|(ex, file_level)| {
            let level = log_level.or(file_level).unwrap_or_else(|| "info".into());
            init_logging(&level)?;
            mqblk::daemon::serve(ex, stats_file)
        }),
        Cmd::Demo {
            size,
            queues,
            jobs,
            iodepth,
            runtime,
            dir,
        } => (|| {
            let size = config::parse_size(&size)
                .filter(|s| *s >= 1 << 20 && s % 4096 == 0)
                .ok_or_else(|| {
                    format!("invalid --size {size}: a multiple of 4K, at least 1M, e.g. 256M")
                })?;
            if !(1..=64).contains(&queues) {
                return Err(format!("invalid --queues {queues}: 1 to 64"));
            }
            if jobs == 0 || iodepth == 0 || !(runtime > 0.0 && runtime <= 3600.0) {
                return Err(
                    "--jobs and --iodepth must be at least 1, --runtime 0 to 3600 s".into(),
                );
            }
            init_logging("warn")?;
            let opts = demo::DemoOptions {
                size,
                queues,
                jobs,
                iodepth,
                runtime: std::time::Duration::from_secs_f64(runtime),
                dir,
            };
            demo::run(&opts).map_err(|e| format!("{e:#}"))
        })(),
        Cmd::Bench(args) => (|| {
            let opts = mqblk_bench::BenchOptions::from_args(&args)?;
            init_logging("warn")?;
            let command = std::env::args()
                .map(|a| mqblk_bench::shell_quote(&a))
                .collect::<Vec<_>>()
                .join(" ");
            mqblk_bench::bench(&opts, &command).map_err(|e| format!("{e:#}"))
        })(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mqblk: error: {e}");
            ExitCode::FAILURE
        }
    }
}
