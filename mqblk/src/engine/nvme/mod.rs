//! `engine=nvme`: NVMe commands straight to a namespace's character device (`/dev/ngXnY`)
//! through io_uring passthrough (`IORING_OP_URING_CMD`), skipping the host's block layer
//! (no bio, no I/O scheduler, no request merging or splitting by the kernel: mqblk builds the
//! commands and the driver only maps the buffers and rings the doorbell).
//!
//! At open the namespace is identified through the driver's admin passthrough ioctl
//! ([`identify`]): its block size, capacity, the controller's largest transfer (MDTS), which
//! optional commands it has (Dataset Management, Write Zeroes) and whether it has a volatile
//! write cache. From that follow what the export offers the guest ([`Limits`]) and which
//! requests the I/O threads split. Each I/O thread's ring is set up with 128-byte submission
//! and 32-byte completion entries, which passthrough commands need ([`channel`]).

mod channel;
pub mod command;
pub mod identify;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use io_uring::opcode;

use super::{Channel, Engine, Limits, OpenError, ResizeError, MAX_DWZ_SECTORS};
use channel::NvmeChannel;
use command::MAX_BLOCKS_PER_COMMAND;

/// Why a path cannot be served with engine=nvme. Each message is one line that says what to
/// use instead.
#[derive(Debug, thiserror::Error)]
pub enum NvmeError {
    /// A block device: the namespace's other face.
    #[error("{0} is a block device: engine=nvme takes the namespace's character device (/dev/ngXnY), or serve the block device with engine=uring")]
    BlockDevice(String),
    /// A regular file, directory, socket...
    #[error("{0} is not an NVMe namespace's character device (/dev/ngXnY): serve files and block devices with engine=uring")]
    NotCharDevice(String),
    /// A character device the NVMe driver does not own.
    #[error("{path} is not an NVMe namespace's character device (the NVMe ioctl says: {err}): serve files and block devices with engine=uring")]
    NotNvme {
        /// The device.
        path: String,
        /// What `NVME_IOCTL_ID` said.
        err: io::Error,
    },
    /// No `IORING_OP_URING_CMD` (Linux before 5.19).
    #[error("this kernel has no io_uring passthrough (IORING_OP_URING_CMD, Linux 5.19): serve the block device (/dev/nvmeXnY) with engine=uring")]
    NoPassthrough,
    /// A format with metadata (or protection information) per block.
    #[error("{path} is formatted with {bytes} bytes of metadata per block, which engine=nvme does not serve: serve the block device (/dev/nvmeXnY) with engine=uring, or reformat the namespace without metadata")]
    Metadata {
        /// The device.
        path: String,
        /// Metadata bytes per block.
        bytes: u16,
    },
    /// A block size virtio-blk cannot present.
    #[error("{path} has {bytes}-byte blocks; engine=nvme serves 512-byte to 4 KiB blocks: serve the block device (/dev/nvmeXnY) with engine=uring")]
    BlockSize {
        /// The device.
        path: String,
        /// Its block size.
        bytes: u64,
    },
    /// Identify failed.
    #[error("cannot identify the NVMe namespace {path}: {err}")]
    Identify {
        /// The device.
        path: String,
        /// What failed.
        err: io::Error,
    },
}

/// An NVMe namespace served through passthrough commands.
pub struct NvmeEngine {
    file: Arc<File>,
    path: PathBuf,
    nsid: u32,
    lba_shift: u32,
    capacity: AtomicU64,
    limits: Limits,
    volatile_write_cache: bool,
}

/// The opcodes its channels' entries use.
const OPCODES: &[u8] = &[opcode::UringCmd80::CODE];

/// Most bytes one command carries when neither the controller nor the kernel says: what Linux
/// allows a passthrough command on most controllers.
const DEFAULT_MAX_TRANSFER: u64 = 1 << 20;
/// Most iovecs one command carries when the kernel does not say (NVMe PCI's `max_segments`).
const DEFAULT_MAX_SEGMENTS: u32 = 127;

impl Engine for NvmeEngine {
    fn name(&self) -> &'static str {
        "nvme"
    }
    fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Relaxed)
    }
    fn block_size(&self) -> u32 {
        1 << self.lba_shift
    }
    fn channel(&self) -> io::Result<Box<dyn Channel>> {
        Ok(Box::new(NvmeChannel::new(
            self.file.clone(),
            self.nsid,
            self.lba_shift,
            self.volatile_write_cache,
            self.limits.write_zeroes_may_unmap,
        )))
    }
    fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError> {
        let ns = identify::namespace(&self.file, self.nsid)?;
        let actual = ns
            .bytes()
            .ok_or_else(|| io::Error::other("namespace size overflows"))?;
        if ns.lba_shift != self.lba_shift {
            return Err(io::Error::other(format!(
                "{} was reformatted ({}-byte blocks, was {}): remove and re-add the export",
                self.path.display(),
                1u64 << ns.lba_shift,
                1u64 << self.lba_shift
            ))
            .into());
        }
        if let Some(s) = size {
            if s != actual {
                return Err(ResizeError::Namespace { actual });
            }
        }
        self.capacity.store(actual, Ordering::Relaxed);
        Ok(actual)
    }
    fn ring_opcodes(&self) -> &'static [u8] {
        OPCODES
    }
    fn wide_entries(&self) -> bool {
        true
    }
    fn limits(&self) -> Limits {
        self.limits
    }
}

/// The kernel's limit for the namespace's requests, from its block device's sysfs queue
/// directory (`/dev/ng0n1`'s block device is `nvme0n1`), if readable.
fn queue_limit(path: &Path, name: &str) -> Option<u64> {
    let dev = path.file_name()?.to_str()?;
    let block = format!("nvme{}", dev.strip_prefix("ng")?);
    let text = std::fs::read_to_string(format!("/sys/block/{block}/queue/{name}")).ok()?;
    text.trim().parse().ok()
}

/// Whether this kernel's io_uring has `IORING_OP_URING_CMD`.
fn has_passthrough() -> bool {
    let Ok(ring) = io_uring::IoUring::new(2) else {
        return false;
    };
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe).is_ok()
        && probe.is_supported(opcode::UringCmd80::CODE)
}

/// Opens the namespace at `path` (its character device); `size`, if given, must be its size.
pub(super) fn open(
    path: &Path,
    size: Option<u64>,
    readonly: bool,
) -> Result<NvmeEngine, OpenError> {
    let shown = || path.display().to_string();
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(OpenError::Io {
                what: "no NVMe namespace at",
                path: shown(),
                err: e,
            })
        }
        Err(e) => return Err(super::uring::ioerr("cannot stat", path, e)),
    };
    if meta.file_type().is_block_device() {
        return Err(NvmeError::BlockDevice(shown()).into());
    }
    if !meta.file_type().is_char_device() {
        return Err(NvmeError::NotCharDevice(shown()).into());
    }
    let file = OpenOptions::new()
        .read(true)
        .write(!readonly)
        .open(path)
        .map_err(|e| super::uring::ioerr("cannot open", path, e))?;
    let nsid =
        identify::namespace_id(&file).map_err(|err| NvmeError::NotNvme { path: shown(), err })?;
    if !has_passthrough() {
        return Err(NvmeError::NoPassthrough.into());
    }
    let identify_err = |err| NvmeError::Identify { path: shown(), err };
    let ctrl = identify::controller(&file).map_err(identify_err)?;
    let ns = identify::namespace(&file, nsid).map_err(identify_err)?;
    if ns.metadata_bytes != 0 {
        return Err(NvmeError::Metadata {
            path: shown(),
            bytes: ns.metadata_bytes,
        }
        .into());
    }
    if !(9..=12).contains(&ns.lba_shift) {
        return Err(NvmeError::BlockSize {
            path: shown(),
            bytes: 1u64 << ns.lba_shift.min(63),
        }
        .into());
    }
    let capacity = ns
        .bytes()
        .filter(|&b| b > 0)
        .ok_or_else(|| OpenError::TooSmall(shown()))?;
    if let Some(given) = size {
        if given != capacity {
            return Err(OpenError::SizeMismatch {
                path: shown(),
                given,
                actual: capacity,
            });
        }
    }
    let limits = limits_of(&ctrl, &ns, path);
    tracing::info!(
        path = %shown(),
        nsid,
        block_size = 1u32 << ns.lba_shift,
        capacity,
        max_transfer = limits.max_transfer,
        max_segments = limits.max_segments,
        discard = limits.discard,
        write_zeroes = limits.write_zeroes,
        volatile_write_cache = ctrl.volatile_write_cache,
        "NVMe namespace identified"
    );
    Ok(NvmeEngine {
        file: Arc::new(file),
        path: path.to_path_buf(),
        nsid,
        lba_shift: ns.lba_shift,
        capacity: AtomicU64::new(capacity),
        limits,
        volatile_write_cache: ctrl.volatile_write_cache,
    })
}

/// What an export of this namespace offers, and where its I/O threads split requests.
fn limits_of(ctrl: &identify::Controller, ns: &identify::Namespace, path: &Path) -> Limits {
    let block = 1u64 << ns.lba_shift;
    // The controller's MDTS, and the kernel's own bound on one request, whichever is smaller;
    // whole blocks, and no more than one command's block count.
    let kernel = queue_limit(path, "max_hw_sectors_kb").map(|kb| kb << 10);
    let max_transfer = [ctrl.max_transfer(), kernel]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(DEFAULT_MAX_TRANSFER)
        .min(MAX_BLOCKS_PER_COMMAND * block)
        .max(block)
        / block
        * block;
    let max_segments =
        queue_limit(path, "max_segments").map_or(DEFAULT_MAX_SEGMENTS, |n| n.clamp(1, 1024) as u32);
    let sectors_per_block = (block >> 9) as u32;
    // One Write Zeroes covers at most 65536 blocks; one Dataset Management range, u32::MAX.
    let max_write_zeroes_sectors =
        ((MAX_BLOCKS_PER_COMMAND as u32).saturating_mul(sectors_per_block)).min(MAX_DWZ_SECTORS);
    Limits {
        max_transfer: Some(max_transfer as u32),
        max_segments: Some(max_segments),
        // Deallocation is only a hint unless deallocated blocks read as zeros; offered either
        // way, as a file's punched hole is.
        discard: ctrl.dataset_management(),
        write_zeroes: ctrl.write_zeroes(),
        max_discard_sectors: MAX_DWZ_SECTORS,
        max_write_zeroes_sectors,
        write_zeroes_may_unmap: ns.write_zeroes_deallocates && ns.deallocated_reads_zeroes,
        cuts_runs: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctrl(mdts: u8, oncs: u16) -> identify::Controller {
        identify::Controller {
            mdts,
            oncs,
            volatile_write_cache: true,
        }
    }

    fn ns(lba_shift: u32) -> identify::Namespace {
        identify::Namespace {
            blocks: 1 << 20,
            lba_shift,
            metadata_bytes: 0,
            deallocated_reads_zeroes: true,
            write_zeroes_deallocates: true,
        }
    }

    #[test]
    fn limits_follow_the_controller_and_namespace() {
        let nowhere = Path::new("/nonexistent/ng9n1");
        // MDTS 3 (32 KiB), DSM and Write Zeroes, 512-byte blocks.
        let l = limits_of(&ctrl(3, 0b1100), &ns(9), nowhere);
        assert_eq!(l.max_transfer, Some(32 << 10));
        assert_eq!(l.max_segments, Some(DEFAULT_MAX_SEGMENTS));
        assert!(l.discard && l.write_zeroes && l.write_zeroes_may_unmap);
        // 65536 blocks of 512 bytes per Write Zeroes.
        assert_eq!(l.max_write_zeroes_sectors, 1 << 16);
        // No MDTS: the default; no optional commands: nothing offered.
        let l = limits_of(&ctrl(0, 0), &ns(12), nowhere);
        assert_eq!(l.max_transfer, Some(DEFAULT_MAX_TRANSFER as u32));
        assert!(!l.discard && !l.write_zeroes);
        // 4 KiB blocks: 65536 of them are 256 MiB of zeroes per command.
        assert_eq!(l.max_write_zeroes_sectors, 1 << 19);
        // Write Zeroes that deallocates into blocks that do not read as zeros may not unmap.
        let mut n = ns(12);
        n.deallocated_reads_zeroes = false;
        assert!(!limits_of(&ctrl(0, 0b1000), &n, nowhere).write_zeroes_may_unmap);
    }

    #[test]
    fn paths_that_are_not_namespaces_get_their_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("disk.img");
        std::fs::write(&file, [0u8; 4096]).unwrap();
        let e = open(&file, None, false).err().unwrap().to_string();
        assert!(
            e.contains("is not an NVMe namespace's character device") && e.contains("engine=uring"),
            "{e}"
        );
        // A character device that is not NVMe.
        let e = open(Path::new("/dev/null"), None, false)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("/dev/null is not an NVMe namespace") && e.contains("engine=uring"),
            "{e}"
        );
        let e = open(&dir.path().join("missing"), None, false)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("no NVMe namespace at") && !e.contains('\n'),
            "{e}"
        );
    }
}
