//! NVMe commands as mqblk builds them: the I/O commands a request becomes (NVM Command Set
//! 1.0, section 3) in the layout the Linux NVMe driver takes through io_uring passthrough
//! (`struct nvme_uring_cmd`, `<linux/nvme_ioctl.h>`), and the LBA arithmetic they need.
//!
//! Everything here is pure: the bytes are checked against hand-computed ones in the tests.

/// `NVME_URING_CMD_IO`, `_IOWR('N', 0x80, struct nvme_uring_cmd)`: one data buffer.
pub const URING_CMD_IO: u32 = ioc_readwrite(0x80, UringCmd::SIZE);
/// `NVME_URING_CMD_IO_VEC`, `_IOWR('N', 0x81, struct nvme_uring_cmd)`: an iovec array (the
/// driver builds the PRP list or SGL itself).
pub const URING_CMD_IO_VEC: u32 = ioc_readwrite(0x81, UringCmd::SIZE);

/// `_IOWR('N', nr, size)`: read and write (3 << 30), the size, type 'N', the number.
const fn ioc_readwrite(nr: u32, size: usize) -> u32 {
    3 << 30 | (size as u32) << 16 | (b'N' as u32) << 8 | nr
}

/// NVM command set opcodes mqblk sends.
pub mod opcode {
    /// Flush the volatile write cache.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management (deallocate).
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// Command dword 12 of a read or write: Force Unit Access (the data is on media when the
/// command completes, cache or not).
const CDW12_FUA: u32 = 1 << 30;
/// Command dword 12 of a Write Zeroes: Deallocate (the blocks may be deallocated, and then
/// read as zeros where the namespace says so).
const CDW12_DEAC: u32 = 1 << 25;
/// Command dword 11 of a Dataset Management: Attribute - Deallocate.
const CDW11_AD: u32 = 1 << 2;

/// Most logical blocks one read, write or Write Zeroes covers: its block count is a 16-bit
/// field holding the count minus one.
pub const MAX_BLOCKS_PER_COMMAND: u64 = 1 << 16;

/// `struct nvme_uring_cmd`: the 72 bytes the driver reads from a passthrough entry's command
/// area.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UringCmd {
    /// Command opcode.
    pub opcode: u8,
    /// Command flags (none used).
    pub flags: u8,
    /// Namespace.
    pub nsid: u32,
    /// Metadata buffer (none: metadata formats are refused at open).
    pub metadata: u64,
    /// The data buffer, or (`URING_CMD_IO_VEC`) the iovec array.
    pub addr: u64,
    /// Metadata length.
    pub metadata_len: u32,
    /// The data length in bytes, or (`URING_CMD_IO_VEC`) the number of iovecs.
    pub data_len: u32,
    /// Command dwords 10 to 15.
    pub cdw: [u32; 6],
    /// Timeout (0: the driver's default).
    pub timeout_ms: u32,
}

impl UringCmd {
    /// Bytes of `struct nvme_uring_cmd`.
    pub const SIZE: usize = 72;

    /// The command area of an io_uring passthrough entry (80 bytes; the driver reads the first
    /// 72), little-endian as the driver's structure is on every host Linux runs NVMe on.
    pub fn to_bytes(&self) -> [u8; 80] {
        let mut b = [0u8; 80];
        b[0] = self.opcode;
        b[1] = self.flags;
        // 2..4: rsvd1.
        b[4..8].copy_from_slice(&self.nsid.to_le_bytes());
        // 8..16: cdw2, cdw3.
        b[16..24].copy_from_slice(&self.metadata.to_le_bytes());
        b[24..32].copy_from_slice(&self.addr.to_le_bytes());
        b[32..36].copy_from_slice(&self.metadata_len.to_le_bytes());
        b[36..40].copy_from_slice(&self.data_len.to_le_bytes());
        for (i, dw) in self.cdw.iter().enumerate() {
            b[40 + 4 * i..44 + 4 * i].copy_from_slice(&dw.to_le_bytes());
        }
        b[64..68].copy_from_slice(&self.timeout_ms.to_le_bytes());
        // 68..72: rsvd2.
        b
    }
}

/// A byte range that is not a whole number of logical blocks, or is too long for one command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{bytes} bytes at offset {offset} are not whole {block_size}-byte blocks, or too many for one command")]
pub struct BadRange {
    /// Byte offset.
    pub offset: u64,
    /// Byte length.
    pub bytes: u64,
    /// The namespace's logical block size.
    pub block_size: u64,
}

/// A byte range as `(starting LBA, number of blocks)` on a namespace with `1 << lba_shift`
/// byte blocks: whole blocks only, at least one, at most `max_blocks`.
pub fn lba_range(
    offset: u64,
    bytes: u64,
    lba_shift: u32,
    max_blocks: u64,
) -> Result<(u64, u64), BadRange> {
    let block = 1u64 << lba_shift;
    let bad = BadRange {
        offset,
        bytes,
        block_size: block,
    };
    if !offset.is_multiple_of(block) || !bytes.is_multiple_of(block) || bytes == 0 {
        return Err(bad);
    }
    let blocks = bytes >> lba_shift;
    if blocks > max_blocks {
        return Err(bad);
    }
    Ok((offset >> lba_shift, blocks))
}

/// The dwords 10, 11 (starting LBA) and 12 (block count minus one, in bits 15:0) of a read,
/// write or Write Zeroes.
fn lba_dwords(slba: u64, blocks: u64, cdw12_flags: u32) -> [u32; 6] {
    debug_assert!((1..=MAX_BLOCKS_PER_COMMAND).contains(&blocks));
    [
        slba as u32,
        (slba >> 32) as u32,
        (blocks - 1) as u32 | cdw12_flags,
        0,
        0,
        0,
    ]
}

/// A read or write of `blocks` blocks at `slba`. `addr`/`data_len` are the data buffer and its
/// length, or (for `URING_CMD_IO_VEC`) the iovec array and its count. `fua` asks for the data
/// to be on media at completion.
pub fn read_write(
    opcode: u8,
    nsid: u32,
    slba: u64,
    blocks: u64,
    addr: u64,
    data_len: u32,
    fua: bool,
) -> UringCmd {
    UringCmd {
        opcode,
        nsid,
        addr,
        data_len,
        cdw: lba_dwords(slba, blocks, if fua { CDW12_FUA } else { 0 }),
        ..Default::default()
    }
}

/// A Flush of the volatile write cache.
pub fn flush(nsid: u32) -> UringCmd {
    UringCmd {
        opcode: opcode::FLUSH,
        nsid,
        ..Default::default()
    }
}

/// A Write Zeroes of `blocks` blocks at `slba`, deallocating them if `deallocate`.
pub fn write_zeroes(nsid: u32, slba: u64, blocks: u64, deallocate: bool) -> UringCmd {
    UringCmd {
        opcode: opcode::WRITE_ZEROES,
        nsid,
        cdw: lba_dwords(slba, blocks, if deallocate { CDW12_DEAC } else { 0 }),
        ..Default::default()
    }
}

/// One Dataset Management range (16 bytes, little-endian): context attributes (none), the
/// number of blocks, the starting LBA.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub struct DsmRange(pub [u8; 16]);

impl DsmRange {
    /// The range of `blocks` blocks (at most `u32::MAX`) at `slba`.
    pub fn new(slba: u64, blocks: u32) -> Self {
        let mut b = [0u8; 16];
        b[4..8].copy_from_slice(&blocks.to_le_bytes());
        b[8..16].copy_from_slice(&slba.to_le_bytes());
        DsmRange(b)
    }
}

/// A Dataset Management that deallocates the one range at `range` (a [`DsmRange`] that stays
/// valid until the command completes).
pub fn deallocate(nsid: u32, range: *const DsmRange) -> UringCmd {
    UringCmd {
        opcode: opcode::DATASET_MANAGEMENT,
        nsid,
        addr: range as u64,
        data_len: std::mem::size_of::<DsmRange>() as u32,
        // Number of ranges minus one, and the deallocate attribute.
        cdw: [0, CDW11_AD, 0, 0, 0, 0],
        ..Default::default()
    }
}

/// An NVMe completion status as the Linux driver reports a passthrough command's (the status
/// field of the completion entry without its phase bit): status code in bits 7:0, status code
/// type in 10:8, then retry delay, More and Do Not Retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u16);

impl Status {
    /// Status code type: 0 generic, 1 command specific, 2 media and data integrity, 3 path.
    pub fn code_type(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }

    /// Status code.
    pub fn code(self) -> u8 {
        self.0 as u8
    }

    /// What the status says, for the log.
    pub fn meaning(self) -> &'static str {
        match (self.code_type(), self.code()) {
            (0, 0x01) => "invalid command opcode",
            (0, 0x02) => "invalid field in command",
            (0, 0x04) => "data transfer error",
            (0, 0x06) => "internal error",
            (0, 0x0b) => "invalid namespace or format",
            (0, 0x80) => "LBA out of range",
            (0, 0x81) => "capacity exceeded",
            (0, 0x82) => "namespace not ready",
            (1, _) => "command specific error",
            (2, 0x80) => "write fault",
            (2, 0x81) => "unrecovered read error",
            (2, _) => "media or data integrity error",
            (3, _) => "path error",
            _ => "error",
        }
    }

    /// The errno a request gets for it: a command the device does not support (which mqblk
    /// does not offer, so only a device that changed under it sends this) is unsupported;
    /// everything else is an I/O error.
    pub fn errno(self) -> i32 {
        match (self.code_type(), self.code()) {
            (0, 0x01) | (0, 0x02) => libc::EOPNOTSUPP,
            _ => libc::EIO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        // From <linux/nvme_ioctl.h> as compiled: _IOWR('N', 0x80/0x81, struct nvme_uring_cmd).
        assert_eq!(URING_CMD_IO, 0xC048_4E80);
        assert_eq!(URING_CMD_IO_VEC, 0xC048_4E81);
    }

    #[test]
    fn lba_math() {
        // 512-byte blocks: 8 KiB at 1 MiB is LBA 2048, 16 blocks.
        assert_eq!(lba_range(1 << 20, 8192, 9, 1 << 16), Ok((2048, 16)));
        // 4 KiB blocks: the same range is LBA 256, 2 blocks.
        assert_eq!(lba_range(1 << 20, 8192, 12, 1 << 16), Ok((256, 2)));
        // Not whole blocks, empty, or more than one command holds.
        assert!(lba_range(512, 4096, 12, 1 << 16).is_err());
        assert!(lba_range(4096, 512, 12, 1 << 16).is_err());
        assert!(lba_range(0, 0, 9, 1 << 16).is_err());
        assert!(lba_range(0, (1 << 16) * 512 + 512, 9, 1 << 16).is_err());
        assert_eq!(lba_range(0, (1 << 16) * 512, 9, 1 << 16), Ok((0, 1 << 16)));
        // Offsets past 2^32 blocks keep their high bits.
        assert_eq!(
            lba_range(0x1234_5678_9000, 4096, 12, 1 << 16),
            Ok((0x1_2345_6789, 1))
        );
    }

    #[test]
    fn a_read_is_laid_out_as_the_driver_reads_it() {
        // Read of 2 blocks at LBA 0x1_0000_0003 of namespace 1, one 8 KiB buffer at 0xdead0000.
        let cmd = read_write(opcode::READ, 1, 0x1_0000_0003, 2, 0xdead_0000, 8192, false);
        let mut want = [0u8; 80];
        want[0] = 0x02; // opcode
        want[4] = 1; // nsid
        want[24..32].copy_from_slice(&[0x00, 0x00, 0xad, 0xde, 0, 0, 0, 0]); // addr
        want[36..40].copy_from_slice(&[0x00, 0x20, 0, 0]); // data_len 8192
        want[40..44].copy_from_slice(&[3, 0, 0, 0]); // cdw10: SLBA low
        want[44..48].copy_from_slice(&[1, 0, 0, 0]); // cdw11: SLBA high
        want[48..52].copy_from_slice(&[1, 0, 0, 0]); // cdw12: NLB 2 - 1
        assert_eq!(cmd.to_bytes(), want);
    }

    #[test]
    fn a_vectored_fua_write_carries_the_iovec_count() {
        // Write of 8 blocks at LBA 16, through 3 iovecs at 0x7000, forced to media.
        let cmd = read_write(opcode::WRITE, 2, 16, 8, 0x7000, 3, true);
        let b = cmd.to_bytes();
        assert_eq!(b[0], 0x01);
        assert_eq!(&b[4..8], &[2, 0, 0, 0]);
        assert_eq!(&b[24..32], &[0x00, 0x70, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[36..40], &[3, 0, 0, 0], "data_len is the iovec count");
        assert_eq!(&b[40..48], &[16, 0, 0, 0, 0, 0, 0, 0]);
        // NLB 7, FUA (bit 30).
        assert_eq!(&b[48..52], &[7, 0, 0, 0x40]);
        assert!(b[52..80].iter().all(|&x| x == 0));
    }

    #[test]
    fn write_zeroes_flush_and_deallocate() {
        // 65536 blocks (the most one command holds) at LBA 0x100, deallocating (bit 25).
        let b = write_zeroes(1, 0x100, 1 << 16, true).to_bytes();
        assert_eq!(b[0], 0x08);
        assert_eq!(&b[40..44], &[0x00, 0x01, 0, 0]);
        assert_eq!(&b[48..52], &[0xff, 0xff, 0x00, 0x02]);
        assert!(b[24..40].iter().all(|&x| x == 0), "no data buffer");
        let b = write_zeroes(1, 0, 1, false).to_bytes();
        assert_eq!(&b[48..52], &[0, 0, 0, 0]);

        let b = flush(7).to_bytes();
        let mut want = [0u8; 80];
        want[4] = 7;
        assert_eq!(b, want);

        // A range of 0x20000 blocks at LBA 0x1_0000_0000: context 0, NLB, SLBA.
        let range = DsmRange::new(0x1_0000_0000, 0x2_0000);
        assert_eq!(
            range.0,
            [0, 0, 0, 0, 0x00, 0x00, 0x02, 0x00, 0, 0, 0, 0, 1, 0, 0, 0]
        );
        let b = deallocate(1, 0x5000 as *const DsmRange).to_bytes();
        assert_eq!(b[0], 0x09);
        assert_eq!(&b[24..32], &[0x00, 0x50, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[36..40], &[16, 0, 0, 0], "one 16-byte range");
        assert_eq!(&b[40..44], &[0, 0, 0, 0], "number of ranges minus one");
        assert_eq!(&b[44..48], &[4, 0, 0, 0], "attribute: deallocate");
    }

    #[test]
    fn statuses() {
        // LBA out of range, with Do Not Retry set (bit 14).
        let s = Status(0x4080);
        assert_eq!((s.code_type(), s.code()), (0, 0x80));
        assert_eq!(s.meaning(), "LBA out of range");
        assert_eq!(s.errno(), libc::EIO);
        assert_eq!(Status(0x0001).errno(), libc::EOPNOTSUPP);
        assert_eq!(Status(0x0281).meaning(), "unrecovered read error");
    }
}
