//! The I/O thread's state and its loop. The stages the loop calls live beside it: `submit`
//! (gather, parse, merge, start), `complete` (results to used entries), `control` (commands).
//!
//! The thread blocks only in `io_uring_enter(submit, wait 1)`: kicks, control commands, engine
//! completions and an engine's own completion fd all arrive as completions on its ring, and the
//! guest notifications are ring entries too, so a batch costs one syscall. While requests keep
//! coming it polls instead (the adaptive window of `policy::poll`), with guest notifications
//! suppressed.

use std::os::fd::AsRawFd;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;
use std::time::Instant;

use vmm_sys_util::eventfd::EventFd;

use super::migration::DirtyTracking;
use super::policy::{self, BatchPolicy, EarlyNotify, EngineWait, PollPolicy, Shape};
use super::qos::Throttle;
use super::ring::{Ring, Token};
use super::slots::{SlotId, SlotTable};
use super::split::SplitLimits;
use super::stats::{IoCounters, SharedCounters};
use super::vq::Vq;
use super::{Command, GuestMemory, IoThreadConfig};
use crate::blk::{Limits, Scratch, Segment};
use crate::config::Tuning;
use crate::engine::{Channel, Engine};
use crate::log_limit::LogLimiter;

/// Poll-loop iterations between yields of the CPU (a few microseconds).
const YIELD_SPINS: u32 = 128;

/// A capacity change waiting for these requests (slot, use) to complete before it replies.
pub(super) type CapacityBarrier = (Vec<(SlotId, u32)>, SyncSender<()>);

/// An I/O thread.
pub(super) struct IoThread {
    pub(super) ring: Ring,
    /// Keeps the storage open for `channel`.
    _engine: Arc<dyn Engine>,
    pub(super) channel: Box<dyn Channel>,
    /// Results of pending engine operations, collected from the channel.
    pub(super) engine_done: Vec<(u64, i32)>,
    pub(super) commands: Receiver<Command>,
    pub(super) wake: EventFd,
    /// Where the wake eventfd's counter is read to (stable: boxed).
    pub(super) wake_buf: Box<u64>,
    shared: Arc<SharedCounters>,
    pub(super) counters: IoCounters,
    /// This thread's queues, by local index; `None` while stopped.
    pub(super) queues: Vec<Option<Vq>>,
    /// Each queue's largest size: the most requests it may have in flight.
    pub(super) queue_sizes: Vec<u16>,
    pub(super) generations: Vec<u16>,
    pub(super) slots: SlotTable,
    /// Requests parsed in this batch and not yet started on the engine, in order.
    pub(super) staged: Vec<SlotId>,
    /// Scratch for the merge plan.
    pub(super) shapes: Vec<Shape>,
    pub(super) runs: Vec<(usize, usize)>,
    pub(super) mem: Option<Arc<GuestMemory>>,
    /// A memory swap waiting for in-flight requests to drain.
    pub(super) pending_mem: Option<(Option<Arc<GuestMemory>>, SyncSender<()>)>,
    pub(super) limits: Limits,
    pub(super) serial: Vec<u8>,
    /// Write-back cache mode (false: writes go out RWF_DSYNC).
    pub(super) writeback: bool,
    pub(super) scratch: Scratch,
    pub(super) segs: Vec<Segment>,
    pub(super) shutdown: bool,
    pub(super) log: LogLimiter,
    pub(super) tuning: Tuning,
    pub(super) batch: BatchPolicy,
    poll: PollPolicy,
    /// How long a poll waits for requests at the engine.
    engine_wait: EngineWait,
    /// Whether to notify at a round's first used entry (`policy::notify`).
    pub(super) early_notify: EarlyNotify,
    /// Requests started on the engine and not yet completed.
    pub(super) engine_in_flight: u64,
    /// Whether the engine answered a request the moment it was started since the last
    /// [`IoThread::notify`] (the null engine; an engine refusing an operation).
    pub(super) answered_at_once: bool,
    /// What `now_ns` counts from.
    epoch: Instant,
    /// When this loop iteration began, in nanoseconds since `epoch`: the one clock reading
    /// per iteration that the in-flight integral and every request's latency use.
    pub(super) now_ns: u64,
    /// This thread, as the QoS buckets it shares tell their waiters apart (read once here,
    /// not per request).
    pub(super) thread_id: std::thread::ThreadId,
    /// QoS buckets (shared with the export's other threads, or its group's); `None`: no
    /// limit, and requests skip admission.
    pub(super) throttle: Option<Arc<Throttle>>,
    /// Waiting requests should ask their buckets again (a timer fired, the limits or the
    /// queue's state changed).
    pub(super) admission_due: bool,
    /// When the earliest QoS timer armed and not yet fired ends.
    pub(super) qos_timer: Option<Instant>,
    /// Capacity changes waiting for the requests in flight before them to complete.
    pub(super) capacity_barrier: Vec<CapacityBarrier>,
    /// Dirty logging while the VM migrates.
    pub(super) dirty: DirtyTracking,
    /// Where host I/Os are cut to fit the engine (`None`: it takes any size).
    pub(super) split_limits: Option<SplitLimits>,
    /// The ring takes the engine's 128-byte entries, whose completions carry a status for
    /// [`Channel::wide_result`](crate::engine::Channel::wide_result).
    wide: bool,
}

impl IoThread {
    pub(super) fn new(
        cfg: IoThreadConfig,
        engine: Arc<dyn Engine>,
        commands: Receiver<Command>,
        wake: EventFd,
        shared: Arc<SharedCounters>,
    ) -> std::io::Result<Self> {
        let nslots: usize = cfg.queue_sizes.iter().map(|&s| s as usize).sum();
        let nq = cfg.queue_sizes.len();
        // Every in-flight request, kick poll and notification fits at once.
        let entries = (nslots + 3 * nq + 8).next_power_of_two().clamp(64, 4096) as u32;
        let wide = engine.wide_entries();
        let mut ring = Ring::confined(entries, &cfg.tuning, wide, engine.ring_opcodes())?;
        let split_limits = SplitLimits::of(&engine.limits(), engine.block_size());
        let channel = engine.channel()?;
        if cfg.tuning.fixed_files {
            ring.register_file(channel.file_fd());
        }
        let mut t = IoThread {
            ring,
            _engine: engine,
            channel,
            engine_done: Vec::new(),
            commands,
            wake,
            wake_buf: Box::new(0),
            shared,
            counters: IoCounters::default(),
            queues: (0..nq).map(|_| None).collect(),
            queue_sizes: cfg.queue_sizes,
            generations: vec![0; nq],
            slots: SlotTable::new(nslots),
            staged: Vec::with_capacity(nslots),
            shapes: Vec::with_capacity(nslots),
            runs: Vec::with_capacity(nslots),
            mem: None,
            pending_mem: None,
            scratch: Scratch::with_capacity(cfg.limits.max_descriptors),
            segs: Vec::with_capacity(cfg.limits.max_descriptors),
            limits: cfg.limits,
            serial: cfg.serial,
            writeback: true,
            shutdown: false,
            log: LogLimiter::new(),
            batch: BatchPolicy::new(cfg.tuning.batch_wait_us),
            poll: PollPolicy::new(cfg.tuning.poll, cfg.tuning.poll_max_us),
            engine_wait: EngineWait::new(cfg.tuning.poll_engine_us),
            early_notify: EarlyNotify::new(cfg.tuning.notify_early),
            tuning: cfg.tuning,
            engine_in_flight: 0,
            answered_at_once: false,
            epoch: Instant::now(),
            now_ns: 0,
            throttle: cfg.throttle,
            admission_due: false,
            qos_timer: None,
            capacity_barrier: Vec::new(),
            dirty: DirtyTracking::new(nq),
            split_limits,
            wide,
            // `new` runs on the I/O thread it builds.
            thread_id: std::thread::current().id(),
        };
        t.arm_control();
        if let Some(fd) = t.channel.completion_fd() {
            t.ring.push_poll(fd, Token::EngineEvents, &mut t.counters);
        }
        Ok(t)
    }

    /// The loop: reap, gather and start, finish stops, notify; then poll or sleep. Returns
    /// once told to shut down and drained, or with the error of an io_uring that stopped
    /// working.
    pub(super) fn run(&mut self) -> std::io::Result<()> {
        loop {
            self.tick();
            if let Some(trial) = self.poll.observe(self.now_ns, self.counters.requests) {
                self.on_poll_trial(trial);
            }
            if self.early_notify.check_due(self.now_ns) {
                self.early_notify
                    .on_epoch(self.now_ns, policy::notify::involuntary_switches());
            }
            self.reap();
            if self.admission_due {
                self.admit_waiting();
            }
            self.gather();
            self.start_staged();
            self.channel.end_round();
            self.finish_stops();
            self.notify();
            self.shared.publish(&self.counters, self.engine_in_flight);
            if self.shutdown && self.queues.iter().all(Option::is_none) && self.slots.in_use() == 0
            {
                break;
            }
            // Poll while it pays: guest notifications stay suppressed, and completions are
            // reaped from the completion ring without a syscall. What is queued goes out first.
            if self.poll.window_ns() > 0 {
                self.ring.submit(&mut self.counters);
                if self.poll_for_work() {
                    continue;
                }
            }
            // Going to sleep: ask the guest for notifications again, and look once more so a
            // request that raced with that is not left waiting for a kick that never comes.
            if self.enable_notifications() {
                self.ring.submit(&mut self.counters);
                continue;
            }
            let slept = Instant::now();
            // Only the reap after the sleep changes it.
            let engine_busy = self.engine_in_flight > 0;
            if let Err(e) = self.ring.submit_and_wait(&mut self.counters) {
                self.shared.publish(&self.counters, self.engine_in_flight);
                return Err(e);
            }
            self.counters.sleeps += 1;
            self.poll
                .on_sleep(slept.elapsed().as_nanos() as u64, engine_busy);
        }
        self.shared.publish(&self.counters, self.engine_in_flight);
        Ok(())
    }

    /// Reads the clock for this loop iteration (`now_ns`) and adds the time since the last
    /// one, times the requests in flight at the engine, to `engine_in_flight_ns`. The count
    /// changes only while the loop works, and holds while it sleeps or polls, which is where
    /// the time goes. Requests are stamped with `now_ns` when popped and when answered, so
    /// their latency costs no clock reading of its own.
    fn tick(&mut self) {
        let now = self.epoch.elapsed().as_nanos() as u64;
        self.counters.engine_in_flight_ns += self.engine_in_flight * (now - self.now_ns);
        self.now_ns = now;
    }

    /// Counts a finished rate trial of adaptive polling, and says what it found (at most
    /// one line per trial, every half second while the thread polls).
    fn on_poll_trial(&mut self, trial: policy::poll::TrialOutcome) {
        self.counters.poll_trials += 1;
        self.counters.poll_sleep_votes += u64::from(trial.sleep_vote);
        tracing::debug!(
            polled_per_s = trial.polled_per_s,
            slept_per_s = trial.slept_per_s,
            sleeps = trial.sleeps,
            "poll trial: {}",
            if trial.sleep_vote {
                "sleeping serves as much"
            } else {
                "polling serves more"
            }
        );
    }

    /// Reads the wake eventfd through the ring: its completion means commands wait.
    pub(super) fn arm_control(&mut self) {
        let buf: *mut u64 = &mut *self.wake_buf;
        // SAFETY: `wake_buf` is boxed (a stable address) and lives, like the wake eventfd, as
        // long as the thread and its ring.
        unsafe {
            self.ring.push_read_u64(
                self.wake.as_raw_fd(),
                buf,
                Token::Control,
                &mut self.counters,
            )
        };
    }

    /// Handles every completion waiting on the ring.
    fn reap(&mut self) {
        while let Some(c) = self.ring.next_completion() {
            match c.token {
                Token::Io(slot) if self.wide => {
                    let res = self.channel.wide_result(c.result);
                    self.complete_io(slot, res, true);
                }
                Token::Io(slot) => self.complete_io(slot, c.result, false),
                Token::Kick { local, generation } => self.on_kick(local as usize, generation, &c),
                Token::Control => {
                    self.handle_commands();
                    self.arm_control();
                }
                Token::EngineEvents => {
                    let mut done = std::mem::take(&mut self.engine_done);
                    self.channel.reap(&mut |token, res| done.push((token, res)));
                    for &(token, res) in &done {
                        self.complete_io(token as SlotId, res, false);
                    }
                    done.clear();
                    self.engine_done = done;
                    if c.multishot_ended() {
                        if let Some(fd) = self.channel.completion_fd() {
                            self.ring
                                .push_poll(fd, Token::EngineEvents, &mut self.counters);
                        }
                    }
                }
                Token::QosTimer => self.on_qos_timer(),
                Token::Ignore => {}
            }
        }
    }

    fn on_kick(&mut self, local: usize, generation: u16, c: &super::ring::Completion) {
        let Some(Some(q)) = self.queues.get_mut(local) else {
            return;
        };
        // A poll of an earlier start of this queue, or of a queue being stopped.
        if q.generation != generation || q.stop_reply.is_some() {
            return;
        }
        if c.result < 0 && c.result != -libc::ECANCELED {
            tracing::warn!(queue = q.index, err = %std::io::Error::from_raw_os_error(-c.result), "kick eventfd poll failed");
        }
        q.pending = true;
        self.counters.kicks += 1;
        if c.multishot_ended() {
            // The multishot poll ended (e.g. completion ring overflow): re-arm.
            let fd = q.kick_fd();
            let token = Token::Kick {
                local: local as u16,
                generation,
            };
            self.ring.push_poll(fd, token, &mut self.counters);
        }
    }

    /// Busy-polls the avail rings and the completion ring for up to the poll window, and
    /// while requests are at the engine, for up to the engine wait. Returns true when it found
    /// work.
    fn poll_for_work(&mut self) -> bool {
        let window = self.poll.window_ns();
        if window == 0 || self.pending_mem.is_some() || self.shutdown {
            return false;
        }
        let limit = self.engine_wait.limit_ns(window, self.engine_in_flight);
        // Set once the poll has gone past its window, waiting for the engine.
        let mut waiting_for_engine = false;
        // The clock is read every 16 spins, starting at the 16th: a poll that finds work
        // sooner (at iodepth 1 with a polling client, most do) reads it not at all, and the
        // window is longer by those 16 spins (about a microsecond, against windows of 4 µs
        // and up).
        let mut start: Option<Instant> = None;
        let mut spins = 0u32;
        loop {
            self.ring.run_task_work(&mut self.counters);
            if self.ring.has_completions() || self.any_avail() {
                // A completion caught while waiting for the engine is a hit for the window
                // too: its rule is whether polling found work. Counted a miss, it would push
                // the window toward zero where the disk is slower than the window, and a thread
                // whose window is zero neither polls nor waits.
                self.counters.poll_hits += 1;
                self.poll.on_poll_hit();
                if waiting_for_engine {
                    self.on_engine_wait(true);
                }
                return true;
            }
            spins += 1;
            if spins.is_multiple_of(16) {
                match start {
                    None => start = Some(Instant::now()),
                    Some(t) => {
                        let elapsed = t.elapsed().as_nanos() as u64;
                        if elapsed >= limit {
                            self.counters.poll_misses += 1;
                            self.poll.on_poll_miss();
                            if limit > window {
                                self.on_engine_wait(false);
                            }
                            return false;
                        }
                        waiting_for_engine = elapsed >= window;
                    }
                }
            }
            if spins.is_multiple_of(YIELD_SPINS) {
                // Let a runnable thread on this CPU (often the very client this poll waits
                // for) go first; with nobody waiting this returns at once and polling goes on.
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
    }

    /// Counts a poll that went on past its window for the engine, and tells the policy
    /// whether work came.
    fn on_engine_wait(&mut self, arrived: bool) {
        self.counters.poll_engine_waits += 1;
        self.counters.poll_engine_waits_missed += u64::from(!arrived);
        self.engine_wait.on_wait(arrived);
    }

    /// Whether any queue that takes requests now has avail entries not yet popped.
    pub(super) fn any_avail(&mut self) -> bool {
        let Some(mem) = self.mem.as_deref() else {
            return false;
        };
        let mut found = false;
        for q in self.queues.iter_mut().flatten() {
            found |= q.has_avail(mem);
        }
        found
    }

    /// Re-enables guest notifications on every serving queue whose requests do not wait for
    /// admission; true if work arrived meanwhile.
    fn enable_notifications(&mut self) -> bool {
        let Some(mem) = self.mem.as_deref() else {
            return false;
        };
        let mut found = false;
        for q in self.queues.iter_mut().flatten().filter(|q| q.is_serving()) {
            match q.enable_notifications(mem) {
                Ok(f) => found |= f,
                Err(e) => q.mark_broken(e, &mut self.log),
            }
        }
        found
    }

    /// Sends the guest the notifications its queues want for their new used entries.
    ///
    /// A notification travels as a ring entry, with the round's I/O, in the next
    /// `io_uring_enter`. When the engine answered requests the moment they were started, the
    /// client that sent them may not have gone to sleep yet, and the sooner the eventfd is
    /// signalled the likelier it finds the client awake (a wake-up across vCPUs costs several
    /// microseconds). Then, if nothing else is queued and the thread goes on to poll, the
    /// enter would carry the notification alone, and the first one is written with write(2)
    /// instead: the same one syscall, without io_uring's request set-up before the signal.
    /// Measured at iodepth 1 with libblkio on the null engine: 3.6x the IOPS at 0.28x the CPU
    /// per I/O (docs/PERFORMANCE.md 12e). Answers of I/O the device completed reach a client
    /// that slept through the device's latency; there the write(2) gained nothing (0.82x at
    /// iodepth 1 on a loop device), so they keep the entry, as does a thread about to sleep
    /// (its sleep's enter carries the entry at no extra syscall).
    pub(super) fn notify(&mut self) {
        let Some(mem) = self.mem.as_deref() else {
            return;
        };
        let mut alone = std::mem::take(&mut self.answered_at_once)
            && self.poll.window_ns() > 0
            && self.ring.nothing_queued();
        for q in self.queues.iter_mut().flatten() {
            if let Some(used) = q.take_notification(mem) {
                if let Some(call) = q.call.as_ref() {
                    self.counters.count_notification(used);
                    if std::mem::take(&mut alone) {
                        self.ring.notify_alone(call, &mut self.counters);
                    } else {
                        self.ring.push_notify(call, &mut self.counters);
                    }
                }
            }
        }
    }
}
