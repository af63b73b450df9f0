//! QoS admission, between parsing a request and staging it for the engine; only for exports
//! with limits (an I/O thread without a throttle never comes here).
//!
//! A request the buckets hold back waits in its queue's FIFO, and the queue is not popped
//! while any of its requests wait, so the guest's order is kept; the thread arms one io_uring
//! timeout for the earliest wait and goes on serving its other queues. Nothing spins: the
//! thread sleeps in `io_uring_enter` until the timer (or other work) wakes it.

use std::thread::ThreadId;
use std::time::{Duration, Instant};

use super::buckets::Dir;
use super::throttle::{Throttle, MAX_WAIT};
use crate::blk::Kind;
use crate::io::ring::Token;
use crate::io::slots::{Slot, SlotId};
use crate::io::thread::IoThread;

/// What the limits count of a request: its direction and bytes. As in QEMU, reads and writes
/// (write-zeroes included) are limited; flushes, discards and GET_ID are not.
fn counted(slot: &Slot) -> Option<(Dir, u64)> {
    match slot.kind {
        Kind::Read => Some((Dir::Read, slot.len)),
        Kind::Write | Kind::WriteZeroes { .. } => Some((Dir::Write, slot.len)),
        Kind::Flush | Kind::Discard | Kind::GetId => None,
    }
}

/// Lets `slot` of thread `me` through `throttle` at `now`, or says how long it must wait.
fn try_admit(throttle: &Throttle, me: ThreadId, slot: &Slot, now: Instant) -> Result<(), Duration> {
    match counted(slot) {
        Some((dir, bytes)) => throttle.admit(me, dir, bytes, now),
        None => Ok(()),
    }
}

/// The shortest QoS timer. At a limit of N requests a second, a request waits about 1/N for
/// its turn: at 200,000, a timer every 5 µs, and arming and taking each one cost more than
/// the request itself (on this project's VM an export held to 200k IOPS spent a whole CPU,
/// 4.8 s per million requests, 62% of it arming timers: docs/PERFORMANCE.md 7b). A request
/// that waits is late already; letting it wait up to this much longer admits the requests
/// that came meanwhile together, and the buckets still hold the average and the burst to the
/// limits, since each request is admitted only when they have room for it.
pub const TIMER_GRANULARITY: Duration = Duration::from_micros(100);

/// How long a timer for a wait of `wait` runs: at least [`TIMER_GRANULARITY`], and at most
/// [`MAX_WAIT`] (so that a raised limit is seen soon).
fn timer_wait(wait: Duration) -> Duration {
    wait.clamp(TIMER_GRANULARITY, MAX_WAIT)
}

impl IoThread {
    /// Admits request `id` of queue `local`: true if it may be staged now. Otherwise it waits
    /// behind any request of its queue already waiting, and the queue is not popped until
    /// they have all gone.
    pub(in crate::io) fn admit(&mut self, local: usize, id: SlotId) -> bool {
        let Some(q) = self.queues[local].as_mut() else {
            return true;
        };
        let now = Instant::now();
        let mut wait = None;
        if q.waiting.is_empty() {
            let Some(throttle) = self.throttle.as_deref() else {
                return true;
            };
            match try_admit(throttle, self.thread_id, self.slots.get(id), now) {
                Ok(()) => return true,
                Err(w) => wait = Some(w),
            }
        }
        q.waiting.push_back((id, now));
        self.counters.throttled += 1;
        if let Some(w) = wait {
            self.arm_qos_timer(now, w);
        }
        false
    }

    /// Stages the waiting requests the buckets now let through, each queue in its order, and
    /// arms the timer for the rest. Requests of a queue being stopped, or of a thread that
    /// swaps guest memory, shuts down or lost its limits, go without waiting (as QEMU's drain
    /// does): a stop must not wait for the limits.
    pub(in crate::io) fn admit_waiting(&mut self) {
        self.admission_due = false;
        let now = Instant::now();
        let drain_all = self.throttle.is_none() || self.shutdown || self.pending_mem.is_some();
        let mut next: Option<Duration> = None;
        for q in self.queues.iter_mut().flatten() {
            if q.waiting.is_empty() {
                continue;
            }
            let drain = drain_all || q.stop_reply.is_some();
            while let Some(&(id, since)) = q.waiting.front() {
                if let (false, Some(throttle)) = (drain, self.throttle.as_deref()) {
                    if let Err(w) = try_admit(throttle, self.thread_id, self.slots.get(id), now) {
                        next = Some(next.map_or(w, |n| n.min(w)));
                        break;
                    }
                }
                q.waiting.pop_front();
                self.counters.throttled_ns +=
                    now.saturating_duration_since(since).as_nanos() as u64;
                self.staged.push(id);
            }
            if q.waiting.is_empty() {
                // Popping resumes, in this same loop iteration.
                q.pending = true;
            }
        }
        if let Some(wait) = next {
            self.arm_qos_timer(now, wait);
        }
    }

    /// Makes sure a timer ends within [`timer_wait`]`(wait)` of `now`. One already armed to
    /// end by then will do.
    fn arm_qos_timer(&mut self, now: Instant, wait: Duration) {
        let wait = timer_wait(wait);
        let at = now + wait;
        if self.qos_timer.is_some_and(|t| t <= at) {
            return;
        }
        self.qos_timer = Some(at);
        self.ring
            .push_timeout(wait, Token::QosTimer, &mut self.counters);
    }

    /// A QoS timer ended: the waiting requests ask again in this loop iteration.
    pub(in crate::io) fn on_qos_timer(&mut self) {
        self.admission_due = true;
        // An earlier-armed, later-ending timer may still be pending; it only causes one more
        // look when it ends.
        if self.qos_timer.is_some_and(|t| t <= Instant::now()) {
            self.qos_timer = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timer_runs_at_least_the_granularity_and_at_most_the_longest_wait() {
        assert_eq!(timer_wait(Duration::from_nanos(1)), TIMER_GRANULARITY);
        assert_eq!(timer_wait(Duration::from_micros(5)), TIMER_GRANULARITY);
        assert_eq!(
            timer_wait(Duration::from_micros(250)),
            Duration::from_micros(250)
        );
        assert_eq!(timer_wait(Duration::from_secs(3)), MAX_WAIT);
        assert!(TIMER_GRANULARITY < MAX_WAIT);
    }
}
