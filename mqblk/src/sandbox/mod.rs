//! The daemon's confinement: what `mqblk serve` gives up before it serves anyone.
//!
//! The daemon parses descriptor chains that another process wrote, in memory that process
//! shares. Should a bug there let a guest or a frontend run code in the daemon, that code finds:
//! - `privileges`: no capability (effective, permitted, inheritable, ambient, bounding; where
//!   RLIMIT_MEMLOCK cannot be lifted, CAP_IPC_LOCK stays permitted, never effective, for the
//!   rings of I/O threads and qcow2 metadata workers), no new privileges (`PR_SET_NO_NEW_PRIVS`), optionally another user
//!   and group (`--user`, `--group`);
//! - `filesystem`: Landlock: only the files and directories the configuration names (images,
//!   socket directories, the API socket's, the stats file's, Ceph's conf and keyring, the qcow2
//!   metadata journals' directory in the state directory) and those `--allow-dir` adds for
//!   exports added later through the API;
//! - [`seccomp`]: a system-call allowlist for every thread, and a narrower one for each I/O
//!   thread, which it adds to its own when it starts; a forbidden call ends the daemon
//!   (`sigsys` says which call and which thread first);
//! - [`uring`]: each I/O thread's io_uring accepts only the opcodes its engine and the thread
//!   use (seccomp cannot see what a ring does).
//!
//! Order matters. Capabilities and Landlock domains belong to a thread and are inherited only
//! by the threads it starts, so [`enter`] runs while the process has one thread (it checks),
//! before any export starts: every export, given at startup or added through the API, is
//! opened under the same confinement. The seccomp filter is installed last, with TSYNC.
//!
//! `--sandbox auto` (the default) applies every layer the kernel supports and warns, naming
//! each one it lacks; `strict` refuses to start without all of them; `off` applies none (for
//! debugging, or under a supervisor that confines the daemon itself).

mod filesystem;
mod privileges;
pub mod seccomp;
mod sigsys;
pub mod uring;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::OnceLock;

use crate::config::ExportConfig;

pub use filesystem::PathRefused;

/// How much of the sandbox `mqblk serve` applies (`--sandbox`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// Every layer the kernel supports; a warning names each one it lacks.
    #[default]
    Auto,
    /// Every layer, or the daemon refuses to start.
    Strict,
    /// None.
    Off,
}

impl Mode {
    /// The values `--sandbox` takes.
    pub const NAMES: &'static str = "auto, strict or off";
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "auto" => Ok(Mode::Auto),
            "strict" => Ok(Mode::Strict),
            "off" => Ok(Mode::Off),
            _ => Err(format!("'{s}' is not a sandbox mode: {}", Mode::NAMES)),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Auto => "auto",
            Mode::Strict => "strict",
            Mode::Off => "off",
        })
    }
}

/// The sandbox's settings (`mqblk serve --sandbox, --allow-dir, --user, --group`).
#[derive(Debug, Clone, Default)]
pub struct SandboxOptions {
    /// How much to apply.
    pub mode: Mode,
    /// Directories where exports added through the API may keep images, sockets and Ceph
    /// files.
    pub allow_dirs: Vec<PathBuf>,
    /// Run as this user (a name or a number) once confined.
    pub user: Option<String>,
    /// Run as this group (a name or a number); the user's own group by default.
    pub group: Option<String>,
}

/// What the configuration names, which the sandbox must leave reachable.
#[derive(Debug, Clone, Copy)]
pub struct Needs<'a> {
    /// The exports given at startup.
    pub exports: &'a [ExportConfig],
    /// `--api-socket`.
    pub api_socket: Option<&'a Path>,
    /// `--stats-file`.
    pub stats_file: Option<&'a Path>,
    /// `--metrics`: the control threads serve TCP.
    pub tcp_server: bool,
}

/// Why the sandbox could not be entered. Each message is one line for the operator.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Threads already run: they would escape the confinement.
    #[error("the sandbox must be entered before any thread starts, but {0} threads run")]
    ThreadsRunning(usize),
    /// `--sandbox strict` and the kernel lacks a layer.
    #[error("--sandbox strict: {0}; use --sandbox auto to run without it")]
    LayerMissing(String),
    /// `--user` or `--group` names nobody.
    #[error("{0}")]
    NoSuchUser(String),
    /// A step that the kernel refused.
    #[error("sandbox: {what}: {err}")]
    Refused {
        /// What was being done.
        what: &'static str,
        /// The error.
        err: std::io::Error,
    },
    /// The Landlock ruleset could not be built or applied.
    #[error("sandbox: Landlock: {0}")]
    Landlock(String),
    /// A seccomp filter could not be built or applied.
    #[error("sandbox: seccomp: {0}")]
    Seccomp(String),
}

/// What the daemon kept of its confinement, for the I/O threads it starts and the exports the
/// API adds.
struct Confined {
    /// The I/O threads' compiled filters.
    io_filters: seccomp::IoFilters,
    /// Rings are created with an opcode allowlist.
    rings: bool,
    /// What an I/O thread raises to create its ring (see [`privileges::memlock_exemption`]).
    ring_caps: rustix::thread::CapabilitySet,
    /// What Landlock lets the daemon reach; `None` where Landlock is not enforced.
    grants: Option<filesystem::Grants>,
}

static CONFINED: OnceLock<Confined> = OnceLock::new();

/// Confines the process as `opts` asks, leaving reachable what `needs` names. Must run while
/// the process has one thread. With [`Mode::Off`], does nothing.
pub fn enter(opts: &SandboxOptions, needs: &Needs) -> Result<(), Error> {
    if opts.mode == Mode::Off {
        tracing::warn!("--sandbox off: the daemon runs unconfined");
        make_journals_dir(None);
        return Ok(());
    }
    let threads = thread_count();
    if threads != 1 {
        return Err(Error::ThreadsRunning(threads));
    }
    let strict = opts.mode == Mode::Strict;
    let missing = |layer: String| -> Result<(), Error> {
        if strict {
            return Err(Error::LayerMissing(layer));
        }
        tracing::warn!("sandbox: {layer}; running without it");
        Ok(())
    };

    let rings = match uring::probe() {
        Ok(()) => true,
        Err(e) => {
            missing(format!(
                "this kernel cannot restrict io_uring opcodes ({e})"
            ))?;
            false
        }
    };
    let identity = privileges::Identity::resolve(opts.user.as_deref(), opts.group.as_deref())?;
    make_journals_dir(identity.as_ref());
    let ring_caps = privileges::memlock_exemption();
    privileges::drop_all(identity.as_ref(), ring_caps)?;

    let grants = filesystem::Grants::new(needs, &opts.allow_dirs);
    let enforced = match grants.restrict_self()? {
        filesystem::Enforced::Fully => true,
        filesystem::Enforced::Partly(lacking) => {
            // The layer is there, only weaker: a warning even under --sandbox strict.
            tracing::warn!("sandbox: Landlock of this kernel cannot restrict {lacking}");
            true
        }
        filesystem::Enforced::Not(why) => {
            missing(format!("Landlock is unavailable ({why})"))?;
            false
        }
    };

    if seccomp::measuring() {
        tracing::warn!("MQBLK_SECCOMP_LOG=1: calls outside the allowlists are let through");
    }
    let context = seccomp::Context::new(needs.tcp_server);
    let io_filters = seccomp::IoFilters::compile(&context)?;
    sigsys::install()?;
    install_panic_hook();
    seccomp::apply_control_filter(&context)?;

    let confined = Confined {
        io_filters,
        rings,
        ring_caps,
        grants: enforced.then_some(grants),
    };
    if CONFINED.set(confined).is_err() {
        // Entered twice in one process (a test, say): the first confinement stands, and the
        // second filter, already stacked, only narrows it.
        tracing::warn!("sandbox entered twice in one process");
    }
    tracing::info!(
        landlock = enforced,
        io_uring_restrictions = rings,
        user = ?opts.user,
        "sandbox: confined (seccomp, no capabilities, no new privileges)"
    );
    Ok(())
}

/// Makes the qcow2 metadata journals' directory of the user the daemon is to run as, where the
/// daemon made the directory of every user's (`daemon::serve`): Landlock would refuse to make
/// it later. A failure leaves the exports' opens to say what it costs them.
fn make_journals_dir(identity: Option<&privileges::Identity>) {
    use crate::config::state_dir;
    if !state_dir::qcow2_journals_root().is_dir() {
        return;
    }
    let (uid, gid) = identity.map_or_else(
        || {
            (
                rustix::process::geteuid().as_raw(),
                rustix::process::getegid().as_raw(),
            )
        },
        privileges::Identity::owner,
    );
    if let Err(err) = state_dir::make_qcow2_journals(uid, gid) {
        tracing::warn!(
            dir = %state_dir::qcow2_journals_of(uid).display(),
            %err,
            "cannot make the qcow2 metadata journals' directory of the daemon's user"
        );
    }
}

/// Confines the calling I/O thread, once set up, to what its loop does. Does nothing where the
/// daemon is not confined (`--sandbox off`, `mqblk demo`, unit tests).
pub fn confine_io_thread() -> std::io::Result<()> {
    match CONFINED.get() {
        Some(c) => {
            c.io_filters.apply()?;
            IO_THREAD_CONFINED.set(true);
            Ok(())
        }
        None => Ok(()),
    }
}

thread_local! {
    /// The calling thread carries the I/O threads' filter.
    static IO_THREAD_CONFINED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A panic hook that an I/O thread survives: the default one prints a backtrace when
/// `RUST_BACKTRACE` asks for it, and resolving it reads the executable (`readlink`, `getcwd`),
/// which an I/O thread's allowlist forbids, so the trap would end the daemon before the panic
/// could be contained (`io::failure`). On a confined I/O thread the hook prints the panic's
/// place and message only; elsewhere it is the default one.
fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if IO_THREAD_CONFINED.get() {
            let current = std::thread::current();
            let name = current.name().unwrap_or("an I/O thread");
            // Not `eprintln!`: a panic while standard error fails would abort the daemon.
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "thread '{name}' {info} (no backtrace: the thread is confined)"
            );
        } else {
            default(info);
        }
    }));
}

/// Whether the daemon is confined: from then on it makes no directory (seccomp forbids it),
/// only files where Landlock lets it.
pub fn confined() -> bool {
    CONFINED.get().is_some()
}

/// Whether I/O threads create their rings with an opcode allowlist.
pub fn rings_confined() -> bool {
    CONFINED.get().is_some_and(|c| c.rings)
}

/// Runs `create`, an I/O thread (or a qcow2 metadata worker) creating its ring; in a confined
/// daemon, with what exempts the ring (and the buffers it registers) from RLIMIT_MEMLOCK where the limit could not be lifted, after which the thread holds
/// no capability at all.
pub fn ring_setup<T>(create: impl FnOnce() -> T) -> T {
    match CONFINED.get() {
        Some(c) => privileges::ring_setup(c.ring_caps, create),
        None => create(),
    }
}

/// Checks that everything `cfg` would open lies where the confined daemon may reach it, so
/// that an export the API adds elsewhere fails with a message naming the rule, not a bare
/// "permission denied" from the kernel.
pub fn check_export(cfg: &ExportConfig) -> Result<(), PathRefused> {
    match CONFINED.get().and_then(|c| c.grants.as_ref()) {
        Some(grants) => grants.check(cfg),
        None => Ok(()),
    }
}

/// The process's threads, from /proc (0 if it cannot be read: the caller then refuses).
fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}
