//! When the guest hears of a batch's completions: at the first one, or after the last.
//!
//! The I/O thread answers a batch of requests and notifies the guest once, after the last used
//! entry, as EVENT_IDX allows. When the guest's submitting thread (a vCPU, or a libblkio
//! client) runs on another CPU and sleeps until that notification, its wake-up (an IPI and a
//! reschedule; several microseconds in a VM) starts only once the whole batch is answered, and
//! the two CPUs take turns: the batch is answered, then the guest wakes, then it refills.
//! Notifying at the batch's first used entry starts that wake-up while the rest is answered; the
//! guest usually finds the whole batch when it runs, so the number of notifications stays the
//! same (EVENT_IDX suppresses the one after the last entry while the guest has not re-armed).
//!
//! It pays only while the I/O thread has its CPU to itself. When the guest's thread shares it,
//! the early wake-up preempts the I/O thread in the middle of the batch, the guest finds one
//! entry, and both lose (docs/PERFORMANCE.md 12c: 0.60x at 2 jobs on 2 vCPUs). The signal for
//! that is the thread's involuntary context switches: a polling thread alone on its CPU has next
//! to none, or a few hundred a second when a lightly busy thread (a client's helper, a kernel
//! worker) sometimes runs beside it; one that shares its CPU with the guest's busy thread is
//! switched out at every round, tens of thousands of times a second, by its own `sched_yield`
//! or by the scheduler. The thread reads the count once per epoch and notifies early only after
//! an epoch with at most [`MAX_SWITCHES`] of them.

/// How often the I/O thread reads its involuntary context switches, in nanoseconds.
pub const EPOCH_NS: u64 = 10_000_000;

/// The most involuntary context switches an epoch may have for the next to notify early: a
/// tenth of what a thread that yields to a busy neighbour at every round has (about 550 per
/// 10 ms at 2 jobs on 2 vCPUs), well above what one that has its CPU mostly to itself has (1
/// to 23 per 10 ms at 1 job with libblkio, whose helper thread runs at 37% of a CPU).
pub const MAX_SWITCHES: u64 = 50;

/// The smallest mean batch (requests per submission, `BatchPolicy::mean`) worth an early
/// notification: a round that answers one request has nothing to overlap the wake-up with,
/// and there the write(2) of its own cost more than the io_uring entry it replaces (0.84x to
/// 0.93x IOPS at iodepth 1 on a loop device, docs/PERFORMANCE.md 12c).
pub const MIN_MEAN_BATCH: f64 = 2.0;

/// The early-notification decision of one I/O thread.
#[derive(Debug, Clone)]
pub struct EarlyNotify {
    enabled: bool,
    alone: bool,
    next_check_ns: u64,
    /// The involuntary context switches read at the last check; `None` before the first.
    switches: Option<u64>,
}

impl EarlyNotify {
    /// The decision for a thread with early notification `enabled` by its export's tuning. It
    /// notifies early only after one whole epoch showed the thread alone on its CPU.
    pub fn new(enabled: bool) -> Self {
        EarlyNotify {
            enabled,
            alone: false,
            next_check_ns: 0,
            switches: None,
        }
    }

    /// Whether to notify at a batch's first used entry now, given the thread's recent mean
    /// batch size.
    pub fn active(&self, mean_batch: f64) -> bool {
        self.alone && mean_batch >= MIN_MEAN_BATCH
    }

    /// Whether the thread should read its involuntary context switches at `now_ns` and pass
    /// them to [`EarlyNotify::on_epoch`].
    pub fn check_due(&self, now_ns: u64) -> bool {
        self.enabled && now_ns >= self.next_check_ns
    }

    /// Takes the thread's involuntary context switches since it started, read at `now_ns`
    /// (`None`: they could not be read, and the next epoch is not early either).
    pub fn on_epoch(&mut self, now_ns: u64, switches: Option<u64>) {
        self.alone = matches!((self.switches, switches),
            (Some(last), Some(now)) if now.saturating_sub(last) <= MAX_SWITCHES);
        self.switches = switches;
        self.next_check_ns = now_ns + EPOCH_NS;
    }
}

/// The calling thread's involuntary context switches since it started, if it can read them.
pub fn involuntary_switches() -> Option<u64> {
    // SAFETY: an all-zero rusage is a valid value of the plain C struct getrusage fills.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a live, writable rusage for the kernel to fill.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) } != 0 {
        return None;
    }
    u64::try_from(usage.ru_nivcsw).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_never_checks_nor_notifies_early() {
        let p = EarlyNotify::new(false);
        assert!(!p.check_due(u64::MAX));
        assert!(!p.active(32.0));
    }

    #[test]
    fn early_only_after_a_whole_quiet_epoch() {
        let mut p = EarlyNotify::new(true);
        assert!(p.check_due(0));
        // The first reading is only a baseline, however small.
        p.on_epoch(0, Some(0));
        assert!(!p.active(32.0));
        assert!(!p.check_due(EPOCH_NS - 1));
        assert!(p.check_due(EPOCH_NS));
        p.on_epoch(EPOCH_NS, Some(MAX_SWITCHES));
        assert!(p.active(32.0));
        assert!(!p.active(1.0), "one request per round: nothing to overlap");
    }

    #[test]
    fn a_busy_epoch_stops_it_and_a_quiet_one_resumes_it() {
        let mut p = EarlyNotify::new(true);
        p.on_epoch(0, Some(100));
        p.on_epoch(EPOCH_NS, Some(101));
        assert!(p.active(32.0));
        // Sharing the CPU: thousands of switches in an epoch.
        p.on_epoch(2 * EPOCH_NS, Some(101 + 5000));
        assert!(!p.active(32.0));
        p.on_epoch(3 * EPOCH_NS, Some(101 + 5000 + MAX_SWITCHES + 1));
        assert!(!p.active(32.0));
        p.on_epoch(4 * EPOCH_NS, Some(101 + 5000 + MAX_SWITCHES + 1));
        assert!(p.active(32.0));
    }

    #[test]
    fn a_count_that_cannot_be_read_is_never_quiet() {
        let mut p = EarlyNotify::new(true);
        p.on_epoch(0, None);
        p.on_epoch(EPOCH_NS, None);
        assert!(!p.active(32.0));
        // After a failed reading the next good one is a new baseline, not a quiet epoch.
        p.on_epoch(2 * EPOCH_NS, Some(7));
        assert!(!p.active(32.0));
        p.on_epoch(3 * EPOCH_NS, Some(7));
        assert!(p.active(32.0));
    }

    #[test]
    fn the_calling_thread_can_read_its_count() {
        // getrusage(RUSAGE_THREAD) works here, as it must under the I/O threads' seccomp filter
        // (which allows it; a daemon test would die of SIGSYS otherwise).
        assert!(involuntary_switches().is_some());
    }
}
