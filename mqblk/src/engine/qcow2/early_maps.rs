//! New clusters that imago maps before their data is written, and the L2 table writes that
//! wait for that data.
//!
//! imago holds an L2 table's write lock from preparing a mapping to committing it. A
//! copy-on-write that writes its new cluster between the two keeps every other allocation in
//! the same table (512 MiB of guest disk at 64 KiB clusters) waiting for that write: on an
//! empty overlay, one data write per L2 table at a time. So the copy-on-write
//! ([`cow`](super::cow)) commits the mapping first, in imago's cache, and writes the data
//! after, with the lock released. Until the data is written, nothing may see the mapping:
//!
//! - not the image file: a write of an L2 table waits until no such data write is under way
//!   ([`EarlyMaps::settled`]), and while one waits no mapping is committed early (the
//!   copy-on-write then writes its data first, as imago does), so the wait ends. The table's
//!   bytes were taken before the wait, and the sync before an L2 table
//!   ([`write_order`](super::write_order)) comes after it, so it covers that data;
//! - not a read: the write holds its cluster (`ClusterLocks`) until its data is written, as
//!   reads on the metadata path do theirs, and the I/O threads are not given the mapping before
//!   the write's group commit (`unpersisted`).
//!
//! It cannot wait for itself: a copy-on-write makes no I/O of imago's between its commit and
//! its data write, and imago's commit writes refcount blocks at most, never an L2 table.
//! (`tests/qcow2.rs` widens the window with a debug build's delay, [`test_hooks`](super::test_hooks),
//! and kills mqblk inside it.)
//!
//! If the data write fails after its mapping was committed, the mapping points at a cluster
//! without the data, and nothing may write it to the file: the image is given up
//! ([`Image::give_up`](super::image::Image::give_up)), every metadata write and metadata-path
//! request fails from then on, and the file keeps what the last group commit wrote (every
//! acknowledged write). Serving it again starts from there.

use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::task::{Poll, Waker};

/// The new clusters mapped ahead of their data, and who waits for their data.
#[derive(Debug, Default)]
pub struct EarlyMaps {
    state: Mutex<State>,
    /// The image was given up: no metadata may be written (read by every metadata write: no
    /// lock).
    broken: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    /// Data writes under way into clusters mapped ahead of them.
    pending: usize,
    /// L2 table writes waiting for those: no new mapping is made early meanwhile.
    draining: usize,
    waiters: Vec<Waker>,
}

/// A data write into a cluster mapped ahead of it, under way until dropped.
#[must_use = "the write is under way until the guard is dropped"]
pub struct Early<'a> {
    maps: &'a EarlyMaps,
}

impl EarlyMaps {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a data write under way into a cluster to be mapped ahead of it, unless an L2
    /// table write is waiting for such writes to end (then the caller writes the data first).
    pub fn begin(&self) -> Option<Early<'_>> {
        if self.broken() {
            return None;
        }
        let mut s = self.state();
        if s.draining > 0 {
            return None;
        }
        s.pending += 1;
        Some(Early { maps: self })
    }

    /// Waits until no data write into a cluster mapped ahead of it is under way.
    pub async fn settled(&self) {
        {
            let mut s = self.state();
            if s.pending == 0 {
                return;
            }
            s.draining += 1;
        }
        let _draining = Draining { maps: self };
        poll_fn(|cx| {
            let mut s = self.state();
            if s.pending == 0 {
                return Poll::Ready(());
            }
            if !s.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                s.waiters.push(cx.waker().clone());
            }
            Poll::Pending
        })
        .await;
    }

    /// The image was given up (a data write into a cluster mapped ahead of it failed, or the
    /// worker panicked): nothing may write a mapping.
    pub fn set_broken(&self) {
        self.broken.store(true, Ordering::Release);
    }

    /// Whether [`set_broken`](Self::set_broken) was called.
    pub fn broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }
}

impl Drop for Early<'_> {
    fn drop(&mut self) {
        let waiters = {
            let mut s = self.maps.state();
            s.pending -= 1;
            if s.pending > 0 {
                return;
            }
            std::mem::take(&mut s.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

/// An L2 table write waiting in [`EarlyMaps::settled`] (ended when the wait ends or is
/// dropped).
struct Draining<'a> {
    maps: &'a EarlyMaps,
}

impl Drop for Draining<'_> {
    fn drop(&mut self) {
        self.maps.state().draining -= 1;
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::Context;

    use super::super::counted_wakes::Count;
    use super::*;

    #[test]
    fn an_l2_write_waits_for_early_data_and_stops_new_early_mappings_meanwhile() {
        let maps = EarlyMaps::default();
        let (waker, count) = Count::waker();
        let mut cx = Context::from_waker(&waker);
        // Nothing under way: no wait.
        assert!(Box::pin(maps.settled()).as_mut().poll(&mut cx).is_ready());
        let a = maps.begin().expect("nothing waits");
        let b = maps.begin().expect("nothing waits");
        let mut table = Box::pin(maps.settled());
        assert!(table.as_mut().poll(&mut cx).is_pending());
        assert!(
            maps.begin().is_none(),
            "a waiting table write must not be starved by new early mappings"
        );
        drop(a);
        assert_eq!(count.get(), 0, "one is still under way");
        assert!(table.as_mut().poll(&mut cx).is_pending());
        drop(b);
        assert_eq!(count.get(), 1, "the last one wakes it");
        assert!(table.as_mut().poll(&mut cx).is_ready());
        drop(table);
        assert!(
            maps.begin().is_some(),
            "early mappings again once it is done"
        );
    }

    #[test]
    fn a_dropped_wait_lets_early_mappings_go_on_and_a_broken_image_makes_none() {
        let maps = EarlyMaps::default();
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let a = maps.begin().unwrap();
        let mut table = Box::pin(maps.settled());
        assert!(table.as_mut().poll(&mut cx).is_pending());
        drop(table);
        assert!(maps.begin().is_some());
        drop(a);
        maps.set_broken();
        assert!(maps.broken() && maps.begin().is_none());
    }
}
