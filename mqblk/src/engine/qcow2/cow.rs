//! Copy-on-write done by the metadata workers themselves, and the locks that keep it correct.
//!
//! A guest write of part of a cluster that the top image does not hold yet needs the rest of
//! the cluster from where it reads now (a backing image, or zeros). imago does that under
//! its lock of the cluster's L2 table: a read of the whole cluster, a write of it, then the
//! guest's write, one after the other, while every other allocation in the same table (512 MiB
//! of guest disk at 64 KiB clusters) waits. Here the worker reads the rest of the cluster
//! first, on its ring, outside any imago lock and in parallel with other jobs, and then hands
//! imago one write of the whole cluster (that rest around the guest's data), which imago maps
//! without copying anything: one write under the table's lock instead of three I/Os.
//!
//! Between reading the rest and writing the cluster, nothing else may change the cluster, or
//! the stale rest would overwrite it. Every metadata-path write holds [`ClusterLocks`] on its
//! clusters for the whole of its work (the I/O threads write only clusters already allocated,
//! which this path never rewrites), and zeroing holds `Image::zeroing` exclusively, which
//! every write holds shared.

use std::collections::hash_map::{Entry, HashMap};
use std::future::poll_fn;
use std::io;
use std::os::fd::RawFd;
use std::sync::Mutex;
use std::task::{Poll, Waker};

use imago::io_buffers::{IoBuffer, IoVector};

use super::image::Image;
use super::mapping::Target;
use super::metadata::resolve;
use super::uring_io;

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

/// Writes the guest's `data` (`len` bytes at guest `offset`, inside one cluster and less than
/// all of it) into a cluster that the top image does not hold yet, as one write of the whole
/// cluster: the rest read from where the cluster reads now. `None` when that is not the case
/// (the cluster is allocated, or only imago can read it, or the range is not inside one
/// cluster), or the rest could not be read: imago's own write does it then.
///
/// The caller holds the cluster's lock ([`ClusterLocks`]) and `Image::zeroing` shared.
pub async fn write_into_new_cluster(
    image: &Image,
    offset: u64,
    data: &[&[u8]],
    len: u64,
) -> Option<io::Result<()>> {
    let size = 1u64 << image.cluster_bits;
    let start = offset & !(size - 1);
    if len == 0 || len >= size || offset + len > start + size {
        return None;
    }
    let mut rest = IoBuffer::new(size as usize, image.access.mem_align().max(4096)).ok()?;
    let mut at = start;
    while at < start + size {
        let (target, n) = resolve(&image.access, at, start + size - at).await.ok()?;
        let n = n.min(start + size - at);
        if n == 0 {
            return None;
        }
        let within = (at - start) as usize..(at - start + n) as usize;
        let dst = rest.as_mut_range(within).into_slice();
        match target? {
            Target::Zeros => dst.fill(0),
            Target::File { layer, offset, .. } if layer > 0 => {
                read_full(image.layer_fd(layer)?, dst, offset).await.ok()?;
            }
            // In the top image: written in place by imago.
            Target::File { .. } => return None,
        }
        at += n;
    }
    let (head, tail) = ((offset - start) as usize, (offset - start + len) as usize);
    let mut whole = IoVector::with_capacity(data.len() + 2);
    if head > 0 {
        whole.push(rest.as_ref_range(0..head).into_slice());
    }
    for d in data {
        whole.push(d);
    }
    if tail < size as usize {
        whole.push(rest.as_ref_range(tail..size as usize).into_slice());
    }
    Some(image.access.writev(whole, start).await)
}

/// Fills `buf` from `fd` at `offset`; past the end of the file, with zeros.
async fn read_full(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = uring_io::read_at(fd, &mut buf[done..], offset + done as u64).await?;
        if n == 0 {
            buf[done..].fill(0);
            break;
        }
        done += n;
    }
    Ok(())
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
