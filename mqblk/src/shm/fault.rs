//! Containing SIGBUS in mappings of files a frontend could truncate.
//!
//! A [`FaultGuard`] registers one mapping (its address range and a duplicate of the descriptor
//! of the frontend connection that shared it) in a fixed table. The process's SIGBUS handler
//! looks the faulting address up there. Inside a registered range it:
//! 1. maps anonymous memory over the whole range (`MAP_FIXED`), so the faulting access and any
//!    later one complete (reads see zeros; writes go nowhere the frontend can see);
//! 2. marks the guard faulted and counts the fault;
//! 3. shuts the connection down (`shutdown(2)`), which ends the session's message loop: the
//!    session then drains its queues and unmaps, as for any disconnect.
//!
//! Everything the handler does is async-signal-safe: atomic loads and stores on a static table,
//! and the `mmap`, `shutdown` and `sigaction` system calls. A SIGBUS outside every registered
//! range goes to the handler that was installed before (Rust's own, which reports a stack
//! overflow, or the default action, which kills the process as before).
//!
//! A guard must outlive its mapping, or a fault in the mapping would go unhandled; a guard that
//! outlives it briefly is harmless (an unmapped range cannot raise SIGBUS).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Mappings that can be guarded at once (every connection's unsealable regions together).
pub const MAX_GUARDS: usize = 4096;

struct Slot {
    /// Claimed by a guard.
    taken: AtomicBool,
    start: AtomicUsize,
    /// 0 while the slot holds no range: the handler reads it first.
    len: AtomicUsize,
    /// The connection to shut down on a fault, or -1.
    connection: AtomicI32,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)] // each array element is its own slot
const EMPTY: Slot = Slot {
    taken: AtomicBool::new(false),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    connection: AtomicI32::new(-1),
    faulted: AtomicBool::new(false),
};

static SLOTS: [Slot; MAX_GUARDS] = [EMPTY; MAX_GUARDS];

/// Faults contained since the daemon started.
static CONTAINED: AtomicU64 = AtomicU64::new(0);

/// The SIGBUS disposition before ours, to pass on faults that are not ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// SIGBUS faults contained since the daemon started (all guards together).
pub fn contained() -> u64 {
    CONTAINED.load(Ordering::Relaxed)
}

/// One guarded mapping; unregisters it when dropped.
pub struct FaultGuard {
    slot: usize,
    /// Keeps the descriptor the handler shuts down valid (and its number unused by anything
    /// else) for as long as the slot names it.
    _connection: Option<OwnedFd>,
}

impl FaultGuard {
    /// Guards `len` bytes at `addr`; a fault there shuts `connection` down.
    pub fn new(
        addr: *const u8,
        len: usize,
        connection: Option<BorrowedFd<'_>>,
    ) -> io::Result<Self> {
        install_handler()?;
        let connection = connection.map(|c| c.try_clone_to_owned()).transpose()?;
        let slot = SLOTS
            .iter()
            .position(|s| {
                s.taken
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            })
            .ok_or_else(|| {
                io::Error::other(format!(
                    "every one of the {MAX_GUARDS} fault guards is in use"
                ))
            })?;
        let s = &SLOTS[slot];
        s.faulted.store(false, Ordering::Relaxed);
        s.connection.store(
            connection.as_ref().map_or(-1, |c| c.as_raw_fd()),
            Ordering::Relaxed,
        );
        s.start.store(addr as usize, Ordering::Relaxed);
        // Published last: the handler matches a range only once its length is set.
        s.len.store(len, Ordering::Release);
        Ok(FaultGuard {
            slot,
            _connection: connection,
        })
    }

    /// Whether a fault in this mapping was contained (the frontend truncated its file).
    pub fn faulted(&self) -> bool {
        SLOTS[self.slot].faulted.load(Ordering::Acquire)
    }
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        let s = &SLOTS[self.slot];
        s.len.store(0, Ordering::Release);
        s.connection.store(-1, Ordering::Release);
        s.taken.store(false, Ordering::Release);
    }
}

fn install_handler() -> io::Result<()> {
    static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();
    (*INSTALLED.get_or_init(|| {
        // SAFETY: sigaction with a zeroed (then filled) struct: our handler is an
        // `extern "C"` function of the SA_SIGINFO signature, the mask is emptied with
        // sigemptyset, and the previous action is written to a live local.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus
                as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void)
                as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &action, &mut previous) != 0 {
                return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
            }
            let _ = PREVIOUS.set(previous);
        }
        Ok(())
    }))
    .map_err(io::Error::from_raw_os_error)
}

/// The guarded range containing `addr`, if any.
fn guarded(addr: usize) -> Option<&'static Slot> {
    SLOTS.iter().find(|s| {
        let len = s.len.load(Ordering::Acquire);
        let start = s.start.load(Ordering::Relaxed);
        len != 0 && addr >= start && addr - start < len
    })
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler; for SIGBUS,
    // si_addr is the faulting address.
    let addr = unsafe { (*info).si_addr() } as usize;
    if let Some(slot) = guarded(addr) {
        let start = slot.start.load(Ordering::Relaxed);
        let len = slot.len.load(Ordering::Relaxed);
        // SAFETY: replaces exactly the guarded mapping (which its guard keeps registered only
        // while it is mapped, or already unmapped) with private anonymous memory of the same
        // size, so that the faulting instruction, retried on return, completes. Nothing in the
        // daemon holds references into the file's pages: all access is through this range.
        let replaced = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if replaced != libc::MAP_FAILED {
            slot.faulted.store(true, Ordering::Release);
            CONTAINED.fetch_add(1, Ordering::Relaxed);
            let fd = slot.connection.load(Ordering::Acquire);
            if fd >= 0 {
                // SAFETY: shutdown(2) on a descriptor the guard keeps open; it only ends the
                // connection's traffic, which the session sees as a disconnect.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            }
            return;
        }
    }
    pass_on(sig, info, ctx);
}

/// Hands a fault that is not ours to the disposition installed before ours.
fn pass_on(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let previous = PREVIOUS.get().map_or(libc::SIG_DFL, |p| p.sa_sigaction);
    let siginfo = PREVIOUS
        .get()
        .is_some_and(|p| p.sa_flags & libc::SA_SIGINFO != 0);
    if previous == libc::SIG_DFL || previous == libc::SIG_IGN {
        // Back to the default action: on return the access faults again and the process dies
        // as it would have without us (ignoring a SIGBUS would retry it forever).
        // SAFETY: sigaction with a zeroed struct (SIG_DFL, empty mask, no flags).
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &dfl, std::ptr::null_mut());
        }
    } else if siginfo {
        // SAFETY: an SA_SIGINFO handler address installed by the previous owner of SIGBUS.
        let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(previous) };
        handler(sig, info, ctx);
    } else {
        // SAFETY: a plain handler address installed by the previous owner of SIGBUS.
        let handler: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(previous) };
        handler(sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    /// Maps `pages` pages of a memfd that cannot be sealed.
    fn unsealable_mapping(pages: usize) -> (File, *mut u8, usize) {
        let f = File::from(
            rustix::fs::memfd_create(c"guard-test", rustix::fs::MemfdFlags::empty()).unwrap(),
        );
        let len = pages * 4096;
        f.set_len(len as u64).unwrap();
        // SAFETY: a fresh shared mapping of the whole file; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        (f, p.cast(), len)
    }

    #[test]
    fn a_truncated_guarded_mapping_reads_zeros_and_ends_its_connection() {
        let (f, p, len) = unsealable_mapping(4);
        // SAFETY: within the live mapping.
        unsafe { p.add(4096).write_volatile(7) };
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let before = contained();
        let guard = FaultGuard::new(p, len, Some(ours.as_fd_borrowed())).unwrap();
        f.set_len(0).unwrap();
        // SAFETY: within the mapping, which the guard keeps from killing us after the
        // truncation.
        let byte = unsafe { p.add(4096).read_volatile() };
        assert_eq!(
            byte, 0,
            "the contained access reads the anonymous replacement"
        );
        // SAFETY: as above; writes land in the replacement.
        unsafe { p.add(3 * 4096).write_volatile(1) };
        assert!(guard.faulted());
        assert!(contained() > before);
        let mut buf = [0u8; 1];
        assert_eq!(
            theirs.read(&mut buf).unwrap(),
            0,
            "the connection was shut down"
        );
        drop(guard);
        // SAFETY: the mapping as mmap returned it.
        unsafe { libc::munmap(p.cast(), len) };
    }

    #[test]
    fn guards_are_released_and_reused() {
        let (_f, p, len) = unsealable_mapping(1);
        for _ in 0..2 * MAX_GUARDS {
            let g = FaultGuard::new(p, len, None).unwrap();
            assert!(!g.faulted());
        }
        // SAFETY: the mapping as mmap returned it.
        unsafe { libc::munmap(p.cast(), len) };
    }

    trait AsFdBorrowed {
        fn as_fd_borrowed(&self) -> BorrowedFd<'_>;
    }
    impl AsFdBorrowed for UnixStream {
        fn as_fd_borrowed(&self) -> BorrowedFd<'_> {
            std::os::fd::AsFd::as_fd(self)
        }
    }
}
