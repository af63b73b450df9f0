//! The buffers a metadata worker's copy-on-writes build new clusters in: slots of one region,
//! which the worker's ring has registered, so that neither the read of a cluster's rest nor the
//! write of the whole cluster pins its pages again (`gup_fast` took 9% of the daemon's CPU on
//! allocating writes, docs/PERFORMANCE.md 13i), and no copy-on-write allocates.
//!
//! The region belongs to its worker thread ([`install`]); a thread without one (a unit test)
//! and a copy-on-write that finds every slot taken get a buffer of their own.

use std::cell::RefCell;
use std::ptr::NonNull;

use imago::io_buffers::IoBuffer;

/// The most bytes of a worker's region: a slot for each job it runs at once up to 64 KiB
/// clusters, fewer slots for larger ones (one at 2 MiB).
const REGION_BYTES: usize = 2 << 20;

/// The region's size for a worker that runs `jobs` at once on an image of `cluster`-byte
/// clusters: a slot each, within [`REGION_BYTES`], and at least one.
pub fn region_bytes(jobs: usize, cluster: usize) -> usize {
    (jobs * cluster).min(REGION_BYTES).max(cluster)
}

/// Zeroed memory aligned for direct I/O (imago's buffer, which starts uninitialised).
pub struct Region(IoBuffer);

impl Region {
    /// `len` bytes aligned to `align` (a power of two), zeroed.
    pub fn new(len: usize, align: usize) -> Option<Region> {
        let mut buf = IoBuffer::new(len.max(1), align).ok()?;
        buf.as_mut().into_slice().fill(0);
        Some(Region(buf))
    }

    /// The region as an iovec (to register it with a ring).
    pub fn iovec(&mut self) -> libc::iovec {
        let bytes = self.0.as_mut().into_slice();
        libc::iovec {
            iov_base: bytes.as_mut_ptr().cast(),
            iov_len: bytes.len(),
        }
    }

    /// Where it starts, for writes through slots (the memory does not move with the region).
    fn start(&mut self) -> NonNull<u8> {
        NonNull::new(self.0.as_mut().into_slice().as_mut_ptr()).expect("a buffer of 1 byte or more")
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// A worker's region cut into cluster-sized slots, and which are free.
struct Slots {
    /// Owns the memory `start` points into.
    _region: Region,
    start: NonNull<u8>,
    size: usize,
    free: Vec<usize>,
}

thread_local! {
    static SLOTS: RefCell<Option<Slots>> = const { RefCell::new(None) };
}

/// Makes `region` this thread's, cut into slots of `cluster` bytes.
pub fn install(mut region: Region, cluster: usize) {
    let count = region.len() / cluster.max(1);
    SLOTS.set(Some(Slots {
        start: region.start(),
        _region: region,
        size: cluster,
        free: (0..count).rev().collect(),
    }));
}

/// A buffer of one cluster: a slot of the thread's region, given back when dropped, or memory
/// of its own.
pub struct ClusterBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// The slot's index, if it is one.
    slot: Option<usize>,
    /// Its own memory, if it is not.
    _own: Option<Region>,
}

impl ClusterBuffer {
    /// A buffer of `size` bytes aligned to `align` (a slot when one is free and fits).
    pub fn take(size: usize, align: usize) -> Option<ClusterBuffer> {
        let slot = SLOTS.with_borrow_mut(|slots| {
            let slots = slots.as_mut()?;
            let fits = slots.size == size
                && (slots.start.as_ptr() as usize).is_multiple_of(align)
                && size.is_multiple_of(align);
            if !fits {
                return None;
            }
            let i = slots.free.pop()?;
            // SAFETY: slot `i` lies inside the region (`install` counted the whole slots).
            let ptr = unsafe { slots.start.add(i * size) };
            Some(ClusterBuffer {
                ptr,
                len: size,
                slot: Some(i),
                _own: None,
            })
        });
        if slot.is_some() {
            return slot;
        }
        let mut own = Region::new(size, align)?;
        Some(ClusterBuffer {
            ptr: own.start(),
            len: size,
            slot: None,
            _own: Some(own),
        })
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes at `ptr` are this buffer's alone (a slot is handed out once until
        // it comes back), initialised (zeroed at the start) and valid while it lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for ClusterBuffer {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            SLOTS.with_borrow_mut(|slots| {
                if let Some(slots) = slots {
                    slots.free.push(i);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_holds_a_slot_per_job_up_to_its_bound_and_one_cluster_at_least() {
        assert_eq!(region_bytes(32, 64 << 10), 2 << 20);
        assert_eq!(region_bytes(32, 512), 16 << 10);
        assert_eq!(region_bytes(32, 1 << 20), 2 << 20);
        assert_eq!(region_bytes(32, 4 << 20), 4 << 20);
    }

    /// Slots are handed out once until they come back; past the last one, and for another
    /// size, a buffer has memory of its own.
    #[test]
    fn a_slot_is_lent_once_until_it_comes_back() {
        let mut region = Region::new(4 * 4096, 4096).unwrap();
        let start = region.iovec().iov_base as usize;
        let end = start + 4 * 4096;
        install(region, 4096);
        let inside = |b: &ClusterBuffer| (start..end).contains(&(b.bytes().as_ptr() as usize));
        let mut taken: Vec<_> = (0..5)
            .map(|_| ClusterBuffer::take(4096, 4096).unwrap())
            .collect();
        assert!(taken[..4].iter().all(inside));
        let mut at: Vec<_> = taken[..4]
            .iter()
            .map(|b| b.bytes().as_ptr() as usize)
            .collect();
        at.sort();
        at.dedup();
        assert_eq!(at.len(), 4, "four slots, each lent once");
        assert!(!inside(&taken[4]), "the fifth has its own memory");
        assert!(!inside(&ClusterBuffer::take(8192, 4096).unwrap()));
        taken[1].bytes_mut().fill(7);
        let back = taken.remove(1).bytes().as_ptr() as usize;
        let again = ClusterBuffer::take(4096, 4096).unwrap();
        assert_eq!(again.bytes().as_ptr() as usize, back, "the slot given back");
        SLOTS.set(None);
    }
}
