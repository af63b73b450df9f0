//! Adaptive polling: how long an I/O thread busy-polls its rings before it sleeps.
//!
//! While an I/O thread polls, guest notifications stay suppressed and completions are reaped from
//! the io_uring completion queue without syscalls. The window adapts from what recent polls
//! and sleeps found (the idea of QEMU's `poll-grow`/`poll-shrink` and Direct-Virtio's
//! history-based sleep time), driven mainly by the poll *hit rate*:
//! - every [`EPOCH`] poll windows, the share of windows that found work decides: at least half
//!   grows the window (doubles it, up to the maximum); under a quarter shrinks it (halves it,
//!   to zero below the starting step); in between keeps it;
//! - a sleep longer than [`IDLE_NS`] with no request at the engine means the load stopped: the
//!   window halves at once, so an idle thread soon burns no CPU at all (with requests there,
//!   it means the engine is slow, not that the load stopped);
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
//! client can be served as fast by a thread that sleeps, and the polling is CPU spent for
//! nothing: on this project's VM with `haltpoll.guest_halt_poll_ns=200000`, `poll=off` served
//! one job at iodepth 32 at 0.99x the IOPS of adaptive polling for 0.67x its CPU per I/O,
//! where with halt-polling off (as the VM is set up) it served 0.35x (docs/PERFORMANCE.md
//! 12g). So while the thread polls, a *rate trial* every [`TRIAL_EVERY_NS`] measures what it
//! serves polling and then sleeping, each for [`TRIAL_SPAN_NS`] after a warm-up of
//! [`TRIAL_WARMUP_NS`] that is not counted. If sleeping served at least [`SLEEP_KEEPS`] of
//! polling's rate, that is a vote to sleep; if polling served at least [`POLL_GAINS`] times
//! sleeping's rate, a vote to poll; in between, a vote for neither. Two votes in a row for the
//! other mode change it (the second trial comes [`CONFIRM_AFTER_NS`] after the first): a
//! sleeping thread (window zero, hit-rate probes off) polls again at the window it had, a
//! polling one goes to sleep until the next trial, which polls its first span at the maximum
//! window. A span of a few milliseconds is noisy (at tens of thousands of requests a second,
//! consecutive trials of one load have differed by a third, and once by 2.2x), and a single
//! noisy vote that flips the mode costs half a second in the wrong one (docs/PERFORMANCE.md
//! 13j). The hit-rate rules stand still during a trial, and an idle sleep (as above) ends a
//! trial, the votes and the choice to sleep. A trial spends 10 ms in the mode it is not in per
//! `TRIAL_EVERY_NS`: 2% of the time.

pub use crate::config::PollMode;

use super::tally::HitTally;

/// The first non-zero window, in nanoseconds.
pub const GROW_START_NS: u64 = 4_000;
/// Poll windows per hit-rate decision.
pub const EPOCH: u32 = 16;
/// A sleep at least this long, with no request at the engine, means the load stopped. (With
/// requests there it means the engine is slow: a qcow2 image's allocating writes, waiting on
/// its metadata worker, sleep milliseconds while the guest keeps 32 requests in flight.)
pub const IDLE_NS: u64 = 1_000_000;
/// Non-idle sleeps at window zero before a probe at the maximum window.
pub const PROBE_EVERY: u32 = 256;
/// Time between the ends of one rate trial and the start of the next.
pub const TRIAL_EVERY_NS: u64 = 500_000_000;
/// Each of a trial's two spans (polling, then sleeping), counted after a warm-up.
pub const TRIAL_SPAN_NS: u64 = 5_000_000;
/// The start of each span that is not counted: a span counted from the switch between polling
/// and sleeping on measures the switch. (Without it, on this project's VM, a thread that had
/// slept since the trial before polled at 2.1M requests a second in the trial's first span,
/// against 3.4M in the first trial of the run.)
pub const TRIAL_WARMUP_NS: u64 = 5_000_000;
/// A trial that found sleeping served as much is confirmed by another this soon after.
pub const CONFIRM_AFTER_NS: u64 = 50_000_000;
/// The first trial waits this long after the thread starts polling.
pub const FIRST_TRIAL_AFTER_NS: u64 = 20_000_000;
/// Sleeping is chosen when it serves at least this share of polling's rate, as a fraction
/// `(numerator, denominator)`: 19/20, 95%.
pub const SLEEP_KEEPS: (u64, u64) = (19, 20);
/// A trial votes to poll when polling served at least this multiple of sleeping's rate, as
/// `(numerator, denominator)`: 5/4, 125%. Between this and [`SLEEP_KEEPS`] it votes for
/// neither, and the thread goes on as it is.
pub const POLL_GAINS: (u64, u64) = (5, 4);

/// A finished rate trial: what each span served, and what the thread does until the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrialOutcome {
    /// Requests a second served while polling.
    pub polled_per_s: u64,
    /// Requests a second served while sleeping.
    pub slept_per_s: u64,
    /// Sleeping served at least [`SLEEP_KEEPS`] of polling's rate: a vote to sleep.
    pub sleep_vote: bool,
    /// The thread sleeps until the next trial: this vote and the one before were to sleep
    /// (or it slept already and this vote was to sleep).
    pub sleeps: bool,
}

/// One span of a trial: a warm-up not counted, then the span counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    start_ns: u64,
    start_served: u64,
    counting: bool,
}

impl Span {
    fn new(now_ns: u64, served: u64) -> Self {
        Span {
            start_ns: now_ns,
            start_served: served,
            counting: false,
        }
    }

    /// Advances the span; once its counted part is over, what it served and in how long.
    fn advance(&mut self, now_ns: u64, served: u64) -> Option<(u64, u64)> {
        let elapsed = now_ns.saturating_sub(self.start_ns);
        if !self.counting {
            if elapsed >= TRIAL_WARMUP_NS {
                *self = Span {
                    start_ns: now_ns,
                    start_served: served,
                    counting: true,
                };
            }
            return None;
        }
        (elapsed >= TRIAL_SPAN_NS).then(|| (served.saturating_sub(self.start_served), elapsed))
    }
}

/// Where the rate trial stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trial {
    /// None running; the next may start at `next_ns` (`None`: once the thread polls).
    Waiting { next_ns: Option<u64> },
    /// Polling at `window_ns`.
    Polled { span: Span, window_ns: u64 },
    /// Sleeping; the polled span served `polled_served` in `polled_ns`, at `window_ns`.
    Slept {
        span: Span,
        polled_served: u64,
        polled_ns: u64,
        window_ns: u64,
    },
}

/// What a rate trial found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Vote {
    /// Sleeping served at least [`SLEEP_KEEPS`] of polling's rate.
    Sleep,
    /// Polling served at least [`POLL_GAINS`] times sleeping's rate.
    Poll,
    /// Between the two.
    Neither,
}

/// The adaptive poll window.
#[derive(Debug, Clone)]
pub struct PollPolicy {
    mode: PollMode,
    max_ns: u64,
    window_ns: u64,
    /// Poll windows and hits in the current epoch.
    windows: HitTally,
    /// Non-idle sleeps in a row at window zero.
    zero_sleeps: u32,
    /// The current epoch is a probe.
    probing: bool,
    trial: Trial,
    /// What the last trial voted for.
    last_vote: Vote,
    /// The thread sleeps by the trials' choice: the window stays zero and hit-rate probes are
    /// off until the next trial.
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
            windows: HitTally::default(),
            zero_sleeps: 0,
            probing: false,
            trial: Trial::Waiting { next_ns: None },
            last_vote: Vote::Neither,
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
    /// advances and ends rate trials. Returns what a trial that ended now found.
    pub fn observe(&mut self, now_ns: u64, served: u64) -> Option<TrialOutcome> {
        if !self.adaptive() {
            return None;
        }
        match &mut self.trial {
            Trial::Waiting { next_ns } => {
                if self.window_ns == 0 && !self.sleeping_chosen {
                    // Not polling: nothing to weigh until the hit-rate rules poll again.
                    return None;
                }
                match *next_ns {
                    None => *next_ns = Some(now_ns + FIRST_TRIAL_AFTER_NS),
                    Some(next) if now_ns >= next => {
                        if self.sleeping_chosen {
                            self.window_ns = self.max_ns;
                        }
                        self.trial = Trial::Polled {
                            span: Span::new(now_ns, served),
                            window_ns: self.window_ns,
                        };
                    }
                    Some(_) => {}
                }
                None
            }
            Trial::Polled { span, window_ns } => {
                let (polled_served, polled_ns) = span.advance(now_ns, served)?;
                self.trial = Trial::Slept {
                    span: Span::new(now_ns, served),
                    polled_served,
                    polled_ns,
                    window_ns: *window_ns,
                };
                self.window_ns = 0;
                None
            }
            Trial::Slept {
                span,
                polled_served,
                polled_ns,
                window_ns,
            } => {
                let (slept_served, slept_ns) = span.advance(now_ns, served)?;
                let (polled_served, polled_ns, window_ns) =
                    (*polled_served, *polled_ns, *window_ns);
                // slept / slept_ns >= SLEEP_KEEPS * polled / polled_ns, and polled / polled_ns
                // >= POLL_GAINS * slept / slept_ns, without division.
                let (polled_rate, slept_rate) = (
                    u128::from(polled_served) * u128::from(slept_ns),
                    u128::from(slept_served) * u128::from(polled_ns),
                );
                let (num, den) = SLEEP_KEEPS;
                let vote = if slept_rate * u128::from(den) >= polled_rate * u128::from(num) {
                    Vote::Sleep
                } else if polled_rate * u128::from(POLL_GAINS.1)
                    >= slept_rate * u128::from(POLL_GAINS.0)
                {
                    Vote::Poll
                } else {
                    Vote::Neither
                };
                // The mode changes on the second vote in a row for the other one (module
                // docs); a first such vote is confirmed by a trial soon after.
                let other = if self.sleeping_chosen {
                    Vote::Poll
                } else {
                    Vote::Sleep
                };
                let changes = vote == other && self.last_vote == other;
                let sleeping = self.sleeping_chosen != changes;
                let confirm = vote == other && !changes;
                let sleep = vote == Vote::Sleep;
                self.last_vote = vote;
                self.sleeping_chosen = sleeping;
                self.window_ns = if sleeping { 0 } else { window_ns };
                self.zero_sleeps = 0;
                self.windows.restart();
                self.probing = false;
                let wait = if confirm {
                    CONFIRM_AFTER_NS
                } else {
                    TRIAL_EVERY_NS
                };
                self.trial = Trial::Waiting {
                    next_ns: Some(now_ns + wait),
                };
                let per_s =
                    |n: u64, ns: u64| (u128::from(n) * 1_000_000_000 / u128::from(ns)) as u64;
                Some(TrialOutcome {
                    polled_per_s: per_s(polled_served, polled_ns),
                    slept_per_s: per_s(slept_served, slept_ns),
                    sleep_vote: sleep,
                    sleeps: sleeping,
                })
            }
        }
    }

    /// The load stopped: no trial runs, and the votes and the choice to sleep are forgotten.
    /// (A next trial already set while polling keeps its time.)
    fn end_trials(&mut self) {
        if self.in_trial() || self.sleeping_chosen {
            self.trial = Trial::Waiting { next_ns: None };
        }
        self.sleeping_chosen = false;
        self.last_vote = Vote::Neither;
    }

    fn end_of_window(&mut self, hit: bool) {
        if !self.adaptive() || self.in_trial() {
            return;
        }
        let Some(hits) = self.windows.count(hit, EPOCH) else {
            return;
        };
        if hits * 2 >= EPOCH {
            self.grow();
        } else if hits * 4 < EPOCH {
            if self.probing {
                // A failed probe costs one epoch, not the whole way down.
                self.window_ns = 0;
            } else {
                self.shrink();
            }
        }
        self.probing = false;
    }

    /// A poll found work.
    pub fn on_poll_hit(&mut self) {
        self.end_of_window(true);
    }

    /// A poll window expired without work.
    pub fn on_poll_miss(&mut self) {
        self.end_of_window(false);
    }

    /// The thread slept `slept_ns` before the next event, with requests at the engine
    /// throughout if `engine_busy`.
    pub fn on_sleep(&mut self, slept_ns: u64, engine_busy: bool) {
        if !self.adaptive() {
            return;
        }
        if slept_ns >= IDLE_NS && !engine_busy {
            // The load stopped: polling only burns CPU.
            self.end_trials();
            self.shrink();
            self.zero_sleeps = 0;
            self.windows.restart();
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
            self.windows.restart();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_never_polls_on_always_does() {
        let mut p = PollPolicy::new(PollMode::Off, 50);
        p.on_sleep(1_000, false);
        assert_eq!(p.window_ns(), 0);
        let mut p = PollPolicy::new(PollMode::On, 50);
        p.on_sleep(10_000_000, false);
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
            p.on_sleep(1_000, false);
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
            p.on_sleep(IDLE_NS, false);
        }
        assert_eq!(p.window_ns(), 0);
        for _ in 0..(10 * PROBE_EVERY) {
            p.on_sleep(50 * IDLE_NS, false);
            assert_eq!(p.window_ns(), 0, "an idle thread must not poll");
        }
    }

    #[test]
    fn long_wakeups_under_load_probe_and_keep_polling_if_it_pays() {
        // Sleeps of 200 µs: longer than the 32 µs maximum (no plain grow), shorter than idle.
        let mut p = PollPolicy::new(PollMode::Adaptive, 32);
        for _ in 0..PROBE_EVERY - 1 {
            p.on_sleep(200_000, false);
            assert_eq!(p.window_ns(), 0);
        }
        p.on_sleep(200_000, false);
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
            p.on_sleep(200_000, false);
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
    const W: u64 = TRIAL_WARMUP_NS;
    const S: u64 = TRIAL_SPAN_NS;

    /// A polling policy whose first trial has just started (its polled span's warm-up) at `t`.
    fn polling_into_a_trial(t: u64) -> PollPolicy {
        let mut p = PollPolicy::new(PollMode::Adaptive, 32);
        start(&mut p);
        assert_eq!(p.observe(t - FIRST_TRIAL_AFTER_NS, 0), None);
        assert_eq!(p.observe(t - 1, 0), None);
        assert_eq!(p.observe(t, 0), None);
        assert_eq!(p.window_ns(), 32_000);
        p
    }

    /// Runs a trial that started at `t` with `served` so far: `polled` requests in the polled
    /// span's counted part, `slept` in the sleeping span's, and `warm` in each warm-up (which
    /// must not count). Checks the window in each span; returns the outcome and the end.
    fn trial(
        p: &mut PollPolicy,
        t: u64,
        served: u64,
        warm: u64,
        polled: u64,
        slept: u64,
    ) -> (Option<TrialOutcome>, u64) {
        let window = p.window_ns();
        assert!(window > 0, "a trial polls its first span");
        assert_eq!(p.observe(t + W, served + warm), None);
        assert_eq!(p.observe(t + W + S - 1, served + warm), None);
        assert_eq!(p.window_ns(), window);
        let served = served + warm + polled;
        assert_eq!(p.observe(t + W + S, served), None);
        assert_eq!(p.window_ns(), 0, "the second span sleeps");
        assert_eq!(p.observe(t + 2 * W + S, served + warm), None);
        assert_eq!(p.observe(t + 2 * W + 2 * S - 1, served + warm), None);
        let end = t + 2 * W + 2 * S;
        (p.observe(end, served + warm + slept), end)
    }

    /// Checks that no trial starts before `at`, then runs one from `at` (warm-ups serving
    /// nothing); returns its vote, whether the thread then sleeps, and when the trial ended.
    fn next_trial(
        p: &mut PollPolicy,
        at: u64,
        served: u64,
        polled: u64,
        slept: u64,
    ) -> (Option<(bool, bool)>, u64) {
        assert_eq!(p.observe(at - 1, served), None);
        assert_eq!(p.observe(at, served), None);
        let (outcome, end) = trial(p, at, served, 0, polled, slept);
        (outcome.map(|o| (o.sleep_vote, o.sleeps)), end)
    }

    #[test]
    fn two_trials_in_a_row_that_find_sleeping_serves_nearly_as_much_put_the_thread_to_sleep() {
        let t = 100 * MS;
        let mut p = polling_into_a_trial(t);
        // 5,000 requests in 5 ms polling, then 4,800 sleeping: 96% of polling's rate. The
        // warm-ups' requests (a million each) are not counted.
        let (outcome, end) = trial(&mut p, t, 0, 1_000_000, 5_000, 4_800);
        assert_eq!(
            outcome,
            Some(TrialOutcome {
                polled_per_s: 1_000_000,
                slept_per_s: 960_000,
                sleep_vote: true,
                sleeps: false,
            })
        );
        // One vote polls on, and a second trial comes soon to confirm it.
        assert_eq!(p.window_ns(), 32_000);
        let (votes, end) = next_trial(&mut p, end + CONFIRM_AFTER_NS, 3_000_000, 5_000, 5_000);
        assert_eq!(votes, Some((true, true)));
        assert_eq!(p.window_ns(), 0);
        // Short sleeps bring no hit-rate probe while sleeping is the choice.
        for _ in 0..(4 * PROBE_EVERY) {
            p.on_sleep(1_000, false);
            assert_eq!(p.window_ns(), 0, "a probe undid the trials' choice");
        }
        let next = end + TRIAL_EVERY_NS;
        assert_eq!(p.observe(next - 1, 4_000_000), None);
        assert_eq!(p.window_ns(), 0);
        // The next trial polls its first span at the maximum window (`trial` checks that the
        // window holds through it). A vote to poll (polling served 5x) is confirmed by a
        // second trial soon after before the thread polls again.
        assert_eq!(p.observe(next, 4_000_000), None);
        assert_eq!(p.window_ns(), 32_000);
        let (outcome, end) = trial(&mut p, next, 4_000_000, 0, 5_000, 1_000);
        assert_eq!(
            outcome.map(|o| (o.sleep_vote, o.sleeps)),
            Some((false, true))
        );
        assert_eq!(p.window_ns(), 0);
        let (votes, _) = next_trial(&mut p, end + CONFIRM_AFTER_NS, 5_000_000, 5_000, 1_000);
        assert_eq!(votes, Some((false, false)));
        assert_eq!(p.window_ns(), 32_000);
    }

    /// A policy that sleeps by the trials' choice, and when its next trial starts.
    fn sleeping_by_choice() -> (PollPolicy, u64) {
        let t = 100 * MS;
        let mut p = polling_into_a_trial(t);
        let (_, end) = trial(&mut p, t, 0, 0, 5_000, 5_000);
        let (votes, end) = next_trial(&mut p, end + CONFIRM_AFTER_NS, 10_000, 5_000, 5_000);
        assert_eq!(votes, Some((true, true)));
        (p, end + TRIAL_EVERY_NS)
    }

    #[test]
    fn a_sleeping_thread_polls_again_only_on_two_clear_votes_in_a_row() {
        // Polling serving 120% (under POLL_GAINS' 125%) is a vote for neither: the thread
        // sleeps on, and the next trial comes at the usual interval.
        let (mut p, next) = sleeping_by_choice();
        let (votes, end) = next_trial(&mut p, next, 20_000, 6_000, 5_000);
        assert_eq!(votes, Some((false, true)));
        // A clear vote to poll, then one for neither: still asleep (the streak is broken).
        let (votes, end) = next_trial(&mut p, end + TRIAL_EVERY_NS, 30_000, 6_500, 5_000);
        assert_eq!(votes, Some((false, true)));
        let (votes, end) = next_trial(&mut p, end + CONFIRM_AFTER_NS, 40_000, 6_000, 5_000);
        assert_eq!(votes, Some((false, true)));
        assert_eq!(p.window_ns(), 0);
        // Two clear votes in a row: it polls.
        let (votes, end) = next_trial(&mut p, end + TRIAL_EVERY_NS, 50_000, 6_500, 5_000);
        assert_eq!(votes, Some((false, true)));
        let (votes, _) = next_trial(&mut p, end + CONFIRM_AFTER_NS, 60_000, 6_500, 5_000);
        assert_eq!(votes, Some((false, false)));
        assert_eq!(p.window_ns(), 32_000);
    }

    #[test]
    fn a_long_sleep_with_requests_at_the_engine_is_not_an_idle_one() {
        // Waiting milliseconds on a slow engine keeps the choice to sleep and its trials.
        let (mut p, next) = sleeping_by_choice();
        p.on_sleep(50 * IDLE_NS, true);
        let (votes, _) = next_trial(&mut p, next, 20_000, 5_000, 5_000);
        assert_eq!(votes, Some((true, true)));
        // And a polling thread's window does not shrink for it.
        let mut p = PollPolicy::new(PollMode::Adaptive, 32);
        start(&mut p);
        p.on_sleep(50 * IDLE_NS, true);
        assert_eq!(p.window_ns(), 32_000);
        // With nothing at the engine, the load stopped: both are undone.
        let (mut p, next) = sleeping_by_choice();
        p.on_sleep(IDLE_NS, false);
        assert_eq!(p.observe(next, 20_000), None);
        assert_eq!(p.window_ns(), 0, "an idle thread's trial polled");
        let mut p = PollPolicy::new(PollMode::Adaptive, 32);
        start(&mut p);
        p.on_sleep(IDLE_NS, false);
        assert_eq!(p.window_ns(), 16_000);
    }

    #[test]
    fn a_trial_keeps_polling_at_its_window_when_polling_serves_more() {
        let t = 100 * MS;
        let mut p = polling_into_a_trial(t);
        // 4,700 against 5,000: 94%, under the 95% sleeping must keep. The warm-ups would
        // make it 100% if they counted.
        let (outcome, end) = trial(&mut p, t, 0, 10_000, 5_000, 4_700);
        assert_eq!(outcome.map(|o| o.sleep_vote), Some(false));
        assert_eq!(p.window_ns(), 32_000);
        // The next trial starts TRIAL_EVERY_NS after this one ended.
        let (votes, end) = next_trial(&mut p, end + TRIAL_EVERY_NS, 50_000, 5_000, 5_000);
        assert_eq!(votes, Some((true, false)));
        // A vote against sleeping between two for it: the thread polls on.
        let (votes, end) = next_trial(&mut p, end + CONFIRM_AFTER_NS, 100_000, 5_000, 100);
        assert_eq!(votes, Some((false, false)));
        let (votes, _) = next_trial(&mut p, end + TRIAL_EVERY_NS, 200_000, 5_000, 5_000);
        assert_eq!(votes, Some((true, false)));
        assert_eq!(p.window_ns(), 32_000);
    }

    #[test]
    fn spans_are_compared_as_rates_whatever_their_length() {
        // A loop iteration can come late: here the sleeping span is seen to end after twice
        // its length. Twice the requests in twice the time is the same rate; the same count
        // is half of it.
        for (slept, vote) in [(10_000, true), (5_000, false)] {
            let t = 100 * MS;
            let mut p = polling_into_a_trial(t);
            p.observe(t + W, 0);
            p.observe(t + W + S, 5_000);
            p.observe(t + 2 * W + S, 5_000);
            let outcome = p.observe(t + 2 * W + 3 * S, 5_000 + slept);
            assert_eq!(outcome.map(|o| o.sleep_vote), Some(vote), "{slept}");
            assert_eq!(outcome.map(|o| o.slept_per_s), Some(slept * 100), "{slept}");
        }
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
        p.observe(t + W, 0);
        p.observe(t + W + S, 5_000);
        p.on_sleep(IDLE_NS, false);
        // The trial is over: later observations decide nothing until polling resumes.
        assert_eq!(p.observe(t + 4 * (W + S), 10_000), None);
        assert_eq!(p.window_ns(), 0);

        let mut p = polling_into_a_trial(t);
        let (_, end) = trial(&mut p, t, 0, 0, 5_000, 5_000);
        let (votes, end) = next_trial(&mut p, end + CONFIRM_AFTER_NS, 10_000, 5_000, 5_000);
        assert_eq!(votes, Some((true, true)));
        p.on_sleep(IDLE_NS, false);
        // The load came back: the hit-rate rules run again (short sleeps bring a probe), and
        // no trial starts before polling has gone on for a while.
        start(&mut p);
        let now = end + 2 * TRIAL_EVERY_NS;
        assert_eq!(p.observe(now, 20_000), None);
        assert_eq!(p.observe(now + FIRST_TRIAL_AFTER_NS - 1, 20_000), None);
        assert_eq!(p.window_ns(), 32_000);
        assert_eq!(p.observe(now + FIRST_TRIAL_AFTER_NS, 20_000), None);
        // And the votes before the idle time are forgotten: one vote to sleep polls on.
        let (outcome, _) = trial(&mut p, now + FIRST_TRIAL_AFTER_NS, 20_000, 0, 100, 100);
        assert_eq!(
            outcome.map(|o| (o.sleep_vote, o.sleeps)),
            Some((true, false))
        );
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
