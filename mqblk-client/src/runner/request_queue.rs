//! What a queue's thread needs from a driver's queue ([`RequestQueue`]): queue reads and
//! writes, then submit them and wait for completions. libblkio's queues ([`BlkioQueue`]) and
//! mqblk's own frontend's ([`SplitQueue`]) both provide it, so the same jobs, slots and counts
//! measure either driver.

use std::mem::MaybeUninit;
use std::time::Duration;

use blkio::{Blkioq, Completion, Errno, ReqFlags};

use crate::connect::blkio_err;
use crate::frontend::vring::SplitQueue;

/// Why a wait ended without completions.
pub(super) enum WaitError {
    /// None within the timeout.
    Timeout,
    /// The driver failed (connection broken, ...).
    Failed(anyhow::Error),
}

/// A queue a runner thread drives.
pub(super) trait RequestQueue: Send {
    /// Queues a read (`write` false) or a write of `len` bytes at disk `offset` with the data
    /// at `buf`, as request `tag`; it is submitted by the next [`RequestQueue::wait`].
    fn queue(&mut self, tag: usize, write: bool, offset: u64, buf: *mut u8, len: usize);

    /// Submits what is queued and waits up to `timeout` for at least one completion; appends
    /// `(tag, ret)` for each (ret 0 or a negative errno).
    fn wait(&mut self, done: &mut Vec<(usize, i32)>, timeout: Duration) -> Result<(), WaitError>;
}

/// A libblkio queue, with room for a wait's completions.
pub(super) struct BlkioQueue {
    queue: Blkioq,
    completions: Vec<MaybeUninit<Completion>>,
}

impl BlkioQueue {
    /// `queue`, taking up to `max` completions per wait (the requests it can have in flight).
    pub(super) fn new(queue: Blkioq, max: usize) -> Self {
        let mut completions = Vec::with_capacity(max);
        completions.resize_with(max.max(1), MaybeUninit::uninit);
        BlkioQueue { queue, completions }
    }
}

impl RequestQueue for BlkioQueue {
    fn queue(&mut self, tag: usize, write: bool, offset: u64, buf: *mut u8, len: usize) {
        if write {
            self.queue.write(offset, buf, len, tag, ReqFlags::empty());
        } else {
            self.queue.read(offset, buf, len, tag, ReqFlags::empty());
        }
    }

    fn wait(&mut self, done: &mut Vec<(usize, i32)>, timeout: Duration) -> Result<(), WaitError> {
        let mut left = timeout;
        match self
            .queue
            .do_io(&mut self.completions, 1, Some(&mut left), None)
        {
            Ok(n) => {
                for c in &self.completions[..n] {
                    // SAFETY: do_io initialised the first n entries.
                    let c = unsafe { c.assume_init_ref() };
                    done.push((c.user_data, c.ret));
                }
                Ok(())
            }
            Err(e) if e.errno() == Errno::TIME => Err(WaitError::Timeout),
            Err(e) => Err(WaitError::Failed(blkio_err("waiting for completions", e))),
        }
    }
}

impl RequestQueue for SplitQueue {
    fn queue(&mut self, tag: usize, write: bool, offset: u64, buf: *mut u8, len: usize) {
        SplitQueue::queue(self, tag, write, offset, buf, len);
    }

    fn wait(&mut self, done: &mut Vec<(usize, i32)>, timeout: Duration) -> Result<(), WaitError> {
        match SplitQueue::wait(self, done, timeout) {
            Ok(true) => Ok(()),
            Ok(false) => Err(WaitError::Timeout),
            Err(e) => Err(WaitError::Failed(anyhow::anyhow!(
                "waiting on the call eventfd: {e}"
            ))),
        }
    }
}
