//! A started queue's rings at host addresses, translated once per memory table instead of at
//! every access: the avail index and entries, `used_event`, the used ring and its index, and
//! the descriptor table.
//!
//! For every request the I/O thread reads the avail index (at every poll, too) and an avail
//! entry, walks the request's descriptors, writes a used entry and the used index and (with
//! EVENT_IDX) reads `used_event`. Through vm-memory each of those finds the guest address's
//! region and builds a volatile slice: in the I/O thread's profile (null engine, 1 job,
//! docs/PERFORMANCE.md section 12c) address translation took 21% and the avail index loads
//! 15%. Here each is one atomic access or one 16-byte copy.
//!
//! Only the rings are translated once. Indirect tables, a request's header and status byte
//! (`blk::guest_bytes`) and its buffers (`slots::map_segments`) are looked up in the memory
//! table at each request. A queue whose rings do not each lie within one region gets no view,
//! and keeps the vm-memory path.
//!
//! The guest writes the avail ring while the thread reads it, and reads the used ring while
//! the thread writes it: every access is atomic, with the orderings virtio-queue uses for the
//! same fields (the avail index acquired, the used index released after its entry).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use super::GuestMemory;
use crate::blk::chain::HostTable;
use crate::blk::guest_bytes;

/// Bytes before the avail ring's entries (flags, idx), and per entry.
const AVAIL_HEADER: u64 = 4;
const AVAIL_ENTRY: u64 = 2;
/// Bytes before the used ring's entries (flags, idx), and per entry (id, len).
const USED_HEADER: u64 = 4;
const USED_ENTRY: u64 = 8;
/// Bytes per descriptor.
const DESCRIPTOR: u64 = 16;

/// Where `used_event` lies in the avail ring of a queue of `size` entries: after them.
pub fn used_event_offset(size: u16) -> u64 {
    AVAIL_HEADER + AVAIL_ENTRY * u64::from(size)
}

/// Host pointers to the fields of one queue's rings that the I/O thread touches per request.
///
/// Valid while the memory table it was made from is: the I/O thread remakes it whenever it
/// takes another table (and drops it with the queue), and only uses it with the table it
/// holds. A frontend cannot take the mapping away meanwhile: the mapping is the daemon's, and
/// its file is sealed against shrinking or fault-guarded (`crate::shm`).
pub struct RingView {
    /// The avail ring's `idx`.
    avail_idx: NonNull<AtomicU16>,
    /// The avail ring's first entry (`size` little-endian u16 heads).
    avail_entries: NonNull<AtomicU16>,
    /// `used_event`, after the avail ring's entries (read only with EVENT_IDX).
    used_event: NonNull<AtomicU16>,
    /// The used ring's `idx`.
    used_idx: NonNull<AtomicU16>,
    /// The used ring's first entry: `size` pairs of little-endian u32 (id, len).
    used_entries: NonNull<AtomicU32>,
    /// The descriptor table.
    descriptors: HostTable,
    size: u16,
}

impl RingView {
    /// The view of `queue`'s rings in `mem`, or None if either ring does not lie in one
    /// region of it or is misaligned (the queue then keeps vm-memory's path).
    pub fn new(queue: &Queue, mem: &GuestMemory) -> Option<RingView> {
        let size = queue.size();
        if size == 0 {
            return None;
        }
        // The avail ring with used_event after its entries; the used ring with avail_event.
        let avail_len = used_event_offset(size) + 2;
        let used_len = USED_HEADER + USED_ENTRY * u64::from(size) + 2;
        let avail = host_range(mem, queue.avail_ring(), avail_len, 2)?;
        let used = host_range(mem, queue.used_ring(), used_len, 4)?;
        let table = host_range(mem, queue.desc_table(), DESCRIPTOR * u64::from(size), 16)?;
        // SAFETY: each offset is within the range just checked to be mapped (`host_range`),
        // and keeps the alignment checked there (2 for the avail ring, 4 for the used ring, 16
        // for the table); the mapping outlives the view (the type's comment).
        unsafe {
            Some(RingView {
                avail_idx: avail.byte_add(2).cast(),
                avail_entries: avail.byte_add(AVAIL_HEADER as usize).cast(),
                used_event: avail.byte_add(used_event_offset(size) as usize).cast(),
                used_idx: used.byte_add(2).cast(),
                used_entries: used.byte_add(USED_HEADER as usize).cast(),
                descriptors: HostTable::new(table, size),
                size,
            })
        }
    }

    fn field(&self, p: NonNull<AtomicU16>) -> &AtomicU16 {
        // SAFETY: `p` is one of this view's fields: a 2-aligned pointer into a mapping that
        // outlives the view (see the type's comment).
        unsafe { p.as_ref() }
    }

    /// The avail index the guest published (acquire: the entries before it are visible).
    #[inline]
    pub fn avail_idx(&self) -> u16 {
        u16::from_le(self.field(self.avail_idx).load(Ordering::Acquire))
    }

    /// The head the guest put at position `at` of the avail ring (its validity is the
    /// walk's to check). Acquire, as virtio-queue reads it.
    #[inline]
    pub fn avail_entry(&self, at: u16) -> u16 {
        // SAFETY: `at % size < size`: within the avail ring's entries (checked mapped and
        // 2-aligned in `new`), which outlive the view.
        let entry = unsafe { self.avail_entries.add(usize::from(at % self.size)).as_ref() };
        u16::from_le(entry.load(Ordering::Acquire))
    }

    /// The descriptor table, for a chain walk.
    #[inline]
    pub fn descriptors(&self) -> HostTable {
        self.descriptors
    }

    /// The guest's `used_event` (EVENT_IDX).
    #[inline]
    pub fn used_event(&self) -> u16 {
        u16::from_le(self.field(self.used_event).load(Ordering::Relaxed))
    }

    /// Writes the used entry `(head, len)` at position `at` of the ring, then publishes `at + 1`
    /// as the used index (release: the guest sees the entry before the index).
    #[inline]
    pub fn put_used(&self, at: u16, head: u16, len: u32) {
        let slot = usize::from(at % self.size) * 2;
        // SAFETY: `slot + 1 < 2 * size`: both words are within the used ring's entries (checked
        // mapped and 4-aligned in `new`), which outlive the view.
        let (id, length) = unsafe {
            (
                self.used_entries.add(slot).as_ref(),
                self.used_entries.add(slot + 1).as_ref(),
            )
        };
        id.store(u32::from(head).to_le(), Ordering::Relaxed);
        length.store(len.to_le(), Ordering::Relaxed);
        self.field(self.used_idx)
            .store(at.wrapping_add(1).to_le(), Ordering::Release);
    }
}

/// The host address of guest bytes `addr..addr + len`, if they lie in one region of `mem` and
/// that address is `align`-aligned.
fn host_range(mem: &GuestMemory, addr: u64, len: u64, align: usize) -> Option<NonNull<u8>> {
    let len = usize::try_from(len).ok()?;
    NonNull::new(guest_bytes::host_range(mem, GuestAddress(addr), len)?)
        .filter(|p| p.as_ptr().addr() % align == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::Bytes;

    #[test]
    fn reads_and_writes_the_same_places_as_virtio_queue() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_000)]).unwrap();
        let mock = MockSplitQueue::new(&mem, 16);
        let mut q: Queue = mock.create_queue().unwrap();
        q.set_used_ring_address(Some(0x8000), Some(0));
        let view = RingView::new(&q, &mem).expect("rings in one region");

        mock.avail().idx().store(7);
        assert_eq!(view.avail_idx(), 7);
        mock.avail().ring().ref_at(3).unwrap().store(11);
        assert_eq!(
            view.avail_entry(3 + 16),
            11,
            "position 19 of 16 entries is entry 3"
        );
        assert_eq!(
            view.avail_idx(),
            q.avail_idx(&mem, Ordering::Acquire).unwrap().0
        );

        // The mock's rings are virtio-queue's own layout: used_event after 16 entries.
        let used_event = mock.avail_addr().0 + 4 + 2 * 16;
        mem.write_obj(0x1234u16, GuestAddress(used_event)).unwrap();
        assert_eq!(view.used_event(), 0x1234);

        // Position 17 wraps to entry 1 of 16.
        view.put_used(17, 5, 4097);
        let entry = 0x8000 + USED_HEADER + USED_ENTRY;
        assert_eq!(mem.read_obj::<u32>(GuestAddress(entry)).unwrap(), 5);
        assert_eq!(mem.read_obj::<u32>(GuestAddress(entry + 4)).unwrap(), 4097);
        assert_eq!(mem.read_obj::<u16>(GuestAddress(0x8002)).unwrap(), 18);
        // Nothing else of the ring was touched.
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(0x8000 + USED_HEADER))
                .unwrap(),
            0
        );
    }

    #[test]
    fn rings_across_regions_or_out_of_memory_get_no_view() {
        // Two regions that touch: the used ring starts 8 bytes before the second one.
        let mem = GuestMemory::from_ranges(&[
            (GuestAddress(0), 0x10_000),
            (GuestAddress(0x10_000), 0x10_000),
        ])
        .unwrap();
        let mock = MockSplitQueue::new(&mem, 16);
        let mut q: Queue = mock.create_queue().unwrap();
        q.set_used_ring_address(Some(0x8000), Some(0));
        assert!(RingView::new(&q, &mem).is_some());
        q.set_used_ring_address(Some(0x10_000 - 8), Some(0));
        assert!(RingView::new(&q, &mem).is_none(), "used ring spans regions");
        q.set_used_ring_address(Some(0x30_000), Some(0));
        assert!(RingView::new(&q, &mem).is_none(), "used ring out of memory");
    }
}
