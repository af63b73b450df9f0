//! A connection whose rings are set up but cannot start because the engine cannot take up the
//! disk yet (`Engine::refresh` failing with `ResourceBusy`): another process holds a
//! conflicting image lock (a `qemu-img` that a monitoring job runs at the wrong moment, a
//! migration's source that has not stopped), or a flush-mode server's dirty mark is still on
//! the image. The guest's requests wait in its rings; the connection's listener tries again
//! every [`RETRY`] until the disk is free, instead of leaving the guest without its disk until
//! it reconnects. Other failures (a corrupt image, the store's errors) are not retried: they
//! do not pass by themselves, and a try may cost a read of the image's tables.

use std::time::{Duration, Instant};

/// How often a waiting connection tries to take up the disk again.
pub const RETRY: Duration = Duration::from_millis(100);

/// How often a connection that still waits says so.
const REMIND: Duration = Duration::from_secs(30);

/// Whether, and since when, this connection waits to take up its disk.
#[derive(Default)]
pub struct DiskWait {
    /// When the first attempt failed, and when the wait was last logged.
    waiting: Option<(Instant, Instant)>,
    /// Failed attempts so far, so that a retry can tell whether any ring still tried.
    attempts: u64,
}

impl DiskWait {
    /// Whether the connection's rings wait for the disk.
    pub fn waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// Queue `queue` could not start: `err` says why. Logged when the wait begins and then
    /// every [`REMIND`], not at each try.
    pub fn failed(&mut self, queue: usize, err: &std::io::Error) {
        self.attempts += 1;
        let now = Instant::now();
        match &mut self.waiting {
            None => {
                tracing::error!(
                    queue,
                    err = %err,
                    retry_ms = RETRY.as_millis() as u64,
                    "cannot take up the disk yet; the queue starts once it is free, tried again every retry_ms"
                );
                self.waiting = Some((now, now));
            }
            Some((since, logged)) => {
                if now.duration_since(*logged) >= REMIND {
                    tracing::warn!(
                        queue,
                        err = %err,
                        waited_s = now.duration_since(*since).as_secs(),
                        "still waiting to take up the disk; its queues have not started"
                    );
                    *logged = now;
                }
            }
        }
    }

    /// Failed attempts so far.
    pub fn attempts(&self) -> u64 {
        self.attempts
    }

    /// No ring waits any more (the frontend stopped or reset them while they waited, or the
    /// disk failed otherwise).
    pub fn abandoned(&mut self) {
        self.waiting = None;
    }

    /// The disk was taken up: the rings start.
    pub fn ended(&mut self) {
        if let Some((since, _)) = self.waiting.take() {
            tracing::info!(
                waited_ms = since.elapsed().as_millis() as u64,
                "took up the disk after waiting; queues starting"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_begins_at_the_first_failure_and_ends_when_the_disk_is_taken_up_or_no_ring_waits() {
        let mut w = DiskWait::default();
        assert!(!w.waiting());
        let err = std::io::Error::other("locked");
        w.failed(0, &err);
        w.failed(1, &err);
        assert!(w.waiting());
        assert_eq!(w.attempts(), 2);
        w.ended();
        assert!(!w.waiting());
        w.failed(0, &err);
        assert!(w.waiting());
        w.abandoned();
        assert!(!w.waiting());
    }
}
