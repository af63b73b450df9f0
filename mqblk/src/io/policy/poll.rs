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
//!
//! A hit says a request came while the thread polled, not that polling made it come sooner.
//! Where a wake-up is cheap (bare metal, or a VM whose idle vCPUs halt-poll), a closed-loop
//! client is served as fast by a thread that sleeps, and the polling is CPU spent for nothing:
//! on this project's VM with `haltpoll.guest_halt_poll_ns=200000`, `poll=off` served one job
//! at iodepth 32 at 0.99x the IOPS of adaptive polling for 0.67x its CPU per I/O, where with
//! halt-polling off (as the VM is set up) it served 0.35x (docs/PERFORMANCE.md 12g). So while
//! the thread polls, a *rate trial* every [`TRIAL_EVERY_NS`] measures what it serves in a
//! span of [`TRIAL_SPAN_NS`] polling and then in one sleeping. If sleeping served at least
//! [`SLEEP_KEEPS`] of polling's rate, the thread sleeps (window zero, hit-rate probes off) until
//! the next trial, which then polls at the maximum window for its first span; otherwise it
//! polls on at the window it had. The hit-rate rules stand still during a trial, and a sleep
//! of [`IDLE_NS`] or more ends a trial and the choice to sleep. A trial costs one span in the
//! worse mode per `TRIAL_EVERY_NS`: 1% of the time.

pub use crate::config::PollMode;

/// The first non-zero window, in nanoseconds.
pub const GROW_START_NS: u64 = 4_000;
/// Poll windows per hit-rate decision.
pub const EPOCH: u32 = 16;
/// A sleep at least this long means the load stopped.
pub const IDLE_NS: u64 = 1_000_000;
/// Non-idle sleeps at window zero before a probe at the maximum window.
pub const PROBE_EVERY: u32 = 256;
/// Time between the ends of one rate trial and the start of the next.
pub const TRIAL_EVERY_NS: u64 = 500_000_000;
/// Each of a trial's two spans (polling, then sleeping).
pub const TRIAL_SPAN_NS: u64 = 5_000_000;
/// The first trial waits this long after the thread starts polling.
pub const FIRST_TRIAL_AFTER_NS: u64 = 20_000_000;
/// Sleeping is chosen when it serves at least this share of polling's rate, as a fraction
/// `(numerator, denominator)`: 19/20, 95%.
pub const SLEEP_KEEPS: (u64, u64) = (19, 20);

/// A finished rate trial: what each span served, and what the thread does until the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrialOutcome {
    /// Requests a second served while polling.
    pub polled_per_s: u64,
    /// Requests a second served while sleeping.
    pub slept_per_s: u64,
    pub choice: TrialChoice,
}

/// What a finished rate trial chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrialChoice {
    /// Polling served more than sleeping by over 5%: poll on.
    Poll,
    /// Sleeping served nearly as much: sleep until the next trial.
    Sleep,
}

/// Where the rate trial stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trial {
    /// None running; the next may start at `next_ns` (`None`: once the thread polls).
    Waiting { next_ns: Option<u64> },
    /// Polling at `window_ns`, counting from `start_ns` and `start_served`.
    Polled {
        start_ns: u64,
        start_served: u64,
        window_ns: u64,
    },
    /// Sleeping, counting from `start_ns` and `start_served`; the polled span served
    /// `polled_served` in `polled_ns`, at `window_ns`.
    Slept {
        start_ns: u64,
        start_served: u64,
        polled_served: u64,
        polled_ns: u64,
        window_ns: u64,
    },
}

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
    trial: Trial,
    /// The last trial chose to sleep: the window stays zero and hit-rate probes are off
    /// until the next trial.
    sleeping_chosen: bool,
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
            trial: Trial::Waiting { next_ns: None },
            sleeping_chosen: false,
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

    fn in_trial(&self) -> bool {
        !matches!(self.trial, Trial::Waiting { .. })
    }

    /// Called once per loop iteration with the clock and the requests served so far: starts,
    /// advances and ends rate trials. Returns what a trial that ended now chose.
    pub fn observe(&mut self, now_ns: u64, served: u64) -> Option<TrialOutcome> {
        if !self.adaptive() {
            return None;
        }
        match self.trial {
            Trial::Waiting { next_ns } => {
                if self.window_ns == 0 && !self.sleeping_chosen {
                    // Not polling: nothing to weigh until the hit-rate rules poll again.
                    return None;
                }
                match next_ns {
                    None => {
                        self.trial = Trial::Waiting {
                            next_ns: Some(now_ns + FIRST_TRIAL_AFTER_NS),
                        }
                    }
                    Some(next) if now_ns >= next => {
                        let window_ns = if self.sleeping_chosen {
                            self.max_ns
                        } else {
                            self.window_ns
                        };
                        self.window_ns = window_ns;
                        self.trial = Trial::Polled {
                            start_ns: now_ns,
                            start_served: served,
                            window_ns,
                        };
                    }
                    Some(_) => {}
                }
                None
            }
            Trial::Polled {
                start_ns,
                start_served,
                window_ns,
            } => {
                if now_ns - start_ns >= TRIAL_SPAN_NS {
                    self.window_ns = 0;
                    self.trial = Trial::Slept {
                        start_ns: now_ns,
                        start_served: served,
                        polled_served: served - start_served,
                        polled_ns: now_ns - start_ns,
                        window_ns,
                    };
                }
                None
            }
            Trial::Slept {
                start_ns,
                start_served,
                polled_served,
                polled_ns,
                window_ns,
            } => {
                let slept_ns = now_ns - start_ns;
                if slept_ns < TRIAL_SPAN_NS {
                    return None;
                }
                let slept_served = served - start_served;
                // slept / slept_ns >= SLEEP_KEEPS * polled / polled_ns, without division.
                let (num, den) = SLEEP_KEEPS;
                let sleep = u128::from(slept_served) * u128::from(polled_ns) * u128::from(den)
                    >= u128::from(polled_served) * u128::from(slept_ns) * u128::from(num);
                self.sleeping_chosen = sleep;
                self.window_ns = if sleep { 0 } else { window_ns };
                self.zero_sleeps = 0;
                self.polls = 0;
                self.hits = 0;
                self.probing = false;
                self.trial = Trial::Waiting {
                    next_ns: Some(now_ns + TRIAL_EVERY_NS),
                };
                let per_s =
                    |n: u64, ns: u64| (u128::from(n) * 1_000_000_000 / u128::from(ns)) as u64;
                Some(TrialOutcome {
                    polled_per_s: per_s(polled_served, polled_ns),
                    slept_per_s: per_s(slept_served, slept_ns),
                    choice: if sleep {
                        TrialChoice::Sleep
                    } else {
                        TrialChoice::Poll
                    },
                })
            }
        }
    }

    /// The load stopped: no trial runs, and the choice to sleep is forgotten.
    fn end_trials(&mut self) {
        if self.in_trial() || self.sleeping_chosen {
            self.trial = Trial::Waiting { next_ns: None };
        }
        self.sleeping_chosen = false;
    }

    fn end_of_window(&mut self, hit: bool) {
        if !self.adaptive() || self.in_trial() {
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
            self.end_trials();
            self.shrink();
            self.zero_sleeps = 0;
            self.polls = 0;
            self.hits = 0;
            return;
        }
        if self.window_ns > 0 || self.in_trial() || self.sleeping_chosen {
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
    const MS: u64 = 1_000_000;

    /// A polling policy whose first trial has just started its polled span at `t`.
    fn polling_into_a_trial(t: u64) -> PollPolicy {
        let mut p = PollPolicy::new(PollMode::Adaptive, 32);
        start(&mut p);
        assert_eq!(p.observe(t - FIRST_TRIAL_AFTER_NS, 0), None);
        assert_eq!(p.observe(t - 1, 0), None);
        assert_eq!(p.observe(t, 0), None);
        assert_eq!(p.window_ns(), 32_000);
        p
    }

    #[test]
    fn a_trial_chooses_sleep_when_sleeping_serves_nearly_as_much_and_polls_again_for_the_next() {
        let t = 100 * MS;
        let mut p = polling_into_a_trial(t);
        // Polled span: 5,000 requests in 5 ms; then the sleeping span.
        assert_eq!(p.observe(t + TRIAL_SPAN_NS, 5_000), None);
        assert_eq!(p.window_ns(), 0, "the second span sleeps");
        // 4,800 in 5 ms: 96% of polling's rate.
        assert_eq!(
            p.observe(t + 2 * TRIAL_SPAN_NS, 9_800),
            Some(TrialOutcome {
                polled_per_s: 1_000_000,
                slept_per_s: 960_000,
                choice: TrialChoice::Sleep
            })
        );
        assert_eq!(p.window_ns(), 0);
        // Short sleeps bring no hit-rate probe while sleeping is the choice.
        for _ in 0..(4 * PROBE_EVERY) {
            p.on_sleep(1_000);
            assert_eq!(p.window_ns(), 0, "a probe undid the trial's choice");
        }
        let next = t + 2 * TRIAL_SPAN_NS + TRIAL_EVERY_NS;
        assert_eq!(p.observe(next - 1, 50_000), None);
        assert_eq!(p.window_ns(), 0);
        // The next trial polls its first span at the maximum window.
        assert_eq!(p.observe(next, 50_000), None);
        assert_eq!(p.window_ns(), 32_000);
    }

    #[test]
    fn a_trial_keeps_polling_at_its_window_when_polling_serves_more() {
        let t = 100 * MS;
        let mut p = polling_into_a_trial(t);
        p.observe(t + TRIAL_SPAN_NS, 5_000);
        // 4,700 in 5 ms: 94%, under the 95% sleeping must keep.
        assert_eq!(
            p.observe(t + 2 * TRIAL_SPAN_NS, 9_700).map(|o| o.choice),
            Some(TrialChoice::Poll)
        );
        assert_eq!(p.window_ns(), 32_000);
        // And the spans are compared as rates: a sleeping span that ran twice as long and
        // served twice as much is the same rate.
        let t2 = t + 2 * TRIAL_SPAN_NS + TRIAL_EVERY_NS;
        p.observe(t2, 0);
        p.observe(t2 + TRIAL_SPAN_NS, 5_000);
        assert_eq!(
            p.observe(t2 + 3 * TRIAL_SPAN_NS, 15_000).map(|o| o.choice),
            Some(TrialChoice::Sleep)
        );
    }

    #[test]
    fn hit_rate_rules_stand_still_during_a_trial() {
        let t = 100 * MS;
        let mut p = polling_into_a_trial(t);
        for _ in 0..10 {
            epoch(&mut p, 0);
        }
        assert_eq!(p.window_ns(), 32_000, "misses shrank the window mid-trial");
    }

    #[test]
    fn an_idle_sleep_ends_a_trial_and_the_choice_to_sleep() {
        let t = 100 * MS;
        let mut p = polling_into_a_trial(t);
        p.observe(t + TRIAL_SPAN_NS, 5_000);
        p.on_sleep(IDLE_NS);
        // The trial is over: later observations decide nothing until polling resumes.
        assert_eq!(p.observe(t + 3 * TRIAL_SPAN_NS, 10_000), None);
        assert_eq!(p.window_ns(), 0);

        let mut p = polling_into_a_trial(t);
        p.observe(t + TRIAL_SPAN_NS, 5_000);
        assert_eq!(
            p.observe(t + 2 * TRIAL_SPAN_NS, 10_000).map(|o| o.choice),
            Some(TrialChoice::Sleep)
        );
        p.on_sleep(IDLE_NS);
        // The load came back: the hit-rate rules run again (short sleeps bring a probe), and
        // no trial starts before polling has gone on for a while.
        start(&mut p);
        let now = t + 2 * TRIAL_SPAN_NS + 2 * TRIAL_EVERY_NS;
        assert_eq!(p.observe(now, 20_000), None);
        assert_eq!(p.observe(now + FIRST_TRIAL_AFTER_NS - 1, 20_000), None);
        assert_eq!(p.window_ns(), 32_000);
    }

    #[test]
    fn no_trial_runs_unless_polling_adapts_and_the_thread_polls() {
        for mode in [PollMode::Off, PollMode::On] {
            let mut p = PollPolicy::new(mode, 32);
            for i in 0..100 {
                assert_eq!(p.observe(i * TRIAL_SPAN_NS, i * 1000), None);
            }
        }
        // Adaptive at window zero (a thread that sleeps): nothing to weigh.
        let mut p = PollPolicy::new(PollMode::Adaptive, 32);
        for i in 0..100 {
            assert_eq!(p.observe(i * TRIAL_SPAN_NS, i * 1000), None);
            assert_eq!(p.window_ns(), 0);
        }
    }
}
