//! From an engine result to the guest: the request's status, its status byte, and its used
//! entry (the notification decision follows in the loop, once per batch).

use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

use super::slots::SlotId;
use super::split::PartDone;
use super::thread::IoThread;
use super::GuestMemory;
use crate::blk::{self, guest_bytes, Kind, ReqType, Segment, Status};

/// A request being answered: where its used entry goes, and what the counters book.
pub(super) struct Answered {
    /// Its queue, by index among this thread's queues.
    pub local: usize,
    /// Its head descriptor (the used entry's id).
    pub head: u16,
    /// Its type, when known (not for GET_ID, nor for chains too broken to read a header of).
    pub ty: Option<ReqType>,
    /// Bytes it transfers, discards or zeroes (booked only when it succeeds).
    pub bytes: u64,
    /// When it was popped (`IoThread::now_ns`).
    pub started_ns: u64,
}

/// Why a request that reached the engine failed. The message is its log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IoFailure {
    /// The engine reported an error.
    #[error("I/O error: {}", std::io::Error::from_raw_os_error(*.0))]
    Errno(i32),
    /// The engine transferred fewer bytes than the request asked for.
    #[error("short I/O: {done} of {want} bytes")]
    Short {
        /// Bytes transferred.
        done: u64,
        /// Bytes asked for.
        want: u64,
    },
}

impl IoFailure {
    /// The status the guest gets.
    pub fn status(&self) -> Status {
        Status::IoErr
    }
}

/// The outcome of a request of `kind` whose host I/O returned `res` for `want` bytes.
pub fn status_of(kind: Kind, res: i32, want: u64) -> Result<(), IoFailure> {
    if res < 0 {
        // Discard is a hint: a store that cannot deallocate simply keeps the data.
        if kind == Kind::Discard && res == -libc::EOPNOTSUPP {
            return Ok(());
        }
        return Err(IoFailure::Errno(-res));
    }
    if matches!(kind, Kind::Read | Kind::Write) && res as u64 != want {
        return Err(IoFailure::Short {
            done: res as u64,
            want,
        });
    }
    Ok(())
}

impl IoThread {
    /// Completes the host I/O led by `lead` with the engine's result `res`: every member
    /// request gets its status and its used entry.
    /// `whole`: the engine's commands are all or nothing, and `res` 0 means every byte moved.
    pub(super) fn complete_io(&mut self, lead: SlotId, res: i32, whole: bool) {
        if self.slots.lookup(lead).is_none() {
            return;
        }
        // The common case (one plain operation) costs one test here; the I/O's length is
        // only needed for a split or all-or-nothing one.
        let plain = !whole && !self.slots.get(lead).split.in_progress();
        let (res, split) = if plain {
            (res, false)
        } else {
            let io_len = self.slots.io_len(lead);
            match self.slots.get_mut(lead).split.part_done(res, whole, io_len) {
                PartDone::NotSplit if whole && res == 0 => {
                    (io_len.min(i32::MAX as u64) as i32, false)
                }
                PartDone::NotSplit => (res, false),
                PartDone::Waiting => return,
                PartDone::Last(res) => (res, true),
            }
        };
        let slot = self.slots.get(lead);
        let (kind, head, merged) = (slot.kind, slot.head, slot.is_merged());
        if res < 0 && !merged && !split {
            let op = self.op_of(lead);
            // SAFETY: as in `start_run`: the slot, its iovecs and guest memory stay until this
            // request completes, which it has not yet.
            if let Some(again) = unsafe { self.channel.retry(&op, res, u64::from(lead)) } {
                self.on_started(lead, again);
                return;
            }
        }
        let outcome = status_of(kind, res, self.slots.io_len(lead));
        let status = match outcome {
            Ok(()) => Status::Ok,
            Err(f) => {
                if let Some(d) = self.log.allow() {
                    tracing::warn!(?kind, head, err = %f, dropped_logs = d, "request failed");
                }
                f.status()
            }
        };
        // Borrowed by taking it out and putting it back: no reference-count traffic per
        // completion. (Memory is swapped only when no slot is in use, so it is here.)
        let Some(mem) = self.mem.take() else {
            return;
        };
        let mut next = Some(lead);
        while let Some(id) = next {
            next = self.slots.next_member(id);
            let s = self.slots.get(id);
            let (queue, head, len, status_addr) = (s.queue as usize, s.head, s.len, s.status_addr);
            // The engine wrote a read's data into guest memory where only the frontend's dirty
            // log can learn of it (a failed or short read may have written part of it).
            if self.dirty.is_on() && kind == Kind::Read {
                self.dirty.host_writes(&mem, &s.iovs, &mut self.counters);
            }
            let req = Answered {
                local: queue,
                head,
                ty: kind.req_type(),
                bytes: len,
                started_ns: s.started_ns,
            };
            if status == Status::Ok && matches!(kind, Kind::Read | Kind::Write) {
                self.counters.bytes += len;
            }
            let used_len = if kind == Kind::Read && status == Status::Ok {
                len as u32 + 1
            } else {
                1
            };
            self.slots.release(id);
            self.engine_in_flight -= 1;
            self.answer(req, status, used_len, Some(status_addr), &mem);
        }
        self.mem = Some(mem);
    }

    /// Answers a request: writes `status` (if there is a status byte), adds the used entry and
    /// counts it. A status byte that cannot be written is answered with a used length of 0.
    pub(super) fn answer(
        &mut self,
        req: Answered,
        status: Status,
        used_len: u32,
        status_addr: Option<GuestAddress>,
        mem: &GuestMemory,
    ) {
        let Answered { local, head, .. } = req;
        let written = match status_addr {
            Some(addr) if guest_bytes::write_byte(mem, addr, status as u8) => Some(addr),
            _ => None,
        };
        let used_len = if written.is_some() { used_len } else { 0 };
        if self.dirty.is_on() {
            if let Some(addr) = written {
                self.dirty.status_byte(addr, &mut self.counters);
            }
        }
        let ok = status == Status::Ok;
        if !ok {
            self.counters.errors += 1;
        }
        self.counters.requests += 1;
        if let Some(ty) = req.ty {
            let latency = self.now_ns.saturating_sub(req.started_ns);
            self.counters.count_request(ty, ok, req.bytes, latency);
        }
        let max_in_flight = u32::from(self.queue_sizes[local]);
        let Some(Some(q)) = self.queues.get_mut(local) else {
            return;
        };
        let added = q.add_used(mem, head, used_len, max_in_flight);
        // The used entry and index, marked as soon as they are written.
        if self.dirty.is_on() {
            self.dirty
                .used_ring(local, q.queue.size(), &mut self.counters);
        }
        if let Err(e) = added {
            if let Some(d) = self.log.allow() {
                tracing::warn!(queue = q.index, err = %e, dropped_logs = d, "cannot add used entry");
            }
        }
        if self.early_notify.active(self.batch.mean()) {
            if let (Some(used), Some(call)) = (q.take_early_notification(mem), q.call.as_ref()) {
                self.counters.count_notification(used);
                self.ring.notify_now(call, &mut self.counters);
            }
        }
    }
}

/// Writes the serial (NUL-padded to 20 bytes, as much as `len` allows) into a GET_ID
/// request's buffers. False when a buffer cannot be written.
pub fn write_id(mem: &GuestMemory, segs: &[Segment], serial: &[u8], len: usize) -> bool {
    let mut id = [0u8; blk::request::ID_LEN];
    let n = serial.len().min(id.len());
    id[..n].copy_from_slice(&serial[..n]);
    let len = len.min(id.len());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_to_statuses() {
        assert_eq!(status_of(Kind::Read, 4096, 4096), Ok(()));
        assert_eq!(
            status_of(Kind::Read, 512, 4096),
            Err(IoFailure::Short {
                done: 512,
                want: 4096
            })
        );
        assert_eq!(
            status_of(Kind::Write, -libc::EIO, 4096),
            Err(IoFailure::Errno(libc::EIO))
        );
        assert_eq!(status_of(Kind::Flush, 0, 0), Ok(()));
        assert_eq!(
            status_of(Kind::Flush, -libc::EIO, 0),
            Err(IoFailure::Errno(libc::EIO))
        );
        // Discard is a hint; write-zeroes is not.
        assert_eq!(status_of(Kind::Discard, -libc::EOPNOTSUPP, 0), Ok(()));
        assert_eq!(
            status_of(Kind::WriteZeroes { unmap: false }, -libc::EOPNOTSUPP, 0),
            Err(IoFailure::Errno(libc::EOPNOTSUPP))
        );
        assert_eq!(IoFailure::Errno(libc::EIO).status(), Status::IoErr);
        assert!(IoFailure::Short { done: 1, want: 2 }
            .to_string()
            .contains("short"));
    }

    #[test]
    fn serial_is_padded_and_bounded() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        let segs = [
            Segment {
                addr: GuestAddress(0x100),
                len: 8,
            },
            Segment {
                addr: GuestAddress(0x200),
                len: 64,
            },
        ];
        mem.write_slice(&[0xff; 64], GuestAddress(0x200)).unwrap();
        assert!(write_id(&mem, &segs, b"disk-serial-1", 20));
        let mut a = [0u8; 8];
        let mut b = [0u8; 13];
        mem.read_slice(&mut a, GuestAddress(0x100)).unwrap();
        mem.read_slice(&mut b, GuestAddress(0x200)).unwrap();
        assert_eq!(&a, b"disk-ser");
        assert_eq!(&b[..5], b"ial-1");
        assert_eq!(&b[5..12], &[0; 7], "padded with NULs to 20 bytes");
        assert_eq!(b[12], 0xff, "nothing past the 20 bytes");
        let outside = [Segment {
            addr: GuestAddress(0x2000),
            len: 20,
        }];
        assert!(!write_id(&mem, &outside, b"x", 20));
    }
}
