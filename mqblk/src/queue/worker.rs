//! The I/O thread: owns its queues and its io_uring, and runs the request path.
//!
//! ```text
//! kick (a multishot io_uring poll on the kick eventfd) or a poll of the avail ring
//!   -> pop avail chains -> parse + validate (blk::request) -> map SG list to host iovecs
//!   -> one readv/writev per request, the whole batch submitted with one io_uring_enter
//!   -> reap completions on this thread -> status byte + used entry
//!   -> one guest notification per queue per batch, if EVENT_IDX says the guest wants it
//! ```
//!
//! The thread blocks only in `io_uring_enter(submit, wait 1)`: kicks, control commands and I/O
//! completions all arrive as completions on the same ring, and the guest notification itself is
//! an io_uring write to the call eventfd, so a batch costs one syscall.
//! Nothing here takes a lock shared with another worker or allocates per request once warm.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::Instant;

use io_uring::{opcode, squeue, types, IoUring};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::blk::chain::ChainWalker;
use crate::blk::{self, Kind, Limits, Scratch, Segment, Status};
use crate::engine::{Engine, Op};
use crate::queue::batch::BatchPolicy;
use crate::queue::merge::{self, Dir, MergeLimits, Shape};
use crate::queue::poll::{PollMode, PollPolicy};
use crate::vhost::inflight::InflightQueue;

/// Guest memory as the worker sees it.
pub type Mem = GuestMemoryMmap<()>;

/// Most iovecs one host I/O may carry (Linux's IOV_MAX).
pub const IOV_MAX: usize = 1024;
/// Largest merged host I/O.
pub const MAX_MERGE_BYTES: u64 = 1 << 20;
/// Poll-loop iterations between yields of the CPU (a few microseconds).
const YIELD_SPINS: u32 = 128;

/// The switchable mechanisms of the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Polling mode.
    pub poll: PollMode,
    /// Longest poll window, microseconds.
    pub poll_max_us: u32,
    /// Longest wait to grow a batch under heavy load, microseconds (0: never wait).
    pub batch_wait_us: u32,
    /// Merge adjacent requests into one host I/O.
    pub merge: bool,
    /// Register the engine's file with each I/O thread's ring (IOSQE_FIXED_FILE): no
    /// reference count on the shared `struct file` per I/O.
    pub fixed_files: bool,
    /// Register guest memory with each ring as fixed buffers: single-segment reads and writes
    /// use READ_FIXED/WRITE_FIXED and skip pinning pages per I/O. Pins all guest memory.
    pub fixed_buffers: bool,
    /// A kernel submission-queue polling thread per ring (IORING_SETUP_SQPOLL), idle after
    /// this many milliseconds (0: off).
    pub sqpoll_idle_ms: u32,
    /// Set up rings with COOP_TASKRUN (completions never interrupt the I/O thread).
    pub coop_taskrun: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            // Hit-rate-driven adaptive polling, yielding the CPU while it spins: well ahead of
            // poll=off with one job on 2 vCPUs, behind by about a fifth only when busy threads
            // outnumber CPUs (docs/PERFORMANCE.md section 5c).
            poll: PollMode::Adaptive,
            poll_max_us: 32,
            batch_wait_us: 0,
            merge: true,
            fixed_files: true,
            fixed_buffers: false,
            sqpoll_idle_ms: 0,
            coop_taskrun: true,
        }
    }
}

const TAG_SHIFT: u32 = 56;
const TAG_IO: u64 = 0;
const TAG_KICK: u64 = 1;
const TAG_CTRL: u64 = 2;
const TAG_NOP: u64 = 3;
const PAYLOAD_MASK: u64 = (1 << TAG_SHIFT) - 1;

fn ud(tag: u64, payload: u64) -> u64 {
    (tag << TAG_SHIFT) | (payload & PAYLOAD_MASK)
}

/// The value written to a call eventfd (must outlive the io_uring write: it is static).
static ONE: u64 = 1;

/// Commands from the vhost-user control thread to a worker.
pub enum Command {
    /// Start serving a queue (its local index on this worker).
    Start {
        /// Index among this worker's queues.
        local: usize,
        /// Global virtqueue index (for logs).
        index: usize,
        /// The configured queue (addresses, size, next indices, EVENT_IDX).
        queue: Queue,
        /// Guest-to-backend notifications.
        kick: File,
        /// Backend-to-guest notifications.
        call: Option<File>,
        /// In-flight tracking for this queue (INFLIGHT_SHMFD), if the frontend set it up.
        inflight: Option<InflightQueue>,
        /// Heads that were in flight before a reconnect, to resubmit first, in fetch order.
        resubmit: Vec<u16>,
    },
    /// Stop a queue once its in-flight requests have completed; replies with next_avail.
    Stop {
        /// Index among this worker's queues.
        local: usize,
        /// Where to send the queue's next available index.
        reply: SyncSender<u16>,
    },
    /// Replace a running queue's call eventfd.
    SetCall {
        /// Index among this worker's queues.
        local: usize,
        /// The new eventfd.
        call: Option<File>,
    },
    /// Swap guest memory once nothing is in flight; replies when done.
    SetMem {
        /// The new memory map (None: no memory, after a disconnect).
        mem: Option<Arc<Mem>>,
        /// Acknowledgement.
        reply: SyncSender<()>,
    },
    /// Write-back (true) or write-through (false) cache mode, from CONFIG_WCE.
    SetWriteback(bool),
    /// Drain everything and exit the thread.
    Shutdown,
}

/// Per-worker counters, written by the worker only (relaxed stores), read by anyone.
#[derive(Default, Debug)]
#[repr(align(64))]
pub struct WorkerStats {
    /// Requests completed (any status).
    pub requests: AtomicU64,
    /// Requests that completed with IOERR or UNSUPP, or were dropped.
    pub errors: AtomicU64,
    /// io_uring_enter calls that carried at least one I/O request to the engine.
    pub submits: AtomicU64,
    /// io_uring_enter calls of any kind (submissions, waits, notification-only submits).
    pub enters: AtomicU64,
    /// Requests submitted to the engine.
    pub submitted: AtomicU64,
    /// Guest notifications sent.
    pub notifies: AtomicU64,
    /// Bytes read or written.
    pub bytes: AtomicU64,
    /// Requests folded into another request's host I/O.
    pub merges: AtomicU64,
    /// Kicks (guest notifications to the backend) received.
    pub kicks: AtomicU64,
    /// Polls that found work.
    pub poll_hits: AtomicU64,
    /// Poll windows that expired.
    pub poll_misses: AtomicU64,
    /// Times the worker slept in the kernel.
    pub sleeps: AtomicU64,
    /// Batch waits under heavy load.
    pub batch_waits: AtomicU64,
    /// Host I/Os issued on a registered buffer (READ_FIXED/WRITE_FIXED).
    pub fixed_buf_ios: AtomicU64,
    /// Host I/Os issued on the registered (fixed) file.
    pub fixed_file_ios: AtomicU64,
    /// Writes issued write-through (RWF_DSYNC: the guest turned the write cache off).
    pub sync_writes: AtomicU64,
}

#[derive(Default)]
struct LocalStats {
    requests: u64,
    errors: u64,
    submits: u64,
    enters: u64,
    submitted: u64,
    notifies: u64,
    bytes: u64,
    merges: u64,
    kicks: u64,
    poll_hits: u64,
    poll_misses: u64,
    sleeps: u64,
    batch_waits: u64,
    fixed_buf_ios: u64,
    fixed_file_ios: u64,
    sync_writes: u64,
}

impl LocalStats {
    fn publish(&self, s: &WorkerStats) {
        s.requests.store(self.requests, Ordering::Relaxed);
        s.errors.store(self.errors, Ordering::Relaxed);
        s.submits.store(self.submits, Ordering::Relaxed);
        s.enters.store(self.enters, Ordering::Relaxed);
        s.submitted.store(self.submitted, Ordering::Relaxed);
        s.notifies.store(self.notifies, Ordering::Relaxed);
        s.bytes.store(self.bytes, Ordering::Relaxed);
        s.merges.store(self.merges, Ordering::Relaxed);
        s.kicks.store(self.kicks, Ordering::Relaxed);
        s.poll_hits.store(self.poll_hits, Ordering::Relaxed);
        s.poll_misses.store(self.poll_misses, Ordering::Relaxed);
        s.sleeps.store(self.sleeps, Ordering::Relaxed);
        s.batch_waits.store(self.batch_waits, Ordering::Relaxed);
        s.fixed_buf_ios.store(self.fixed_buf_ios, Ordering::Relaxed);
        s.fixed_file_ios
            .store(self.fixed_file_ios, Ordering::Relaxed);
        s.sync_writes.store(self.sync_writes, Ordering::Relaxed);
    }
}

/// The handle the control thread keeps for one worker.
pub struct WorkerHandle {
    tx: Sender<Command>,
    wake: EventFd,
    /// Counters.
    pub stats: Arc<WorkerStats>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl WorkerHandle {
    /// Sends a command and wakes the worker.
    pub fn send(&self, cmd: Command) {
        if self.tx.send(cmd).is_ok() {
            let _ = self.wake.write(1);
        }
    }

    /// Stops the worker after draining, and joins it.
    pub fn shutdown(&mut self) {
        self.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Static settings of a worker.
pub struct WorkerConfig {
    /// Thread name.
    pub name: String,
    /// CPU to pin to.
    pub cpu: Option<usize>,
    /// Largest size of each of this worker's queues, by local index.
    pub queue_sizes: Vec<u16>,
    /// Request validation limits.
    pub limits: Limits,
    /// GET_ID answer (at most 20 bytes).
    pub serial: Vec<u8>,
    /// Polling, batching and merging settings.
    pub tuning: Tuning,
}

/// Starts a worker thread.
pub fn spawn(cfg: WorkerConfig, engine: Arc<dyn Engine>) -> std::io::Result<WorkerHandle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let wake = EventFd::new(libc::EFD_CLOEXEC)?;
    let wake2 = wake.try_clone()?;
    let stats = Arc::new(WorkerStats::default());
    let stats2 = stats.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let thread = std::thread::Builder::new()
        .name(cfg.name.clone())
        .spawn(move || {
            if let Some(cpu) = cfg.cpu {
                pin_to_cpu(cpu);
            }
            match Worker::new(cfg, engine, rx, wake2, stats2) {
                Ok(mut w) => {
                    let _ = ready_tx.send(Ok(()));
                    w.run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(WorkerHandle {
            tx,
            wake,
            stats,
            thread: Some(thread),
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => Err(std::io::Error::other("worker thread died during setup")),
    }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes within it for cpu < CPU_SETSIZE (checked);
    // sched_setaffinity reads it for the calling thread (pid 0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= libc::CPU_SETSIZE as usize {
            tracing::warn!(cpu, "CPU number too large to pin to");
            return;
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::warn!(cpu, err = %std::io::Error::last_os_error(), "could not pin I/O thread");
        }
    }
}

/// Logs at most a few lines per second, counting what it drops.
struct RateLimit {
    window: Instant,
    used: u32,
    dropped: u64,
}

impl RateLimit {
    const PER_SEC: u32 = 10;
    fn new() -> Self {
        RateLimit {
            window: Instant::now(),
            used: 0,
            dropped: 0,
        }
    }
    /// Returns how many lines were dropped before this one if this one may be logged.
    fn allow(&mut self) -> Option<u64> {
        if self.window.elapsed().as_secs() >= 1 {
            self.window = Instant::now();
            self.used = 0;
        }
        if self.used < Self::PER_SEC {
            self.used += 1;
            Some(std::mem::take(&mut self.dropped))
        } else {
            self.dropped += 1;
            None
        }
    }
}

struct ActiveQueue {
    index: usize,
    queue: Queue,
    kick: File,
    call: Option<File>,
    /// Generation of the pending kick read, so stale completions are ignored.
    gen: u32,
    inflight: u32,
    /// Used entries were added since the last notification check.
    used_added: bool,
    /// Avail entries may be waiting (kicked, throttled, or resumed).
    pending: bool,
    /// The guest broke the ring; nothing more is popped until the queue is restarted.
    broken: bool,
    stop_reply: Option<SyncSender<u16>>,
    track: Option<InflightQueue>,
}

const NO_SLOT: u32 = u32::MAX;

struct Slot {
    local: u16,
    head: u16,
    kind: Kind,
    status_addr: GuestAddress,
    len: u64,
    offset: u64,
    retried: bool,
    /// Next member of a merged I/O led by another slot (NO_SLOT at the end).
    next: u32,
    /// This request's iovecs.
    iovs: Vec<libc::iovec>,
    /// A merged I/O's concatenated iovecs (leader only).
    miovs: Vec<libc::iovec>,
}

impl Slot {
    fn new() -> Self {
        Slot {
            local: 0,
            head: 0,
            kind: Kind::Flush,
            status_addr: GuestAddress(0),
            len: 0,
            offset: 0,
            retried: false,
            next: NO_SLOT,
            iovs: Vec::new(),
            miovs: Vec::new(),
        }
    }
}

struct Worker {
    ring: IoUring,
    engine: Arc<dyn Engine>,
    rx: Receiver<Command>,
    wake: EventFd,
    stats: Arc<WorkerStats>,
    local_stats: LocalStats,
    queues: Vec<Option<ActiveQueue>>,
    queue_sizes: Vec<u16>,
    gens: Vec<u32>,
    ctrl_buf: Box<u64>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Requests parsed in this batch and not yet handed to the ring, in order.
    staged: Vec<u32>,
    shapes: Vec<Shape>,
    runs_buf: Vec<(usize, usize)>,
    mem: Option<Arc<Mem>>,
    pending_mem: Option<(Option<Arc<Mem>>, SyncSender<()>)>,
    limits: Limits,
    serial: Vec<u8>,
    writeback: bool,
    scratch: Scratch,
    segs: Vec<Segment>,
    shutdown: bool,
    log: RateLimit,
    queued_sqes: u32,
    /// Engine I/O entries among `queued_sqes`.
    queued_io: u32,
    /// Flags of the guest-notification writes: no completion entry when they succeed (where
    /// the kernel can), so a notification never wakes this thread by itself.
    notify_flags: squeue::Flags,
    /// The engine's file is registered as fixed-file slot (its descriptor number).
    fixed_file: bool,
    /// The ring was set up with COOP_TASKRUN and TASKRUN_FLAG.
    taskrun_flag: bool,
    /// Guest memory registered as fixed buffers: `(host start, host end)` by buffer index.
    bufs: Vec<(usize, usize)>,
    tuning: Tuning,
    batch: BatchPolicy,
    poll: PollPolicy,
}

impl Worker {
    fn new(
        cfg: WorkerConfig,
        engine: Arc<dyn Engine>,
        rx: Receiver<Command>,
        wake: EventFd,
        stats: Arc<WorkerStats>,
    ) -> std::io::Result<Self> {
        let nslots: usize = cfg.queue_sizes.iter().map(|&s| s as usize).sum();
        let nq = cfg.queue_sizes.len();
        // Every in-flight request, kick poll+read and notification fits at once.
        let want = (nslots + 3 * nq + 8).next_power_of_two().clamp(64, 4096) as u32;
        let build = |coop: bool| {
            let mut builder = IoUring::builder();
            builder.setup_cqsize(want * 4);
            if cfg.tuning.sqpoll_idle_ms > 0 {
                builder.setup_sqpoll(cfg.tuning.sqpoll_idle_ms);
            }
            if coop {
                // Completions arriving while this thread runs do not interrupt it (no IPI):
                // their task work runs at its next syscall, and while it polls the ring's
                // TASKRUN flag tells it to make one. Only this thread ever submits.
                builder
                    .setup_coop_taskrun()
                    .setup_taskrun_flag()
                    .setup_single_issuer();
            }
            builder.build(want)
        };
        // Kernels before 6.0 refuse these flags: fall back to a plain ring.
        let coop = cfg.tuning.coop_taskrun && cfg.tuning.sqpoll_idle_ms == 0;
        let (ring, taskrun_flag) = match build(coop) {
            Ok(r) => (r, coop),
            Err(_) if coop => (build(false)?, false),
            Err(e) => return Err(e),
        };
        let fixed_file = cfg.tuning.fixed_files && register_file(&ring, engine.file_fd());
        let notify_flags = if ring.params().is_feature_skip_cqe_on_success() {
            squeue::Flags::SKIP_SUCCESS
        } else {
            squeue::Flags::empty()
        };
        let mut w = Worker {
            ring,
            engine,
            rx,
            wake,
            stats,
            local_stats: LocalStats::default(),
            queues: (0..nq).map(|_| None).collect(),
            queue_sizes: cfg.queue_sizes,
            gens: vec![0; nq],
            ctrl_buf: Box::new(0),
            slots: (0..nslots).map(|_| Slot::new()).collect(),
            free: (0..nslots as u32).rev().collect(),
            staged: Vec::with_capacity(nslots),
            shapes: Vec::with_capacity(nslots),
            runs_buf: Vec::with_capacity(nslots),
            mem: None,
            pending_mem: None,
            scratch: Scratch::with_capacity(cfg.limits.max_descriptors),
            segs: Vec::with_capacity(cfg.limits.max_descriptors),
            limits: cfg.limits,
            serial: cfg.serial,
            writeback: true,
            shutdown: false,
            log: RateLimit::new(),
            queued_sqes: 0,
            queued_io: 0,
            notify_flags,
            fixed_file,
            taskrun_flag,
            bufs: Vec::new(),
            batch: BatchPolicy::new(cfg.tuning.batch_wait_us),
            poll: PollPolicy::new(cfg.tuning.poll, cfg.tuning.poll_max_us),
            tuning: cfg.tuning,
        };
        w.arm_ctrl();
        Ok(w)
    }

    /// Makes room for `n` more submission entries, submitting what is queued if needed.
    fn ensure_room(&mut self, n: usize) {
        loop {
            let room = {
                let sq = self.ring.submission();
                sq.capacity() - sq.len()
            };
            if room >= n {
                return;
            }
            self.record_submit();
            match self.ring.submit() {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EBUSY) | Some(libc::EINTR) | Some(libc::EAGAIN)
                    ) =>
                {
                    // Completion queue backlog: let the kernel flush it on the next wait.
                    self.local_stats.enters += 1;
                    let _ = self.ring.submitter().submit_and_wait(0);
                }
                Err(e) => {
                    tracing::error!(err = %e, "io_uring submit failed");
                    std::thread::yield_now();
                }
            }
        }
    }

    fn push(&mut self, sqe: squeue::Entry) {
        self.ensure_room(1);
        // SAFETY: every buffer an entry points to (iovecs in a slot, guest memory they
        // describe, kick/ctrl buffers, the static ONE) stays valid until its completion:
        // slots are only reused after their completion, guest memory is only swapped when
        // nothing is in flight, and the kick/ctrl buffers live as long as the worker.
        let pushed = unsafe { self.ring.submission().push(&sqe) };
        debug_assert!(pushed.is_ok(), "room was ensured");
        self.queued_sqes += 1;
    }

    fn arm_ctrl(&mut self) {
        let sqe = opcode::Read::new(
            types::Fd(self.wake.as_raw_fd()),
            &mut *self.ctrl_buf as *mut u64 as *mut u8,
            8,
        )
        .build()
        .user_data(ud(TAG_CTRL, 0));
        self.push(sqe);
    }

    fn kick_tag(q: &ActiveQueue, local: usize) -> u64 {
        ud(TAG_KICK, (u64::from(q.gen) << 16) | local as u64)
    }

    /// Watches a queue's kick eventfd with a multishot poll: one completion per guest kick,
    /// no re-arming and no syscall of ours per kick. The eventfd's counter is not read: a poll
    /// does not consume it, so a stale poll can never swallow a kick meant for a newer one, and
    /// the counter (64 bits, +1 per kick) cannot overflow in practice.
    fn arm_kick(&mut self, local: usize) {
        let Some(q) = self.queues[local].as_ref() else {
            return;
        };
        let poll = opcode::PollAdd::new(types::Fd(q.kick.as_raw_fd()), libc::POLLIN as u32)
            .multi(true)
            .build()
            .user_data(Self::kick_tag(q, local));
        self.push(poll);
    }

    fn run(&mut self) {
        loop {
            self.reap();
            self.gather();
            self.flush_staged();
            self.finish_stops();
            self.notify();
            self.local_stats.publish(&self.stats);
            if self.shutdown && self.queues.iter().all(|q| q.is_none()) && self.inflight() == 0 {
                break;
            }
            // Poll while it pays: guest notifications stay suppressed, and completions are
            // reaped from the completion ring without a syscall. What is queued goes out first.
            if self.poll.window_ns() > 0 {
                self.submit_now();
                if self.poll_for_work() {
                    continue;
                }
            }
            // Going to sleep: ask the guest for notifications again, and look once more so a
            // request that raced with that is not left waiting for a kick that never comes.
            if self.enable_notifications() {
                self.submit_now();
                continue;
            }
            // One syscall submits what is queued (I/O, guest notifications) and sleeps.
            if self.queued_sqes > 0 {
                self.record_submit();
            } else {
                self.local_stats.enters += 1;
            }
            let slept = Instant::now();
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
                    ) => {}
                Err(e) => {
                    tracing::error!(err = %e, "io_uring_enter failed; I/O thread stops");
                    break;
                }
            }
            self.local_stats.sleeps += 1;
            self.poll.on_sleep(slept.elapsed().as_nanos() as u64);
        }
        self.local_stats.publish(&self.stats);
    }

    /// Submits whatever is queued, now.
    fn submit_now(&mut self) {
        if self.queued_sqes == 0 {
            return;
        }
        self.record_submit();
        if let Err(e) = self.ring.submit() {
            if !matches!(
                e.raw_os_error(),
                Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
            ) {
                tracing::error!(err = %e, "io_uring submit failed");
            }
        }
    }

    /// Accounts for an io_uring_enter that hands over everything queued.
    fn record_submit(&mut self) {
        self.local_stats.enters += 1;
        if self.queued_io > 0 {
            self.local_stats.submits += 1;
        }
        self.queued_sqes = 0;
        self.queued_io = 0;
    }

    /// Busy-polls the avail rings and the completion ring for up to the poll window.
    /// Returns true when it found work.
    fn poll_for_work(&mut self) -> bool {
        let window = self.poll.window_ns();
        if window == 0 || self.pending_mem.is_some() || self.shutdown {
            return false;
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if self.taskrun_flag && self.ring.submission().taskrun() {
                // Completions wait as task work: one syscall posts them.
                self.local_stats.enters += 1;
                let _ = self.ring.submit();
            }
            if !self.ring.completion().is_empty() || self.any_avail() {
                self.local_stats.poll_hits += 1;
                self.poll.on_poll_hit(start.elapsed().as_nanos() as u64);
                return true;
            }
            spins += 1;
            if spins.is_multiple_of(16) && start.elapsed().as_nanos() as u64 >= window {
                self.local_stats.poll_misses += 1;
                self.poll.on_poll_miss();
                return false;
            }
            if spins.is_multiple_of(YIELD_SPINS) {
                // Let a runnable thread on this CPU (often the very client this poll waits
                // for) go first; with nobody waiting this returns at once and polling goes on.
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
    }

    /// Whether any running queue has avail entries not yet popped (a read of guest memory).
    fn any_avail(&mut self) -> bool {
        let Some(mem) = self.mem.as_deref() else {
            return false;
        };
        let mut found = false;
        for q in self.queues.iter_mut().flatten() {
            if q.broken || q.stop_reply.is_some() {
                continue;
            }
            if let Ok(idx) = q.queue.avail_idx(mem, Ordering::Acquire) {
                if idx.0 != q.queue.next_avail() {
                    q.pending = true;
                    found = true;
                }
            }
        }
        found
    }

    /// Re-enables guest notifications on every running queue; true if work arrived meanwhile.
    fn enable_notifications(&mut self) -> bool {
        let Some(mem) = self.mem.clone() else {
            return false;
        };
        let mut found = false;
        for q in self.queues.iter_mut().flatten() {
            if q.broken || q.stop_reply.is_some() {
                continue;
            }
            match q.queue.enable_notification(&*mem) {
                Ok(true) => {
                    q.pending = true;
                    found = true;
                }
                Ok(false) => {}
                Err(e) => {
                    q.broken = true;
                    if let Some(d) = self.log.allow() {
                        tracing::error!(queue = q.index, err = %e, dropped_logs = d, "avail ring unreadable; queue stopped until reset");
                    }
                }
            }
        }
        found
    }

    fn inflight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn reap(&mut self) {
        loop {
            let cqe = match self.ring.completion().next() {
                Some(c) => c,
                None => return,
            };
            let (data, res, flags) = (cqe.user_data(), cqe.result(), cqe.flags());
            let payload = data & PAYLOAD_MASK;
            match data >> TAG_SHIFT {
                TAG_IO => self.complete_io(payload as u32, res),
                TAG_KICK => {
                    let local = (payload & 0xffff) as usize;
                    let gen = (payload >> 16) as u32;
                    let live = matches!(self.queues.get(local), Some(Some(q)) if q.gen == gen && q.stop_reply.is_none());
                    if live {
                        if res < 0 && res != -libc::ECANCELED {
                            tracing::warn!(err = %std::io::Error::from_raw_os_error(-res), "kick eventfd poll failed");
                        }
                        if let Some(Some(q)) = self.queues.get_mut(local) {
                            q.pending = true;
                        }
                        self.local_stats.kicks += 1;
                        if !io_uring::cqueue::more(flags) {
                            // The multishot poll ended (e.g. completion ring overflow): re-arm.
                            self.arm_kick(local);
                        }
                    }
                }
                TAG_CTRL => {
                    self.handle_commands();
                    self.arm_ctrl();
                }
                _ => {}
            }
        }
    }

    fn handle_commands(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                Command::Start {
                    local,
                    index,
                    queue,
                    kick,
                    call,
                    inflight,
                    resubmit,
                } => {
                    if local >= self.queues.len() {
                        tracing::error!(local, "start for a queue this worker does not own");
                        continue;
                    }
                    self.gens[local] = self.gens[local].wrapping_add(1) & 0xffff;
                    self.queues[local] = Some(ActiveQueue {
                        index,
                        queue,
                        kick,
                        call,
                        gen: self.gens[local],
                        inflight: 0,
                        used_added: false,
                        // The guest may have queued requests before the kick fd was armed.
                        pending: true,
                        broken: false,
                        stop_reply: None,
                        track: inflight,
                    });
                    self.arm_kick(local);
                    self.resubmit(local, &resubmit);
                    // With in-flight tracking this may be a restart after a crash: requests the
                    // previous backend completed may never have been signalled (it died with the
                    // notification still queued), and the guest, waiting, will not kick. One
                    // spurious interrupt is harmless; a lost one hangs the guest.
                    if let Some(Some(q)) = self.queues.get(local) {
                        if q.track.is_some() {
                            if let Some(call) = q.call.as_ref() {
                                let _ = nix_write_one(call);
                            }
                        }
                    }
                    tracing::debug!(queue = index, resubmitted = resubmit.len(), "queue started");
                }
                Command::Stop { local, reply } => match self.queues.get_mut(local) {
                    Some(Some(q)) => q.stop_reply = Some(reply),
                    _ => {
                        let _ = reply.send(0);
                    }
                },
                Command::SetCall { local, call } => {
                    // Queued notifications name the old descriptor: submit them first.
                    self.submit_now();
                    if let Some(Some(q)) = self.queues.get_mut(local) {
                        q.call = call;
                    }
                }
                Command::SetMem { mem, reply } => {
                    // A private copy of the region table (the mappings themselves are shared):
                    // the Arc clones this worker makes per batch then touch a reference count
                    // no other worker touches.
                    let private = mem.map(|m| Arc::new((*m).clone()));
                    self.pending_mem = Some((private, reply));
                }
                Command::SetWriteback(wb) => self.writeback = wb,
                Command::Shutdown => {
                    self.shutdown = true;
                    for q in self.queues.iter_mut().flatten() {
                        if q.stop_reply.is_none() {
                            let (tx, _rx) = std::sync::mpsc::sync_channel(1);
                            q.stop_reply = Some(tx);
                        }
                    }
                }
            }
        }
    }

    /// Completes stops and memory swaps whose queues have drained.
    fn finish_stops(&mut self) {
        for local in 0..self.queues.len() {
            let done =
                matches!(&self.queues[local], Some(q) if q.stop_reply.is_some() && q.inflight == 0);
            if done {
                let mut q = self.queues[local].take().expect("checked");
                // Publish what completed before stopping.
                if q.used_added {
                    if let Some(mem) = self.mem.as_deref() {
                        if notify_queue(
                            &mut self.ring,
                            &mut self.local_stats,
                            &mut q,
                            mem,
                            self.notify_flags,
                        ) {
                            self.queued_sqes += 1;
                        }
                    }
                }
                // Cancel the kick poll, and hand every queued entry to the kernel before the
                // queue's descriptors are closed: entries name descriptors by number, and a
                // number closed before submission could be reused by another thread.
                let cancel = opcode::PollRemove::new(Self::kick_tag(&q, local))
                    .build()
                    .user_data(ud(TAG_NOP, 2));
                self.push(cancel);
                self.submit_now();
                let next_avail = q.queue.next_avail();
                let (index, reply) = (q.index, q.stop_reply.take());
                drop(q);
                tracing::debug!(queue = index, next_avail, "queue stopped");
                if let Some(r) = reply {
                    let _ = r.send(next_avail);
                }
            }
        }
        if self.pending_mem.is_some() && self.inflight() == 0 {
            let (mem, reply) = self.pending_mem.take().expect("checked");
            self.mem = mem;
            self.register_mem();
            let _ = reply.send(());
            for q in self.queues.iter_mut().flatten() {
                q.pending = true;
            }
        }
    }

    /// Resubmits requests that were in flight when the previous backend died (they are still
    /// marked in the in-flight region, with their original fetch order).
    fn resubmit(&mut self, local: usize, heads: &[u16]) {
        let Some(mem) = self.mem.clone() else {
            return;
        };
        for &head in heads {
            let (table, size) = {
                let q = self.queues[local].as_mut().expect("just started");
                q.inflight += 1;
                (GuestAddress(q.queue.desc_table()), q.queue.size())
            };
            let chain = ChainWalker::new(&*mem, table, size, head);
            self.start_request(local, head, chain, &mem);
        }
    }

    /// Pops and stages what the queues have, waiting a little for more under heavy load.
    fn gather(&mut self) {
        if self.pending_mem.is_some() {
            return;
        }
        self.drain_pending();
        let wait = self.batch.wait_ns(self.staged.len());
        if wait > 0 {
            let start = Instant::now();
            let target = self.batch.mean() as usize;
            let mut spins = 0u32;
            while self.staged.len() < target {
                if self.any_avail() {
                    self.drain_pending();
                    continue;
                }
                spins += 1;
                if spins.is_multiple_of(16) && start.elapsed().as_nanos() as u64 >= wait {
                    break;
                }
                std::hint::spin_loop();
            }
            self.local_stats.batch_waits += 1;
        }
        if !self.staged.is_empty() {
            self.batch.record(self.staged.len());
        }
    }

    fn drain_pending(&mut self) {
        for local in 0..self.queues.len() {
            let go = matches!(&self.queues[local], Some(q) if q.pending && !q.broken && q.stop_reply.is_none());
            if go {
                self.drain_queue(local);
            }
        }
    }

    /// Pops one queue's avail ring (bounded by its size in flight), with guest notifications
    /// suppressed; they are re-enabled only when the worker is about to sleep.
    fn drain_queue(&mut self, local: usize) {
        let Some(mem) = self.mem.clone() else {
            return;
        };
        let mem: &Mem = &mem;
        let size = u32::from(self.queue_sizes[local]);
        {
            let q = self.queues[local].as_mut().expect("caller checked");
            q.pending = false;
            if let Err(e) = q.queue.disable_notification(mem) {
                q.broken = true;
                if let Some(d) = self.log.allow() {
                    tracing::error!(queue = q.index, err = %e, dropped_logs = d, "used ring unwritable; queue stopped until reset");
                }
                return;
            }
        }
        loop {
            // Take a snapshot of the avail index and pop exactly what it shows. A guest that
            // moves the index more than the queue size ahead, or whose ring cannot be read,
            // broke the ring. (Checking after a failed pop instead would race with a guest that
            // is legitimately adding a request right then.)
            let q = self.queues[local].as_mut().expect("caller checked");
            let avail = match q.queue.avail_idx(mem, Ordering::Acquire) {
                Ok(idx) => idx.0.wrapping_sub(q.queue.next_avail()),
                Err(_) => u16::MAX,
            };
            if avail == 0 {
                return;
            }
            if avail > q.queue.size() {
                q.broken = true;
                if let Some(d) = self.log.allow() {
                    tracing::error!(
                        queue = q.index,
                        avail,
                        dropped_logs = d,
                        "guest broke the avail ring (index too far ahead or unreadable); queue stopped until reset"
                    );
                }
                return;
            }
            for _ in 0..avail {
                let q = self.queues[local].as_mut().expect("caller checked");
                if q.inflight >= size {
                    // Throttled: resumes when completions free room.
                    q.pending = true;
                    return;
                }
                let Some(chain) = q.queue.pop_descriptor_chain(mem) else {
                    q.broken = true;
                    if let Some(d) = self.log.allow() {
                        tracing::error!(
                            queue = q.index,
                            dropped_logs = d,
                            "avail ring unreadable; queue stopped until reset"
                        );
                    }
                    return;
                };
                q.inflight += 1;
                let head = chain.head_index();
                if let Some(t) = q.track.as_mut() {
                    t.on_fetch(head);
                }
                self.start_request(local, head, chain, mem);
            }
        }
    }

    /// Completes a request that never reaches the engine: writes `status`, adds the used entry.
    fn complete_now(
        &mut self,
        local: usize,
        head: u16,
        status: Status,
        used_len: u32,
        status_addr: Option<GuestAddress>,
        mem: &Mem,
    ) {
        let used = match status_addr {
            Some(addr) if mem.write_obj(status as u8, addr).is_ok() => used_len,
            _ => 0,
        };
        if status != Status::Ok {
            self.local_stats.errors += 1;
        }
        self.finish(local, head, used, mem);
    }

    fn start_request<I>(&mut self, local: usize, head: u16, chain: I, mem: &Mem)
    where
        I: IntoIterator<Item = virtio_queue::desc::split::Descriptor>,
    {
        let parsed = blk::parse(chain, mem, &self.limits, &mut self.scratch, &mut self.segs);
        let req = match parsed {
            Ok(r) => r,
            Err(rej) => {
                if let Some(d) = self.log.allow() {
                    let q = self.queues[local].as_ref().map(|q| q.index).unwrap_or(0);
                    tracing::warn!(queue = q, head, reason = %rej.reason, status = ?rej.status, dropped_logs = d, "bad request from guest");
                }
                self.complete_now(local, head, rej.status, 1, rej.status_addr, mem);
                return;
            }
        };
        let st = Some(req.status_addr);
        if req.kind == Kind::GetId {
            let ok = write_id(mem, &self.segs, &self.serial, req.len as usize);
            let status = if ok { Status::Ok } else { Status::IoErr };
            self.complete_now(local, head, status, req.len as u32 + 1, st, mem);
            return;
        }
        let Some(slot_idx) = self.free.pop() else {
            // Cannot happen: slots = sum of queue sizes and each queue is throttled at its
            // size. Fail safely anyway.
            self.complete_now(local, head, Status::IoErr, 1, st, mem);
            return;
        };
        let slot = &mut self.slots[slot_idx as usize];
        slot.iovs.clear();
        if matches!(req.kind, Kind::Read | Kind::Write) {
            let mut mapped = true;
            'segs: for s in &self.segs {
                for vs in GuestMemoryBackend::get_slices(mem, s.addr, s.len as usize) {
                    match vs {
                        Ok(vs) if slot.iovs.len() < IOV_MAX => slot.iovs.push(libc::iovec {
                            iov_base: vs.ptr_guard_mut().as_ptr() as *mut libc::c_void,
                            iov_len: vs.len(),
                        }),
                        _ => {
                            mapped = false;
                            break 'segs;
                        }
                    }
                }
            }
            if !mapped {
                self.free.push(slot_idx);
                if let Some(d) = self.log.allow() {
                    tracing::warn!(head, dropped_logs = d, "bad request from guest: data buffer outside guest memory or too many segments");
                }
                self.complete_now(local, head, Status::IoErr, 1, st, mem);
                return;
            }
        }
        slot.local = local as u16;
        slot.head = head;
        slot.kind = req.kind;
        slot.status_addr = req.status_addr;
        slot.len = req.len;
        slot.offset = req.offset();
        slot.retried = false;
        slot.next = NO_SLOT;
        self.staged.push(slot_idx);
    }

    fn op_of(&self, slot: &Slot, merged: bool) -> Op {
        let iovs = if merged { &slot.miovs } else { &slot.iovs };
        let (ptr, cnt) = (iovs.as_ptr(), iovs.len() as u32);
        let buf_index = match iovs.as_slice() {
            [one] if !self.bufs.is_empty() => buffer_index(&self.bufs, one),
            _ => None,
        };
        match slot.kind {
            Kind::Read => Op::Read {
                offset: slot.offset,
                iovs: ptr,
                iovcnt: cnt,
                buf_index,
            },
            Kind::Write => Op::Write {
                offset: slot.offset,
                iovs: ptr,
                iovcnt: cnt,
                sync: !self.writeback,
                buf_index,
            },
            Kind::Flush | Kind::GetId => Op::Flush,
            Kind::Discard => Op::Discard {
                offset: slot.offset,
                len: slot.len,
            },
            Kind::WriteZeroes { unmap } => Op::WriteZeroes {
                offset: slot.offset,
                len: slot.len,
                unmap,
            },
        }
    }

    /// Hands the staged requests to the engine: adjacent reads/writes of one queue merged
    /// into one host I/O where allowed, everything submitted with the next io_uring_enter.
    fn flush_staged(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let staged = std::mem::take(&mut self.staged);
        self.shapes.clear();
        for &i in &staged {
            let s = &self.slots[i as usize];
            self.shapes.push(Shape {
                dir: match s.kind {
                    Kind::Read => Dir::Read,
                    _ => Dir::Write,
                },
                // Only reads and writes of the same queue may merge: give everything else a
                // shape that never extends or is extended.
                offset: if matches!(s.kind, Kind::Read | Kind::Write) {
                    s.offset
                } else {
                    u64::MAX
                },
                len: if matches!(s.kind, Kind::Read | Kind::Write) {
                    s.len
                } else {
                    0
                },
                iovs: if matches!(s.kind, Kind::Read | Kind::Write) {
                    s.iovs.len()
                } else {
                    IOV_MAX + 1
                },
            });
        }
        let limits = MergeLimits {
            max_iovs: if self.tuning.merge { IOV_MAX } else { 0 },
            max_bytes: MAX_MERGE_BYTES,
        };
        let mut runs: Vec<(usize, usize)> = std::mem::take(&mut self.runs_buf);
        runs.clear();
        let shapes = std::mem::take(&mut self.shapes);
        merge::plan(&shapes, &limits, |a, n| runs.push((a, n)));
        self.shapes = shapes;
        for &(a, n) in &runs {
            // Runs never mix queues: split them at queue boundaries.
            let mut start = a;
            while start < a + n {
                let local = self.slots[staged[start] as usize].local;
                let mut end = start + 1;
                while end < a + n && self.slots[staged[end] as usize].local == local {
                    end += 1;
                }
                self.submit_run(&staged[start..end]);
                start = end;
            }
        }
        self.runs_buf = runs;
        let mut staged = staged;
        staged.clear();
        self.staged = staged;
    }

    fn submit_run(&mut self, run: &[u32]) {
        let lead = run[0];
        let merged = run.len() > 1;
        if merged {
            // Chain the members and build the leader's concatenated iovecs.
            let mut miovs = std::mem::take(&mut self.slots[lead as usize].miovs);
            miovs.clear();
            let mut total = 0u64;
            for (k, &i) in run.iter().enumerate() {
                let s = &mut self.slots[i as usize];
                miovs.extend_from_slice(&s.iovs);
                total += s.len;
                s.next = run.get(k + 1).copied().unwrap_or(NO_SLOT);
            }
            let l = &mut self.slots[lead as usize];
            l.miovs = miovs;
            self.local_stats.merges += (run.len() - 1) as u64;
            let _ = total;
        }
        let op = self.op_of(&self.slots[lead as usize], merged);
        self.local_stats.submitted += run.len() as u64;
        if matches!(
            op,
            Op::Read {
                buf_index: Some(_),
                ..
            } | Op::Write {
                buf_index: Some(_),
                ..
            }
        ) {
            self.local_stats.fixed_buf_ios += 1;
        }
        if let Op::Write { sync: true, .. } = op {
            self.local_stats.sync_writes += 1;
        }
        match self.engine.prepare(&op) {
            Some(sqe) => {
                let sqe = self.on_fixed_file(sqe);
                self.push(sqe.user_data(ud(TAG_IO, u64::from(lead))));
                self.queued_io += 1;
            }
            None => {
                // Completed at once (null engine): reads return zeros.
                let res = run.iter().map(|&i| self.slots[i as usize].len).sum::<u64>();
                self.complete_io(lead, res.min(i32::MAX as u64) as i32);
            }
        }
    }

    fn complete_io(&mut self, lead: u32, res: i32) {
        let Some(slot) = self.slots.get_mut(lead as usize) else {
            return;
        };
        let (kind, head) = (slot.kind, slot.head);
        let merged = slot.next != NO_SLOT;
        let status = if res < 0 {
            let errno = -res;
            if errno == libc::EOPNOTSUPP && !slot.retried && !merged {
                let op = self.op_of(&self.slots[lead as usize], false);
                if let Some(sqe) = self.engine.fallback_punch(&op) {
                    // ZERO_RANGE refused (e.g. tmpfs): punching a hole also reads back zeros.
                    self.slots[lead as usize].retried = true;
                    let sqe = self.on_fixed_file(sqe);
                    self.push(sqe.user_data(ud(TAG_IO, u64::from(lead))));
                    self.queued_io += 1;
                    return;
                }
            }
            if kind == Kind::Discard && errno == libc::EOPNOTSUPP {
                // Discard is a hint; a store that cannot deallocate just keeps the data.
                Status::Ok
            } else {
                if let Some(d) = self.log.allow() {
                    tracing::warn!(?kind, head, err = %std::io::Error::from_raw_os_error(errno), dropped_logs = d, "I/O error");
                }
                Status::IoErr
            }
        } else if matches!(kind, Kind::Read | Kind::Write) {
            let mut want = 0u64;
            let mut i = lead;
            while i != NO_SLOT {
                want += self.slots[i as usize].len;
                i = self.slots[i as usize].next;
            }
            if res as u64 != want {
                if let Some(d) = self.log.allow() {
                    tracing::warn!(?kind, head, done = res, want, dropped_logs = d, "short I/O");
                }
                Status::IoErr
            } else {
                Status::Ok
            }
        } else {
            Status::Ok
        };
        // Borrowed by taking it out and putting it back: no reference-count traffic per
        // completion. (Memory is swapped only when nothing is in flight, so it is here.)
        let Some(mem) = self.mem.take() else {
            return;
        };
        let null_read = self.engine.is_null() && kind == Kind::Read;
        let mut i = lead;
        while i != NO_SLOT {
            let (local, head, len, status_addr, next) = {
                let s = &mut self.slots[i as usize];
                let next = s.next;
                s.next = NO_SLOT;
                (s.local as usize, s.head, s.len, s.status_addr, next)
            };
            if null_read {
                zero_iovecs(&mem, &self.slots[i as usize].iovs);
            }
            if status == Status::Ok && matches!(kind, Kind::Read | Kind::Write) {
                self.local_stats.bytes += len;
            }
            let used = if kind == Kind::Read && status == Status::Ok {
                len as u32 + 1
            } else {
                1
            };
            self.free.push(i);
            self.complete_now(local, head, status, used, Some(status_addr), &mem);
            i = next;
        }
        self.mem = Some(mem);
    }

    /// Marks an engine entry as naming the registered file, when it is registered.
    fn on_fixed_file(&mut self, sqe: squeue::Entry) -> squeue::Entry {
        if self.fixed_file {
            self.local_stats.fixed_file_ios += 1;
            sqe.flags(squeue::Flags::FIXED_FILE)
        } else {
            sqe
        }
    }

    /// Registers the current guest memory with the ring as fixed buffers (fixed-buffers=on),
    /// replacing what was registered before. Runs only when nothing is in flight. A failure
    /// (an old kernel, RLIMIT_MEMLOCK without CAP_IPC_LOCK) leaves plain readv/writev.
    fn register_mem(&mut self) {
        if !self.tuning.fixed_buffers || self.engine.file_fd().is_none() {
            return;
        }
        if !self.bufs.is_empty() {
            self.bufs.clear();
            if let Err(e) = self.ring.submitter().unregister_buffers() {
                tracing::warn!(err = %e, "cannot unregister fixed buffers");
            }
        }
        let Some(mem) = self.mem.clone() else {
            return;
        };
        let chunks = buffer_chunks(&mem);
        if chunks.is_empty() || chunks.len() > usize::from(u16::MAX) {
            return;
        }
        let iovs: Vec<libc::iovec> = chunks
            .iter()
            .map(|&(start, end)| libc::iovec {
                iov_base: start as *mut libc::c_void,
                iov_len: end - start,
            })
            .collect();
        // SAFETY: each iovec is a range of a live guest-memory mapping. The kernel pins those
        // pages; they stay registered (and the mapping alive, held by `self.mem`) until the
        // next swap, which unregisters them first, or until the ring is dropped.
        match unsafe { self.ring.submitter().register_buffers(&iovs) } {
            Ok(()) => {
                let bytes: usize = iovs.iter().map(|v| v.iov_len).sum();
                tracing::debug!(
                    buffers = iovs.len(),
                    bytes,
                    "guest memory registered as fixed buffers"
                );
                self.bufs = chunks;
            }
            Err(e) => {
                tracing::warn!(err = %e, "cannot register guest memory as fixed buffers; using readv/writev");
            }
        }
    }

    /// Publishes a used entry for `head`.
    fn finish(&mut self, local: usize, head: u16, used_len: u32, mem: &Mem) {
        self.local_stats.requests += 1;
        let Some(Some(q)) = self.queues.get_mut(local) else {
            return;
        };
        let size = u32::from(self.queue_sizes[local]);
        if q.inflight == size && !q.broken {
            // It was throttled: resume popping now that there is room.
            q.pending = true;
        }
        q.inflight = q.inflight.saturating_sub(1);
        if let Some(t) = q.track.as_ref() {
            t.before_used(head);
        }
        if let Err(e) = q.queue.add_used(mem, head, used_len) {
            if let Some(d) = self.log.allow() {
                tracing::warn!(queue = q.index, err = %e, dropped_logs = d, "cannot add used entry");
            }
        }
        if let Some(t) = q.track.as_ref() {
            t.after_used(head, q.queue.next_used());
        }
        q.used_added = true;
    }

    fn notify(&mut self) {
        let Some(mem) = self.mem.clone() else {
            return;
        };
        let mut queued = 0;
        for q in self.queues.iter_mut().flatten() {
            if q.used_added
                && notify_queue(
                    &mut self.ring,
                    &mut self.local_stats,
                    q,
                    &mem,
                    self.notify_flags,
                )
            {
                queued += 1;
            }
        }
        self.queued_sqes += queued;
    }
}

/// Largest fixed buffer io_uring accepts.
const MAX_FIXED_BUFFER: usize = 1 << 30;

/// Guest memory as `(host start, host end)` ranges of at most [`MAX_FIXED_BUFFER`] bytes.
fn buffer_chunks(mem: &Mem) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for r in mem.iter() {
        let start = r.as_ptr() as usize;
        let end = start + r.len() as usize;
        let mut at = start;
        while at < end {
            let next = (at + MAX_FIXED_BUFFER).min(end);
            out.push((at, next));
            at = next;
        }
    }
    out
}

/// The registered buffer that wholly holds `iov`, if any. (An iovec never straddles two:
/// iovecs come from per-region slices, and a chunk boundary inside a region only matters to
/// an iovec that crosses it, which then simply goes through readv/writev.)
fn buffer_index(bufs: &[(usize, usize)], iov: &libc::iovec) -> Option<u16> {
    let start = iov.iov_base as usize;
    let end = start.checked_add(iov.iov_len)?;
    bufs.iter()
        .position(|&(s, e)| s <= start && end <= e)
        .map(|i| i as u16)
}

/// Registers the engine's file as fixed-file slot `fd` (so entries keep naming it by its
/// number and only gain IOSQE_FIXED_FILE). False when there is no file or the kernel refuses.
fn register_file(ring: &IoUring, fd: Option<std::os::fd::RawFd>) -> bool {
    let Some(fd) = fd.filter(|&fd| (0..65_536).contains(&fd)) else {
        return false;
    };
    let mut table = vec![-1; fd as usize + 1];
    table[fd as usize] = fd;
    match ring.submitter().register_files(&table) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(err = %e, "cannot register the backing file with io_uring; using plain descriptors");
            false
        }
    }
}

/// Writes the serial into a GET_ID request's buffers.
fn write_id(mem: &Mem, segs: &[Segment], serial: &[u8], len: usize) -> bool {
    let mut id = [0u8; blk::request::ID_LEN];
    let n = serial.len().min(id.len());
    id[..n].copy_from_slice(&serial[..n]);
    let mut at = 0usize;
    for s in segs {
        if at >= len {
            break;
        }
        let n = (len - at).min(s.len as usize);
        if mem.write_slice(&id[at..at + n], s.addr).is_err() {
            return false;
        }
        at += n;
    }
    true
}

fn zero_iovecs(mem: &Mem, iovs: &[libc::iovec]) {
    let _ = mem;
    for iov in iovs {
        // SAFETY: each iovec was produced from a vm-memory slice of the current guest memory
        // mapping (held alive by `mem`), with exactly this base and length.
        unsafe { std::ptr::write_bytes(iov.iov_base as *mut u8, 0, iov.iov_len) };
    }
}

/// Notifies the guest about `q`'s new used entries if EVENT_IDX says it wants that. Returns
/// true when the notification was queued on the ring (it goes out with the next submit).
fn notify_queue(
    ring: &mut IoUring,
    stats: &mut LocalStats,
    q: &mut ActiveQueue,
    mem: &Mem,
    flags: squeue::Flags,
) -> bool {
    q.used_added = false;
    let needed = q.queue.needs_notification(mem).unwrap_or(true);
    let Some(call) = q.call.as_ref().filter(|_| needed) else {
        return false;
    };
    stats.notifies += 1;
    let sqe = opcode::Write::new(
        types::Fd(call.as_raw_fd()),
        &ONE as *const u64 as *const u8,
        8,
    )
    .build()
    .flags(flags)
    .user_data(ud(TAG_NOP, 1));
    // SAFETY: `ONE` is static; the call file is kept open by the kernel for the request.
    if unsafe { ring.submission().push(&sqe) }.is_ok() {
        return true;
    }
    // Ring full: write directly.
    let _ = nix_write_one(call);
    false
}

fn nix_write_one(f: &File) -> std::io::Result<()> {
    let v = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live stack buffer to a descriptor we own.
    let r = unsafe { libc::write(f.as_raw_fd(), v.as_ptr() as *const libc::c_void, 8) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
