//! Mappings the metadata worker has made and not yet written back to the image file.
//!
//! A job that may change mappings (an allocating write, a zeroing) is counted here from before
//! any mapping it makes can be seen until it completes, which is after the group commit that
//! wrote its changes back. A reply that relies on a mapping (a write into clusters it found
//! allocated, the mappings it hands a thread to cache) must not rely on one counted here: a
//! crash of mqblk before the commit would lose the mapping and with it the acknowledged write.

use std::ops::RangeInclusive;
use std::sync::Mutex;

use super::locks::{clusters, overlap};

/// Guest clusters being allocated, and zeroings under way.
#[derive(Default)]
pub struct Unpersisted {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The cluster ranges of the writes that may be allocating (one entry per write at work,
    /// whatever its length).
    writes: Vec<RangeInclusive<u64>>,
    /// Zeroings under way (rare; they count for every cluster).
    zeroings: u32,
}

impl Unpersisted {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A write that may allocate the clusters of `offset..offset + len` begins.
    pub fn add_write(&self, offset: u64, len: u64, bits: u32) {
        self.lock().writes.push(clusters(offset, len, bits));
    }

    /// That write completed.
    pub fn remove_write(&self, offset: u64, len: u64, bits: u32) {
        let range = clusters(offset, len, bits);
        let mut inner = self.lock();
        if let Some(i) = inner.writes.iter().position(|r| *r == range) {
            inner.writes.swap_remove(i);
        }
    }

    /// A zeroing begins.
    pub fn add_zeroing(&self) {
        self.lock().zeroings += 1;
    }

    /// That zeroing completed.
    pub fn remove_zeroing(&self) {
        let mut inner = self.lock();
        inner.zeroings = inner.zeroings.saturating_sub(1);
    }

    /// Whether a zeroing is under way.
    pub fn zeroing(&self) -> bool {
        self.lock().zeroings > 0
    }

    /// Whether a mapping of `offset..offset + len` may not be in the image file yet.
    pub fn touches(&self, offset: u64, len: u64, bits: u32) -> bool {
        let range = clusters(offset, len, bits);
        let inner = self.lock();
        inner.zeroings > 0 || inner.writes.iter().any(|r| overlap(r, &range))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_unpersisted_while_a_write_or_a_zeroing_of_it_is_under_way() {
        let u = Unpersisted::default();
        // 64 KiB clusters: a write over 60 KiB..68 KiB is clusters 0 and 1.
        u.add_write(60 << 10, 8 << 10, 16);
        u.add_write(64 << 10, 4 << 10, 16);
        assert!(u.touches(0, 512, 16) && u.touches(100 << 10, 512, 16));
        assert!(!u.touches(128 << 10, 64 << 10, 16));
        u.remove_write(60 << 10, 8 << 10, 16);
        assert!(!u.touches(0, 512, 16), "cluster 0 was released");
        assert!(u.touches(64 << 10, 512, 16), "cluster 1 still has a write");
        u.remove_write(64 << 10, 4 << 10, 16);
        assert!(!u.touches(0, 1 << 30, 16));
        u.add_zeroing();
        assert!(u.zeroing() && u.touches(1 << 29, 512, 16));
        u.remove_zeroing();
        assert!(!u.zeroing() && !u.touches(0, 1 << 30, 16));
    }
}
