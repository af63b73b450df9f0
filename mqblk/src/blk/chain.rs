//! Walking a descriptor chain from a given head.
//!
//! The request path gets its chains from `virtio_queue` (which pops them from the avail ring).
//! Resubmitting in-flight requests after a reconnect needs the chain of a head that is not at
//! the avail ring's next position, which `virtio_queue` does not expose, so this walker follows
//! the same rules: at most `queue_size` descriptors (a loop ends the walk), one level of indirect
//! table whose length is a multiple of 16 bytes, at most 2^32 bytes in all, and the walk stops
//! at the first descriptor it cannot read. A walk that stops early leaves its last descriptor
//! with the NEXT flag set, which `blk::parse` treats as a truncated chain.

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

/// Iterator over the descriptors of the chain starting at `head`.
pub struct ChainWalker<'a, M: ?Sized> {
    mem: &'a M,
    table: GuestAddress,
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
            table_len: queue_size,
            next: head,
            ttl: queue_size,
            indirect: false,
            bytes: 0,
        }
    }
}

impl<M: GuestMemory + ?Sized> Iterator for ChainWalker<'_, M> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        if self.ttl == 0 || self.next >= self.table_len {
            return None;
        }
        let addr = self.table.checked_add(u64::from(self.next) * 16)?;
        let desc: Descriptor = self.mem.read_obj(addr).ok()?;
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

    #[test]
    fn direct_chain() {
        let m = mem();
        put(&m, 0, 2, Descriptor::new(0x1000, 16, N, 5));
        put(&m, 0, 5, Descriptor::new(0x2000, 512, W | N, 7));
        put(&m, 0, 7, Descriptor::new(0x3000, 1, W, 0));
        let v: Vec<_> = ChainWalker::new(&m, GuestAddress(0), 8, 2).collect();
        assert_eq!(v.len(), 3);
        assert_eq!(v[2].addr(), GuestAddress(0x3000));
        assert!(!v[2].has_next());
        assert_eq!(ChainWalker::new(&m, GuestAddress(0), 8, 8).count(), 0);
    }

    #[test]
    fn loops_end_with_next_set() {
        let m = mem();
        put(&m, 0, 0, Descriptor::new(0x1000, 16, N, 1));
        put(&m, 0, 1, Descriptor::new(0x2000, 16, N, 0));
        let v: Vec<_> = ChainWalker::new(&m, GuestAddress(0), 4, 0).collect();
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
        assert_eq!(ChainWalker::new(&m, GuestAddress(0), 4, 0).count(), 3);
        // Nested indirect and a table outside memory stop the walk.
        put(&m, 0x800, 1, Descriptor::new(0x900, 16, I, 0));
        assert_eq!(ChainWalker::new(&m, GuestAddress(0), 4, 0).count(), 1);
        put(&m, 0, 0, Descriptor::new(0xfff_0000, 48, I, 0));
        assert_eq!(ChainWalker::new(&m, GuestAddress(0), 4, 0).count(), 0);
    }
}
