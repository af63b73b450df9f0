//! A waker that counts its wakes, for the tests of what wakes waiting tasks (`locks`,
//! `early_maps`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Wake, Waker};

/// Counts the wakes of the wakers made from it.
#[derive(Default)]
pub struct Count(AtomicUsize);

impl Count {
    /// A waker, and the count of its wakes.
    pub fn waker() -> (Waker, Arc<Count>) {
        let count = Arc::new(Count::default());
        (Waker::from(count.clone()), count)
    }

    /// The wakes so far.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}
