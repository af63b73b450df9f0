//! The queue between an image's I/O threads and its metadata worker
//! ([`metadata`](super::metadata)): the jobs a thread hands the worker, and the replies, with
//! the mappings the thread may cache, that come back on the thread's own queue and eventfd.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use super::mapping::Target;

/// Guest iovecs handed from an I/O thread to a worker.
pub struct IoVecs {
    /// The array; valid, with the memory it describes, until the request completes.
    pub ptr: *const libc::iovec,
    /// Its length.
    pub count: u32,
}

// SAFETY: the iovecs and the guest memory they describe stay valid until the request's reply
// is reaped (the `Channel::start` contract); the worker is the only one touching them until
// then, and the memory is shared memory of the process, valid from any thread.
unsafe impl Send for IoVecs {}

/// What a worker is asked to do.
pub enum Work {
    /// Read into the iovecs at a guest offset.
    Read { offset: u64, iovs: IoVecs },
    /// Write the iovecs at a guest offset, durably before completion if `sync`.
    Write {
        offset: u64,
        iovs: IoVecs,
        sync: bool,
    },
    /// Make completed writes and their metadata durable.
    Flush,
    /// Make a range read as zeroes; `unmap` lets the file's blocks go.
    Zero { offset: u64, len: u64, unmap: bool },
}

/// One request on the metadata path. A job dropped unanswered (its worker panicked with it,
/// or went away with it queued) answers EIO as it goes, so that no request the worker took
/// waits forever. The worker drops a job only once its I/O is over (an entry on the worker's
/// ring waits for its completion when dropped, and a job outlives the entries it makes), so
/// the guest's buffers are the guest's again when the answer reaches it.
pub struct Job {
    /// What to do.
    pub work: Work,
    /// The thread's token for it.
    pub token: u64,
    /// Where the answer goes.
    pub replies: Arc<Replies>,
    /// Answered (or handed back to the sender, who answers it): nothing to say when dropped.
    answered: bool,
}

impl Job {
    /// A job for `work`, answered on `replies` with `token`.
    pub fn new(work: Work, token: u64, replies: Arc<Replies>) -> Job {
        Job {
            work,
            token,
            replies,
            answered: false,
        }
    }

    /// Queues the answer; the thread hears of it at the queue's next signal.
    pub(super) fn answer(&mut self, result: i32, hints: Vec<Hint>, epoch: u64) {
        self.replies.push(Reply {
            token: self.token,
            result,
            hints,
            epoch,
        });
        self.answered = true;
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.answered {
            self.answer(-libc::EIO, Vec::new(), 0);
            self.replies.signal();
        }
    }
}

/// Where a run of guest clusters is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hint {
    /// Guest offset (cluster-aligned).
    pub guest: u64,
    /// Where it is.
    pub target: Target,
    /// Bytes.
    pub len: u64,
}

/// A finished job.
pub struct Reply {
    /// The thread's token.
    pub token: u64,
    /// Bytes transferred, 0, or a negative errno.
    pub result: i32,
    /// Mappings the thread may cache, true as of `epoch`.
    pub hints: Vec<Hint>,
    /// The epoch the hints were read in.
    pub epoch: u64,
}

/// One I/O thread's reply queue and the eventfd its ring polls.
pub struct Replies {
    /// Finished jobs, oldest first.
    pub done: Mutex<Vec<Reply>>,
    /// Written once per reply.
    pub event: OwnedFd,
}

impl Replies {
    /// Queues `reply`; the thread hears of it at the next [`signal`](Self::signal).
    pub(super) fn push(&self, reply: Reply) {
        self.done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(reply);
    }

    /// Tells the thread that replies wait.
    pub(super) fn signal(&self) {
        let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
    }
}

/// The reply queues that got replies since they were last signalled: each is signalled once
/// for all of them, so a thread wakes once per batch of replies rather than per reply.
#[derive(Default)]
pub(super) struct ToSignal(Vec<Arc<Replies>>);

impl ToSignal {
    pub(super) fn add(&mut self, replies: &Arc<Replies>) {
        if !self.0.iter().any(|r| Arc::ptr_eq(r, replies)) {
            self.0.push(replies.clone());
        }
    }

    pub(super) fn signal_all(&mut self) {
        for r in self.0.drain(..) {
            r.signal();
        }
    }
}

impl Drop for ToSignal {
    /// A panic of the worker must not leave answers unheard.
    fn drop(&mut self) {
        self.signal_all();
    }
}

/// The queue of an image's metadata worker, as the I/O threads hold it.
#[derive(Clone)]
pub struct Jobs {
    tx: Sender<Job>,
    /// The worker's wake eventfd: a job sent while the worker waits on its ring is seen at once.
    wake: Arc<OwnedFd>,
}

/// The image's metadata worker is gone: the export is shutting down, or the worker panicked
/// and the image was given up.
#[derive(Debug)]
pub struct WorkerGone;

impl Jobs {
    /// The queue `tx` of a worker woken through `wake`.
    pub(super) fn new(tx: Sender<Job>, wake: Arc<OwnedFd>) -> Jobs {
        Jobs { tx, wake }
    }

    /// Hands `job` to the worker, which sees it at once if it is running and after the next
    /// [`Jobs::wake`] if it waits on its ring; if the worker is gone, the caller answers the
    /// job itself.
    pub fn send(&self, job: Job) -> Result<(), WorkerGone> {
        self.tx.send(job).map_err(|e| {
            let mut job = e.0;
            job.answered = true;
            WorkerGone
        })
    }

    /// Ends the worker's wait on its ring, so that it takes the jobs sent since. (A worker
    /// with no job at work waits on the queue itself, which a send ends.)
    pub fn wake(&self) {
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
    }
}

/// The raw fd of a reply queue's eventfd.
pub fn event_fd(replies: &Replies) -> std::os::fd::RawFd {
    replies.event.as_raw_fd()
}

#[cfg(test)]
mod tests {
    use rustix::event::{eventfd, EventfdFlags};

    use super::*;

    /// A job the worker drops unanswered (a panic unwound through it, or it was queued when
    /// the worker went) answers EIO and wakes its thread; one answered, or handed back by a
    /// dead worker's queue (its sender answers it), says nothing more.
    #[test]
    fn a_job_dropped_unanswered_answers_eio_and_no_job_answers_twice() {
        let replies = Arc::new(Replies {
            done: Mutex::new(Vec::new()),
            event: eventfd(0, EventfdFlags::CLOEXEC).unwrap(),
        });
        let mut signals = [0u8; 8];
        drop(Job::new(Work::Flush, 7, replies.clone()));
        let mut answered = Job::new(Work::Flush, 8, replies.clone());
        answered.answer(0, Vec::new(), 0);
        drop(answered);
        let (tx, rx) = std::sync::mpsc::channel();
        drop(rx);
        let gone = Jobs {
            tx,
            wake: Arc::new(eventfd(0, EventfdFlags::CLOEXEC).unwrap()),
        };
        assert!(gone
            .send(Job::new(Work::Flush, 9, replies.clone()))
            .is_err());
        let said: Vec<(u64, i32)> = replies
            .done
            .lock()
            .unwrap()
            .iter()
            .map(|r| (r.token, r.result))
            .collect();
        assert_eq!(said, [(7, -libc::EIO), (8, 0)]);
        rustix::io::read(&replies.event, &mut signals).unwrap();
        assert_eq!(
            u64::from_ne_bytes(signals),
            1,
            "the dropped job woke its thread"
        );
    }
}
