//! Connection setup: libblkio's `virtio-blk-vhost-user` driver connected to a socket and
//! started, buffers mapped for the device, and libblkio's errors turned into messages.

use std::ffi::CStr;
use std::path::Path;

use anyhow::bail;
use blkio::{Blkio, Blkioq, Completion, Errno, MemoryRegion};

/// libblkio driver name used for every connection.
pub const DRIVER: &str = "virtio-blk-vhost-user";

const PAGE_SIZE: usize = 4096;

/// How to connect. [`ConnectOptions::new`] gives one interrupt-driven queue, the default queue
/// size, and read-only auto-detection.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Number of virtqueues to set up (must not exceed what the device offers).
    pub num_queues: usize,
    /// Virtqueue size (power of two). `None`: libblkio's default (256).
    pub queue_size: Option<u32>,
    /// Use poll queues (completion by busy-polling the used ring, no call eventfd waits).
    pub poll: bool,
    /// `Some(true)`: connect read-only. `Some(false)`: connect read-write and fail if the device is
    /// read-only. `None`: read-write if the device allows it, else read-only (this costs a second
    /// connection when the device is read-only, because libblkio's `read-only` property can only
    /// be set before connecting).
    pub read_only: Option<bool>,
}

impl ConnectOptions {
    /// `num_queues` interrupt-driven queues of libblkio's default size, read-only auto-detected.
    pub fn new(num_queues: usize) -> Self {
        Self {
            num_queues,
            queue_size: None,
            poll: false,
            read_only: None,
        }
    }
}

/// An established, started libblkio connection.
///
/// Field order matters: the queues point into virtqueue memory owned by the driver inside `blkio`,
/// so they are dropped first.
pub(crate) struct Connection {
    pub(crate) queues: Vec<Blkioq>,
    pub(crate) blkio: Blkio,
    pub(crate) read_only: bool,
}

impl Connection {
    /// Disk size in bytes, from the device's config space.
    pub(crate) fn capacity(&self) -> anyhow::Result<u64> {
        self.blkio
            .get_u64("capacity")
            .map_err(|e| blkio_err("reading capacity", e))
    }
}

/// Connects to `socket` and starts the device, connecting again read-only where
/// [`ConnectOptions::read_only`] leaves it open and the device is read-only.
pub(crate) fn open(socket: &Path, opts: &ConnectOptions) -> anyhow::Result<Connection> {
    let first = opts.read_only.unwrap_or(false);
    match try_open(socket, opts, first) {
        Ok(c) => Ok(c),
        Err(StartError::ReadOnly) if opts.read_only.is_none() => {
            tracing::debug!("{} is read-only, reconnecting read-only", socket.display());
            try_open(socket, opts, true).map_err(|e| match e {
                StartError::ReadOnly => anyhow::anyhow!("device refused a read-only connection"),
                StartError::Other(e) => e,
            })
        }
        Err(StartError::ReadOnly) => {
            bail!(
                "{} is a read-only device (VIRTIO_BLK_F_RO)",
                socket.display()
            )
        }
        Err(StartError::Other(e)) => Err(e),
    }
}

/// Why one attempt to connect and start failed.
enum StartError {
    /// The device offers VIRTIO_BLK_F_RO and we connected read-write.
    ReadOnly,
    Other(anyhow::Error),
}

impl StartError {
    /// For `map_err`: a libblkio failure while doing `what`.
    fn other(what: &str) -> impl FnOnce(blkio::Error) -> StartError + '_ {
        move |e| StartError::Other(blkio_err(what, e))
    }
}

/// Connects and starts. Returns the libblkio error unwrapped where the caller needs its errno.
fn try_open(
    socket: &Path,
    opts: &ConnectOptions,
    read_only: bool,
) -> Result<Connection, StartError> {
    let path = socket.to_str().ok_or_else(|| {
        StartError::Other(anyhow::anyhow!("socket path is not UTF-8: {socket:?}"))
    })?;
    let mut blkio = Blkio::new(DRIVER).map_err(StartError::other("blkio_new"))?;
    blkio
        .set_str("path", path)
        .map_err(StartError::other("setting path"))?;
    blkio
        .set_bool("read-only", read_only)
        .map_err(StartError::other("setting read-only"))?;
    blkio.connect().map_err(StartError::other(&format!(
        "connecting to {}",
        socket.display()
    )))?;

    let max_queues = blkio
        .get_i32("max-queues")
        .map_err(StartError::other("reading max-queues"))?;
    if opts.num_queues == 0 || opts.num_queues > max_queues as usize {
        return Err(StartError::Other(anyhow::anyhow!(
            "{} queues requested, the device offers {max_queues}",
            opts.num_queues
        )));
    }
    let n = opts.num_queues as i32;
    let (normal, polled) = if opts.poll { (0, n) } else { (n, 0) };
    let mut set_i32 = |name: &str, value: i32| {
        blkio
            .set_i32(name, value)
            .map_err(StartError::other(&format!("setting {name}")))
    };
    set_i32("num-queues", normal)?;
    set_i32("num-poll-queues", polled)?;
    if let Some(qs) = opts.queue_size {
        set_i32("queue-size", qs as i32)?;
    }
    match blkio.start() {
        Ok(out) => {
            let queues = if opts.poll {
                out.poll_queues
            } else {
                out.queues
            };
            Ok(Connection {
                queues,
                blkio,
                read_only,
            })
        }
        Err(e) if e.errno() == Errno::ROFS => Err(StartError::ReadOnly),
        Err(e) => Err(StartError::Other(blkio_err("starting", e))),
    }
}

/// Allocates and maps a memory region of at least `len` bytes (rounded up to a page).
pub(crate) fn map_buffer(blkio: &mut Blkio, len: usize) -> anyhow::Result<MemoryRegion> {
    let align = (blkio
        .get_u64("mem-region-alignment")
        .map_err(|e| blkio_err("reading mem-region-alignment", e))? as usize)
        .max(PAGE_SIZE);
    let len = len.max(1).div_ceil(align) * align;
    let region = blkio
        .alloc_mem_region(len)
        .map_err(|e| blkio_err("allocating buffer memory", e))?;
    if let Err(e) = blkio.map_mem_region(&region) {
        blkio.free_mem_region(&region);
        return Err(blkio_err("mapping buffer memory into the device", e));
    }
    Ok(region)
}

/// A libblkio error as a message: what we were doing, libblkio's message, the errno.
pub(crate) fn blkio_err(what: &str, e: blkio::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "{what}: {} (errno {})",
        e.message(),
        e.errno().raw_os_error()
    )
}

/// A completion's positive errno by name, with the system's text for it.
pub(crate) fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EIO => "EIO",
        libc::ENOTSUP => "ENOTSUP",
        libc::EPROTO => "EPROTO",
        libc::EBADF => "EBADF",
        libc::EINVAL => "EINVAL",
        libc::EROFS => "EROFS",
        libc::ETIME => "ETIME",
        libc::ENOSPC => "ENOSPC",
        _ => {
            return format!(
                "errno {errno}: {}",
                std::io::Error::from_raw_os_error(errno)
            )
        }
    };
    format!("{name}: {}", std::io::Error::from_raw_os_error(errno))
}

/// Error message libblkio attached to a completion, if any (static strings inside libblkio).
pub(crate) fn completion_msg(c: &Completion) -> Option<String> {
    if c.error_msg.is_null() {
        None
    } else {
        // SAFETY: libblkio only stores pointers to `'static` NUL-terminated strings here.
        Some(
            unsafe { CStr::from_ptr(c.error_msg) }
                .to_string_lossy()
                .into_owned(),
        )
    }
}
