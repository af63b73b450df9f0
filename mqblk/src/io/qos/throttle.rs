//! The buckets one export (or one throttle group of exports) shares among its I/O threads.
//!
//! Only exports with a limit have one in their I/O threads: the lock is taken once per request
//! of a limited export (and once per retry of a waiting queue), never by an unlimited one. It
//! is held for a few arithmetic operations.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::buckets::{Buckets, Dir};
use crate::config::QosConfig;

/// Shared QoS state: the limits and their buckets.
#[derive(Debug)]
pub struct Throttle {
    state: Mutex<State>,
    /// The clock's zero.
    epoch: Instant,
}

#[derive(Debug)]
struct State {
    cfg: QosConfig,
    buckets: Buckets,
}

impl Throttle {
    /// Empty buckets for the limits of `cfg` (its group name is not kept).
    pub fn new(cfg: &QosConfig) -> Throttle {
        let cfg = cfg.without_group();
        Throttle {
            state: Mutex::new(State {
                buckets: Buckets::new(&cfg, 0),
                cfg,
            }),
            epoch: Instant::now(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is plain numbers, valid whatever a panicking holder left.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// The limits.
    pub fn config(&self) -> QosConfig {
        self.lock().cfg.clone()
    }

    /// Whether any limit is set.
    pub fn is_limited(&self) -> bool {
        self.lock().cfg.is_limited()
    }

    /// Replaces the limits. As in QEMU, the buckets start empty: the new limits apply from
    /// now, with their own initial allowance. Requests waiting under the old limits retry
    /// within `MAX_WAIT` (their timers are capped at that).
    pub fn set_config(&self, cfg: &QosConfig) {
        let cfg = cfg.without_group();
        let now = self.ns(Instant::now());
        let mut s = self.lock();
        s.buckets = Buckets::new(&cfg, now);
        s.cfg = cfg;
    }

    /// Lets a request of `dir` and `bytes` through at `now` (and counts it), or says how long
    /// it must wait.
    pub fn admit(&self, dir: Dir, bytes: u64, now: Instant) -> Result<(), Duration> {
        let now = self.ns(now);
        self.lock()
            .buckets
            .admit(dir, bytes, now)
            .map_err(Duration::from_nanos)
    }
}

/// The longest a waiting queue sleeps before it asks the buckets again, whatever they said:
/// a raised limit (or a removed one) takes effect within this.
pub const MAX_WAIT: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_config_applies_at_once_with_empty_buckets() {
        let mut cfg = QosConfig::default();
        cfg.iops_total.rate = 10;
        cfg.group = Some("g".into());
        let t = Throttle::new(&cfg);
        assert_eq!(t.config().group, None);
        assert!(t.is_limited());
        let now = Instant::now();
        // A bucket of 1 (a tenth of 10): two at once, then a wait of about 100 ms.
        assert!(t.admit(Dir::Read, 4096, now).is_ok());
        assert!(t.admit(Dir::Read, 4096, now).is_ok());
        let wait = t.admit(Dir::Read, 4096, now).unwrap_err();
        assert!(wait > Duration::from_millis(50), "{wait:?}");
        cfg.iops_total.rate = 1000;
        t.set_config(&cfg);
        for _ in 0..101 {
            assert!(t.admit(Dir::Read, 4096, Instant::now()).is_ok());
        }
        t.set_config(&QosConfig::default());
        assert!(!t.is_limited());
        assert!(t.admit(Dir::Write, 1 << 30, Instant::now()).is_ok());
    }
}
