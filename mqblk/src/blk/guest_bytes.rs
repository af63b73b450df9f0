//! The request path's small accesses to guest memory (a request's header, its status byte):
//! one region lookup and one volatile access when the bytes lie in one region, as they nearly
//! always do; vm-memory's general path when they do not.
//!
//! vm-memory's `read_slice` and `write_obj` build a slice iterator and a copy loop for a range
//! of any size and shape: for 16 bytes or 1, that machinery was about 9% of an I/O thread
//! serving a polling client (docs/PERFORMANCE.md section 12d).
//!
//! The guest may write these bytes meanwhile (a driver that breaks the rules): every access is
//! volatile, and only the copy read is checked and used. Writes here bypass any dirty bitmap
//! of vm-memory's; mqblk's memory has none (its dirty log is marked by the I/O thread, which
//! marks the status byte itself).

use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

/// The host address of guest bytes `addr..addr + len`, if they lie in one region.
#[inline]
pub fn host_range<M: GuestMemoryBackend + ?Sized>(
    mem: &M,
    addr: GuestAddress,
    len: usize,
) -> Option<*mut u8> {
    let (region, offset) = mem.to_region_addr(addr)?;
    let end = offset.raw_value().checked_add(len as u64)?;
    if end > region.len() {
        return None;
    }
    region.get_host_address(offset).ok()
}

/// Reads `buf.len()` guest bytes at `addr`; false if they are not all guest memory.
#[inline]
pub fn read<M: GuestMemoryBackend + ?Sized>(mem: &M, addr: GuestAddress, buf: &mut [u8]) -> bool {
    let Some(p) = host_range(mem, addr, buf.len()) else {
        return mem.read_slice(buf, addr).is_ok();
    };
    if let Ok(whole) = <&mut [u8; 16]>::try_from(&mut *buf) {
        // SAFETY: `p` points to 16 bytes of one mapped region (`host_range`), which the
        // caller's `mem` keeps mapped; `[u8; 16]` needs no alignment.
        *whole = unsafe { p.cast::<[u8; 16]>().read_volatile() };
        return true;
    }
    for (i, b) in buf.iter_mut().enumerate() {
        // SAFETY: `i < buf.len()`: within the range `host_range` found mapped.
        *b = unsafe { p.add(i).read_volatile() };
    }
    true
}

/// Writes one byte of guest memory at `addr`; false if it is not guest memory.
#[inline]
pub fn write_byte<M: GuestMemoryBackend + ?Sized>(mem: &M, addr: GuestAddress, value: u8) -> bool {
    match host_range(mem, addr, 1) {
        Some(p) => {
            // SAFETY: one byte of a mapped region (`host_range`), kept mapped by `mem`.
            unsafe { p.write_volatile(value) };
            true
        }
        None => mem.write_obj(value, addr).is_ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    #[test]
    fn reads_and_writes_within_a_region_across_regions_and_outside() {
        // Two touching regions, then a hole.
        let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
        ])
        .unwrap();
        let bytes: Vec<u8> = (0..32).collect();
        mem.write_slice(&bytes, GuestAddress(0xff0)).unwrap();

        let mut header = [0u8; 16];
        assert!(
            read(&mem, GuestAddress(0xff0), &mut header),
            "within the first region"
        );
        assert_eq!(header[..], bytes[..16]);
        assert!(
            read(&mem, GuestAddress(0xff8), &mut header),
            "across the two regions"
        );
        assert_eq!(header[..], bytes[8..24]);
        let mut five = [0u8; 5];
        assert!(read(&mem, GuestAddress(0x1002), &mut five));
        assert_eq!(five[..], bytes[18..23]);
        assert!(
            !read(&mem, GuestAddress(0x1ff8), &mut header),
            "runs into the hole"
        );
        assert!(
            !read(&mem, GuestAddress(u64::MAX - 3), &mut header),
            "wraps around"
        );

        assert!(write_byte(&mem, GuestAddress(0x1fff), 0xab));
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0x1fff)).unwrap(), 0xab);
        assert!(!write_byte(&mem, GuestAddress(0x2000), 1));
    }
}
