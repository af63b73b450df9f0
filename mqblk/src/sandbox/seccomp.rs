//! seccomp-bpf allowlists, one per thread role, compiled with rust-vmm's `seccompiler` (pure
//! Rust, no C library to link or keep in step; Firecracker's and Cloud Hypervisor's choice).
//!
//! - Every thread: [`IO_THREAD`] and [`CONTROL`] (the main thread, listeners, the API and
//!   metrics threads, librados's threads), installed on all of them at once (TSYNC). It can
//!   open files (Landlock says which), bind unix sockets, start threads and create rings,
//!   because the API may add an export at any time; it cannot execute a program, map memory
//!   executable, trace or signal another process, mount, load a module, or create a socket of
//!   another family than those it serves.
//! - Each I/O thread then adds [`IO_THREAD`] alone: its ring, eventfds, memory, logging and
//!   exit, nothing that opens, creates or executes anything. The rbd engine's I/O threads call
//!   librbd, which was measured to need nothing more there (it hands the work to librados's
//!   threads, which have the control list).
//!
//! The lists were measured, not guessed: `scripts/seccomp-measure.sh` runs the integration
//! tests (and the rbd tests) with the daemon under `strace -f -ff`, and lists what each role
//! called after its filter went on (docs/RELIABILITY.md, "Security"). A call outside a thread's list
//! traps (`super::sigsys`): one log line names it, then the daemon dies of SIGSYS, as under
//! SECCOMP_RET_KILL_PROCESS.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::Error;

/// What the filters depend on besides the role.
#[derive(Debug, Clone, Copy)]
pub(super) struct Context {
    /// The process id: the only one a thread may send signals to.
    pid: u32,
    /// The control threads serve TCP (`--metrics`), or talk to a Ceph cluster.
    tcp: bool,
}

impl Context {
    /// The filters' context for this process.
    pub(super) fn new(tcp_server: bool) -> Context {
        Context {
            pid: std::process::id(),
            tcp: tcp_server || crate::config::rbd::BUILT,
        }
    }
}

/// An I/O thread's whole allowlist (besides the conditional calls), which every other thread
/// has too.
pub const IO_THREAD: &[i64] = &[
    // Memory (the allocator, thread stacks); mmap and mprotect are conditional.
    libc::SYS_brk,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    // Waiting and time (restart_syscall: a sleep resumed after a signal).
    libc::SYS_futex,
    libc::SYS_restart_syscall,
    libc::SYS_sched_yield,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    // Its own involuntary context switches, every 10 ms (io/policy/notify.rs).
    libc::SYS_getrusage,
    // Descriptors it holds: eventfds, logging, closing.
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    // io_uring on rings it has.
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    // Signals of its own, thread exit, and the SIGSYS report.
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigaction,
    libc::SYS_sigaltstack,
    // A fault guard (mqblk/src/shm) shuts down the connection of a frontend that truncated
    // memory it shared, on the thread that touched it: mostly an I/O thread.
    libc::SYS_shutdown,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

/// Calls the control threads may make besides [`IO_THREAD`], unconditionally.
pub const CONTROL: &[i64] = &[
    // Files (Landlock limits which): images, sockets' paths, the stats file.
    libc::SYS_openat,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_statx,
    // imago asks which filesystem holds a qcow2 image (its O_DIRECT alignment).
    libc::SYS_fstatfs,
    libc::SYS_lseek,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_readv,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    // A qcow2 image's metadata, written through (`RWF_DSYNC`) when a control thread resizes
    // or snapshots it.
    libc::SYS_pwritev2,
    libc::SYS_fcntl,
    libc::SYS_ioctl,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_unlinkat,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_readlinkat,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_getcwd,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_umask,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_pipe2,
    libc::SYS_eventfd2,
    libc::SYS_memfd_create,
    // Sockets (socket() is conditional): the API, exports, the backend channel, sd_notify.
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_socketpair,
    libc::SYS_ppoll,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_rt_sigtimedwait,
    // Threads (I/O threads, listeners, librados's) and rings.
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_setaffinity,
    libc::SYS_prlimit64,
    libc::SYS_io_uring_setup,
    // An I/O thread adds its own filter under this one, after it has given up its
    // capabilities.
    libc::SYS_seccomp,
    libc::SYS_capset,
    libc::SYS_getrandom,
    libc::SYS_uname,
    // The API's peer check; librados.
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
];

/// Calls the control threads may make on x86_64 only (older names of the calls above).
#[cfg(target_arch = "x86_64")]
const CONTROL_X86_64: &[i64] = &[
    libc::SYS_poll,
    libc::SYS_epoll_create,
    libc::SYS_epoll_wait,
    libc::SYS_access,
    libc::SYS_readlink,
    libc::SYS_rename,
    libc::SYS_unlink,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_chmod,
];
#[cfg(not(target_arch = "x86_64"))]
const CONTROL_X86_64: &[i64] = &[];

/// What an I/O thread may not do, but may try: glibc's allocator reads
/// /proc/sys/vm/overcommit_memory the first time it shrinks a thread's heap, on whichever
/// thread that happens, and copes with a refusal. These calls fail with EACCES (as Landlock
/// would refuse them) instead of ending the daemon.
const IO_REFUSED: &[i64] = &[libc::SYS_openat];

/// The I/O threads' compiled filters.
pub(super) struct IoFilters {
    /// Turns [`IO_REFUSED`] into EACCES.
    refused: BpfProgram,
    /// An I/O thread's allowlist.
    allowlist: BpfProgram,
}

impl IoFilters {
    /// Compiles the I/O threads' filters.
    pub(super) fn compile(ctx: &Context) -> Result<IoFilters, Error> {
        let rules = IO_REFUSED.iter().map(|&nr| (nr, Vec::new())).collect();
        let refused = SeccompFilter::new(
            rules,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::EACCES as u32),
            target_arch()?,
        )
        .and_then(TryInto::try_into)
        .map_err(|e| Error::Seccomp(e.to_string()))?;
        Ok(IoFilters {
            refused,
            allowlist: compile(ctx, &[IO_THREAD, IO_REFUSED], false)?,
        })
    }

    /// Adds the I/O thread's filters to the calling thread: its allowlist, and the refusal of
    /// what it may try (the kernel takes the strictest answer of all a thread's filters).
    pub(super) fn apply(&self) -> std::io::Result<()> {
        // The allowlist last: it allows neither prctl(PR_SET_NO_NEW_PRIVS) nor seccomp.
        seccompiler::apply_filter(&self.refused).map_err(std::io::Error::other)?;
        seccompiler::apply_filter(&self.allowlist).map_err(std::io::Error::other)
    }
}

/// What a call outside an allowlist gets: a trap (`super::sigsys`). A debug build run with
/// `MQBLK_SECCOMP_LOG=1` lets it through instead (SECCOMP_RET_LOG), with everything else
/// confined as usual, so that `scripts/seccomp-measure.sh` can record what each thread role
/// calls; a release build has no such setting.
fn mismatch_action() -> SeccompAction {
    if measuring() {
        return SeccompAction::Log;
    }
    SeccompAction::Trap
}

/// Whether this (debug) run lets calls outside the allowlists through to be measured
/// (`MQBLK_SECCOMP_LOG=1`); never in a release build.
pub(super) fn measuring() -> bool {
    cfg!(debug_assertions) && std::env::var_os("MQBLK_SECCOMP_LOG").is_some_and(|v| v == "1")
}

/// The architecture the filters are compiled for: this one.
fn target_arch() -> Result<TargetArch, Error> {
    TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|e| Error::Seccomp(format!("{}: {e}", std::env::consts::ARCH)))
}

/// Installs the control threads' filter on every thread of the process.
pub(super) fn apply_control_filter(ctx: &Context) -> Result<(), Error> {
    let prog = compile(ctx, &[IO_THREAD, CONTROL, CONTROL_X86_64], true)?;
    seccompiler::apply_filter_all_threads(&prog).map_err(|e| Error::Seccomp(e.to_string()))
}

/// A filter allowing `lists` (and the conditional calls of a control or I/O thread), trapping
/// everything else.
fn compile(ctx: &Context, lists: &[&[i64]], control: bool) -> Result<BpfProgram, Error> {
    let err = |e: seccompiler::BackendError| Error::Seccomp(e.to_string());
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = lists
        .iter()
        .flat_map(|l| l.iter())
        .map(|&nr| (nr, Vec::new()))
        .collect();
    for (nr, conditional) in conditional_rules(ctx, control).map_err(err)? {
        // An unconditional entry already allows every use.
        if !rules.get(&nr).is_some_and(|r| r.is_empty()) {
            rules.entry(nr).or_default().extend(conditional);
        }
    }
    let filter = SeccompFilter::new(
        rules,
        mismatch_action(),
        SeccompAction::Allow,
        target_arch()?,
    )
    .map_err(err)?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| err(e))
}

/// prctl(2)'s PR_GET_AUXV ("AUXV"), which the libc crate does not name.
const PR_GET_AUXV: u64 = 0x4155_5856;

/// `arg` (a 32-bit argument) equals `value`.
fn arg_eq(arg: u8, value: u64) -> Result<SeccompCondition, seccompiler::BackendError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value)
}

/// `arg` has none of the bits of `mask`.
fn arg_lacks(arg: u8, mask: u64) -> Result<SeccompCondition, seccompiler::BackendError> {
    SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(mask),
        0,
    )
}

/// The calls allowed only with some arguments.
fn conditional_rules(
    ctx: &Context,
    control: bool,
) -> Result<Vec<(i64, Vec<SeccompRule>)>, seccompiler::BackendError> {
    let one = |c: SeccompCondition| SeccompRule::new(vec![c]);
    let prot_exec = libc::PROT_EXEC as u64;
    let mut out = vec![
        // Memory: never executable (nothing is loaded once confined; librados, measured, maps
        // no code after it).
        (libc::SYS_mmap, vec![one(arg_lacks(2, prot_exec)?)?]),
        (libc::SYS_mprotect, vec![one(arg_lacks(2, prot_exec)?)?]),
        // Descriptor flags: an I/O thread only reads them (debug builds check a descriptor is
        // open before closing it).
        (
            libc::SYS_fcntl,
            vec![one(arg_eq(1, libc::F_GETFD as u64)?)?],
        ),
        // Signals: to this process's threads only (the SIGSYS report re-raises its signal).
        (libc::SYS_tgkill, vec![one(arg_eq(0, u64::from(ctx.pid))?)?]),
    ];
    // Thread names: every thread reads its own (the SIGSYS report); control threads set them,
    // and set no_new_privs again as an I/O thread adds its filter. Any thread may read the
    // process's auxiliary vector: rustix takes the page size from it (PR_GET_AUXV, Linux 6.4;
    // on older kernels it reads /proc/self/auxv), e.g. when a dirty log is mapped.
    let mut prctl = vec![
        one(arg_eq(0, libc::PR_GET_NAME as u64)?)?,
        one(arg_eq(0, PR_GET_AUXV)?)?,
    ];
    if control {
        prctl.push(one(arg_eq(0, libc::PR_SET_NAME as u64)?)?);
        prctl.push(one(arg_eq(0, libc::PR_SET_NO_NEW_PRIVS as u64)?)?);
    }
    out.push((libc::SYS_prctl, prctl));
    if control {
        let mut families = vec![one(arg_eq(0, libc::AF_UNIX as u64)?)?];
        if ctx.tcp {
            families.push(one(arg_eq(0, libc::AF_INET as u64)?)?);
            families.push(one(arg_eq(0, libc::AF_INET6 as u64)?)?);
        }
        out.push((libc::SYS_socket, families));
    }
    Ok(out)
}
