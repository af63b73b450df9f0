//! When an I/O thread dies: a panic, or an io_uring that stops working. Its queues are then
//! served by nobody, so the failure is made loud and kept to its export: the export is marked
//! failed (a log line, `export_list`, a metric), its frontend is disconnected (the listener
//! polls [`Failure::event_fd`]), and nothing else in the daemon is touched. `export_del` and
//! `export_add` bring the export back with new threads.

use std::any::Any;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::event::{eventfd, EventfdFlags};

use super::thread::IoThread;

/// An export's failure, shared by its I/O threads (which record it) and its listener and
/// status (which read it).
pub struct Failure {
    failed: AtomicBool,
    reason: Mutex<Option<String>>,
    /// An eventfd, readable once failed (never reset: a failed export stays failed).
    event: OwnedFd,
}

impl Failure {
    /// No failure yet.
    pub fn new() -> std::io::Result<Failure> {
        Ok(Failure {
            failed: AtomicBool::new(false),
            reason: Mutex::new(None),
            event: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
        })
    }

    /// Records that thread `thread` died because of `why`; the first failure is the one kept.
    pub fn record(&self, thread: &str, why: &str) {
        let mut reason = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if reason.is_none() {
            *reason = Some(format!("{thread}: {why}"));
        }
        self.failed.store(true, Ordering::Release);
        let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
    }

    /// Whether an I/O thread of the export died.
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Why the export failed, if it did.
    pub fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A descriptor that polls readable once the export has failed.
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        self.event.as_fd()
    }
}

/// The message a panic carried.
pub(super) fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// How long a dead thread waits for the kernel to finish the I/O it had started.
const SETTLE: Duration = Duration::from_secs(10);

impl IoThread {
    /// Cleans up after the thread's loop panicked or its ring failed: refuses further commands (their senders
    /// see the thread gone, as after a shutdown), then waits until the kernel has finished
    /// every I/O the thread started, which may still write into guest memory and the thread's
    /// iovecs. If that cannot be shown within [`SETTLE`], the thread's state is leaked rather
    /// than freed under the kernel.
    pub(super) fn abandon(mut self) {
        let (_, dead) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.commands, dead));
        let settled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.settle(Instant::now() + SETTLE)
        }))
        .unwrap_or(false);
        if settled {
            drop(self);
        } else {
            tracing::error!(
                "the dead I/O thread's requests did not finish: its memory is kept until the daemon exits"
            );
            std::mem::forget(self);
        }
    }

    /// Reaps (and discards) completions until nothing this thread started is in flight.
    fn settle(&mut self, deadline: Instant) -> bool {
        // Requests started on an engine with completions of its own (rbd) cannot be waited for
        // on the ring.
        if self.engine_in_flight > self.ring.io_at_device() + self.ring.queued_io() {
            return false;
        }
        self.ring.submit(&mut self.counters);
        while self.ring.io_at_device() > 0 {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            while self.ring.next_completion().is_some() {}
            if self.ring.io_at_device() == 0 {
                break;
            }
            if self
                .ring
                .wait_at_most(deadline - now, &mut self.counters)
                .is_err()
            {
                return false;
            }
        }
        true
    }
}
