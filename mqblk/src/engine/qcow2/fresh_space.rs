//! Which parts of the top image file are known to read as zeros because this process grew the
//! file over them and has not touched them since: there, a new cluster whose copy-on-write
//! rest is zeros needs only the guest's part written ([`cow`](super::cow)), not the whole
//! cluster (QEMU's qcow2 driver skips such zero copy-on-write the same way, with a
//! write-zeroes of the cluster first).
//!
//! Everything at or past the file's length at open reads as zeros until something writes it:
//! the file grows by `fallocate` (unwritten extents) or `ftruncate` (a hole), both read as
//! zeros, on stable storage too once a sync has made the growth durable (and the L2 entry of a
//! new cluster goes after such a sync, as for any new cluster's data: `write_order`). Every
//! write, zeroing, discard or preallocation of the file through the storage marks its range
//! touched, before it is issued; a range is fresh only while none of it is marked. A cluster
//! that imago freed and hands out again was written when it was first used, so it is never
//! fresh. Before the file's length at open nothing is known (a file grown ahead by an earlier
//! run holds stale data wherever that run wrote), so nothing there is fresh.
//!
//! The marks are kept per [`GRANULE`] of the file (a bit each), so a cluster smaller than that
//! shares its bit with its neighbours and is fresh less often (never wrongly). The bitmap grows
//! with what is touched, up to [`MAX_GRANULES`] past the length at open (2 MiB of bits, a TiB
//! of file); a range past that is never fresh, so an image whose tables point far past its end
//! cannot make the bitmap large.

use std::sync::Mutex;

/// The file bytes one bit stands for.
pub const GRANULE: u64 = 64 << 10;

/// The most granules past the length at open that are tracked.
const MAX_GRANULES: u64 = 1 << 24;

/// The fresh part of one image file.
#[derive(Debug)]
pub struct FreshSpace {
    /// The file's length at open, rounded up to a granule: nothing before it is fresh.
    from: u64,
    /// A bit per granule from `from`: touched.
    touched: Mutex<Vec<u64>>,
}

impl FreshSpace {
    /// For a file whose length is now `len`.
    pub fn new(len: u64) -> FreshSpace {
        FreshSpace {
            from: len.next_multiple_of(GRANULE),
            touched: Mutex::new(Vec::new()),
        }
    }

    /// The granules `offset..offset + len` overlaps past `from`, as indices from `from`
    /// (`None`: it lies wholly before `from`).
    fn granules(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
        let end = offset.saturating_add(len);
        if end <= self.from || len == 0 {
            return None;
        }
        let first = (offset.max(self.from) - self.from) / GRANULE;
        let last = (end - self.from).div_ceil(GRANULE);
        Some((first, last))
    }

    /// Marks `offset..offset + len` touched (call before the write, zeroing or discard is
    /// issued).
    pub fn touch(&self, offset: u64, len: u64) {
        let Some((first, last)) = self.granules(offset, len) else {
            return;
        };
        let last = last.min(MAX_GRANULES);
        if first >= last {
            return;
        }
        let mut bits = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        let words = last.div_ceil(64) as usize;
        if bits.len() < words {
            bits.resize(words, 0);
        }
        for g in first..last {
            bits[(g / 64) as usize] |= 1 << (g % 64);
        }
    }

    /// Whether all of `offset..offset + len` reads as zeros: past the length at open, within
    /// the tracked granules, and not touched.
    pub fn is_fresh(&self, offset: u64, len: u64) -> bool {
        if offset < self.from || len == 0 {
            return false;
        }
        let Some((first, last)) = self.granules(offset, len) else {
            return false;
        };
        if last > MAX_GRANULES {
            return false;
        }
        let bits = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        (first..last).all(|g| {
            bits.get((g / 64) as usize)
                .is_none_or(|w| w & (1 << (g % 64)) == 0)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ranges_past_the_length_at_open_that_nothing_touched_are_fresh() {
        let f = FreshSpace::new(100_000);
        let from = 2 * GRANULE;
        assert!(!f.is_fresh(0, GRANULE), "before the length at open");
        assert!(
            !f.is_fresh(from - 4096, 8192),
            "straddles the length at open"
        );
        assert!(f.is_fresh(from, GRANULE));
        assert!(f.is_fresh(from + 10 * GRANULE, 3 * GRANULE));
        assert!(!f.is_fresh(from, 0), "an empty range is no cluster");

        // A write of one block marks its whole granule, and only that one.
        f.touch(from + 5 * GRANULE + 4096, 4096);
        assert!(!f.is_fresh(from + 5 * GRANULE, GRANULE));
        assert!(!f.is_fresh(from + 4 * GRANULE, 2 * GRANULE), "overlaps it");
        assert!(f.is_fresh(from + 4 * GRANULE, GRANULE));
        assert!(f.is_fresh(from + 6 * GRANULE, GRANULE));

        // A touch that starts before the length at open marks what lies past it.
        f.touch(0, from + 1);
        assert!(!f.is_fresh(from, GRANULE));
        assert!(f.is_fresh(from + GRANULE, GRANULE));

        // Across a word of the bitmap.
        f.touch(from + 63 * GRANULE, 2 * GRANULE);
        assert!(!f.is_fresh(from + 64 * GRANULE, GRANULE));
        assert!(f.is_fresh(from + 65 * GRANULE, GRANULE));
    }

    #[test]
    fn past_the_tracked_granules_nothing_is_fresh_and_the_bitmap_stays_bounded() {
        let f = FreshSpace::new(0);
        let far = MAX_GRANULES * GRANULE;
        assert!(f.is_fresh(far - GRANULE, GRANULE));
        assert!(!f.is_fresh(far, GRANULE), "past the tracked granules");
        // A touch far past the end (an image's table pointing there) grows nothing.
        f.touch(u64::MAX / 2, GRANULE);
        f.touch(far + GRANULE, u64::MAX);
        assert!(f.touched.lock().unwrap().is_empty());
        assert!(f.is_fresh(0, GRANULE));
    }
}
