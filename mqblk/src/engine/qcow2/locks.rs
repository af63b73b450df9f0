//! What a metadata-path write holds while it works: its guest clusters, so that no other write
//! changes a cluster between the copy-on-write's read of the cluster's rest and its write of
//! the whole cluster ([`cow`](super::cow)), and no read sees a new cluster mapped before its
//! data is written ([`early_maps`](super::early_maps)); reads on the metadata path hold
//! theirs too.
//!
//! A write holds its whole range of clusters at once, so no two writes can wait for each
//! other. What is held is a list of ranges, one per write at work (at most the worker's
//! running jobs), whatever the length of the guest's request.

use std::future::poll_fn;
use std::ops::RangeInclusive;
use std::sync::Mutex;
use std::task::{Poll, Waker};

/// The guest clusters `offset..offset + len` cover, for clusters of `1 << bits` bytes.
pub fn clusters(offset: u64, len: u64, bits: u32) -> RangeInclusive<u64> {
    (offset >> bits)..=((offset + len.max(1) - 1) >> bits)
}

/// Whether two cluster ranges share a cluster.
pub fn overlap(a: &RangeInclusive<u64>, b: &RangeInclusive<u64>) -> bool {
    a.start() <= b.end() && b.start() <= a.end()
}

/// Ranges of guest clusters that metadata-path writes are working on, and who waits.
#[derive(Default)]
pub struct ClusterLocks {
    state: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    ranges: Vec<RangeInclusive<u64>>,
    waiters: Vec<Waker>,
}

/// Holds a range of [`ClusterLocks`] until dropped.
pub struct ClusterGuard<'a> {
    locks: &'a ClusterLocks,
    range: RangeInclusive<u64>,
}

impl ClusterLocks {
    fn state(&self) -> std::sync::MutexGuard<'_, Held> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until no other write holds a cluster of `offset..offset + len` (clusters of
    /// `1 << bits` bytes), and holds them all.
    pub async fn lock_range(&self, offset: u64, len: u64, bits: u32) -> ClusterGuard<'_> {
        let range = clusters(offset, len, bits);
        poll_fn(|cx| {
            let mut held = self.state();
            if held.ranges.iter().any(|r| overlap(r, &range)) {
                held.waiters.push(cx.waker().clone());
                return Poll::Pending;
            }
            held.ranges.push(range.clone());
            Poll::Ready(())
        })
        .await;
        ClusterGuard { locks: self, range }
    }
}

impl Drop for ClusterGuard<'_> {
    fn drop(&mut self) {
        let waiters = {
            let mut held = self.locks.state();
            if let Some(i) = held.ranges.iter().position(|r| *r == self.range) {
                held.ranges.swap_remove(i);
            }
            std::mem::take(&mut held.waiters)
        };
        // Every waiter looks again (there are at most as many as jobs at work).
        for w in waiters {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::Context;

    use super::super::counted_wakes::Count;
    use super::*;

    #[test]
    fn a_cluster_is_held_by_one_write_at_a_time_and_the_waiter_is_woken() {
        let locks = ClusterLocks::default();
        let (waker, count) = Count::waker();
        let mut cx = Context::from_waker(&waker);
        // 64 KiB clusters: cluster 3.
        let mut first = Box::pin(locks.lock_range(3 << 16, 4096, 16));
        let Poll::Ready(held) = first.as_mut().poll(&mut cx) else {
            panic!("a free cluster must be taken at once");
        };
        let mut second = Box::pin(locks.lock_range((3 << 16) + 8192, 4096, 16));
        assert!(second.as_mut().poll(&mut cx).is_pending());
        // Another cluster is free (and stays held to the end: a release wakes every waiter).
        let mut other = Box::pin(locks.lock_range(4 << 16, 4096, 16));
        let Poll::Ready(_other) = other.as_mut().poll(&mut cx) else {
            panic!("cluster 4 is free");
        };
        assert_eq!(count.get(), 0);
        drop(held);
        assert_eq!(count.get(), 1, "the waiter was not woken");
        assert!(second.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn a_range_holds_each_of_its_clusters_whatever_its_length() {
        let locks = ClusterLocks::default();
        // 64 KiB clusters: 60 KiB..72 KiB touches clusters 0 and 1.
        let held = futures::executor::block_on(locks.lock_range(60 << 10, 12 << 10, 16));
        assert_eq!(held.range, 0..=1);
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Box::pin(locks.lock_range(1 << 16, 512, 16))
            .as_mut()
            .poll(&mut cx)
            .is_pending());
        drop(held);
        assert!(Box::pin(locks.lock_range(1 << 16, 512, 16))
            .as_mut()
            .poll(&mut cx)
            .is_ready());
        // A 2 GiB request over 512-byte clusters is one entry, not four million.
        let big = futures::executor::block_on(locks.lock_range(0, 1 << 31, 9));
        assert_eq!(big.range, 0..=(1 << 22) - 1);
        assert_eq!(locks.state().ranges.len(), 1);
    }
}
