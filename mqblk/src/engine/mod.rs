//! Storage engines behind one trait.
//!
//! An engine turns a validated operation into the io_uring submission that performs it, or says
//! that it completed at once (the null engine). Each I/O thread has its own io_uring; engines are
//! shared, immutable and lock-free, so threads never contend on them.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use io_uring::{opcode, squeue, types};

use crate::config::{EngineKind, ExportConfig};

/// One operation on the disk. Offsets and lengths are in bytes and already range-checked.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// Read into the iovecs at `offset`.
    Read {
        /// Byte offset.
        offset: u64,
        /// Host iovecs (guest memory), valid until the completion.
        iovs: *const libc::iovec,
        /// Number of iovecs.
        iovcnt: u32,
        /// The io_uring registered buffer holding the single iovec, if there is one.
        buf_index: Option<u16>,
    },
    /// Write the iovecs at `offset`; `sync` asks for write-through (RWF_DSYNC).
    Write {
        /// Byte offset.
        offset: u64,
        /// Host iovecs (guest memory), valid until the completion.
        iovs: *const libc::iovec,
        /// Number of iovecs.
        iovcnt: u32,
        /// Durable before completion (write-through cache mode).
        sync: bool,
        /// The io_uring registered buffer holding the single iovec, if there is one.
        buf_index: Option<u16>,
    },
    /// Make completed writes durable (fdatasync).
    Flush,
    /// Deallocate a range (punch a hole).
    Discard {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
    },
    /// Zero a range; with `unmap` it may be deallocated.
    WriteZeroes {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
        /// Deallocation allowed.
        unmap: bool,
    },
}

/// A storage engine.
pub trait Engine: Send + Sync {
    /// Short name for logs and reports.
    fn name(&self) -> &'static str;
    /// Capacity in bytes (a multiple of 512).
    fn capacity(&self) -> u64;
    /// Logical block size the backing store needs for its I/O (512 or 4096).
    fn block_size(&self) -> u32;
    /// The io_uring entry that performs `op`, or `None` when the engine completed it at once
    /// (successfully; reads then return zeros).
    fn prepare(&self, op: &Op) -> Option<squeue::Entry>;
    /// True for the null engine, whose reads must be answered with zeros by the caller.
    fn is_null(&self) -> bool {
        false
    }
    /// The descriptor every entry of this engine names, if it has one. A worker may register
    /// it with its ring as fixed-file slot `fd` and then mark the entries `IOSQE_FIXED_FILE`.
    fn file_fd(&self) -> Option<RawFd> {
        None
    }
    /// The retry for a write-zeroes whose ZERO_RANGE the store refused (EOPNOTSUPP): a punched
    /// hole, which also reads back as zeros. `None` when there is no fallback.
    fn fallback_punch(&self, op: &Op) -> Option<squeue::Entry> {
        let _ = op;
        None
    }
}

/// Completes everything at once; reads give zeros. The null_blk analogue.
pub struct NullEngine {
    capacity: u64,
}

impl Engine for NullEngine {
    fn name(&self) -> &'static str {
        "null"
    }
    fn capacity(&self) -> u64 {
        self.capacity
    }
    fn block_size(&self) -> u32 {
        512
    }
    fn prepare(&self, _op: &Op) -> Option<squeue::Entry> {
        None
    }
    fn is_null(&self) -> bool {
        true
    }
}

/// io_uring on a file, block device or memfd.
pub struct UringEngine {
    file: File,
    capacity: u64,
    block_size: u32,
    name: &'static str,
}

impl UringEngine {
    fn fd(&self) -> types::Fd {
        types::Fd(self.file.as_raw_fd())
    }

    /// The backing file's descriptor (for tests and diagnostics).
    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl Engine for UringEngine {
    fn name(&self) -> &'static str {
        self.name
    }
    fn capacity(&self) -> u64 {
        self.capacity
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn prepare(&self, op: &Op) -> Option<squeue::Entry> {
        let fd = self.fd();
        Some(match *op {
            Op::Read {
                offset,
                iovs,
                iovcnt: 1,
                buf_index: Some(index),
            } => {
                // SAFETY: the caller's iovec array has one element (iovcnt), valid until the
                // completion like every iovec it hands over.
                let iov = unsafe { *iovs };
                opcode::ReadFixed::new(fd, iov.iov_base as *mut u8, iov.iov_len as u32, index)
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
                opcode::WriteFixed::new(fd, iov.iov_base as *const u8, iov.iov_len as u32, index)
                    .offset(offset)
                    .rw_flags(if sync { libc::RWF_DSYNC } else { 0 })
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
                .rw_flags(if sync { libc::RWF_DSYNC } else { 0 })
                .build(),
            Op::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Op::Discard { offset, len } => opcode::Fallocate::new(fd, len)
                .offset(offset)
                .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
            Op::WriteZeroes { offset, len, unmap } => {
                let mode = if unmap {
                    libc::FALLOC_FL_PUNCH_HOLE
                } else {
                    libc::FALLOC_FL_ZERO_RANGE
                };
                opcode::Fallocate::new(fd, len)
                    .offset(offset)
                    .mode(mode | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
        })
    }
    fn file_fd(&self) -> Option<RawFd> {
        Some(self.file.as_raw_fd())
    }
    fn fallback_punch(&self, op: &Op) -> Option<squeue::Entry> {
        match *op {
            Op::WriteZeroes {
                offset,
                len,
                unmap: false,
            } => self.prepare(&Op::WriteZeroes {
                offset,
                len,
                unmap: true,
            }),
            _ => None,
        }
    }
}

/// Why an export's storage could not be opened. Each message is one clear line.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The image does not exist and no size was given to create it.
    #[error("image {0} does not exist: create it, or pass size=BYTES to have mqblk create it")]
    Missing(String),
    /// The filesystem refuses O_DIRECT.
    #[error("the filesystem holding {0} refuses O_DIRECT: pass direct=off for this export")]
    DirectRefused(String),
    /// size= disagrees with the image.
    #[error("size={given} but {path} is {actual} bytes: drop size= or give the image's size")]
    SizeMismatch {
        /// The image.
        path: String,
        /// size= value.
        given: u64,
        /// The image's size.
        actual: u64,
    },
    /// The image is smaller than one sector.
    #[error("{0} is smaller than 512 bytes")]
    TooSmall(String),
    /// Any other I/O error, with context.
    #[error("{what} {path}: {err}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: String,
        /// The error.
        err: io::Error,
    },
}

fn ioerr(what: &'static str, path: &Path, err: io::Error) -> OpenError {
    OpenError::Io {
        what,
        path: path.display().to_string(),
        err,
    }
}

/// Opens the storage of an export.
pub fn open(cfg: &ExportConfig) -> Result<Box<dyn Engine>, OpenError> {
    match cfg.engine {
        EngineKind::Null => Ok(Box::new(NullEngine {
            capacity: cfg.size.unwrap_or(0),
        })),
        EngineKind::Mem => open_mem(cfg.size.unwrap_or(0)).map(|e| Box::new(e) as Box<dyn Engine>),
        EngineKind::Uring => {
            let path = cfg.path.as_deref().expect("validated: uring has a path");
            open_file(path, cfg.size, cfg.readonly, cfg.direct)
                .map(|e| Box::new(e) as Box<dyn Engine>)
        }
    }
}

fn open_mem(size: u64) -> Result<UringEngine, OpenError> {
    let name = c"mqblk-mem";
    // SAFETY: memfd_create with a valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(ioerr(
            "memfd_create for",
            Path::new("mem"),
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: `fd` is a fresh descriptor that we own exclusively.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)
        .map_err(|e| ioerr("sizing RAM disk", Path::new("mem"), e))?;
    Ok(UringEngine {
        file,
        capacity: size,
        block_size: 512,
        name: "mem",
    })
}

/// Size of a block device in bytes.
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
fn probe_direct_block_size(file: &File, capacity: u64) -> u32 {
    let layout = std::alloc::Layout::from_size_align(4096, 4096).expect("valid layout");
    // SAFETY: non-zero size layout; freed below with the same layout.
    let buf = unsafe { std::alloc::alloc(layout) };
    if buf.is_null() {
        return 4096;
    }
    let mut found = 4096;
    for bs in [512usize, 4096] {
        if bs as u64 > capacity {
            break;
        }
        // SAFETY: `buf` is valid for 4096 bytes and `bs <= 4096`.
        let r = unsafe { libc::pread(file.as_raw_fd(), buf as *mut libc::c_void, bs, 0) };
        if r >= 0 {
            found = bs as u32;
            break;
        }
    }
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    found
}

fn open_file(
    path: &Path,
    size: Option<u64>,
    readonly: bool,
    direct: bool,
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
        f.set_len(sz).map_err(|e| ioerr("cannot size", path, e))?;
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
    Ok(UringEngine {
        file,
        capacity,
        block_size,
        name: "uring",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_export_spec;

    #[test]
    fn open_errors_are_clear() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("x.img");
        let spec = format!("socket=/tmp/s,path={}", img.display());
        let e = open(&parse_export_spec(&spec).unwrap())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("does not exist") && e.contains("size="), "{e}");
        // Created with size=, then a mismatching size= is refused.
        let e = open(&parse_export_spec(&format!("{spec},size=1M,direct=off")).unwrap()).unwrap();
        assert_eq!(e.capacity(), 1 << 20);
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 1 << 20);
        let e = open(&parse_export_spec(&format!("{spec},size=2M,direct=off")).unwrap())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("size=2097152") && e.contains("1048576"), "{e}");
    }

    #[test]
    fn mem_and_null() {
        let e = open(&parse_export_spec("socket=s,engine=mem,size=4M").unwrap()).unwrap();
        assert_eq!((e.name(), e.capacity()), ("mem", 4 << 20));
        assert!(e.prepare(&Op::Flush).is_some());
        let e = open(&parse_export_spec("socket=s,engine=null,size=4M").unwrap()).unwrap();
        assert!(e.prepare(&Op::Flush).is_none());
    }
}
