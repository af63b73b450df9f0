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
//! [`Protection`] picks between the two for one file and its mapping.

pub mod fault;
pub mod seal;

use std::fs::File;
use std::os::fd::BorrowedFd;

pub use fault::FaultGuard;

/// How a mapping of a frontend's file is kept from faulting the daemon. Decided before the
/// file's length is checked: a length checked after sealing stays true, while one checked
/// before could change before the seal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    /// The file can never shrink (it was sealed already, or mqblk sealed it).
    Sealed,
    /// The file can shrink: its mappings need a [`FaultGuard`].
    Unsealable,
}

impl Protection {
    /// Seals `file`, which a frontend shared, against shrinking where it can.
    pub fn of(file: &File) -> Protection {
        match seal::against_shrinking(file) {
            Ok(()) => Protection::Sealed,
            Err(why) => {
                tracing::debug!(%why, "shared file cannot be sealed; its mapping is fault-guarded");
                Protection::Unsealable
            }
        }
    }

    /// The guard a mapping of `len` bytes at `addr` of the file needs (none when sealed); a
    /// fault in it shuts `connection` down. Take it right after mapping, before any access.
    /// Fails only when every guard slot is taken.
    pub fn guard(
        self,
        addr: *const u8,
        len: usize,
        connection: Option<BorrowedFd<'_>>,
    ) -> std::io::Result<Option<FaultGuard>> {
        match self {
            Protection::Sealed => Ok(None),
            Protection::Unsealable => FaultGuard::new(addr, len, connection).map(Some),
        }
    }
}
