//! One job of a run: which request it issues next (offset, read or write) in which phase, when
//! it is done, and what it makes of a completion.

use std::time::{Duration, Instant};

use crate::data_pattern::{check_pattern, mix64};
use crate::report::{FailedRequest, JobCounts, JobReport};
use crate::workload::{Pattern, Workload};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// The pattern's only phase, or Verify's write phase.
    Main,
    /// Verify's read-back phase.
    ReadBack,
    Done,
}

/// A request a job issues: the slot it uses, where, and which way.
pub(super) struct Request {
    pub(super) slot: u32,
    pub(super) offset: u64,
    pub(super) write: bool,
}

pub(super) struct Job {
    idx: usize,
    pub(super) queue: usize,
    region: (u64, u64),
    nblocks: u64,
    pattern: Pattern,
    pub(super) phase: Phase,
    /// Requests to issue in the current phase (u64::MAX: until the deadline).
    target: u64,
    issued: u64,
    pub(super) inflight: usize,
    next_block: u64,
    rng: u64,
    /// Verify: blocks issued by the write phase.
    written_blocks: u64,
    /// This job's free slots, as indexes into its queue's slot table.
    free: Vec<u32>,
    counts: JobCounts,
}

impl Job {
    /// Job `idx` of `w`, on `queue`, over `region`, with the request slots `free`.
    pub(super) fn new(
        idx: usize,
        queue: usize,
        region: (u64, u64),
        w: &Workload,
        free: Vec<u32>,
    ) -> Job {
        let nblocks = region.1 / w.block_size as u64;
        let target = w.requests_per_job(nblocks);
        Job {
            idx,
            queue,
            region,
            nblocks,
            pattern: w.pattern,
            phase: if target == 0 {
                Phase::Done
            } else {
                Phase::Main
            },
            target,
            issued: 0,
            inflight: 0,
            next_block: 0,
            rng: mix64(w.seed ^ (idx as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1,
            written_blocks: 0,
            free,
            counts: JobCounts::default(),
        }
    }

    /// Whether the job may issue another request now.
    pub(super) fn can_issue(&self, now: Instant, deadline: Option<Instant>) -> bool {
        if self.phase == Phase::Done || self.issued >= self.target || self.free.is_empty() {
            return false;
        }
        // The deadline ends the main phase only (Verify's read-back always completes).
        !(self.phase == Phase::Main && deadline.is_some_and(|d| now >= d))
    }

    /// The next request, on one of the job's free slots (there is one where
    /// [`Job::can_issue`] said so), counted as issued.
    pub(super) fn issue(&mut self, bs: u64) -> Request {
        let slot = self.free.pop().expect("can_issue checked for a free slot");
        let offset = self.next_offset(bs);
        let write = self.is_write();
        self.issued += 1;
        self.inflight += 1;
        Request {
            slot,
            offset,
            write,
        }
    }

    /// Whether the job's writes carry the verify pattern (other writes send whatever their
    /// buffer holds).
    pub(super) fn writes_pattern(&self) -> bool {
        self.pattern == Pattern::Verify
    }

    /// Moves to the next phase once the current one has nothing more to issue or wait for.
    pub(super) fn advance(&mut self, now: Instant, deadline: Option<Instant>) {
        if self.phase == Phase::Done || self.inflight > 0 {
            return;
        }
        let exhausted = self.issued >= self.target
            || (self.phase == Phase::Main && deadline.is_some_and(|d| now >= d));
        if !exhausted {
            return;
        }
        if self.phase == Phase::Main && self.pattern == Pattern::Verify && self.issued > 0 {
            self.phase = Phase::ReadBack;
            self.written_blocks = self.issued;
            self.target = self.issued;
            self.issued = 0;
            self.next_block = 0;
        } else {
            self.phase = Phase::Done;
        }
    }

    /// Counts the completion of `req` after `latency`, with libblkio's result `ret` (0 or a
    /// negative errno), and frees its slot. `data` is the slot's buffer: a read's data, checked
    /// against the pattern where the job checks what it reads.
    pub(super) fn complete(
        &mut self,
        req: Request,
        ret: i32,
        latency: Duration,
        data: &[u8],
        seed: u64,
    ) {
        self.free.push(req.slot);
        self.inflight -= 1;
        let c = &mut self.counts;
        c.latency.record(latency);
        c.ios += 1;
        if req.write {
            c.writes += 1;
        } else {
            c.reads += 1;
        }
        if ret != 0 {
            c.errors += 1;
            c.first_error.get_or_insert(FailedRequest {
                job: self.idx,
                write: req.write,
                offset: req.offset,
                errno: -ret,
            });
            return;
        }
        c.bytes += data.len() as u64;
        let checks = self.pattern == Pattern::Check
            || (self.pattern == Pattern::Verify && self.phase == Phase::ReadBack);
        if checks && !req.write {
            match check_pattern(data, req.offset, seed) {
                None => c.verified_bytes += data.len() as u64,
                Some(at) => {
                    c.mismatches += 1;
                    c.first_mismatch.get_or_insert(at);
                }
            }
        }
    }

    /// What the job did, for the report: where it ran and what it counted.
    pub(super) fn into_report(self, bs: usize) -> (JobReport, JobCounts) {
        let c = self.counts;
        let report = JobReport {
            job: self.idx,
            queue: self.queue,
            region: self.region,
            ios: c.ios,
            bytes: c.bytes,
            errors: c.errors,
            pattern_bytes: self.written_blocks * bs as u64,
            mismatches: c.mismatches,
        };
        (report, c)
    }

    fn is_write(&self) -> bool {
        match self.pattern {
            Pattern::RandWrite | Pattern::SeqWrite => true,
            Pattern::Verify => self.phase == Phase::Main,
            _ => false,
        }
    }

    fn next_offset(&mut self, bs: u64) -> u64 {
        let block = match self.pattern {
            Pattern::RandRead | Pattern::RandWrite => {
                // xorshift64*
                self.rng ^= self.rng >> 12;
                self.rng ^= self.rng << 25;
                self.rng ^= self.rng >> 27;
                self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % self.nblocks
            }
            _ => {
                let b = self.next_block;
                self.next_block = (self.next_block + 1) % self.nblocks;
                b
            }
        };
        self.region.0 + block * bs
    }
}
