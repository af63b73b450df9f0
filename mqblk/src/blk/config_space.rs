//! The virtio-blk configuration space (`struct virtio_blk_config`, VIRTIO 1.2 5.2.4) that
//! GET_CONFIG answers from.

use virtio_bindings::virtio_blk::virtio_blk_config;
use vm_memory::ByteValued;

/// Size of the configuration space: `struct virtio_blk_config` as of Linux 6.x, including
/// the secure-erase and zoned fields, which stay zero.
pub const CONFIG_SPACE_LEN: usize = std::mem::size_of::<virtio_blk_config>();
/// Offset of the `writeback` byte (VIRTIO_BLK_F_CONFIG_WCE), the only field a driver writes.
pub const CONFIG_WRITEBACK_OFFSET: usize = std::mem::offset_of!(virtio_blk_config, wce);

/// The configuration space, little-endian as the device presents it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(transparent)]
pub struct ConfigSpace(pub virtio_blk_config);

// SAFETY: `virtio_blk_config` is `repr(C, packed)` plain data (integers and arrays of them), so
// it has no padding and every bit pattern is a valid value; `ConfigSpace` is transparent over it.
unsafe impl ByteValued for ConfigSpace {}

/// What an export advertises, in host terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Most data segments per request.
    pub seg_max: u32,
    /// Logical block size in bytes (512 or 4096).
    pub blk_size: u32,
    /// Number of request queues.
    pub num_queues: u16,
    /// Most sectors per discard (0: not offered).
    pub max_discard_sectors: u32,
    /// Most sectors per write-zeroes (0: not offered).
    pub max_write_zeroes_sectors: u32,
    /// Whether a write-zeroes may deallocate.
    pub write_zeroes_may_unmap: bool,
}

impl ConfigSpace {
    /// The configuration space of a device with `g`, in write-back cache mode.
    pub fn new(g: &Geometry) -> Self {
        let c = virtio_blk_config {
            capacity: g.capacity_sectors.to_le(),
            seg_max: g.seg_max.to_le(),
            blk_size: g.blk_size.to_le(),
            // log2(physical block / logical block): 4 KiB physical blocks under 512-byte
            // logical ones, so that guests align their I/O to 4 KiB.
            physical_block_exp: if g.blk_size >= 4096 { 0 } else { 3 },
            min_io_size: 1u16.to_le(),
            wce: 1,
            num_queues: g.num_queues.to_le(),
            max_discard_sectors: g.max_discard_sectors.to_le(),
            max_discard_seg: 1u32.to_le(),
            discard_sector_alignment: (g.blk_size / 512).max(1).to_le(),
            max_write_zeroes_sectors: g.max_write_zeroes_sectors.to_le(),
            max_write_zeroes_seg: 1u32.to_le(),
            write_zeroes_may_unmap: u8::from(g.write_zeroes_may_unmap),
            ..Default::default()
        };
        ConfigSpace(c)
    }

    /// Sets the cache mode byte: 1 write-back (flush needed for durability), 0 write-through.
    pub fn set_writeback(&mut self, writeback: bool) {
        self.0.wce = u8::from(writeback);
    }

    /// Sets the capacity, in sectors (an online resize).
    pub fn set_capacity_sectors(&mut self, sectors: u64) {
        self.0.capacity = sectors.to_le();
    }

    /// Capacity in sectors.
    pub fn capacity_sectors(&self) -> u64 {
        u64::from_le(self.0.capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        assert_eq!(CONFIG_SPACE_LEN, 96);
        assert_eq!(CONFIG_WRITEBACK_OFFSET, 32);
        let mut c = ConfigSpace::new(&Geometry {
            capacity_sectors: 0x1122334455,
            seg_max: 254,
            blk_size: 512,
            num_queues: 4,
            max_discard_sectors: 1 << 20,
            max_write_zeroes_sectors: 1 << 20,
            write_zeroes_may_unmap: true,
        });
        c.set_writeback(false);
        let b = c.as_slice();
        assert_eq!(
            u64::from_le_bytes(b[0..8].try_into().unwrap()),
            0x1122334455
        );
        assert_eq!(u32::from_le_bytes(b[12..16].try_into().unwrap()), 254);
        assert_eq!(u32::from_le_bytes(b[20..24].try_into().unwrap()), 512);
        assert_eq!(b[24], 3);
        assert_eq!(b[32], 0);
        assert_eq!(u16::from_le_bytes(b[34..36].try_into().unwrap()), 4);
        assert_eq!(u32::from_le_bytes(b[36..40].try_into().unwrap()), 1 << 20);
        assert_eq!(u32::from_le_bytes(b[40..44].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(b[44..48].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(b[52..56].try_into().unwrap()), 1);
        assert_eq!(b[56], 1);
        assert_eq!(c.capacity_sectors(), 0x1122334455);
    }
}
