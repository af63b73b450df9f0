//! Workload-aware batch submission: how long to wait for more requests before the submit.
//!
//! An I/O thread records how many requests each submission carried. When recent submissions were
//! large (the guest keeps the queue busy), waiting a few microseconds for the next requests
//! gathers them into the same `io_uring_enter`, saving a syscall per request; when they were
//! small (light load, latency-bound), waiting would only add latency, so the policy says 0.

/// Number of recent submissions the policy remembers.
pub const HISTORY: usize = 16;

/// The batch-wait decision, from a history of submission sizes.
#[derive(Debug, Clone)]
pub struct BatchPolicy {
    max_wait_ns: u64,
    sizes: [u16; HISTORY],
    next: usize,
    sum: u32,
}

impl BatchPolicy {
    /// A policy that waits at most `max_wait_us` microseconds (0 disables waiting).
    pub fn new(max_wait_us: u32) -> Self {
        BatchPolicy {
            max_wait_ns: u64::from(max_wait_us) * 1000,
            sizes: [0; HISTORY],
            next: 0,
            sum: 0,
        }
    }

    /// Records the size of one submission.
    pub fn record(&mut self, size: usize) {
        let size = size.min(u16::MAX as usize) as u16;
        self.sum -= u32::from(self.sizes[self.next]);
        self.sizes[self.next] = size;
        self.sum += u32::from(size);
        self.next = (self.next + 1) % HISTORY;
    }

    /// Mean submission size over the history, in requests.
    pub fn mean(&self) -> f64 {
        f64::from(self.sum) / HISTORY as f64
    }

    /// How long to keep gathering when `current` requests are ready to submit: nothing under
    /// light load (mean below 2), nothing once the batch reached the usual size, otherwise
    /// the configured maximum.
    pub fn wait_ns(&self, current: usize) -> u64 {
        if self.max_wait_ns == 0 || current == 0 {
            return 0;
        }
        let mean = self.mean();
        if mean < 2.0 || current as f64 >= mean {
            return 0;
        }
        self.max_wait_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_never_waits() {
        let mut p = BatchPolicy::new(0);
        for _ in 0..HISTORY {
            p.record(32);
        }
        assert_eq!(p.wait_ns(1), 0);
    }

    #[test]
    fn light_load_does_not_wait() {
        let mut p = BatchPolicy::new(20);
        for _ in 0..HISTORY {
            p.record(1);
        }
        assert_eq!(p.wait_ns(1), 0);
    }

    #[test]
    fn heavy_load_waits_until_the_usual_size() {
        let mut p = BatchPolicy::new(20);
        for _ in 0..HISTORY {
            p.record(16);
        }
        assert_eq!(p.mean(), 16.0);
        assert_eq!(p.wait_ns(4), 20_000);
        assert_eq!(p.wait_ns(16), 0);
        assert_eq!(p.wait_ns(0), 0);
    }

    #[test]
    fn history_slides() {
        let mut p = BatchPolicy::new(10);
        for _ in 0..HISTORY {
            p.record(32);
        }
        assert!(p.wait_ns(2) > 0);
        for _ in 0..HISTORY {
            p.record(1);
        }
        assert_eq!(p.mean(), 1.0);
        assert_eq!(p.wait_ns(1), 0);
    }
}
