//! Adaptive polling: how long an I/O thread busy-polls its rings before it sleeps.
//!
//! While an I/O thread polls, guest notifications stay suppressed and completions are reaped from
//! the io_uring completion queue without syscalls. The window adapts from what recent polls
//! and sleeps found (the idea of QEMU's `poll-grow`/`poll-shrink` and Direct-Virtio's
//! history-based sleep time), driven mainly by the poll *hit rate*:
//! - every [`EPOCH`] poll windows, the share of windows that found work decides: at least half
//!   grows the window (doubles it, up to the maximum); under a quarter shrinks it (halves it,
//!   to zero below the starting step); in between keeps it;
//! - a sleep longer than [`IDLE_NS`] means the load stopped: the window halves at once, so an
//!   idle thread soon burns no CPU at all;
//! - at window zero, after [`PROBE_EVERY`] sleeps that were not idle (a sleep woken within the
//!   maximum window, which polling would have caught, counts 16 times), one epoch is polled at
//!   the maximum window (a probe); if under a quarter of it hits, the window goes straight
//!   back to zero. (Starting from a small window instead fails where wake-ups are slow: the
//!   small window misses, shrinks back to zero, and the probe that would show polling paying
//!   never comes.) Sleep lengths alone can mislead: on a VM a woken
//!   thread can take longer than the whole window to run, so a busy queue looks like long
//!   sleeps although polling (which keeps the CPU from halting) would catch nearly every
//!   request. The probe's hit rate settles it; when polling does not pay, it costs at most
//!   `EPOCH` windows per `PROBE_EVERY` sleeps (each sleep longer than a window): under 7%.

pub use crate::config::PollMode;

/// The first non-zero window, in nanoseconds.
pub const GROW_START_NS: u64 = 4_000;
/// Poll windows per hit-rate decision.
pub const EPOCH: u32 = 16;
/// A sleep at least this long means the load stopped.
pub const IDLE_NS: u64 = 1_000_000;
/// Non-idle sleeps at window zero before a probe at the maximum window.
pub const PROBE_EVERY: u32 = 256;

/// The adaptive poll window.
#[derive(Debug, Clone)]
pub struct PollPolicy {
    mode: PollMode,
    max_ns: u64,
    window_ns: u64,
    /// Poll windows and hits in the current epoch.
    polls: u32,
    hits: u32,
    /// Non-idle sleeps in a row at window zero.
    zero_sleeps: u32,
    /// The current epoch is a probe.
    probing: bool,
}

impl PollPolicy {
    /// A policy with the given mode and maximum window (microseconds).
    pub fn new(mode: PollMode, max_us: u32) -> Self {
        let max_ns = u64::from(max_us) * 1000;
        let window_ns = match mode {
            PollMode::Off => 0,
            PollMode::On => max_ns,
            PollMode::Adaptive => 0,
        };
        PollPolicy {
            mode,
            max_ns,
            window_ns,
            polls: 0,
            hits: 0,
            zero_sleeps: 0,
            probing: false,
        }
    }

    /// How long to poll now, in nanoseconds.
    pub fn window_ns(&self) -> u64 {
        self.window_ns
    }

    fn adaptive(&self) -> bool {
        self.mode == PollMode::Adaptive && self.max_ns > 0
    }

    fn grow(&mut self) {
        self.window_ns = if self.window_ns == 0 {
            GROW_START_NS.min(self.max_ns)
        } else {
            (self.window_ns * 2).min(self.max_ns)
        };
    }

    fn shrink(&mut self) {
        self.window_ns /= 2;
        if self.window_ns < GROW_START_NS.min(self.max_ns) {
            self.window_ns = 0;
        }
    }

    fn end_of_window(&mut self, hit: bool) {
        if !self.adaptive() {
            return;
        }
        self.polls += 1;
        self.hits += u32::from(hit);
        if self.polls < EPOCH {
            return;
        }
        if self.hits * 2 >= EPOCH {
            self.grow();
        } else if self.hits * 4 < EPOCH {
            if self.probing {
                // A failed probe costs one epoch, not the whole way down.
                self.window_ns = 0;
            } else {
                self.shrink();
            }
        }
        self.probing = false;
        self.polls = 0;
        self.hits = 0;
    }

    /// A poll found work.
    pub fn on_poll_hit(&mut self) {
        self.end_of_window(true);
    }

    /// A poll window expired without work.
    pub fn on_poll_miss(&mut self) {
        self.end_of_window(false);
    }

    /// The thread slept `slept_ns` before the next event.
    pub fn on_sleep(&mut self, slept_ns: u64) {
        if !self.adaptive() {
            return;
        }
        if slept_ns >= IDLE_NS {
            // The load stopped: polling only burns CPU.
            self.shrink();
            self.zero_sleeps = 0;
            self.polls = 0;
            self.hits = 0;
            return;
        }
        if self.window_ns > 0 {
            return;
        }
        // An event that came within the maximum window after we went to sleep would have been
        // caught by polling: such sleeps bring the probe 16 times sooner.
        self.zero_sleeps += if slept_ns <= self.max_ns {
            PROBE_EVERY / 16
        } else {
            1
        };
        if self.zero_sleeps >= PROBE_EVERY {
            // Busy but with long wake-ups: find out whether polling pays.
            self.zero_sleeps = 0;
            self.window_ns = self.max_ns;
            self.probing = true;
            self.polls = 0;
            self.hits = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_never_polls_on_always_does() {
        let mut p = PollPolicy::new(PollMode::Off, 50);
        p.on_sleep(1_000);
        assert_eq!(p.window_ns(), 0);
        let mut p = PollPolicy::new(PollMode::On, 50);
        p.on_sleep(10_000_000);
        assert_eq!(p.window_ns(), 50_000);
    }

    fn epoch(p: &mut PollPolicy, hits: u32) {
        for i in 0..EPOCH {
            if i < hits {
                p.on_poll_hit();
            } else {
                p.on_poll_miss();
            }
        }
    }

    /// Short sleeps at window zero: a probe at the maximum after 16 of them.
    fn start(p: &mut PollPolicy) {
        for _ in 0..16 {
            assert_eq!(p.window_ns(), 0);
            p.on_sleep(1_000);
        }
        assert!(p.window_ns() > 0, "16 short sleeps brought no probe");
    }

    #[test]
    fn short_sleeps_bring_a_probe_and_hits_keep_the_window() {
        let mut p = PollPolicy::new(PollMode::Adaptive, 50);
        assert_eq!(p.window_ns(), 0);
        start(&mut p);
        assert_eq!(p.window_ns(), 50_000);
        for _ in 0..10 {
            epoch(&mut p, EPOCH);
        }
        assert_eq!(p.window_ns(), 50_000);
        // Half the windows hitting still pays; a middling rate keeps the window.
        epoch(&mut p, EPOCH / 2);
        assert_eq!(p.window_ns(), 50_000);
        epoch(&mut p, EPOCH / 4);
        assert_eq!(p.window_ns(), 50_000);
    }

    #[test]
    fn misses_shrink_to_zero() {
        let mut p = PollPolicy::new(PollMode::Adaptive, 64);
        start(&mut p);
        for _ in 0..10 {
            epoch(&mut p, EPOCH);
        }
        assert_eq!(p.window_ns(), 64_000);
        let mut epochs = 0;
        while p.window_ns() > 0 {
            epoch(&mut p, 1);
            epochs += 1;
            assert!(epochs < 20, "window never reaches zero");
        }
        assert!(epochs >= 4);
    }

    #[test]
    fn idle_sleeps_shrink_at_once_and_never_probe() {
        let mut p = PollPolicy::new(PollMode::Adaptive, 64);
        start(&mut p);
        for _ in 0..10 {
            epoch(&mut p, EPOCH);
        }
        for _ in 0..10 {
            p.on_sleep(IDLE_NS);
        }
        assert_eq!(p.window_ns(), 0);
        for _ in 0..(10 * PROBE_EVERY) {
            p.on_sleep(50 * IDLE_NS);
            assert_eq!(p.window_ns(), 0, "an idle thread must not poll");
        }
    }

    #[test]
    fn long_wakeups_under_load_probe_and_keep_polling_if_it_pays() {
        // Sleeps of 200 µs: longer than the 32 µs maximum (no plain grow), shorter than idle.
        let mut p = PollPolicy::new(PollMode::Adaptive, 32);
        for _ in 0..PROBE_EVERY - 1 {
            p.on_sleep(200_000);
            assert_eq!(p.window_ns(), 0);
        }
        p.on_sleep(200_000);
        assert_eq!(p.window_ns(), 32_000, "no probe");
        // The probe pays: most windows find work. The window stays at the maximum.
        epoch(&mut p, EPOCH - 2);
        assert_eq!(p.window_ns(), 32_000);
        // Later the polls stop paying: the window shrinks away, and probes come back only
        // every PROBE_EVERY sleeps.
        for _ in 0..8 {
            epoch(&mut p, 0);
        }
        assert_eq!(p.window_ns(), 0);
        let mut polled = 0;
        for _ in 0..(4 * PROBE_EVERY) {
            p.on_sleep(200_000);
            if p.window_ns() > 0 {
                polled += 1;
                epoch(&mut p, 0);
                assert_eq!(
                    p.window_ns(),
                    0,
                    "a failed probe goes straight back to zero"
                );
            }
        }
        assert_eq!(polled, 4);
    }
}
