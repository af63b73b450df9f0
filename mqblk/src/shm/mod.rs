//! Shared memory a frontend can no longer take away from under the daemon.
//!
//! Every file the frontend shares (guest memory, the in-flight region, the dirty log) is mapped
//! and then read and written by the daemon's threads. If the frontend truncates such a file
//! afterwards, the next access to a page past its new end raises SIGBUS, which by default kills
//! the whole process: every tenant's export with it. Two defences, in order of preference:
//!
//! - [`seal`]: a memfd sealed against shrinking (`F_SEAL_SHRINK`) can never be truncated, by
//!   anyone. QEMU's `memory-backend-memfd` seals its memory by default; a memfd that allows
//!   sealing and is not yet sealed gets the seal from mqblk. The files mqblk creates itself are
//!   sealed against any size change.
//! - [`fault`]: a file that cannot be sealed (a memfd created without `MFD_ALLOW_SEALING`, a
//!   file on tmpfs or hugetlbfs) is mapped under a fault guard: a SIGBUS inside its mapping
//!   replaces the mapping with anonymous memory, so the access completes, and shuts down the
//!   connection of the frontend that shared it. The truncation costs that frontend its
//!   connection and nothing else.
//!
//! [`protect`] picks between the two for one mapping.

pub mod fault;
pub mod seal;

use std::fs::File;
use std::os::fd::BorrowedFd;

pub use fault::FaultGuard;

/// How a mapping of a frontend's file is kept from faulting the daemon.
pub enum Protection {
    /// The file can never shrink (it was sealed already, or mqblk sealed it).
    Sealed,
    /// The file can shrink; a fault in its mapping is contained by this guard, which must live
    /// at least as long as the mapping.
    Guarded(FaultGuard),
}

/// Protects `len` bytes mapped at `addr` from `file`, which the frontend on `connection` shared:
/// seals the file against shrinking where it can, and guards the mapping otherwise.
///
/// Call it right after mapping, before any access. Fails only when the file can be neither
/// sealed nor guarded (every guard slot is taken).
pub fn protect(
    file: &File,
    addr: *const u8,
    len: usize,
    connection: Option<BorrowedFd<'_>>,
) -> std::io::Result<Protection> {
    match seal::against_shrinking(file) {
        Ok(()) => Ok(Protection::Sealed),
        Err(why) => {
            tracing::debug!(%why, "shared file cannot be sealed; its mapping is fault-guarded");
            FaultGuard::new(addr, len, connection).map(Protection::Guarded)
        }
    }
}
