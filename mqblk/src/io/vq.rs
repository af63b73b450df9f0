//! A virtqueue as its I/O thread serves it: popping the avail ring, publishing used entries,
//! and deciding (with EVENT_IDX) when the guest wants a notification.
//!
//! The guest is untrusted here: an avail index that runs more than the queue size ahead, a
//! ring that cannot be read or written, marks the queue broken, and nothing more is taken from
//! it until the frontend restarts it. Other queues are not affected.

use std::collections::VecDeque;
use std::fs::File;
use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, Ordering};
use std::sync::mpsc::SyncSender;
use std::time::Instant;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::inflight::InflightQueue;
use super::ring_view::{self, RingView};
use super::slots::SlotId;
use super::GuestMemory;
use crate::blk::chain::ChainWalker;
use crate::log_limit::LogLimiter;

/// What popping a queue found.
pub enum Pop<'m> {
    /// A request: its head and its descriptor chain.
    Chain {
        /// The chain's head index (not yet checked against the queue size: the walk does).
        head: u16,
        /// The walk of its descriptors.
        chain: ChainWalker<'m, GuestMemory>,
    },
    /// Nothing new in the avail ring.
    Empty,
    /// As many requests in flight as the queue holds: wait for completions.
    Full,
    /// The guest broke the ring (logged by the caller).
    Broken(&'static str),
}

/// A started virtqueue.
pub struct Vq {
    /// The queue's index in the device (for logs).
    pub index: usize,
    /// Ring addresses, indices and EVENT_IDX state.
    pub queue: Queue,
    /// Guest-to-backend notifications.
    pub kick: File,
    /// Backend-to-guest notifications.
    pub call: Option<File>,
    /// Which start of this queue this is (see `Token::Kick`).
    pub generation: u16,
    /// Requests popped and not yet completed.
    pub in_flight: u32,
    /// Used entries were added since the last notification decision.
    pub used_added: bool,
    /// Avail entries may be waiting (kicked, throttled, or just started).
    pub pending: bool,
    /// The guest broke the ring; nothing more is popped until the queue is restarted.
    pub broken: bool,
    /// Stopping: set when the frontend stopped the ring; the reply gets the next avail index
    /// once every popped request has completed.
    pub stop_reply: Option<SyncSender<u16>>,
    /// In-flight tracking for this queue (INFLIGHT_SHMFD), if the frontend set it up.
    pub track: Option<InflightQueue>,
    /// Requests popped and parsed that wait for QoS admission, in order, with when they
    /// began to wait. While any wait, nothing more is popped from this queue, so the guest's
    /// order is kept. (Room for every request the ring can hold: never grows.)
    pub waiting: VecDeque<(SlotId, Instant)>,
    /// Avail entries still to pop from the last snapshot of the avail index.
    snapshot: u16,
    /// Used entries published since the guest was last notified.
    used_since_notify: u32,
    /// This round (an iteration of the I/O thread's loop) already decided whether to notify
    /// early (`take_early_notification`).
    early_decided: bool,
    /// The rings at host addresses, for the memory table the thread holds (None: through
    /// vm-memory).
    view: Option<RingView>,
    /// Used entries added since the last EVENT_IDX decision (`needs_notification`).
    added: Wrapping<u16>,
}

impl Vq {
    /// A queue just started, with requests possibly already waiting; `mem` is the memory table
    /// its thread holds.
    pub fn new(
        index: usize,
        queue: Queue,
        kick: File,
        call: Option<File>,
        generation: u16,
        track: Option<InflightQueue>,
        mem: Option<&GuestMemory>,
    ) -> Self {
        let room = usize::from(queue.size());
        let view = mem.and_then(|m| RingView::new(&queue, m));
        Vq {
            index,
            queue,
            kick,
            call,
            generation,
            in_flight: 0,
            used_added: false,
            pending: true,
            broken: false,
            stop_reply: None,
            track,
            waiting: VecDeque::with_capacity(room),
            snapshot: 0,
            used_since_notify: 0,
            early_decided: false,
            view,
            added: Wrapping(0),
        }
    }

    /// The thread took another memory table: the rings' host addresses are found in it.
    pub fn remap(&mut self, mem: Option<&GuestMemory>) {
        self.view = mem.and_then(|m| RingView::new(&self.queue, m));
    }

    fn avail_idx(&self, mem: &GuestMemory) -> Result<Wrapping<u16>, virtio_queue::Error> {
        match &self.view {
            Some(v) => Ok(Wrapping(v.avail_idx())),
            None => self.queue.avail_idx(mem, Ordering::Acquire),
        }
    }

    /// The guest broke the ring (`why`): nothing more is taken from this queue until the
    /// frontend restarts it. Other queues go on.
    pub fn mark_broken(&mut self, why: &str, log: &mut LogLimiter) {
        self.broken = true;
        if let Some(d) = log.allow() {
            tracing::error!(
                queue = self.index,
                err = why,
                dropped_logs = d,
                "guest broke the ring; queue stopped until reset"
            );
        }
    }

    /// Whether the thread takes requests from this queue.
    pub fn is_serving(&self) -> bool {
        !self.broken && self.stop_reply.is_none()
    }

    /// The kick eventfd.
    pub fn kick_fd(&self) -> i32 {
        self.kick.as_raw_fd()
    }

    /// Starts a round of popping: suppresses guest notifications (they come back when the
    /// thread is about to sleep) and snapshots the avail index. Popping exactly what a
    /// snapshot shows, and checking it against the queue size, tells a guest that moved the
    /// index too far ahead (broken) from one that is adding a request right now (fine).
    pub fn begin_pop(&mut self, mem: &GuestMemory) -> Result<(), &'static str> {
        self.pending = false;
        self.queue
            .disable_notification(mem)
            .map_err(|_| "used ring unwritable")?;
        self.take_snapshot(mem)
    }

    fn take_snapshot(&mut self, mem: &GuestMemory) -> Result<(), &'static str> {
        let idx = self.avail_idx(mem).map_err(|_| "avail ring unreadable")?;
        let ahead = (idx - Wrapping(self.queue.next_avail())).0;
        if ahead > self.queue.size() {
            return Err("avail index more than the queue size ahead");
        }
        self.snapshot = ahead;
        Ok(())
    }

    /// The next request, bounded by `max_in_flight`. After a snapshot is used up, a new one is
    /// taken, so requests the guest adds meanwhile are picked up in the same round.
    pub fn pop<'m>(&mut self, mem: &'m GuestMemory, max_in_flight: u32) -> Pop<'m> {
        if self.snapshot == 0 {
            if let Err(e) = self.take_snapshot(mem) {
                return Pop::Broken(e);
            }
            if self.snapshot == 0 {
                return Pop::Empty;
            }
        }
        if self.in_flight >= max_in_flight {
            // Resumes when a completion frees room.
            self.pending = true;
            return Pop::Full;
        }
        let head = match &self.view {
            Some(v) => {
                let at = self.queue.next_avail();
                self.queue.set_next_avail(at.wrapping_add(1));
                if self.snapshot > 1 {
                    // The next request's descriptors load while this one is handled.
                    v.descriptors().prefetch(v.avail_entry(at.wrapping_add(1)));
                }
                v.avail_entry(at)
            }
            None => match self.queue.pop_descriptor_chain(mem) {
                Some(chain) => chain.head_index(),
                None => return Pop::Broken("avail ring unreadable"),
            },
        };
        self.snapshot -= 1;
        self.in_flight += 1;
        if let Some(t) = self.track.as_mut() {
            t.on_fetch(head);
        }
        Pop::Chain {
            head,
            chain: self.walk(mem, head),
        }
    }

    /// The walk of the chain at `head`: through the descriptor table's host address where
    /// the queue has a view, else through vm-memory.
    pub fn walk<'m>(&self, mem: &'m GuestMemory, head: u16) -> ChainWalker<'m, GuestMemory> {
        let table = GuestAddress(self.queue.desc_table());
        ChainWalker::new(mem, table, self.queue.size(), head)
            .with_host_table(self.view.as_ref().map(RingView::descriptors))
    }

    /// Whether this queue is popped now: it is serving and no request waits for admission.
    pub fn takes_requests(&self) -> bool {
        self.is_serving() && self.waiting.is_empty()
    }

    /// Whether the avail ring holds requests to pop now (one read of guest memory).
    pub fn has_avail(&mut self, mem: &GuestMemory) -> bool {
        if !self.takes_requests() {
            return false;
        }
        let found = matches!(self.avail_idx(mem), Ok(idx) if idx.0 != self.queue.next_avail());
        self.pending |= found;
        found
    }

    /// Asks the guest for notifications again before the thread sleeps; true when requests
    /// arrived meanwhile (so the thread must not sleep). A queue whose requests wait for
    /// admission needs no kick: its timer brings the thread back to it.
    pub fn enable_notifications(&mut self, mem: &GuestMemory) -> Result<bool, &'static str> {
        if !self.waiting.is_empty() {
            return Ok(false);
        }
        let found = self
            .queue
            .enable_notification(mem)
            .map_err(|_| "avail ring unreadable")?;
        self.pending |= found;
        Ok(found)
    }

    /// Publishes a used entry for `head`, keeping the in-flight region in step. A request that
    /// completes on a queue held at its in-flight limit lets popping resume.
    pub fn add_used(
        &mut self,
        mem: &GuestMemory,
        head: u16,
        len: u32,
        max_in_flight: u32,
    ) -> Result<(), virtio_queue::Error> {
        if self.in_flight == max_in_flight && !self.broken {
            self.pending = true;
        }
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(t) = self.track.as_ref() {
            t.before_used(head);
        }
        let r = match &self.view {
            // virtio-queue's checks and order, on the translated ring.
            Some(_) if head >= self.queue.size() => {
                Err(virtio_queue::Error::InvalidDescriptorIndex)
            }
            Some(v) => {
                let at = self.queue.next_used();
                v.put_used(at, head, len);
                self.queue.set_next_used(at.wrapping_add(1));
                Ok(())
            }
            None => self.queue.add_used(mem, head, len),
        };
        if r.is_ok() {
            self.added += 1;
        }
        if let Some(t) = self.track.as_ref() {
            t.after_used(head, self.queue.next_used());
        }
        self.used_added = true;
        // A guest that never asks for notifications never resets it: it must not overflow.
        self.used_since_notify = self.used_since_notify.saturating_add(1);
        r
    }

    /// Whether the guest wants a notification for the used entries added since the last
    /// decision (EVENT_IDX's used_event, or the NO_INTERRUPT flag without it); if so, how many
    /// used entries it publishes. A ring that cannot be read gets one: a spurious interrupt is
    /// harmless, a lost one hangs the guest.
    /// Called by the I/O thread once per round, after it answered what it could.
    pub fn take_notification(&mut self, mem: &GuestMemory) -> Option<u32> {
        self.early_decided = false;
        self.decide_notification(mem)
    }

    /// The notification decision at this round's first used entry, for a queue with
    /// EVENT_IDX (`io::policy::notify`); None at every later entry of the round. Without
    /// EVENT_IDX, a notification now would be followed by another after the round.
    pub fn take_early_notification(&mut self, mem: &GuestMemory) -> Option<u32> {
        if std::mem::replace(&mut self.early_decided, true) || !self.queue.event_idx_enabled() {
            return None;
        }
        self.decide_notification(mem)
    }

    fn decide_notification(&mut self, mem: &GuestMemory) -> Option<u32> {
        if !std::mem::take(&mut self.used_added) {
            return None;
        }
        if self.call.is_none() || !self.needs_notification(mem).unwrap_or(true) {
            return None;
        }
        Some(std::mem::take(&mut self.used_since_notify))
    }

    /// virtio-queue's `needs_notification`, over the entries counted here (the translated
    /// ring's are not counted by the queue): with EVENT_IDX, whether `used_event` lies among
    /// the used indices published since the last decision (the Linux driver's rule); without
    /// it, always.
    fn needs_notification(&mut self, mem: &GuestMemory) -> Result<bool, &'static str> {
        let used_idx = Wrapping(self.queue.next_used());
        // The used index written before used_event is read.
        fence(Ordering::SeqCst);
        if !self.queue.event_idx_enabled() {
            return Ok(true);
        }
        let used_event = match &self.view {
            Some(v) => v.used_event(),
            None => {
                let at = (self.queue.avail_ring())
                    .checked_add(ring_view::used_event_offset(self.queue.size()))
                    .map(GuestAddress)
                    .ok_or("avail ring out of range")?;
                u16::from_le(
                    mem.load(at, Ordering::Relaxed)
                        .map_err(|_| "avail ring unreadable")?,
                )
            }
        };
        let added = std::mem::take(&mut self.added);
        Ok(used_idx - Wrapping(used_event) - Wrapping(1) < added)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Address, GuestAddress};

    fn eventfd() -> File {
        File::from(rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap())
    }

    /// 1 MiB of guest memory in one region.
    fn guest_memory() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_000)]).unwrap()
    }

    /// A queue of 16 entries; `translated`: through a [`RingView`], else through vm-memory.
    fn setup(
        mem: &GuestMemory,
        event_idx: bool,
        translated: bool,
    ) -> (MockSplitQueue<'_, GuestMemory>, Vq) {
        let mock = MockSplitQueue::new(mem, 16);
        let mut q: Queue = mock.create_queue().unwrap();
        // The mock places the used ring over the avail ring's tail (where used_event lives):
        // move it clear.
        q.set_used_ring_address(Some(0x8000), Some(0));
        q.set_event_idx(event_idx);
        let mut vq = Vq::new(0, q, eventfd(), Some(eventfd()), 1, None, Some(mem));
        assert!(vq.view.is_some(), "the mock's rings lie in one region");
        if !translated {
            vq.remap(None);
        }
        (mock, vq)
    }

    /// Runs `check` on a queue's ring through a [`RingView`] and through vm-memory.
    fn both_ways(check: fn(bool)) {
        check(true);
        check(false);
    }

    fn chains(mock: &MockSplitQueue<'_, GuestMemory>, n: u16) {
        let descs: Vec<RawDescriptor> = (0..n)
            .map(|i| {
                RawDescriptor::from(Descriptor::new(
                    0x10_000 + u64::from(i) * 0x1000,
                    0x200,
                    0,
                    0,
                ))
            })
            .collect();
        mock.build_multiple_desc_chains(&descs).unwrap();
    }

    #[test]
    fn pops_up_to_the_in_flight_limit_and_resumes() {
        both_ways(|translated| {
            let mem = guest_memory();
            let (mock, mut vq) = setup(&mem, false, translated);
            chains(&mock, 3);
            vq.begin_pop(&mem).unwrap();
            let mut heads = Vec::new();
            loop {
                match vq.pop(&mem, 2) {
                    Pop::Chain { head, chain } => {
                        // The mock's chains are one descriptor each, in order.
                        let descs: Vec<_> = chain.collect();
                        assert_eq!(descs.len(), 1);
                        let i = heads.len() as u64;
                        assert_eq!(descs[0].addr().0, 0x10_000 + i * 0x1000);
                        assert_eq!(descs[0].len(), 0x200);
                        heads.push(head);
                    }
                    Pop::Full => break,
                    _ => panic!("expected two chains, then full"),
                }
            }
            assert_eq!(heads.len(), 2);
            assert!(vq.pending, "held at the limit: pops again later");
            vq.pending = false;
            vq.add_used(&mem, heads[0], 0, 2).unwrap();
            assert!(vq.pending, "a completion at the limit lets popping resume");
            assert!(matches!(vq.pop(&mem, 2), Pop::Chain { .. }));
            assert!(matches!(vq.pop(&mem, 2), Pop::Empty | Pop::Full));
            // A head the guest made up, past the queue, gets no used entry.
            let next_used = vq.queue.next_used();
            assert!(vq.add_used(&mem, 16, 0, 2).is_err());
            assert_eq!(vq.queue.next_used(), next_used);
        });
    }

    #[test]
    fn an_index_too_far_ahead_breaks_the_queue() {
        both_ways(|translated| {
            let mem = guest_memory();
            let (mock, mut vq) = setup(&mem, false, translated);
            mock.avail().idx().store(17);
            assert!(vq.begin_pop(&mem).is_err());
            mock.avail().idx().store(16);
            assert!(vq.begin_pop(&mem).is_ok());
        });
    }

    #[test]
    fn notifications_follow_event_idx() {
        both_ways(|translated| {
            let mem = guest_memory();
            let (mock, mut vq) = setup(&mem, true, translated);
            chains(&mock, 4);
            let heads = pop_all(&mem, &mut vq);
            assert_eq!(heads.len(), 4);
            assert_eq!(vq.take_notification(&mem), None, "nothing used yet");
            // The guest asks to be told once the used index passes 1.
            set_used_event(&mock, &mem, 1);
            vq.add_used(&mem, heads[0], 0, 16).unwrap();
            assert_eq!(
                vq.take_notification(&mem),
                None,
                "used idx 1 does not pass used_event 1"
            );
            vq.add_used(&mem, heads[1], 0, 16).unwrap();
            assert_eq!(
                vq.take_notification(&mem),
                Some(2),
                "used idx 2 passes used_event 1, with 2 used"
            );
            vq.add_used(&mem, heads[2], 0, 16).unwrap();
            assert_eq!(
                vq.take_notification(&mem),
                None,
                "already told; used_event not moved"
            );
            assert_eq!(vq.take_notification(&mem), None, "no new used entry");
        });
    }

    /// The guest's used_event (the u16 after the avail ring's 16 entries): notify once the used
    /// index passes `idx`.
    fn set_used_event(mock: &MockSplitQueue<'_, GuestMemory>, mem: &GuestMemory, idx: u16) {
        let at = mock.avail_addr().unchecked_add(4 + 2 * 16);
        vm_memory::Bytes::write_obj(mem, idx, at).unwrap();
    }

    /// Pops every chain the avail ring holds and returns their heads.
    fn pop_all(mem: &GuestMemory, vq: &mut Vq) -> Vec<u16> {
        vq.begin_pop(mem).unwrap();
        let mut heads = Vec::new();
        while let Pop::Chain { head, .. } = vq.pop(mem, 16) {
            heads.push(head);
        }
        heads
    }

    #[test]
    fn an_early_notification_at_a_rounds_first_entry_replaces_the_one_after_its_last() {
        both_ways(|translated| {
            let mem = guest_memory();
            let (mock, mut vq) = setup(&mem, true, translated);
            chains(&mock, 4);
            let heads = pop_all(&mem, &mut vq);
            // used_event 0: the guest sleeps until the first entry is used.
            vq.add_used(&mem, heads[0], 0, 16).unwrap();
            assert_eq!(
                vq.take_early_notification(&mem),
                Some(1),
                "the round's first entry"
            );
            vq.add_used(&mem, heads[1], 0, 16).unwrap();
            assert_eq!(vq.take_early_notification(&mem), None, "once per round");
            vq.add_used(&mem, heads[2], 0, 16).unwrap();
            assert_eq!(
                vq.take_notification(&mem),
                None,
                "the guest has not re-armed used_event: the round's end sends nothing more"
            );
            // The guest woke, took 3 entries and sleeps until the next one.
            set_used_event(&mock, &mem, 3);
            vq.add_used(&mem, heads[3], 0, 16).unwrap();
            assert_eq!(
                vq.take_early_notification(&mem),
                Some(3),
                "a new round decides afresh; the notification counts every entry since the last"
            );
        });
    }

    #[test]
    fn no_early_notification_without_event_idx() {
        both_ways(|translated| {
            // Without EVENT_IDX the guest would get a second notification after the round.
            let mem = guest_memory();
            let (mock, mut vq) = setup(&mem, false, translated);
            chains(&mock, 2);
            let heads = pop_all(&mem, &mut vq);
            vq.add_used(&mem, heads[0], 0, 16).unwrap();
            assert_eq!(vq.take_early_notification(&mem), None);
            vq.add_used(&mem, heads[1], 0, 16).unwrap();
            assert_eq!(vq.take_notification(&mem), Some(2));
        });
    }
}
