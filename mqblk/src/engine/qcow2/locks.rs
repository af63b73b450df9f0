//! What a metadata-path write holds while it works: its guest clusters, so that no other write
//! changes a cluster between the copy-on-write's read of the cluster's rest and its write of
//! the whole cluster ([`cow`](super::cow)).

use std::collections::hash_map::{Entry, HashMap};
use std::future::poll_fn;
use std::sync::Mutex;
use std::task::{Poll, Waker};

/// Guest clusters that a metadata-path write is working on, and who waits for them.
#[derive(Default)]
pub struct ClusterLocks {
    held: Mutex<HashMap<u64, Vec<Waker>>>,
}

/// Holds one cluster of [`ClusterLocks`] until dropped.
pub struct ClusterGuard<'a> {
    locks: &'a ClusterLocks,
    cluster: u64,
}

impl ClusterLocks {
    /// Waits until guest cluster `cluster` is free, and holds it.
    pub async fn lock(&self, cluster: u64) -> ClusterGuard<'_> {
        poll_fn(|cx| {
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            match held.entry(cluster) {
                Entry::Vacant(v) => {
                    v.insert(Vec::new());
                    Poll::Ready(())
                }
                Entry::Occupied(mut o) => {
                    o.get_mut().push(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await;
        ClusterGuard {
            locks: self,
            cluster,
        }
    }

    /// Holds every cluster of `offset..offset + len` (clusters of `1 << bits` bytes), taken in
    /// ascending order, as every holder takes them (no two writes can wait for each other).
    pub async fn lock_range(&self, offset: u64, len: u64, bits: u32) -> Vec<ClusterGuard<'_>> {
        let (first, last) = (offset >> bits, (offset + len.max(1) - 1) >> bits);
        let mut guards = Vec::with_capacity((last - first + 1) as usize);
        for cluster in first..=last {
            guards.push(self.lock(cluster).await);
        }
        guards
    }
}

impl Drop for ClusterGuard<'_> {
    fn drop(&mut self) {
        let waiters = self
            .locks
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.cluster);
        for w in waiters.into_iter().flatten() {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Wake};

    use super::*;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_cluster_is_held_by_one_write_at_a_time_and_the_waiter_is_woken() {
        let locks = ClusterLocks::default();
        let count = Arc::new(Count::default());
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut first = Box::pin(locks.lock(3));
        let Poll::Ready(held) = first.as_mut().poll(&mut cx) else {
            panic!("a free cluster must be taken at once");
        };
        let mut second = Box::pin(locks.lock(3));
        assert!(second.as_mut().poll(&mut cx).is_pending());
        // Another cluster is free.
        assert!(Box::pin(locks.lock(4)).as_mut().poll(&mut cx).is_ready());
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        drop(held);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "the waiter was not woken"
        );
        assert!(second.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn a_range_holds_each_of_its_clusters() {
        let locks = ClusterLocks::default();
        // 64 KiB clusters: 60 KiB..72 KiB touches clusters 0 and 1.
        let held = futures::executor::block_on(locks.lock_range(60 << 10, 12 << 10, 16));
        assert_eq!(held.iter().map(|g| g.cluster).collect::<Vec<_>>(), [0, 1]);
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Box::pin(locks.lock(1)).as_mut().poll(&mut cx).is_pending());
        drop(held);
        assert!(Box::pin(locks.lock(1)).as_mut().poll(&mut cx).is_ready());
    }
}
