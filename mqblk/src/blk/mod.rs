//! virtio-blk: request parsing and validation, and the device's configuration space.
//! Nothing here does I/O; everything here is fuzzed and unit-tested.

pub mod chain;
pub mod request;

pub use request::{parse, Kind, Limits, Rejected, Request, Scratch, Segment, Status};

/// Size of the configuration space we answer GET_CONFIG from (`struct virtio_blk_config` as of
/// Linux 6.x, including the secure-erase and zoned fields, which we leave zero).
pub const CONFIG_SPACE_LEN: usize = 96;
/// Offset of the `writeback` byte (VIRTIO_BLK_F_CONFIG_WCE).
pub const CONFIG_WRITEBACK_OFFSET: usize = 32;

/// The values the configuration space advertises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlkConfig {
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Most data segments per request.
    pub seg_max: u32,
    /// Logical block size in bytes.
    pub blk_size: u32,
    /// log2(physical block size / logical block size).
    pub physical_block_exp: u8,
    /// Minimum I/O size in logical blocks.
    pub min_io_size: u16,
    /// Optimal I/O size in logical blocks.
    pub opt_io_size: u32,
    /// 1: write-back cache (flush needed for durability); 0: write-through.
    pub writeback: u8,
    /// Number of request queues.
    pub num_queues: u16,
    /// Most sectors per discard.
    pub max_discard_sectors: u32,
    /// Discard alignment in sectors.
    pub discard_sector_alignment: u32,
    /// Most sectors per write-zeroes.
    pub max_write_zeroes_sectors: u32,
}

impl BlkConfig {
    /// Serialises to the little-endian `struct virtio_blk_config` layout.
    pub fn to_bytes(&self) -> [u8; CONFIG_SPACE_LEN] {
        let mut b = [0u8; CONFIG_SPACE_LEN];
        b[0..8].copy_from_slice(&self.capacity_sectors.to_le_bytes());
        // size_max (8..12) not advertised.
        b[12..16].copy_from_slice(&self.seg_max.to_le_bytes());
        // geometry (16..20) not advertised.
        b[20..24].copy_from_slice(&self.blk_size.to_le_bytes());
        b[24] = self.physical_block_exp;
        b[25] = 0; // alignment_offset
        b[26..28].copy_from_slice(&self.min_io_size.to_le_bytes());
        b[28..32].copy_from_slice(&self.opt_io_size.to_le_bytes());
        b[CONFIG_WRITEBACK_OFFSET] = self.writeback;
        b[34..36].copy_from_slice(&self.num_queues.to_le_bytes());
        b[36..40].copy_from_slice(&self.max_discard_sectors.to_le_bytes());
        b[40..44].copy_from_slice(&1u32.to_le_bytes()); // max_discard_seg
        b[44..48].copy_from_slice(&self.discard_sector_alignment.to_le_bytes());
        b[48..52].copy_from_slice(&self.max_write_zeroes_sectors.to_le_bytes());
        b[52..56].copy_from_slice(&1u32.to_le_bytes()); // max_write_zeroes_seg
        b[56] = 1; // write_zeroes_may_unmap
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_layout() {
        let c = BlkConfig {
            capacity_sectors: 0x1122334455,
            seg_max: 254,
            blk_size: 512,
            physical_block_exp: 3,
            min_io_size: 1,
            opt_io_size: 0,
            writeback: 1,
            num_queues: 4,
            max_discard_sectors: 1 << 20,
            discard_sector_alignment: 8,
            max_write_zeroes_sectors: 1 << 20,
        };
        let b = c.to_bytes();
        assert_eq!(
            u64::from_le_bytes(b[0..8].try_into().unwrap()),
            0x1122334455
        );
        assert_eq!(u32::from_le_bytes(b[12..16].try_into().unwrap()), 254);
        assert_eq!(u32::from_le_bytes(b[20..24].try_into().unwrap()), 512);
        assert_eq!(b[24], 3);
        assert_eq!(b[32], 1);
        assert_eq!(u16::from_le_bytes(b[34..36].try_into().unwrap()), 4);
        assert_eq!(u32::from_le_bytes(b[40..44].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(b[52..56].try_into().unwrap()), 1);
        assert_eq!(b[56], 1);
    }
}
