//! Walking a descriptor chain from a given head.
//!
//! `virtio_queue` walks the chains it pops from the avail ring, but it builds a walk only for
//! the head at the ring's next position, and reads each descriptor through vm-memory's address
//! translation. The I/O thread walks chains itself: from the head it pops, from heads in flight
//! when a previous backend died (resubmission), and from the queue's own descriptor table at
//! its host address ([`HostTable`], translated once per memory table). This walker follows
//! `virtio_queue`'s rules (the `parse_request` fuzz target checks it against `virtio_queue` on
//! every chain): at most `queue_size` descriptors (a loop ends the walk), one level of indirect
//! table whose length is a multiple of 16 bytes, at most 2^32 bytes in all, and the walk stops
//! at the first descriptor it cannot read. A walk that stops early leaves its last descriptor
//! with the NEXT flag set, which `blk::parse` treats as a truncated chain.

use std::ptr::NonNull;

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

/// A queue's descriptor table at its host address: its descriptors are read without
/// vm-memory's translation. (Indirect tables, which the guest places anywhere, are read through
/// vm-memory.)
#[derive(Debug, Clone, Copy)]
pub struct HostTable {
    ptr: NonNull<u8>,
    len: u16,
}

impl HostTable {
    /// The table of `len` descriptors at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be 8-aligned and point to `len * 16` bytes of memory that stays mapped and
    /// readable for as long as this value, and every walker given it, is used.
    pub unsafe fn new(ptr: NonNull<u8>, len: u16) -> HostTable {
        HostTable { ptr, len }
    }

    /// Asks the CPU to start loading descriptor `i` and the two after it (a chain as a driver
    /// usually lays it out: header, data, status), so that a walk of it soon after finds them
    /// in cache: the guest wrote them on another CPU. A hint only; nothing is read.
    #[inline]
    pub fn prefetch(&self, i: u16) {
        if i >= self.len {
            return;
        }
        let at = self.ptr.as_ptr().wrapping_add(usize::from(i) * 16);
        prefetch_line(at);
        // The chain's third descriptor ends 48 bytes on: it may lie in the next line.
        prefetch_line(at.wrapping_add(47));
    }

    /// Descriptor `i`, if the table has it. The guest may be writing it meanwhile (a driver
    /// that breaks the rules): the copy is taken once, and only the copy is checked and used.
    fn get(&self, i: u16) -> Option<Descriptor> {
        if i >= self.len {
            return None;
        }
        // SAFETY: `i < len`, so the 16 bytes are within the table, which the constructor's
        // contract keeps mapped; 8-aligned, as the table. Volatile: guest memory.
        let [a, b] = unsafe {
            self.ptr
                .add(usize::from(i) * 16)
                .cast::<[u64; 2]>()
                .read_volatile()
        };
        // The layout: addr (u64), len (u32), flags (u16), next (u16), little-endian.
        let (addr, rest) = (u64::from_le(a), u64::from_le(b));
        Some(Descriptor::new(
            addr,
            rest as u32,
            (rest >> 32) as u16,
            (rest >> 48) as u16,
        ))
    }
}

/// Starts loading the cache line of `p` (x86-64; elsewhere nothing). A prefetch reads no
/// memory the program sees and cannot fault, whatever `p` is.
#[inline(always)]
fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: PREFETCHT0 is a hint: it never faults and changes nothing visible, so any
        // address is fine (SSE, which it needs, is part of x86-64).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Iterator over the descriptors of the chain starting at `head`.
pub struct ChainWalker<'a, M: ?Sized> {
    mem: &'a M,
    table: GuestAddress,
    /// The queue's table at its host address, while the walk is in it (not in an indirect
    /// table).
    host: Option<HostTable>,
    table_len: u16,
    next: u16,
    ttl: u16,
    indirect: bool,
    bytes: u32,
}

impl<'a, M: GuestMemory + ?Sized> ChainWalker<'a, M> {
    /// A walk of the chain at `head` in the descriptor table at `table` of `queue_size` entries.
    pub fn new(mem: &'a M, table: GuestAddress, queue_size: u16, head: u16) -> Self {
        ChainWalker {
            mem,
            table,
            host: None,
            table_len: queue_size,
            next: head,
            ttl: queue_size,
            indirect: false,
            bytes: 0,
        }
    }

    /// The same walk, reading the queue's table at its host address `host` (which must be the
    /// table at `table` with `queue_size` entries).
    pub fn with_host_table(mut self, host: Option<HostTable>) -> Self {
        self.host = host.filter(|h| h.len == self.table_len);
        self
    }
}

impl<M: GuestMemory + ?Sized> Iterator for ChainWalker<'_, M> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        if self.ttl == 0 || self.next >= self.table_len {
            return None;
        }
        let desc: Descriptor = match &self.host {
            Some(host) => host.get(self.next)?,
            None => {
                let addr = self.table.checked_add(u64::from(self.next) * 16)?;
                self.mem.read_obj(addr).ok()?
            }
        };
        if desc.refers_to_indirect_table() {
            // VIRTIO 2.7.5.3.1: no nested indirect tables; the table is whole descriptors.
            let len = desc.len();
            if self.indirect
                || len == 0
                || !len.is_multiple_of(16)
                || len / 16 > u32::from(u16::MAX)
            {
                self.ttl = 0;
                return None;
            }
            self.indirect = true;
            self.host = None;
            self.table = desc.addr();
            self.table_len = (len / 16) as u16;
            self.ttl = self.table_len;
            self.next = 0;
            return self.next();
        }
        self.bytes = match self.bytes.checked_add(desc.len()) {
            Some(b) => b,
            None => {
                self.ttl = 0;
                return None;
            }
        };
        if desc.has_next() {
            self.next = desc.next();
            self.ttl -= 1;
        } else {
            self.ttl = 0;
        }
        Some(desc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };
    use vm_memory::GuestMemoryMmap;

    const N: u16 = VRING_DESC_F_NEXT as u16;
    const W: u16 = VRING_DESC_F_WRITE as u16;
    const I: u16 = VRING_DESC_F_INDIRECT as u16;

    fn put(m: &GuestMemoryMmap, table: u64, i: u16, d: Descriptor) {
        m.write_obj(d, GuestAddress(table + 16 * u64::from(i)))
            .unwrap();
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()
    }

    /// The chain at `head` of the table of `len` entries at `table`, walked through vm-memory
    /// and through the table's host address, which must agree.
    fn walk(m: &GuestMemoryMmap, table: u64, len: u16, head: u16) -> Vec<Descriptor> {
        use vm_memory::GuestMemoryBackend;
        let fields = |d: &Descriptor| (d.addr(), d.len(), d.flags(), d.next());
        let through_mem: Vec<_> = ChainWalker::new(m, GuestAddress(table), len, head).collect();
        let ptr = NonNull::new(m.get_host_address(GuestAddress(table)).unwrap()).unwrap();
        // SAFETY: the table lies in `m`'s one region, page-aligned, which outlives the walk.
        let host = unsafe { HostTable::new(ptr, len) };
        let through_host: Vec<_> = ChainWalker::new(m, GuestAddress(table), len, head)
            .with_host_table(Some(host))
            .collect();
        assert_eq!(
            through_mem.iter().map(fields).collect::<Vec<_>>(),
            through_host.iter().map(fields).collect::<Vec<_>>(),
            "the host table's walk differs"
        );
        through_host
    }

    #[test]
    fn direct_chain() {
        let m = mem();
        put(&m, 0, 2, Descriptor::new(0x1000, 16, N, 5));
        put(&m, 0, 5, Descriptor::new(0x2000, 512, W | N, 7));
        put(&m, 0, 7, Descriptor::new(0x3000, 1, W, 0));
        let v: Vec<_> = walk(&m, 0, 8, 2);
        assert_eq!(v.len(), 3);
        assert_eq!(v[2].addr(), GuestAddress(0x3000));
        assert!(!v[2].has_next());
        assert_eq!(walk(&m, 0, 8, 8).len(), 0);
    }

    #[test]
    fn loops_end_with_next_set() {
        let m = mem();
        put(&m, 0, 0, Descriptor::new(0x1000, 16, N, 1));
        put(&m, 0, 1, Descriptor::new(0x2000, 16, N, 0));
        let v: Vec<_> = walk(&m, 0, 4, 0);
        assert_eq!(v.len(), 4);
        assert!(v.last().unwrap().has_next());
    }

    #[test]
    fn indirect_once() {
        let m = mem();
        put(&m, 0, 0, Descriptor::new(0x800, 48, I, 0));
        put(&m, 0x800, 0, Descriptor::new(0x1000, 16, N, 1));
        put(&m, 0x800, 1, Descriptor::new(0x2000, 512, W | N, 2));
        put(&m, 0x800, 2, Descriptor::new(0x3000, 1, W, 0));
        assert_eq!(walk(&m, 0, 4, 0).len(), 3);
        // Nested indirect and a table outside memory stop the walk.
        put(&m, 0x800, 1, Descriptor::new(0x900, 16, I, 0));
        assert_eq!(walk(&m, 0, 4, 0).len(), 1);
        put(&m, 0, 0, Descriptor::new(0xfff_0000, 48, I, 0));
        assert_eq!(walk(&m, 0, 4, 0).len(), 0);
    }
}
