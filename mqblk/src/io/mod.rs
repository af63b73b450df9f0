//! The I/O threads: each owns its queues, its io_uring and its engine channel, and runs the
//! whole request path for them.
//!
//! ```text
//! kick (multishot poll on the kick eventfd) or a poll of the avail ring
//!   -> pop avail chains (vq) -> parse + validate (blk::request) -> map to host iovecs (slots)
//!   -> QoS admission, if the export has limits (qos: admit, buckets, throttle)
//!   -> merge adjacent requests (policy::merge) -> start on the engine channel (submit)
//!   -> io_uring_enter: early while the device holds fewer I/Os than are queued, else once
//!      for the batch (policy::submit, ring)
//!   -> reap completions on this thread -> status byte + used entry (complete)
//!   -> one guest notification per queue per batch, if EVENT_IDX says the guest wants it (vq)
//!   -> adapt the poll window and batch wait (policy)
//! ```
//!
//! The files, one stage each: `thread` (the loop only), `ring` (io_uring setup, tokens,
//! accounting, registration), `vq` (popping, used entries, notification decisions),
//! `ring_view` (the avail index and used ring at host addresses, translated once per memory
//! table),
//! [`slots`] (the slot table and iovec mapping), `inflight` (the in-flight region a restarted
//! backend resubmits from), `submit` (staging, merging, starting I/O), `qos` (admission
//! through the QoS buckets an export's threads share, and the waiting queues' timer),
//! `complete` (result to status to used entry), `control` (commands from the frontend),
//! `stats` (the counters), `policy` (poll window, batch wait, merging, early submission),
//! [`dirty_log`] (the
//! frontend's dirty log) and `migration` (marking in it what the thread writes while the VM
//! migrates), `split` (requests larger than the engine takes, cut into parts). Only `slots`,
//! `split` and `dirty_log` are public, for the fuzz targets and their types; the rest is the
//! crate's, and what the frontend uses of it is re-exported here.
//!
//! Nothing here takes a lock shared with another I/O thread or allocates per request once warm,
//! except, for exports with QoS limits only, the buckets the export's threads share.

mod complete;
mod control;
pub mod dirty_log;
mod failure;
#[cfg(debug_assertions)]
pub mod fault_injection;
pub(crate) mod inflight;
mod migration;
mod policy;
mod qos;
mod ring;
mod ring_view;
pub mod slots;
pub mod split;
pub(crate) mod stats;
mod submit;
#[cfg(test)]
mod tests;
mod thread;
mod vq;

use std::fs::File;
use std::sync::mpsc::{Sender, SyncSender};
use std::sync::Arc;

use rustix::thread::{sched_setaffinity, CpuSet};
use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::blk::Limits;
use crate::config::Tuning;
use crate::engine::Engine;
use dirty_log::DirtyLog;
use inflight::InflightQueue;

pub use complete::status_of;
pub use failure::Failure;
pub use migration::used_ring_len;
pub use qos::Throttle;
pub use slots::IOV_MAX;
pub use stats::{IoCounters, SharedCounters};

/// Guest memory as the I/O threads see it.
pub type GuestMemory = GuestMemoryMmap<()>;

/// Largest merged host I/O.
pub const MAX_MERGE_BYTES: u64 = 1 << 20;

/// Commands from the frontend session to an I/O thread.
pub enum Command {
    /// Start serving a queue.
    Start {
        /// Index among this thread's queues.
        local: usize,
        /// The queue's index in the device (for logs).
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
    /// Stop a queue once its in-flight requests have completed; replies with its next avail
    /// index.
    Stop {
        /// Index among this thread's queues.
        local: usize,
        /// Where the next avail index goes.
        reply: SyncSender<u16>,
    },
    /// Replace a running queue's call eventfd.
    SetCall {
        /// Index among this thread's queues.
        local: usize,
        /// The new eventfd.
        call: Option<File>,
    },
    /// Swap guest memory once nothing is in flight; replies when done.
    SetMem {
        /// The new memory map (None: no memory, after a disconnect).
        mem: Option<Arc<GuestMemory>>,
        /// Acknowledgement.
        reply: SyncSender<()>,
    },
    /// Write-back (true) or write-through (false) cache mode, from CONFIG_WCE.
    SetWriteback(bool),
    /// The QoS buckets to admit requests through; `None`: no limit (requests waiting for
    /// admission start at once).
    SetThrottle(Option<Arc<Throttle>>),
    /// A new capacity (an online resize): requests parsed from now on are checked against it;
    /// replies once every request that was in flight when the command arrived has completed,
    /// so that after a shrink nothing reaches past the new end.
    SetCapacity {
        /// Capacity in 512-byte sectors.
        sectors: u64,
        /// Acknowledgement.
        reply: SyncSender<()>,
    },
    /// Live migration: mark what the thread writes into guest memory in `log` from now on
    /// (`None`: stop marking); `used` gives, by local queue, the guest address at which its used
    /// ring's writes are marked (rings without VHOST_VRING_F_LOG: `None`). Replies once in
    /// force: the frontend syncs or replaces the log only after that.
    SetDirtyLog {
        /// The frontend's log while logging is on.
        log: Option<Arc<DirtyLog>>,
        /// Used-ring log addresses by local queue.
        used: Vec<Option<u64>>,
        /// Acknowledgement.
        reply: SyncSender<()>,
    },
    /// Drain everything and exit the thread.
    Shutdown,
    /// Suffer a fault (tests of fault containment and the sandbox).
    #[cfg(debug_assertions)]
    InjectFault(fault_injection::Fault),
}

/// Sends every thread in `threads` the command `command` builds for it (from the thread's
/// index and where to acknowledge), then waits until each has acknowledged: the control plane's
/// way to change something on all of an export's threads at once.
pub fn send_all_and_wait(
    threads: &[IoThreadHandle],
    mut command: impl FnMut(usize, SyncSender<()>) -> Command,
) {
    let acks: Vec<_> = threads
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            t.send(command(i, tx));
            rx
        })
        .collect();
    for rx in acks {
        // An error means the thread has gone, with nothing left to wait for.
        let _ = rx.recv();
    }
}

/// Static settings of an I/O thread.
pub struct IoThreadConfig {
    /// Thread name.
    pub name: String,
    /// CPU to pin to.
    pub cpu: Option<usize>,
    /// Largest size of each of this thread's queues, by local index.
    pub queue_sizes: Vec<u16>,
    /// Request validation limits.
    pub limits: Limits,
    /// GET_ID answer (at most 20 bytes).
    pub serial: Vec<u8>,
    /// Polling, batching, merging and io_uring settings.
    pub tuning: Tuning,
    /// QoS buckets shared with the export's other threads; `None` while it has no limit.
    pub throttle: Option<Arc<Throttle>>,
    /// Where the thread records its death (shared by the export's threads).
    pub failure: Arc<Failure>,
}

/// What the frontend keeps of a running I/O thread.
pub struct IoThreadHandle {
    commands: Sender<Command>,
    wake: EventFd,
    counters: Arc<SharedCounters>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl IoThreadHandle {
    /// Sends a command and wakes the thread.
    pub fn send(&self, cmd: Command) {
        if self.commands.send(cmd).is_ok() {
            let _ = self.wake.write(1);
        }
    }

    /// The thread's published counters.
    pub fn counters(&self) -> &SharedCounters {
        &self.counters
    }

    /// Whether the thread still runs (it ends only when told to, or when its io_uring fails).
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops the thread after draining, and joins it.
    pub fn shutdown(&mut self) {
        self.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts an I/O thread serving `engine`; returns once it is ready (or failed to set up).
pub fn spawn(cfg: IoThreadConfig, engine: Arc<dyn Engine>) -> std::io::Result<IoThreadHandle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let wake = EventFd::new(libc::EFD_CLOEXEC)?;
    let thread_wake = wake.try_clone()?;
    let counters = Arc::new(SharedCounters::default());
    let thread_counters = counters.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let thread = std::thread::Builder::new()
        .name(cfg.name.clone())
        .spawn(move || {
            if let Some(cpu) = cfg.cpu {
                pin_to_cpu(cpu);
            }
            let (name, failure) = (cfg.name.clone(), cfg.failure.clone());
            // Set up (ring, engine channel), then confined to what the loop does.
            let setup = thread::IoThread::new(cfg, engine, rx, thread_wake, thread_counters);
            match setup.and_then(|t| crate::sandbox::confine_io_thread().map(|()| t)) {
                Ok(mut t) => {
                    let _ = ready_tx.send(Ok(()));
                    // A panic ends this thread and its export, never the daemon: the loop runs
                    // under catch_unwind, and what it leaves is cleaned up by `abandon`.
                    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.run())) {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::error!(thread = %name, err = %e, "I/O thread stopped: its io_uring failed; the export is failed");
                            failure.record(&name, &format!("its io_uring failed: {e}"));
                            t.abandon();
                        }
                        Err(payload) => {
                            let why = failure::panic_message(&*payload);
                            tracing::error!(thread = %name, panic = %why, "I/O thread panicked; the export is failed, its frontend disconnected (export_del and export_add bring it back)");
                            failure.record(&name, &format!("panicked: {why}"));
                            t.abandon();
                        }
                    }
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(IoThreadHandle {
            commands: tx,
            wake,
            counters,
            thread: Some(thread),
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => Err(std::io::Error::other("I/O thread died during setup")),
    }
}

fn pin_to_cpu(cpu: usize) {
    if cpu >= CpuSet::MAX_CPU {
        tracing::warn!(cpu, "CPU number too large to pin to");
        return;
    }
    let mut set = CpuSet::new();
    set.set(cpu);
    // None: the calling thread.
    if let Err(e) = sched_setaffinity(None, &set) {
        tracing::warn!(cpu, err = %e, "could not pin I/O thread");
    }
}
