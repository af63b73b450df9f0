//! Waiting for the engine: how long a poll goes on past its window while requests are at the
//! engine, whose completions are known to be coming.
//!
//! The poll window ([`poll`](super::poll)) is sized for what a guest sends: at most
//! `poll-max-us` (32 µs by default), long enough for a client to come back with its next
//! request. A read from a disk takes longer (40–70 µs on this project's VM disk, 10–100 µs on
//! NVMe), so a thread with a request at the device polled through its window, missed, went to
//! sleep, and was woken by the completion: on a VM whose idle vCPUs halt, a wake-up that costs
//! a VM exit. SPDK's reactor never sleeps, and served iodepth 1 on a file 1.4x as fast as
//! mqblk placed as it was (docs/PERFORMANCE.md 12h). So while requests are at the engine, a
//! poll waits up to `poll-engine-us` for them, as the kernel's polled I/O waits for a device.
//!
//! Where the engine is slower than that (a network store, a disk behind a busy host), the wait
//! only burns CPU before the sleep the thread takes anyway, CPU that the engine's own threads
//! may need (a qcow2 image's metadata worker, a loop device's kernel worker). Every [`EPOCH`]
//! waits decide: if under half of them saw work come, the next [`REST`] polls with requests
//! at the engine do not wait, and then it is tried again; each such epoch in a row doubles the
//! rest, up to [`LONGEST_REST`], so an engine that stays slow costs at most `EPOCH` wasted
//! waits per `LONGEST_REST` polls, and one that got fast is waited for again after one epoch.
//! (Whether polling pays at all, the poll window's hit rate and rate trials decide: a thread
//! that does not poll does not wait either.)

use super::tally::HitTally;

/// The most requests at the engine for which a poll waits. With more, their completions
/// come closer together than the window unless the engine is congested, and polling a
/// congested engine only takes CPU from it (a loop device's kernel worker shares the CPUs).
/// Waiting at any depth measured within the noise of not waiting at iodepth 32 on a loop
/// device (docs/PERFORMANCE.md 12h), so the waits stay where they were measured to pay.
pub const MOST_IN_FLIGHT: u64 = 4;
/// Waits per decision.
pub const EPOCH: u32 = 16;
/// Polls with requests at the engine that do not wait after an epoch in which under half the
/// waits saw work come; each such epoch in a row doubles it, up to [`LONGEST_REST`].
pub const REST: u32 = 256;
/// The longest rest: an engine that stays slower than the wait costs at most `EPOCH` wasted
/// waits per this many polls.
pub const LONGEST_REST: u32 = 8192;

/// Whether, and how long, a poll waits for the engine.
#[derive(Debug, Clone)]
pub struct EngineWait {
    max_ns: u64,
    /// Waits, and the ones that saw work come, in the current epoch.
    waits: HitTally,
    /// Polls left that do not wait.
    resting: u32,
    /// How long the next rest is.
    next_rest: u32,
}

impl EngineWait {
    /// Waits of up to `max_us` microseconds (0: never).
    pub fn new(max_us: u32) -> Self {
        EngineWait {
            max_ns: u64::from(max_us) * 1000,
            waits: HitTally::default(),
            resting: 0,
            next_rest: REST,
        }
    }

    /// How long a poll that starts with `in_flight` requests at the engine polls in all, at
    /// least its `window_ns`. Called once per poll.
    pub fn limit_ns(&mut self, window_ns: u64, in_flight: u64) -> u64 {
        if in_flight == 0 || in_flight > MOST_IN_FLIGHT || self.max_ns <= window_ns {
            return window_ns;
        }
        if self.resting > 0 {
            self.resting -= 1;
            return window_ns;
        }
        self.max_ns
    }

    /// A poll that went on past its window ended: `arrived` if it found work.
    pub fn on_wait(&mut self, arrived: bool) {
        let Some(arrivals) = self.waits.count(arrived, EPOCH) else {
            return;
        };
        if arrivals * 2 < EPOCH {
            self.resting = self.next_rest;
            self.next_rest = (self.next_rest * 2).min(LONGEST_REST);
        } else {
            self.next_rest = REST;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poll_with_a_few_requests_at_the_engine_waits_at_most_the_maximum_at_least_its_window() {
        let mut w = EngineWait::new(200);
        assert_eq!(w.limit_ns(32_000, 1), 200_000);
        assert_eq!(w.limit_ns(500_000, 1), 500_000);
        // Nothing at the engine, or so much that completions come anyway: the window alone.
        assert_eq!(w.limit_ns(32_000, 0), 32_000);
        assert_eq!(w.limit_ns(32_000, MOST_IN_FLIGHT), 200_000);
        assert_eq!(w.limit_ns(32_000, MOST_IN_FLIGHT + 1), 32_000);
        let mut off = EngineWait::new(0);
        assert_eq!(off.limit_ns(32_000, 1), 32_000);
        assert_eq!(off.limit_ns(0, 1), 0);
    }

    #[test]
    fn waits_that_see_work_come_go_on() {
        let mut w = EngineWait::new(200);
        for _ in 0..10 * EPOCH {
            assert_eq!(w.limit_ns(32_000, 1), 200_000);
            w.on_wait(true);
        }
        // Half arriving still pays.
        for i in 0..EPOCH {
            assert_eq!(w.limit_ns(32_000, 1), 200_000);
            w.on_wait(i % 2 == 0);
        }
        assert_eq!(w.limit_ns(32_000, 1), 200_000);
    }

    #[test]
    fn an_epoch_of_waits_that_mostly_miss_rests_and_then_tries_again() {
        let mut w = EngineWait::new(200);
        for i in 0..EPOCH {
            assert_eq!(w.limit_ns(32_000, 1), 200_000);
            w.on_wait(i < EPOCH / 2 - 1);
        }
        for _ in 0..REST {
            assert_eq!(w.limit_ns(32_000, 1), 32_000);
        }
        // Tried again: an engine that got faster is waited for.
        for _ in 0..EPOCH {
            assert_eq!(w.limit_ns(32_000, 1), 200_000);
            w.on_wait(true);
        }
        assert_eq!(w.limit_ns(32_000, 1), 200_000);
    }

    /// An epoch of waits that all miss, then the polls that do not wait before the next that
    /// does.
    fn missed_epoch_then_rest(w: &mut EngineWait) -> u32 {
        for _ in 0..EPOCH {
            assert_eq!(w.limit_ns(32_000, 1), 200_000);
            w.on_wait(false);
        }
        let mut rested = 0;
        while w.limit_ns(32_000, 1) == 32_000 {
            rested += 1;
        }
        rested
    }

    #[test]
    fn an_engine_that_stays_slow_rests_longer_each_time_up_to_the_longest_rest() {
        let mut w = EngineWait::new(200);
        let rests: Vec<u32> = (0..8).map(|_| missed_epoch_then_rest(&mut w)).collect();
        assert_eq!(rests, [256, 512, 1024, 2048, 4096, 8192, 8192, 8192]);
        assert_eq!(rests[0], REST);
        assert_eq!(rests[7], LONGEST_REST);
        // An epoch that pays starts the rests over.
        for _ in 0..EPOCH {
            w.limit_ns(32_000, 1);
            w.on_wait(true);
        }
        assert_eq!(missed_epoch_then_rest(&mut w), REST);
    }
}
