//! One queue's thread: keeps each of the queue's jobs at `iodepth` requests in flight until
//! they are done, submitting into its slots and counting what completes.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::job::{Job, Phase, Request};
use super::request_queue::{RequestQueue, WaitError};
use crate::data_pattern::fill_pattern;
use crate::workload::Workload;

/// A request slot: a block-sized buffer in the run's mapped region, and the request using it.
pub(super) struct Slot {
    pub(super) buf: *mut u8,
    /// The job that owns the slot, as an index into its queue's jobs.
    pub(super) job: u32,
    pub(super) write: bool,
    pub(super) offset: u64,
    pub(super) issued_at: Instant,
}

/// A queue with the jobs it serves and their slots, moved into that queue's thread.
pub(super) struct QueueWork<Q> {
    pub(super) queue: Q,
    pub(super) jobs: Vec<Job>,
    pub(super) slots: Vec<Slot>,
}

// SAFETY: `Slot::buf` points into a memory region that outlives the threads (it is owned by the
// connection in `run`, which joins them before returning) and that only this queue's thread
// touches.
unsafe impl<Q: Send> Send for QueueWork<Q> {}

impl<Q: RequestQueue> QueueWork<Q> {
    /// Runs the queue's jobs to their end, the runtime counted from `start`. Returns the queue
    /// (so that it is dropped on the caller's side of the join) and the jobs.
    pub(super) fn drive(mut self, w: &Workload, start: Instant) -> anyhow::Result<(Q, Vec<Job>)> {
        let deadline = w.runtime.map(|r| start + r);
        let mut completions: Vec<(usize, i32)> = Vec::with_capacity(self.slots.len());
        loop {
            let (inflight, active) = self.submit(w, deadline);
            if !active {
                break;
            }
            if inflight == 0 {
                // A job just changed phase; go round again to submit for the new one.
                continue;
            }
            completions.clear();
            self.wait(&mut completions, w.io_timeout, inflight)?;
            let now = Instant::now();
            for &(tag, ret) in &completions {
                self.complete(tag, ret, now, w);
            }
        }
        Ok((self.queue, self.jobs))
    }

    /// Submits as much as every job may. Returns the requests now in flight, and whether any
    /// job is still running.
    fn submit(&mut self, w: &Workload, deadline: Option<Instant>) -> (usize, bool) {
        let bs = w.block_size;
        let mut now = Instant::now();
        let (mut inflight, mut active) = (0, false);
        for job in self.jobs.iter_mut() {
            job.advance(now, deadline);
            while job.can_issue(now, deadline) {
                let Request {
                    slot: si,
                    offset,
                    write,
                } = job.issue(bs as u64);
                let slot = &mut self.slots[si as usize];
                if write && job.writes_pattern() {
                    // SAFETY: the slot's buffer is `bs` bytes inside the mapped region and free.
                    fill_pattern(
                        unsafe { std::slice::from_raw_parts_mut(slot.buf, bs) },
                        offset,
                        w.seed,
                    );
                }
                slot.write = write;
                slot.offset = offset;
                now = Instant::now();
                slot.issued_at = now;
                self.queue.queue(si as usize, write, offset, slot.buf, bs);
            }
            inflight += job.inflight;
            active |= job.phase != Phase::Done;
        }
        (inflight, active)
    }

    /// Submits and waits up to `timeout` for completions (at least one), into `completions`.
    fn wait(
        &mut self,
        completions: &mut Vec<(usize, i32)>,
        timeout: Duration,
        inflight: usize,
    ) -> anyhow::Result<()> {
        let qidx = self.jobs[0].queue;
        match self.queue.wait(completions, timeout) {
            Ok(()) => Ok(()),
            Err(WaitError::Timeout) => bail!(
                "queue {qidx}: no completion for {timeout:?} with {inflight} requests in flight"
            ),
            Err(WaitError::Failed(e)) => Err(e).with_context(|| format!("queue {qidx}")),
        }
    }

    /// Hands the completion of the request on slot `si` to its job.
    fn complete(&mut self, si: usize, ret: i32, now: Instant, w: &Workload) {
        let slot = &self.slots[si];
        // SAFETY: the request on this slot has completed, so nothing writes its buffer, which is
        // `block_size` bytes inside the mapped region.
        let data = unsafe { std::slice::from_raw_parts(slot.buf, w.block_size) };
        let req = Request {
            slot: si as u32,
            offset: slot.offset,
            write: slot.write,
        };
        let latency = now.saturating_duration_since(slot.issued_at);
        self.jobs[slot.job as usize].complete(req, ret, latency, data, w.seed);
    }
}
