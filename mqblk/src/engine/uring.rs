//! The io_uring engine: a raw image file, a block device or (for `engine=mem`) a memfd. Every
//! operation becomes one entry on the I/O thread's own ring.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use io_uring::{opcode, squeue, types};

use super::file_space::{self, DirectBuf};
use super::image_lock::{ImageLock, Perms};
use super::{Channel, Engine, Op, OpenError, ResizeError, Started};
use crate::config::Preallocation;

/// The opcodes of the entries [`UringChannel::entry`] builds, which its thread's ring allows.
pub const OPCODES: &[u8] = &[
    opcode::ReadFixed::CODE,
    opcode::WriteFixed::CODE,
    opcode::Readv::CODE,
    opcode::Writev::CODE,
    opcode::Fsync::CODE,
    opcode::Fallocate::CODE,
];

/// The opcodes of the entries [`rw_entry`] builds.
pub const RW_OPCODES: &[u8] = &[
    opcode::ReadFixed::CODE,
    opcode::WriteFixed::CODE,
    opcode::Readv::CODE,
    opcode::Writev::CODE,
];

/// io_uring on a file, block device or memfd.
pub struct UringEngine {
    file: Arc<File>,
    capacity: AtomicU64,
    block_size: u32,
    name: &'static str,
    /// Opened without O_DIRECT: writes complete into this host's page cache.
    host_cached: bool,
    /// QEMU's locks on the file, held while the engine lives (a memfd has none).
    lock: Option<ImageLock>,
    /// How `export_resize` provides the space it adds.
    preallocation: Preallocation,
}

impl UringEngine {
    /// An engine on an open file of `capacity` bytes.
    pub(super) fn new(file: File, capacity: u64, block_size: u32, name: &'static str) -> Self {
        UringEngine {
            file: Arc::new(file),
            capacity: AtomicU64::new(capacity),
            block_size,
            name,
            host_cached: false,
            lock: None,
            preallocation: Preallocation::Off,
        }
    }
}

impl Engine for UringEngine {
    fn name(&self) -> &'static str {
        self.name
    }
    fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Relaxed)
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn channel(&self) -> io::Result<Box<dyn Channel>> {
        Ok(Box::new(UringChannel {
            file: self.file.clone(),
            zero_by_punching: false,
        }))
    }

    fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError> {
        let meta = self.file.metadata()?;
        let is_blk = meta.file_type().is_block_device();
        let actual = if is_blk {
            blockdev_size(&self.file)?
        } else {
            meta.len()
        };
        let new = match size {
            Some(s) if is_blk && s != actual => return Err(ResizeError::BlockDevice { actual }),
            Some(s) => {
                if s > actual {
                    file_space::grow(&self.file, actual, s, self.preallocation)?;
                } else if s < actual {
                    self.file.set_len(s)?;
                }
                s
            }
            None => actual & !511,
        };
        if new == 0 {
            return Err(ResizeError::BadSize(new));
        }
        self.capacity.store(new, Ordering::Relaxed);
        Ok(new)
    }

    fn ring_opcodes(&self) -> &'static [u8] {
        OPCODES
    }

    fn sync_host_cache(&self) -> io::Result<()> {
        if self.host_cached {
            self.file.sync_data()?;
        }
        Ok(())
    }
}

/// One I/O thread's channel: builds ring entries on the shared file.
struct UringChannel {
    file: Arc<File>,
    /// The store refused FALLOC_FL_ZERO_RANGE (tmpfs does): write-zeroes punch holes
    /// instead, which read back as zeros too.
    zero_by_punching: bool,
}

impl UringChannel {
    fn entry(&self, op: &Op) -> squeue::Entry {
        let fd = types::Fd(self.file.as_raw_fd());
        match *op {
            Op::Read { .. } | Op::Write { .. } => rw_entry(fd.0, op),
            Op::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Op::Discard { offset, len } => fallocate(fd, offset, len, libc::FALLOC_FL_PUNCH_HOLE),
            Op::WriteZeroes { offset, len, unmap } => {
                let mode = if unmap || self.zero_by_punching {
                    libc::FALLOC_FL_PUNCH_HOLE
                } else {
                    libc::FALLOC_FL_ZERO_RANGE
                };
                fallocate(fd, offset, len, mode)
            }
        }
    }
}

/// The ring entry for a read or write `op` on `fd` at the op's offset: a fixed-buffer entry
/// when the op names a registered buffer, a vectored one otherwise; a write asks for
/// write-through with `RWF_DSYNC` when the op is `sync`.
///
/// # Panics
/// On an op other than a read or write.
pub fn rw_entry(fd: RawFd, op: &Op) -> squeue::Entry {
    let fd = types::Fd(fd);
    let rw_flags = |sync: bool| if sync { libc::RWF_DSYNC } else { 0 };
    match *op {
        Op::Read {
            offset,
            iovs,
            iovcnt: 1,
            buf_index: Some(index),
        } => {
            // SAFETY: the iovec array has one element (iovcnt), valid until the operation
            // completes (the contract of `Op`).
            let iov = unsafe { *iovs };
            opcode::ReadFixed::new(fd, iov.iov_base.cast(), iov.iov_len as u32, index)
                .offset(offset)
                .build()
        }
        Op::Write {
            offset,
            iovs,
            iovcnt: 1,
            sync,
            buf_index: Some(index),
        } => {
            // SAFETY: as for the read above.
            let iov = unsafe { *iovs };
            opcode::WriteFixed::new(fd, iov.iov_base.cast(), iov.iov_len as u32, index)
                .offset(offset)
                .rw_flags(rw_flags(sync))
                .build()
        }
        Op::Read {
            offset,
            iovs,
            iovcnt,
            ..
        } => opcode::Readv::new(fd, iovs, iovcnt).offset(offset).build(),
        Op::Write {
            offset,
            iovs,
            iovcnt,
            sync,
            ..
        } => opcode::Writev::new(fd, iovs, iovcnt)
            .offset(offset)
            .rw_flags(rw_flags(sync))
            .build(),
        _ => unreachable!("rw_entry takes reads and writes"),
    }
}

fn fallocate(fd: types::Fd, offset: u64, len: u64, mode: i32) -> squeue::Entry {
    opcode::Fallocate::new(fd, len)
        .offset(offset)
        .mode(mode | libc::FALLOC_FL_KEEP_SIZE)
        .build()
}

impl Channel for UringChannel {
    unsafe fn start(&mut self, op: &Op, _token: u64) -> Started {
        Started::Ring(self.entry(op))
    }

    unsafe fn retry(&mut self, op: &Op, res: i32, _token: u64) -> Option<Started> {
        let zero_range = matches!(op, Op::WriteZeroes { unmap: false, .. });
        if zero_range && res == -libc::EOPNOTSUPP && !self.zero_by_punching {
            self.zero_by_punching = true;
            return Some(Started::Ring(self.entry(op)));
        }
        None
    }

    fn file_fd(&self) -> Option<RawFd> {
        Some(self.file.as_raw_fd())
    }
}

pub(super) fn ioerr(what: &'static str, path: &Path, err: io::Error) -> OpenError {
    OpenError::Io {
        what,
        path: path.display().to_string(),
        err,
    }
}

/// A block device's size in bytes (BLKGETSIZE64).
pub fn blockdev_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    // SAFETY: the ioctl writes one u64 into `size`, which outlives the call.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Finds the smallest block size (512 or 4096) that O_DIRECT accepts on `file`.
pub(crate) fn probe_direct_block_size(file: &File, capacity: u64) -> u32 {
    let mut buf = Box::new(DirectBuf([0; 4096]));
    for bs in [512usize, 4096] {
        if bs as u64 > capacity {
            break;
        }
        if rustix::io::pread(file, &mut buf.0[..bs], 0).is_ok() {
            return bs as u32;
        }
    }
    4096
}

pub(super) fn open_file(
    path: &Path,
    size: Option<u64>,
    readonly: bool,
    direct: bool,
    preallocation: Preallocation,
) -> Result<UringEngine, OpenError> {
    let shown = || path.display().to_string();
    let meta = match std::fs::metadata(path) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(ioerr("cannot stat", path, e)),
    };
    if meta.is_none() {
        let Some(sz) = size else {
            return Err(OpenError::Missing(shown()));
        };
        if readonly {
            return Err(OpenError::Missing(shown()));
        }
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| ioerr("cannot create", path, e))?;
        if let Err(e) = file_space::grow(&f, 0, sz, preallocation).and_then(|()| f.sync_all()) {
            let _ = std::fs::remove_file(path);
            return Err(ioerr("cannot size", path, e));
        }
    }
    let mut opts = OpenOptions::new();
    opts.read(true).write(!readonly);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let file = match opts.open(path) {
        Ok(f) => f,
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
            return Err(OpenError::DirectRefused(shown()))
        }
        Err(e) => return Err(ioerr("cannot open", path, e)),
    };
    let perms = if readonly {
        Perms::RAW_READONLY
    } else {
        Perms::RAW_WRITABLE
    };
    let lock = ImageLock::taken(&file, path, perms)?;
    let meta = file.metadata().map_err(|e| ioerr("cannot stat", path, e))?;
    let is_blk = meta.file_type().is_block_device();
    let actual = if is_blk {
        blockdev_size(&file).map_err(|e| ioerr("cannot get the size of", path, e))?
    } else {
        meta.len()
    };
    if let Some(given) = size {
        if given != actual {
            return Err(OpenError::SizeMismatch {
                path: shown(),
                given,
                actual,
            });
        }
    }
    let capacity = actual & !511;
    if capacity == 0 {
        return Err(OpenError::TooSmall(shown()));
    }
    if capacity != actual {
        tracing::warn!(path = %shown(), "image size {actual} is not a multiple of 512; the last {} bytes are not served", actual - capacity);
    }
    let block_size = if direct {
        probe_direct_block_size(&file, capacity)
    } else {
        512
    };
    let mut engine = UringEngine::new(file, capacity, block_size, "uring");
    engine.host_cached = !direct;
    engine.lock = Some(lock);
    engine.preallocation = preallocation;
    Ok(engine)
}
