//! What the qcow2 exports of one daemon may take in imago's tables together
//! (`mqblk serve --table-memory-total`).
//!
//! Each export's chain is bounded by its own `table-memory-max=` when it opens (each image's
//! L1 table and the L2 tables imago caches for it: `format::qcow2::header::chain`), but a host
//! serves many exports, each of which may be an image a tenant uploaded: at the default bound
//! of 2 GiB, a dozen crafted chains could take more than the host has. Each qcow2 export
//! holds a [`TableLease`] of its chain's bound from its open to its end, and a snapshot
//! grows it by the new overlay's tables before the overlay becomes the top; an export whose
//! lease would take the total past the budget is refused in one line. What is counted is
//! what the tables *could* take, as `table-memory-max=` counts it, not what they take now:
//! the admission is decided at start, not by a guest's reads later.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use thiserror::Error;

/// The daemon's budget, unbounded until [`set_total`] (an engine opened outside `serve`).
static BUDGET: TableBudget = TableBudget::new(u64::MAX);

/// The least `--table-memory-total`: two images of 64 KiB clusters.
pub const MIN_TOTAL: u64 = 16 << 20;

/// The budget unless given: half the host's memory, which no honest host reaches (8 MiB a
/// 64 KiB-cluster image), and which leaves the rest to the guests and the page cache when
/// crafted chains try.
pub fn default_total() -> u64 {
    let info = rustix::system::sysinfo();
    // (`c_ulong`: 32 bits on some targets.)
    let ram = (info.totalram as u64).saturating_mul(u64::from(info.mem_unit.max(1)));
    (ram / 2).max(MIN_TOTAL)
}

/// Sets the daemon's budget (`serve` does, before any export starts).
pub fn set_total(bytes: u64) {
    BUDGET.total.store(bytes, Ordering::Relaxed);
}

/// The daemon's budget.
pub fn budget() -> &'static TableBudget {
    &BUDGET
}

/// A lease that would take the daemon past its budget.
#[derive(Debug, Error, PartialEq, Eq)]
#[error(
    "the backing chain of {image} could hold {mib} MiB of tables in memory, and the daemon's \
     other qcow2 exports may hold {used_mib} MiB of --table-memory-total={total_mib}M: remove \
     an export, lower its table-memory-max= or shorten its chain, or raise --table-memory-total"
)]
pub struct OverBudget {
    /// The top image of the chain.
    pub image: String,
    /// What its chain's tables could take, in MiB (after a snapshot, with the new overlay).
    pub mib: u64,
    /// What the other leases hold, in MiB.
    pub used_mib: u64,
    /// The budget, in MiB.
    pub total_mib: u64,
}

/// Bytes of tables the daemon's qcow2 exports may hold at once, and what they hold.
#[derive(Debug)]
pub struct TableBudget {
    total: AtomicU64,
    used: Mutex<u64>,
}

impl TableBudget {
    /// A budget of `total` bytes, none of it held.
    pub const fn new(total: u64) -> TableBudget {
        TableBudget {
            total: AtomicU64::new(total),
            used: Mutex::new(0),
        }
    }

    fn used(&self) -> std::sync::MutexGuard<'_, u64> {
        self.used.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `bytes` for the chain of `image` until the lease is dropped.
    pub fn lease(&'static self, bytes: u64, image: &Path) -> Result<TableLease, OverBudget> {
        let mut lease = TableLease {
            budget: self,
            bytes: 0,
        };
        lease.grow_to(bytes, image)?;
        Ok(lease)
    }
}

/// Bytes of a [`TableBudget`] held by one export's chain, given back when dropped.
#[derive(Debug)]
pub struct TableLease {
    budget: &'static TableBudget,
    bytes: u64,
}

impl TableLease {
    /// The bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Holds `bytes` instead (the chain of `image` after a snapshot), if the budget has room;
    /// otherwise holds what it held.
    pub fn grow_to(&mut self, bytes: u64, image: &Path) -> Result<(), OverBudget> {
        let mut used = self.budget.used();
        let others = *used - self.bytes;
        let total = self.budget.total.load(Ordering::Relaxed);
        if others.saturating_add(bytes) > total {
            return Err(OverBudget {
                image: image.display().to_string(),
                mib: bytes.div_ceil(1 << 20),
                used_mib: others.div_ceil(1 << 20),
                total_mib: total >> 20,
            });
        }
        *used = others + bytes;
        self.bytes = bytes;
        Ok(())
    }
}

impl Drop for TableLease {
    fn drop(&mut self) {
        *self.budget.used() -= self.bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn leases_are_granted_up_to_the_total_and_given_back_when_dropped() {
        let budget: &'static TableBudget = Box::leak(Box::new(TableBudget::new(20 * MIB)));
        let a = budget.lease(8 * MIB, Path::new("a.qcow2")).unwrap();
        let mut b = budget.lease(8 * MIB, Path::new("b.qcow2")).unwrap();
        let e = budget.lease(8 * MIB, Path::new("c.qcow2")).unwrap_err();
        assert_eq!(
            e,
            OverBudget {
                image: "c.qcow2".into(),
                mib: 8,
                used_mib: 16,
                total_mib: 20,
            }
        );
        assert!(e.to_string().contains("--table-memory-total=20M"), "{e}");
        // A snapshot that would double b's chain does not fit, and b keeps what it held.
        let e = b.grow_to(16 * MIB, Path::new("b.qcow2")).unwrap_err();
        assert_eq!((e.mib, e.used_mib), (16, 8));
        assert_eq!(*budget.used(), 16 * MIB);
        // Once a is gone, it does.
        drop(a);
        b.grow_to(16 * MIB, Path::new("b.qcow2")).unwrap();
        assert_eq!(*budget.used(), 16 * MIB);
        drop(b);
        assert_eq!(*budget.used(), 0);
        // A total of exactly what is asked is enough.
        let whole = budget.lease(20 * MIB, Path::new("d.qcow2")).unwrap();
        assert!(budget.lease(1, Path::new("e.qcow2")).is_err());
        drop(whole);
    }
}
