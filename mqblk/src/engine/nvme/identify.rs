//! What mqblk learns of an NVMe controller and namespace at open: the Identify data (NVMe Base
//! 2.0, 5.17.2.1 and NVM Command Set 1.0, 4.1.5.1) read through the driver's admin passthrough
//! ioctl on the namespace's character device, and the fields of it that decide what the
//! export can offer.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `NVME_IOCTL_ID`, `_IO('N', 0x40)`: the namespace id of the device.
const IOCTL_ID: libc::c_ulong = 0x4E40;
/// `NVME_IOCTL_ADMIN_CMD`, `_IOWR('N', 0x41, struct nvme_admin_cmd)`.
const IOCTL_ADMIN_CMD: libc::c_ulong = 0xC048_4E41;
/// Admin opcode Identify.
const ADMIN_IDENTIFY: u8 = 0x06;
/// Identify's CNS values: the namespace, the controller.
const CNS_NAMESPACE: u32 = 0x00;
const CNS_CONTROLLER: u32 = 0x01;
/// Bytes of Identify data.
const IDENTIFY_LEN: usize = 4096;

/// `struct nvme_passthru_cmd` (`<linux/nvme_ioctl.h>`).
#[repr(C)]
#[derive(Default)]
struct PassthruCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    result: u32,
}

const _: () = assert!(std::mem::size_of::<PassthruCmd>() == 72);

/// Identify data, aligned for the DMA the driver sets up.
#[repr(C, align(4096))]
struct IdentifyBuf([u8; IDENTIFY_LEN]);

/// The namespace id of an NVMe namespace's device, or the error `ioctl` gave (ENOTTY: the
/// device is not an NVMe namespace).
pub fn namespace_id(file: &File) -> io::Result<u32> {
    // SAFETY: NVME_IOCTL_ID takes no argument; it returns the id or fails.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), IOCTL_ID) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as u32)
}

/// Runs Identify with `cns` for `nsid`.
fn identify(file: &File, nsid: u32, cns: u32) -> io::Result<Box<IdentifyBuf>> {
    let mut buf = Box::new(IdentifyBuf([0; IDENTIFY_LEN]));
    let mut cmd = PassthruCmd {
        opcode: ADMIN_IDENTIFY,
        nsid,
        addr: buf.0.as_mut_ptr() as u64,
        data_len: IDENTIFY_LEN as u32,
        cdw10: cns,
        ..Default::default()
    };
    // SAFETY: the command names `buf`, 4096 writable bytes that outlive the call (the ioctl
    // completes synchronously), and `cmd`, which the driver reads and writes the result into.
    let r = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            IOCTL_ADMIN_CMD,
            &mut cmd as *mut PassthruCmd,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    if r > 0 {
        return Err(io::Error::other(format!(
            "Identify (CNS {cns}) failed with NVMe status {r:#x}"
        )));
    }
    Ok(buf)
}

/// What mqblk needs of Identify Controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Controller {
    /// Maximum Data Transfer Size: a power of two in units of the controller's minimum page
    /// size, which Linux sets to 4 KiB; 0 means no limit.
    pub mdts: u8,
    /// Optional NVM Command Support.
    pub oncs: u16,
    /// A volatile write cache is present: data is durable only after a Flush.
    pub volatile_write_cache: bool,
}

impl Controller {
    /// From Identify Controller data.
    pub fn parse(data: &[u8; IDENTIFY_LEN]) -> Self {
        Controller {
            mdts: data[77],
            oncs: u16::from_le_bytes([data[520], data[521]]),
            volatile_write_cache: data[525] & 1 != 0,
        }
    }

    /// The controller takes Dataset Management (deallocate).
    pub fn dataset_management(&self) -> bool {
        self.oncs & (1 << 2) != 0
    }

    /// The controller takes Write Zeroes.
    pub fn write_zeroes(&self) -> bool {
        self.oncs & (1 << 3) != 0
    }

    /// Most bytes one command may transfer, if limited (4 KiB pages: the page size Linux
    /// programs every controller with).
    pub fn max_transfer(&self) -> Option<u64> {
        (self.mdts != 0).then(|| 4096u64 << self.mdts.min(20))
    }
}

/// What mqblk needs of Identify Namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Namespace {
    /// Namespace Size, in logical blocks.
    pub blocks: u64,
    /// log2 of the logical block size of the format in use.
    pub lba_shift: u32,
    /// Metadata bytes per block of the format in use (mqblk serves only formats without).
    pub metadata_bytes: u16,
    /// Deallocated blocks read as zeros (DLFEAT bits 2:0 = 001b).
    pub deallocated_reads_zeroes: bool,
    /// Write Zeroes may deallocate (DLFEAT bit 3).
    pub write_zeroes_deallocates: bool,
}

impl Namespace {
    /// From Identify Namespace data.
    pub fn parse(data: &[u8; IDENTIFY_LEN]) -> Self {
        let nlbaf = usize::from(data[25]) + 1;
        let flbas = data[26];
        // Format index: bits 3:0, and bits 6:5 as its high bits when there are more than 16.
        let mut index = usize::from(flbas & 0xf);
        if nlbaf > 16 {
            index |= usize::from((flbas >> 5) & 0x3) << 4;
        }
        let at = 128 + 4 * index.min(63);
        let lbaf = u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
        let dlfeat = data[33];
        Namespace {
            blocks: u64::from_le_bytes(data[0..8].try_into().expect("8 bytes")),
            lba_shift: (lbaf >> 16) & 0xff,
            metadata_bytes: lbaf as u16,
            deallocated_reads_zeroes: dlfeat & 0x7 == 1,
            write_zeroes_deallocates: dlfeat & (1 << 3) != 0,
        }
    }

    /// Bytes in the namespace (saturating: a size past 2^64 bytes is refused by the caller).
    pub fn bytes(&self) -> Option<u64> {
        self.blocks.checked_mul(1u64 << self.lba_shift.min(63))
    }
}

/// Reads Identify Controller.
pub fn controller(file: &File) -> io::Result<Controller> {
    identify(file, 0, CNS_CONTROLLER).map(|b| Controller::parse(&b.0))
}

/// Reads Identify Namespace of `nsid`.
pub fn namespace(file: &File, nsid: u32) -> io::Result<Namespace> {
    identify(file, nsid, CNS_NAMESPACE).map(|b| Namespace::parse(&b.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_fields() {
        let mut d = [0u8; IDENTIFY_LEN];
        d[77] = 5;
        d[520] = 0b0000_1100; // DSM and Write Zeroes
        d[525] = 1;
        let c = Controller::parse(&d);
        assert_eq!(c.max_transfer(), Some(128 << 10));
        assert!(c.dataset_management() && c.write_zeroes() && c.volatile_write_cache);
        d[77] = 0;
        d[520] = 0b0000_0100;
        d[525] = 0;
        let c = Controller::parse(&d);
        assert_eq!(c.max_transfer(), None);
        assert!(c.dataset_management() && !c.write_zeroes() && !c.volatile_write_cache);
    }

    #[test]
    fn namespace_fields() {
        let mut d = [0u8; IDENTIFY_LEN];
        d[0..8].copy_from_slice(&0x4_0000u64.to_le_bytes());
        d[25] = 1; // two formats
        d[26] = 1; // the second in use
        d[128..132].copy_from_slice(&(9u32 << 16).to_le_bytes()); // 512 bytes
        d[132..136].copy_from_slice(&(12u32 << 16).to_le_bytes()); // 4 KiB
        d[33] = 0b1001;
        let n = Namespace::parse(&d);
        assert_eq!((n.blocks, n.lba_shift, n.metadata_bytes), (0x4_0000, 12, 0));
        assert_eq!(n.bytes(), Some(1 << 30));
        assert!(n.deallocated_reads_zeroes && n.write_zeroes_deallocates);
        // The first format, with 8 bytes of metadata per block; DLFEAT says nothing.
        d[26] = 0;
        d[128..132].copy_from_slice(&(9u32 << 16 | 8).to_le_bytes());
        d[33] = 0;
        let n = Namespace::parse(&d);
        assert_eq!((n.lba_shift, n.metadata_bytes), (9, 8));
        assert!(!n.deallocated_reads_zeroes && !n.write_zeroes_deallocates);
        // More than 16 formats: FLBAS bits 6:5 are the index's high bits (format 17).
        d[25] = 19;
        d[26] = 0b0010_0001;
        d[128 + 4 * 17..132 + 4 * 17].copy_from_slice(&(12u32 << 16).to_le_bytes());
        assert_eq!(Namespace::parse(&d).lba_shift, 12);
    }
}
