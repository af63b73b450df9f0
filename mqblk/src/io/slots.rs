//! The slot table: one slot per request that went to the engine, from its submission to its
//! completion, holding what the completion needs (where the status goes, which used entry to
//! publish) and the host iovecs the engine reads or writes.
//!
//! A merged host I/O is led by its first request's slot; the members are linked through
//! `next`, and the leader carries the concatenated iovecs. There is one slot for every
//! descriptor a thread's queues can hold, so a slot is always free for a popped request, and
//! nothing is allocated per request once the iovec vectors have grown.

use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

use super::GuestMemory;
use crate::blk::{Kind, Segment};

/// Most iovecs one host I/O may carry (Linux's IOV_MAX).
pub const IOV_MAX: usize = 1024;

/// A slot's index.
pub type SlotId = u32;

/// End of a merge chain.
const NONE: SlotId = SlotId::MAX;

/// One request in flight at the engine.
#[derive(Debug)]
pub struct Slot {
    /// The request's queue, by its index among this thread's queues.
    pub queue: u16,
    /// The head descriptor of the request's chain (its used-ring id).
    pub head: u16,
    /// What it asks for.
    pub kind: Kind,
    /// Where its status byte goes (checked to lie in guest memory).
    pub status_addr: vm_memory::GuestAddress,
    /// Bytes to transfer (reads, writes) or to discard or zero.
    pub len: u64,
    /// Byte offset on the disk.
    pub offset: u64,
    /// When it was popped (the I/O thread's `now_ns`), for its latency.
    pub started_ns: u64,
    /// This request's data buffers as host iovecs.
    pub iovs: Vec<libc::iovec>,
    /// The merged I/O's concatenated iovecs (leader only).
    merged_iovs: Vec<libc::iovec>,
    /// The parts of its host I/O while split to fit the engine's limits (leader only).
    pub split: super::split::SplitState,
    /// The next member of the merged I/O this slot belongs to.
    next: SlotId,
    /// Taken by a request now.
    in_use: bool,
    /// How often the slot was taken: tells a request that was in flight at some moment from a
    /// later one in the same slot.
    uses: u32,
}

impl Slot {
    fn new() -> Self {
        Slot {
            queue: 0,
            head: 0,
            kind: Kind::Flush,
            status_addr: vm_memory::GuestAddress(0),
            len: 0,
            offset: 0,
            started_ns: 0,
            iovs: Vec::new(),
            merged_iovs: Vec::new(),
            split: super::split::SplitState::default(),
            next: NONE,
            in_use: false,
            uses: 0,
        }
    }

    /// The iovecs of the host I/O this slot leads: its own, or the merged run's.
    pub fn io_iovs(&self) -> &[libc::iovec] {
        if self.next == NONE {
            &self.iovs
        } else {
            &self.merged_iovs
        }
    }

    /// Whether this slot leads a merged I/O.
    pub fn is_merged(&self) -> bool {
        self.next != NONE
    }
}

/// The slots of one I/O thread.
pub struct SlotTable {
    slots: Vec<Slot>,
    free: Vec<SlotId>,
}

impl SlotTable {
    /// A table of `n` free slots.
    pub fn new(n: usize) -> Self {
        SlotTable {
            slots: (0..n).map(|_| Slot::new()).collect(),
            free: (0..n as SlotId).rev().collect(),
        }
    }

    /// Takes a free slot, its merge link cleared.
    pub fn alloc(&mut self) -> Option<SlotId> {
        let id = self.free.pop()?;
        let s = &mut self.slots[id as usize];
        s.next = NONE;
        s.split.left = 0;
        s.in_use = true;
        s.uses = s.uses.wrapping_add(1);
        Some(id)
    }

    /// Returns a slot to the free list.
    pub fn release(&mut self, id: SlotId) {
        debug_assert!(self.slots[id as usize].in_use, "slot {id} released twice");
        self.slots[id as usize].in_use = false;
        self.free.push(id);
    }

    /// The requests in flight now, to wait for with [`SlotTable::all_done`].
    pub fn snapshot(&self) -> Vec<(SlotId, u32)> {
        (0..self.slots.len() as SlotId)
            .filter(|&id| self.slots[id as usize].in_use)
            .map(|id| (id, self.slots[id as usize].uses))
            .collect()
    }

    /// Whether every request of `snapshot` has completed (later requests in the same slots do
    /// not count).
    pub fn all_done(&self, snapshot: &[(SlotId, u32)]) -> bool {
        snapshot.iter().all(|&(id, uses)| {
            let s = &self.slots[id as usize];
            !s.in_use || s.uses != uses
        })
    }

    /// Slots in use.
    pub fn in_use(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// The slot `id`.
    pub fn get(&self, id: SlotId) -> &Slot {
        &self.slots[id as usize]
    }

    /// The slot `id`, mutably.
    pub fn get_mut(&mut self, id: SlotId) -> &mut Slot {
        &mut self.slots[id as usize]
    }

    /// The slot `id`, if it exists (for ids that come back from the kernel).
    pub fn lookup(&self, id: SlotId) -> Option<&Slot> {
        self.slots.get(id as usize)
    }

    /// Links `run` (two or more slots, in order) into one merged I/O led by `run[0]`, whose
    /// `io_iovs` become the concatenation of the members' iovecs.
    pub fn link(&mut self, run: &[SlotId]) {
        let lead = run[0] as usize;
        let mut merged = std::mem::take(&mut self.slots[lead].merged_iovs);
        merged.clear();
        for (k, &id) in run.iter().enumerate() {
            let s = &mut self.slots[id as usize];
            merged.extend_from_slice(&s.iovs);
            s.next = run.get(k + 1).copied().unwrap_or(NONE);
        }
        self.slots[lead].merged_iovs = merged;
    }

    /// The slots of the I/O led by `lead`, in order (just `lead` when it was not merged).
    pub fn members(&self, lead: SlotId) -> Members<'_> {
        Members {
            table: self,
            at: lead,
        }
    }

    /// The member after `id` in its merged I/O.
    pub fn next_member(&self, id: SlotId) -> Option<SlotId> {
        Some(self.get(id).next).filter(|&n| n != NONE)
    }

    /// Total bytes of the I/O led by `lead`.
    pub fn io_len(&self, lead: SlotId) -> u64 {
        self.members(lead).map(|id| self.get(id).len).sum()
    }
}

/// Iterator over the members of a merged I/O.
pub struct Members<'a> {
    table: &'a SlotTable,
    at: SlotId,
}

impl Iterator for Members<'_> {
    type Item = SlotId;
    fn next(&mut self) -> Option<SlotId> {
        if self.at == NONE {
            return None;
        }
        let id = self.at;
        self.at = self.table.get(id).next;
        Some(id)
    }
}

/// Maps a request's data segments to host iovecs into `out` (cleared first), splitting a
/// segment where it crosses from one guest memory region to the next. False when a segment
/// lies outside guest memory or the request needs more than [`IOV_MAX`] iovecs.
///
/// This runs for every request: it looks a region up once per region crossed (the region of
/// the previous segment is tried first) instead of going through vm-memory's generic slice
/// iterator, which cost a third of an I/O thread's time on the null engine.
pub fn map_segments(mem: &GuestMemory, segs: &[Segment], out: &mut Vec<libc::iovec>) -> bool {
    out.clear();
    let mut last: Option<&GuestRegionMmap<()>> = None;
    for s in segs {
        let mut addr = s.addr;
        let mut left = u64::from(s.len);
        while left > 0 {
            let (region, offset) = match last.and_then(|r| Some((r, r.to_region_addr(addr)?))) {
                Some(hit) => hit,
                None => match mem.to_region_addr(addr) {
                    Some(hit) => hit,
                    None => return false,
                },
            };
            last = Some(region);
            // `offset` is inside the region, so this is at least 1.
            let n = left.min(region.len() - offset.raw_value());
            let Ok(host) = region.get_host_address(offset) else {
                return false;
            };
            if out.len() == IOV_MAX {
                return false;
            }
            out.push(libc::iovec {
                iov_base: host.cast(),
                iov_len: n as usize,
            });
            left -= n;
            match addr.checked_add(n) {
                Some(next) => addr = next,
                // The segment ends exactly at the top of the address space.
                None if left == 0 => {}
                None => return false,
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestAddress;

    #[test]
    fn alloc_release_and_merge_links() {
        let mut t = SlotTable::new(4);
        let ids: Vec<_> = (0..4).map(|_| t.alloc().unwrap()).collect();
        assert!(t.alloc().is_none(), "four slots, four requests");
        assert_eq!(t.in_use(), 4);
        for (n, &id) in ids.iter().enumerate() {
            let s = t.get_mut(id);
            s.len = 512 * (n as u64 + 1);
            s.iovs = vec![libc::iovec {
                iov_base: (0x1000 * (n + 1)) as *mut _,
                iov_len: s.len as usize,
            }];
        }
        t.link(&ids[1..4]);
        assert!(t.get(ids[1]).is_merged() && !t.get(ids[0]).is_merged());
        assert_eq!(t.members(ids[1]).collect::<Vec<_>>(), ids[1..4].to_vec());
        assert_eq!(t.members(ids[0]).collect::<Vec<_>>(), vec![ids[0]]);
        assert_eq!(t.get(ids[1]).io_iovs().len(), 3);
        assert_eq!(t.io_len(ids[1]), 512 * (2 + 3 + 4));
        for id in ids {
            t.release(id);
        }
        assert_eq!(t.in_use(), 0);
        // A reused slot starts unlinked.
        let id = t.alloc().unwrap();
        assert!(!t.get(id).is_merged());
        assert!(t.lookup(99).is_none());
        // A snapshot waits for the requests in flight then, not for later ones in their slots.
        let b = t.alloc().unwrap();
        let snap = t.snapshot();
        assert_eq!(snap.len(), 2);
        assert!(!t.all_done(&snap));
        t.release(id);
        assert!(!t.all_done(&snap));
        t.release(b);
        let again = t.alloc().unwrap();
        assert!(t.all_done(&snap), "slot {again} is a later request");
    }

    #[test]
    fn segments_map_across_regions_and_refuse_holes() {
        let mem = GuestMemory::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x4000), 0x1000),
        ])
        .unwrap();
        let mut out = Vec::new();
        let seg = |addr, len| Segment {
            addr: GuestAddress(addr),
            len,
        };
        assert!(map_segments(&mem, &[seg(0x800, 0x1000)], &mut out));
        assert_eq!(out.len(), 2, "split at the region boundary");
        assert_eq!(out.iter().map(|v| v.iov_len).sum::<usize>(), 0x1000);
        assert!(map_segments(
            &mem,
            &[seg(0x4000, 0x200), seg(0x0, 0x200)],
            &mut out
        ));
        assert_eq!(out.len(), 2);
        assert!(
            !map_segments(&mem, &[seg(0x1800, 0x1000)], &mut out),
            "runs into a hole"
        );
        assert!(
            !map_segments(&mem, &[seg(0x5000, 1)], &mut out),
            "outside memory"
        );
        let many: Vec<_> = (0..IOV_MAX as u64 + 1).map(|i| seg(i, 1)).collect();
        assert!(
            !map_segments(&mem, &many, &mut out),
            "more than IOV_MAX iovecs"
        );
    }
}
