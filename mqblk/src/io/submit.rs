//! From the avail rings to the engine: pop, parse and validate each chain, map its buffers,
//! admit it (QoS, only where the export has limits: `admit`), stage it, then merge adjacent
//! requests and start each host I/O on the engine channel.

use std::time::Instant;

use super::complete::{write_id, Answered};
use super::policy::merge::{self, Dir, MergeLimits, Shape};
use super::slots::{map_segments, SlotId, IOV_MAX};
use super::split::plan;
use super::thread::IoThread;
use super::vq::Pop;
use super::{GuestMemory, MAX_MERGE_BYTES};
use crate::blk::{self, Kind, Status};
use crate::engine::{Op, Started};

impl IoThread {
    /// Pops and stages what the queues have, waiting a little for more under heavy load
    /// (`batch-wait-us`).
    pub(super) fn gather(&mut self) {
        if self.pending_mem.is_some() {
            return;
        }
        self.pop_pending();
        let wait = self.batch.wait_ns(self.staged.len());
        if wait > 0 {
            let start = Instant::now();
            let target = self.batch.mean() as usize;
            let mut spins = 0u32;
            while self.staged.len() < target {
                if self.any_avail() {
                    self.pop_pending();
                    continue;
                }
                spins += 1;
                if spins.is_multiple_of(16) && start.elapsed().as_nanos() as u64 >= wait {
                    break;
                }
                std::hint::spin_loop();
            }
            self.counters.batch_waits += 1;
        }
        if !self.staged.is_empty() {
            self.batch.record(self.staged.len());
        }
    }

    fn pop_pending(&mut self) {
        for local in 0..self.queues.len() {
            if matches!(&self.queues[local], Some(q) if q.pending && q.takes_requests()) {
                self.pop_queue(local);
            }
        }
    }

    /// Pops one queue's avail ring, bounded by its size in flight; with QoS, until a request
    /// has to wait for admission.
    fn pop_queue(&mut self, local: usize) {
        let Some(mem) = self.mem.clone() else {
            return;
        };
        let qos = self.throttle.is_some();
        let max_in_flight = u32::from(self.queue_sizes[local]);
        let q = self.queues[local].as_mut().expect("caller checked");
        if let Err(e) = q.begin_pop(&mem) {
            self.broke(local, e);
            return;
        }
        loop {
            let q = self.queues[local].as_mut().expect("caller checked");
            match q.pop(&mem, max_in_flight) {
                Pop::Chain { head, chain } => {
                    if let Some(id) = self.start_request(local, head, chain, &mem) {
                        // The one test an export without limits pays per request.
                        if !qos || self.admit(local, id) {
                            self.staged.push(id);
                        } else {
                            return;
                        }
                    }
                }
                Pop::Empty | Pop::Full => return,
                Pop::Broken(e) => {
                    self.broke(local, e);
                    return;
                }
            }
        }
    }

    /// Marks a queue broken by its guest.
    fn broke(&mut self, local: usize, why: &'static str) {
        if let Some(q) = self.queues[local].as_mut() {
            q.mark_broken(why, &mut self.log);
        }
    }

    /// Resubmits requests that were in flight when the previous backend died (they are still
    /// marked in the in-flight region, with their original fetch order).
    pub(super) fn resubmit(&mut self, local: usize, heads: &[u16]) {
        let Some(mem) = self.mem.clone() else {
            return;
        };
        for &head in heads {
            let q = self.queues[local].as_mut().expect("just started");
            q.in_flight += 1;
            let chain = q.walk(&mem, head);
            if let Some(id) = self.start_request(local, head, chain, &mem) {
                // Waiting requests keep their order: admit queues each behind the first.
                if self.admit(local, id) {
                    self.staged.push(id);
                }
            }
        }
    }

    /// Parses and validates one chain; answers it at once if it is bad or needs no I/O, else
    /// returns its slot, ready to stage for the engine.
    fn start_request<I>(
        &mut self,
        local: usize,
        head: u16,
        chain: I,
        mem: &GuestMemory,
    ) -> Option<SlotId>
    where
        I: IntoIterator<Item = virtio_queue::desc::split::Descriptor>,
    {
        // Answered here, a request is answered in the iteration that popped it.
        let now = self.now_ns;
        let answered = |ty, bytes| Answered {
            local,
            head,
            ty,
            bytes,
            started_ns: now,
        };
        let req = match blk::parse(chain, mem, &self.limits, &mut self.scratch, &mut self.segs) {
            Ok(r) => r,
            Err(rej) => {
                if let Some(d) = self.log.allow() {
                    let q = self.queues[local].as_ref().map_or(0, |q| q.index);
                    tracing::warn!(queue = q, head, reason = %rej.reason, status = ?rej.status, dropped_logs = d, "bad request from guest");
                }
                self.answer(
                    answered(rej.req_type, 0),
                    rej.status,
                    1,
                    rej.status_addr,
                    mem,
                );
                return None;
            }
        };
        let status_addr = Some(req.status_addr);
        let early = answered(req.kind.req_type(), req.len);
        if req.kind == Kind::GetId {
            let ok = write_id(mem, &self.segs, &self.serial, req.len as usize);
            if self.dirty.is_on() {
                self.dirty.guest_writes(&self.segs, &mut self.counters);
            }
            let status = if ok { Status::Ok } else { Status::IoErr };
            self.answer(early, status, req.len as u32 + 1, status_addr, mem);
            return None;
        }
        let Some(id) = self.slots.alloc() else {
            // Cannot happen: slots = sum of queue sizes and each queue is held at its size.
            // Fail safely anyway.
            self.answer(early, Status::IoErr, 1, status_addr, mem);
            return None;
        };
        let slot = self.slots.get_mut(id);
        if matches!(req.kind, Kind::Read | Kind::Write) {
            if !map_segments(mem, &self.segs, &mut slot.iovs) {
                self.slots.release(id);
                if let Some(d) = self.log.allow() {
                    tracing::warn!(head, dropped_logs = d, "bad request from guest: data buffer outside guest memory or too many segments");
                }
                self.answer(early, Status::IoErr, 1, status_addr, mem);
                return None;
            }
        } else {
            slot.iovs.clear();
        }
        slot.queue = local as u16;
        slot.head = head;
        slot.kind = req.kind;
        slot.status_addr = req.status_addr;
        slot.len = req.len;
        slot.offset = req.offset();
        slot.started_ns = self.now_ns;
        Some(id)
    }

    /// Hands the staged requests to the engine: adjacent reads/writes of one queue merged into
    /// one host I/O where allowed; ring entries go out with the next io_uring_enter.
    pub(super) fn start_staged(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let staged = std::mem::take(&mut self.staged);
        let mut shapes = std::mem::take(&mut self.shapes);
        shapes.clear();
        shapes.extend(staged.iter().map(|&id| shape_of(self.slots.get(id))));
        // Never merge past what the engine takes in one operation.
        let (engine_bytes, engine_iovs) = self
            .split_limits
            .map_or((u64::MAX, usize::MAX), |l| (l.max_bytes, l.max_iovs));
        let limits = MergeLimits {
            max_iovs: if self.tuning.merge {
                IOV_MAX.min(engine_iovs)
            } else {
                0
            },
            max_bytes: MAX_MERGE_BYTES.min(engine_bytes),
        };
        let mut runs = std::mem::take(&mut self.runs);
        runs.clear();
        merge::plan(&shapes, &limits, |a, n| runs.push((a, n)));
        for &(a, n) in &runs {
            // A run never mixes queues: split it where the queue changes.
            let mut start = a;
            while start < a + n {
                let queue = self.slots.get(staged[start]).queue;
                let mut end = start + 1;
                while end < a + n && self.slots.get(staged[end]).queue == queue {
                    end += 1;
                }
                self.start_run(&staged[start..end]);
                start = end;
            }
        }
        self.shapes = shapes;
        self.runs = runs;
        let mut staged = staged;
        staged.clear();
        self.staged = staged;
    }

    /// Starts one host I/O for `run` (one request, or several merged).
    fn start_run(&mut self, run: &[SlotId]) {
        let lead = run[0];
        if run.len() > 1 {
            self.slots.link(run);
            self.counters.merges += (run.len() - 1) as u64;
        }
        self.counters.submitted += run.len() as u64;
        self.engine_in_flight += run.len() as u64;
        let op = self.op_of(lead);
        match op {
            Op::Read {
                buf_index: Some(_), ..
            }
            | Op::Write {
                buf_index: Some(_), ..
            } => self.counters.fixed_buf_ios += 1,
            _ => {}
        }
        if let Op::Write { sync: true, .. } = op {
            self.counters.sync_writes += 1;
        }
        if self.start_split(lead, &op) {
            return;
        }
        // SAFETY: `op`'s iovecs are the lead slot's, mapped from guest memory by
        // `map_segments` (every range checked to lie inside a guest region, writable ones for
        // reads); the slot keeps its iovec array until the request completes, and the thread
        // swaps or drops guest memory only once nothing is in flight (control.rs).
        let started = unsafe { self.channel.start(&op, u64::from(lead)) };
        self.on_started(lead, started);
    }

    /// Starts the I/O led by `lead` as parts within the engine's limits, if it needs that;
    /// returns false (starting nothing) if it does not.
    pub(super) fn start_split(&mut self, lead: SlotId, op: &Op) -> bool {
        let Some(limits) = self.split_limits else {
            return false;
        };
        let (offset, sync, read) = match *op {
            Op::Read { offset, .. } => (offset, false, true),
            Op::Write { offset, sync, .. } => (offset, sync, false),
            _ => return false,
        };
        let slot = self.slots.get_mut(lead);
        let bytes: u64 = slot.io_iovs().iter().map(|v| v.iov_len as u64).sum();
        let channel = &self.channel;
        let cut = limits.cuts_runs && channel.run_end(offset, bytes) < offset + bytes;
        if !cut && !limits.needed(bytes, slot.io_iovs().len()) {
            return false;
        }
        let mut split = std::mem::take(&mut slot.split);
        let run_end = |at, left| {
            if limits.cuts_runs {
                channel.run_end(at, left)
            } else {
                at + left
            }
        };
        let ok = plan(
            slot.io_iovs(),
            offset,
            &limits,
            run_end,
            &mut split.iovs,
            &mut split.parts,
        );
        split.left = if ok { split.parts.len() as u32 } else { 0 };
        split.error = 0;
        split.done = 0;
        split.whole = false;
        let nparts = split.parts.len();
        slot.split = split;
        if !ok {
            if let Some(d) = self.log.allow() {
                tracing::warn!(
                    bytes,
                    iovecs = slot.io_iovs().len(),
                    max_parts = super::split::MAX_PARTS,
                    dropped_logs = d,
                    "request cannot be split within the device's limits (into whole blocks, at most max_parts parts)"
                );
            }
            self.complete_io(lead, -libc::EINVAL, false);
            return true;
        }
        self.counters.split_parts += nparts as u64;
        for k in 0..nparts {
            let slot = self.slots.get(lead);
            let part = slot.split.parts[k];
            let iovs = slot.split.iovs[part.first..part.first + part.count].as_ptr();
            let iovcnt = part.count as u32;
            let part_op = if read {
                Op::Read {
                    offset: part.offset,
                    iovs,
                    iovcnt,
                    buf_index: None,
                }
            } else {
                Op::Write {
                    offset: part.offset,
                    iovs,
                    iovcnt,
                    sync,
                    buf_index: None,
                }
            };
            // SAFETY: the part's iovecs lie in the slot's split array, which is left alone
            // until the last part completes, and describe ranges of the request's own iovecs
            // (guest memory, checked by `map_segments`), which stay valid as in `start_run`.
            let started = unsafe { self.channel.start(&part_op, u64::from(lead)) };
            self.on_started(lead, started);
        }
        true
    }

    /// Acts on how the engine took the I/O led by `lead`.
    pub(super) fn on_started(&mut self, lead: SlotId, started: Started) {
        match started {
            Started::Ring(sqe) => {
                // SAFETY: the entry names the slot's iovecs and the guest memory they describe.
                // The slot is reused only after this entry's completion, and guest memory is
                // swapped only when no slot is in use.
                unsafe { self.ring.push_io(sqe, lead, &mut self.counters) };
                if self.tuning.submit_early && self.ring.submit_early_due() {
                    self.ring.submit(&mut self.counters);
                }
            }
            Started::WideRing(sqe) => {
                // SAFETY: as for `Started::Ring`.
                if !unsafe { self.ring.push_wide_io(sqe, lead, &mut self.counters) } {
                    self.complete_io(lead, -libc::EINVAL, false);
                    return;
                }
                if self.tuning.submit_early && self.ring.submit_early_due() {
                    self.ring.submit(&mut self.counters);
                }
            }
            Started::Pending => {}
            Started::Done(res) => {
                self.answered_at_once = true;
                self.complete_io(lead, res, false)
            }
        }
    }

    /// The engine operation for the I/O led by `lead`.
    pub(super) fn op_of(&self, lead: SlotId) -> Op {
        let slot = self.slots.get(lead);
        let iovs = slot.io_iovs();
        let (ptr, cnt) = (iovs.as_ptr(), iovs.len() as u32);
        let buf_index = self.ring.buffer_index(iovs);
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
}

/// What the merge plan needs of a staged request. Only reads and writes merge: everything else
/// gets a shape that never extends or is extended.
fn shape_of(s: &super::slots::Slot) -> Shape {
    match s.kind {
        Kind::Read | Kind::Write => Shape {
            dir: if s.kind == Kind::Read {
                Dir::Read
            } else {
                Dir::Write
            },
            offset: s.offset,
            len: s.len,
            iovs: s.iovs.len(),
        },
        _ => Shape {
            dir: Dir::Write,
            offset: u64::MAX,
            len: 0,
            iovs: IOV_MAX + 1,
        },
    }
}
