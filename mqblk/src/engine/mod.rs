//! Storage engines behind one trait.
//!
//! An [`Engine`] is an export's opened storage, shared by its I/O threads. Each I/O thread asks
//! it once for a [`Channel`] (the SPDK notion: one thread's private context on a shared
//! device) and starts every operation through it. A channel answers each operation in one of
//! three ways ([`Started`]): an io_uring entry for the thread's own ring (file, block device,
//! RAM disk), a result at once (the null engine), or "pending" for an engine that completes on
//! its own completion source, an fd the thread's ring polls (a network or librbd engine).
//! Whichever way, the result comes back to the thread that started the operation.
//!
//! To add an engine: a file here with a type implementing [`Engine`] and [`Channel`], a variant
//! of [`EngineKind`](crate::config::EngineKind) and its `engine=` value in
//! [`config::keys`](crate::config::keys), and a line in [`open`].

mod file_space;
pub mod image_lock;
mod mem;
mod null;
pub mod nvme;
pub mod qcow2;
#[cfg(feature = "rbd")]
pub mod rbd;
pub(crate) mod uring;

use std::io;
use std::os::fd::RawFd;
use std::path::Path;

use io_uring::squeue;

use crate::config::{keys, EngineKind, ExportConfig, ImageFormat, Preallocation};

pub use null::NullEngine;
pub use uring::{blockdev_size, rw_entry, UringEngine};

/// One operation on the disk. Offsets and lengths are in bytes and already range-checked.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// Read into the iovecs at `offset`.
    Read {
        /// Byte offset.
        offset: u64,
        /// Host iovecs (guest memory), valid and writable until the operation completes.
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
        /// Host iovecs (guest memory), valid until the operation completes.
        iovs: *const libc::iovec,
        /// Number of iovecs.
        iovcnt: u32,
        /// Durable before completion (write-through cache mode).
        sync: bool,
        /// The io_uring registered buffer holding the single iovec, if there is one.
        buf_index: Option<u16>,
    },
    /// Make completed writes durable.
    Flush,
    /// Deallocate a range.
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

/// How a channel took an operation.
#[derive(Debug)]
pub enum Started {
    /// Perform this entry on the thread's io_uring; its completion is the result.
    Ring(squeue::Entry),
    /// Perform this 128-byte entry (an NVMe passthrough command) on the thread's ring, which
    /// is wide because the engine asked for it ([`Engine::wide_entries`]); its completion,
    /// through [`Channel::wide_result`], is the result. All or nothing: success means every
    /// byte was transferred.
    WideRing(squeue::Entry128),
    /// In flight on the engine's own completion source; [`Channel::reap`] returns it later
    /// with the token it was started with.
    Pending,
    /// Already completed with this result (bytes transferred, or a negative errno).
    Done(i32),
}

/// Where an engine reports a failure it contained outside the I/O threads (a qcow2 image
/// given up), as `(who, why)`: the export then shows it failed and disconnects its frontend,
/// as for an I/O thread that died.
pub type FailureReport = std::sync::Arc<dyn Fn(&str, &str) + Send + Sync>;

/// An export's storage, shared by its I/O threads.
pub trait Engine: Send + Sync {
    /// Short name for logs and reports.
    fn name(&self) -> &'static str;
    /// Capacity in bytes (a multiple of 512).
    fn capacity(&self) -> u64;
    /// Logical block size the backing store needs for its I/O (512 or 4096).
    fn block_size(&self) -> u32;
    /// A new channel for the calling I/O thread, which owns it from then on.
    fn channel(&self) -> io::Result<Box<dyn Channel>>;
    /// Changes the capacity: to `size` bytes (a positive multiple of 512: the device checks it
    /// first), or (`None`) to what the backing store now holds (a file or block device resized
    /// by someone else). Returns the new capacity.
    fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError>;
    /// Writes back what completed writes left in a cache of this host (a file opened without
    /// O_DIRECT keeps them in the page cache), so that another host sharing the storage reads
    /// them: after a live migration the destination's backend serves the disk. Engines with no
    /// such cache have nothing to do.
    fn sync_host_cache(&self) -> io::Result<()> {
        Ok(())
    }
    /// Re-reads whatever this engine caches of the storage's own state. Called when a ring
    /// of an export starts while none of its other rings runs, so no request is in flight:
    /// another host's backend (the source of a live migration) may have changed the storage
    /// since this one opened it. Engines that cache nothing have nothing to do.
    ///
    /// An error of kind `ResourceBusy` says the storage is not free yet (another process's
    /// conflicting lock, another server's mark): the session tries again until it is. Any
    /// other error leaves the ring stopped until the frontend starts it again.
    fn refresh(&self) -> io::Result<()> {
        Ok(())
    }
    /// Called when the last started ring of an export stops (GET_VRING_BASE): no request is
    /// in flight, and none comes until a ring starts again, after [`Engine::refresh`]. The
    /// storage's next writer may be another backend (a live migration's destination): an
    /// engine whose image allows one writer lets go of it here, and takes it again in
    /// `refresh`. Engines that hold nothing have nothing to do.
    fn deactivate(&self) {}
    /// Takes an external snapshot: the storage as it is becomes read-only (a consistent image
    /// at `overlay`'s backing), and every write from now on goes to a new image at `overlay`
    /// over it. Called with no request in flight and none starting until it returns.
    fn snapshot(&self, overlay: &std::path::Path) -> Result<(), SnapshotError> {
        let _ = overlay;
        Err(SnapshotError::Unsupported(self.name()))
    }
    /// The io_uring opcodes of the entries its channels hand their I/O thread's ring
    /// ([`Started::Ring`]): the ring of a confined daemon accepts only those and its own.
    fn ring_opcodes(&self) -> &'static [u8] {
        &[]
    }
    /// Whether its channels start operations as 128-byte entries ([`Started::WideRing`]), so
    /// that the I/O threads' rings must be set up with `IORING_SETUP_SQE128 | CQE32`.
    fn wide_entries(&self) -> bool {
        false
    }
    /// What the storage can take in one operation, and which operations it has at all.
    fn limits(&self) -> Limits {
        Limits::default()
    }
    /// The bytes of the daemon's budget for qcow2 tables it holds (a qcow2 engine's
    /// [`TableLease`](qcow2::table_budget::TableLease)); `None` for the others.
    fn table_memory(&self) -> Option<u64> {
        None
    }
    /// What a qcow2 engine's metadata path has done; `None` for the others.
    fn metadata_counters(&self) -> Option<qcow2::MetadataCounters> {
        None
    }
    /// Where to report the failures it contains on its own (see [`FailureReport`]); engines
    /// that have none ignore it.
    fn report_failures_to(&self, report: FailureReport) {
        let _ = report;
    }
}

/// What an engine's storage can take; the device advertises what follows from it, and the
/// I/O threads split a request that exceeds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes one read or write may carry (a multiple of the block size), if limited.
    pub max_transfer: Option<u32>,
    /// Most iovecs one read or write may carry, if fewer than the I/O threads' own bound.
    pub max_segments: Option<u32>,
    /// Whether it deallocates ranges (discard is offered to the guest).
    pub discard: bool,
    /// Whether it zeroes ranges (write-zeroes is offered to the guest).
    pub write_zeroes: bool,
    /// Most 512-byte sectors one discard may cover.
    pub max_discard_sectors: u32,
    /// Most 512-byte sectors one write-zeroes may cover.
    pub max_write_zeroes_sectors: u32,
    /// Whether a write-zeroes may deallocate (`VIRTIO_BLK_F_WRITE_ZEROES`' `unmap` honoured).
    pub write_zeroes_may_unmap: bool,
    /// Whether the channels cut reads and writes where the storage behind them stops being
    /// contiguous ([`Channel::run_end`]): the I/O thread then starts each run as a part of
    /// its own.
    pub cuts_runs: bool,
}

/// Largest discard / write-zeroes an engine takes unless it says otherwise, in sectors (512
/// MiB).
pub const MAX_DWZ_SECTORS: u32 = 1 << 20;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_transfer: None,
            max_segments: None,
            discard: true,
            write_zeroes: true,
            max_discard_sectors: MAX_DWZ_SECTORS,
            max_write_zeroes_sectors: MAX_DWZ_SECTORS,
            write_zeroes_may_unmap: true,
            cuts_runs: false,
        }
    }
}

/// Why a snapshot was not taken. Each message is one line for the operator.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Only qcow2 images have snapshots.
    #[error("engine {0} takes no snapshots: serve a qcow2 image (format=qcow2) to have them")]
    Unsupported(&'static str),
    /// A read-only export has nothing to write an overlay for.
    #[error("the export is read-only: a snapshot is for an image that is written")]
    ReadOnly,
    /// The overlay could not be made or opened.
    #[error(transparent)]
    Open(#[from] OpenError),
}

/// Why an export could not be resized. Each message is one line for the operator.
#[derive(Debug, thiserror::Error)]
pub enum ResizeError {
    /// The size is zero or not a multiple of 512.
    #[error("size {0} is not a positive multiple of 512 bytes")]
    BadSize(u64),
    /// This engine needs the new size given.
    #[error("engine={0} has no backing store to re-read: give the new size")]
    SizeNeeded(&'static str),
    /// A block device's size is its own.
    #[error("a block device cannot be resized by mqblk ({actual} bytes): resize the device, then resize the export without a size")]
    BlockDevice {
        /// The device's size.
        actual: u64,
    },
    /// An NVMe namespace's size is its controller's.
    #[error("an NVMe namespace cannot be resized by mqblk ({actual} bytes): resize the namespace, then resize the export without a size")]
    Namespace {
        /// The namespace's size.
        actual: u64,
    },
    /// A qcow2 image only grows while it is served.
    #[error("a qcow2 image is only grown by mqblk (it is {actual} bytes): shrink it offline with `qemu-img resize --shrink`")]
    Shrink {
        /// The image's size.
        actual: u64,
    },
    /// The backing store could not be resized or measured.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// One I/O thread's way to its engine. Never shared between threads.
///
/// Starting an operation hands the engine raw memory (the iovecs of [`Op::Read`] and
/// [`Op::Write`]), which it, or the kernel on its behalf, reads or writes after `start`
/// returns: hence `start` and `retry` are `unsafe`, and their caller answers for the memory.
pub trait Channel {
    /// Starts `op`. `token` names it in [`Channel::reap`] (for [`Started::Pending`]).
    ///
    /// # Safety
    ///
    /// For [`Op::Read`] and [`Op::Write`], `iovs` must point to `iovcnt` initialised iovecs,
    /// each describing memory that is valid for writes (a read) or reads (a write) for
    /// `iov_len` bytes; the iovec array and that memory must stay valid until the operation
    /// has completed: at once for [`Started::Done`], on its ring completion for
    /// [`Started::Ring`], when [`Channel::reap`] returns its token for [`Started::Pending`].
    unsafe fn start(&mut self, op: &Op, token: u64) -> Started;
    /// `op` failed with `res` (a negative errno): start it again differently, or `None` to let
    /// the failure stand. The same token names the retry.
    ///
    /// # Safety
    ///
    /// As for [`Channel::start`].
    unsafe fn retry(&mut self, op: &Op, res: i32, token: u64) -> Option<Started> {
        let _ = (op, res, token);
        None
    }
    /// Where the run of a read or write from `offset` (of `len` bytes) that this channel takes
    /// as one operation ends, at most `offset + len`: an engine whose storage maps guest
    /// offsets piecewise (a qcow2 image's clusters) cuts where a piece ends, and the I/O thread
    /// starts the rest as further parts. Called only for engines whose [`Limits::cuts_runs`].
    fn run_end(&self, offset: u64, len: u64) -> u64 {
        offset + len
    }
    /// The descriptor every [`Started::Ring`] entry names, if there is one: the thread may
    /// register it as a fixed file (slot = the descriptor number) and mark the entries
    /// `IOSQE_FIXED_FILE`.
    fn file_fd(&self) -> Option<RawFd> {
        None
    }
    /// A descriptor that becomes readable when [`Started::Pending`] operations completed.
    fn completion_fd(&self) -> Option<RawFd> {
        None
    }
    /// Hands over the completed pending operations: `(token, result)` each.
    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        let _ = done;
    }
    /// The thread has started (and retried) what its round had: a channel that hands
    /// [`Started::Pending`] operations to a thread of its own wakes that thread here, once a
    /// round rather than once an operation. Called every round, before the thread may sleep.
    fn end_round(&mut self) {}
    /// The result of a [`Started::WideRing`] entry's completion as the kernel posted it (for
    /// NVMe passthrough: 0, a positive NVMe status, or a negative errno), as 0 for success or
    /// a negative errno. Channels that build no wide entries never see one.
    fn wide_result(&mut self, res: i32) -> i32 {
        res.min(0)
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
    /// The Ceph cluster, pool or image of an rbd export.
    #[cfg(feature = "rbd")]
    #[error(transparent)]
    Rbd(#[from] rbd::RbdError),
    /// An NVMe namespace engine=nvme cannot serve (see [`nvme::NvmeError`]).
    #[error(transparent)]
    Nvme(#[from] nvme::NvmeError),
    /// Another process has the image open in a way this export cannot share.
    #[error(transparent)]
    Locked(#[from] image_lock::LockError),
    /// A qcow2 image mqblk cannot serve (see [`Qcow2Error`](crate::format::qcow2::Qcow2Error)).
    #[error(transparent)]
    Qcow2(#[from] crate::format::qcow2::Qcow2Error),
    /// A qcow2 export whose tables would take the daemon past `--table-memory-total`.
    #[error(transparent)]
    TableMemory(#[from] qcow2::table_budget::OverBudget),
    /// An engine this build does not have.
    #[error("engine={0} is not in this build of mqblk: build it with --features {0}")]
    NotBuilt(&'static str),
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

/// Opens the storage of an export.
pub fn open(cfg: &ExportConfig) -> Result<Box<dyn Engine>, OpenError> {
    let size = cfg.size.unwrap_or(0);
    if let Some(path) = cfg.path.as_deref().filter(|p| p.exists()) {
        note_kept_allocation(path, cfg);
    }
    Ok(match cfg.engine {
        EngineKind::Null => Box::new(NullEngine::new(size, cfg.read_zeroes)),
        EngineKind::Mem => Box::new(mem::open(size)?),
        EngineKind::Uring if cfg.format == ImageFormat::Qcow2 => Box::new(qcow2::open(cfg)?),
        EngineKind::Uring => {
            let path = cfg
                .path
                .as_deref()
                .expect("config checked: uring has a path");
            Box::new(uring::open_file(
                path,
                cfg.size,
                cfg.readonly,
                cfg.direct,
                cfg.preallocation,
            )?)
        }
        EngineKind::Nvme => {
            let path = cfg
                .path
                .as_deref()
                .expect("config checked: nvme has a path");
            Box::new(nvme::open(path, cfg.size, cfg.readonly)?)
        }
        #[cfg(feature = "rbd")]
        EngineKind::Rbd => Box::new(rbd::open(cfg)?),
        // The config refuses engine=rbd in such a build; an engine built by hand gets this.
        #[cfg(not(feature = "rbd"))]
        EngineKind::Rbd => return Err(OpenError::NotBuilt("rbd")),
    })
}

/// Says that `preallocation=` leaves the existing image `path` as it is: an operator who gave
/// it may expect the image to be preallocated.
fn note_kept_allocation(path: &Path, cfg: &ExportConfig) {
    if cfg.preallocation == Preallocation::Off {
        return;
    }
    let given = keys::key("preallocation")
        .and_then(|k| k.show(cfg))
        .unwrap_or_default();
    tracing::info!(
        path = %path.display(),
        "the image exists and keeps the space it has: preallocation={given} applies to an image \
         mqblk creates and to what export_resize adds"
    );
}

/// The bytes an operation's iovecs describe.
///
/// # Safety
/// For reads and writes, `iovs` must point to `iovcnt` valid iovecs.
pub(crate) unsafe fn op_bytes(op: &Op) -> u64 {
    match *op {
        Op::Read { iovs, iovcnt, .. } | Op::Write { iovs, iovcnt, .. } => {
            // SAFETY: the caller's contract.
            let iovs = unsafe { std::slice::from_raw_parts(iovs, iovcnt as usize) };
            iovs.iter().map(|v| v.iov_len as u64).sum()
        }
        _ => 0,
    }
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
    fn mem_goes_through_the_ring_and_null_completes_at_once() {
        let e = open(&parse_export_spec("socket=s,engine=mem,size=4M").unwrap()).unwrap();
        assert_eq!((e.name(), e.capacity()), ("mem", 4 << 20));
        let mut ch = e.channel().unwrap();
        // SAFETY: a flush carries no memory.
        let started = unsafe { ch.start(&Op::Flush, 7) };
        assert!(matches!(started, Started::Ring(_)));
        assert!(ch.file_fd().is_some());

        let e = open(&parse_export_spec("socket=s,engine=null,size=4M").unwrap()).unwrap();
        let mut ch = e.channel().unwrap();
        // SAFETY: a flush carries no memory.
        let started = unsafe { ch.start(&Op::Flush, 7) };
        assert!(matches!(started, Started::Done(0)));
        // A null read zeroes the buffers and reports every byte transferred.
        let mut buf = vec![0xaau8; 8192];
        let iovs = [
            libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: 4096,
            },
            libc::iovec {
                iov_base: buf[4096..].as_mut_ptr().cast(),
                iov_len: 4096,
            },
        ];
        let read = Op::Read {
            offset: 0,
            iovs: iovs.as_ptr(),
            iovcnt: 2,
            buf_index: None,
        };
        // SAFETY: two iovecs over `buf`, which outlives the (immediate) completion.
        let started = unsafe { ch.start(&read, 1) };
        assert!(matches!(started, Started::Done(8192)));
        assert!(buf.iter().all(|&b| b == 0));

        // With read-zeroes=off the buffers keep what they held, and the read still counts.
        let e = open(&parse_export_spec("socket=s,engine=null,size=4M,read-zeroes=off").unwrap())
            .unwrap();
        let mut ch = e.channel().unwrap();
        buf.fill(0xaa);
        // SAFETY: as above.
        let started = unsafe { ch.start(&read, 2) };
        assert!(matches!(started, Started::Done(8192)));
        assert!(buf.iter().all(|&b| b == 0xaa));
    }
}
