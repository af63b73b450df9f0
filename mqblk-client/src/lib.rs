//! Built-in vhost-user-blk client: connect to a vhost-user-blk socket with libblkio's
//! `virtio-blk-vhost-user` driver and run a workload or single requests against it.
//!
//! Two entry points:
//!
//! * [`run`] drives a [`Workload`]: `jobs` jobs, each with `iodepth` requests in flight on its own
//!   slice of the disk, over `num_queues` virtqueues of one connection. It is what `mqblk demo` and
//!   `mqblk bench` use, and it reports IOPS, throughput and latency percentiles ([`Report`]).
//! * [`Client`] issues one request at a time on a chosen queue and returns its status. It is what
//!   the integration tests use to probe the daemon's behaviour request by request.
//!
//! Data written by [`Pattern::Verify`] is a function of the absolute byte offset and a seed
//! ([`fill_pattern`]/[`check_pattern`]), so data that lands at the wrong offset, stale data and
//! data from another run are all detected, also when the image file is read directly on the host.
//!
//! # libblkio facts this module relies on
//!
//! * libblkio's virtio-blk driver uses 3 descriptors per request (header, data, status; discard and
//!   write-zeroes: header, segment, status) and no indirect descriptors, so a queue of size `n`
//!   holds `n / 3` requests; more are kept on libblkio's own backlog (which allocates).
//! * Buffers must lie in memory regions mapped with [`Blkio::map_mem_region`]: the backend can
//!   only access memory it was told about.
//! * If the device offers `VIRTIO_BLK_F_RO`, `start()` fails with `EROFS` unless the `read-only`
//!   property was set before `connect()`; libblkio then fails writes, discards and write-zeroes
//!   itself (`EBADF`) without sending them to the device.
//! * libblkio does not check requests against the capacity; out-of-range requests reach the
//!   device. Device status `IOERR` completes with `-EIO`, `UNSUPP` with `-ENOTSUP`, anything else
//!   with `-EPROTO`.

use std::ffi::CStr;
use std::fmt;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use blkio::{Blkio, Blkioq, Completion, Errno, MemoryRegion};

/// Request flags for [`Client::write_flags`] (libblkio's).
pub use blkio::ReqFlags;

/// libblkio driver name used for every connection.
pub const DRIVER: &str = "virtio-blk-vhost-user";

/// Largest queue size asked for by default: libvhost-user (qemu-storage-daemon) and mqblk's
/// default both accept 1024 but not more.
const MAX_DEFAULT_QUEUE_SIZE: u32 = 1024;

/// Descriptors libblkio uses per request.
const DESCRIPTORS_PER_REQUEST: usize = 3;

const PAGE_SIZE: usize = 4096;

// ---------------------------------------------------------------------------------------------
// Connection setup
// ---------------------------------------------------------------------------------------------

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
struct Connection {
    queues: Vec<Blkioq>,
    blkio: Blkio,
    read_only: bool,
}

fn blkio_err(what: &str, e: blkio::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "{what}: {} (errno {})",
        e.message(),
        e.errno().raw_os_error()
    )
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
    let mut blkio = Blkio::new(DRIVER).map_err(|e| StartError::Other(blkio_err("blkio_new", e)))?;
    blkio
        .set_str("path", path)
        .map_err(|e| StartError::Other(blkio_err("setting path", e)))?;
    blkio
        .set_bool("read-only", read_only)
        .map_err(|e| StartError::Other(blkio_err("setting read-only", e)))?;
    blkio.connect().map_err(|e| {
        StartError::Other(blkio_err(&format!("connecting to {}", socket.display()), e))
    })?;

    let max_queues = blkio
        .get_i32("max-queues")
        .map_err(|e| StartError::Other(blkio_err("reading max-queues", e)))?;
    if opts.num_queues == 0 || opts.num_queues > max_queues as usize {
        return Err(StartError::Other(anyhow::anyhow!(
            "{} queues requested, the device offers {max_queues}",
            opts.num_queues
        )));
    }
    let n = opts.num_queues as i32;
    let (normal, polled) = if opts.poll { (0, n) } else { (n, 0) };
    blkio
        .set_i32("num-queues", normal)
        .map_err(|e| StartError::Other(blkio_err("setting num-queues", e)))?;
    blkio
        .set_i32("num-poll-queues", polled)
        .map_err(|e| StartError::Other(blkio_err("setting num-poll-queues", e)))?;
    if let Some(qs) = opts.queue_size {
        blkio
            .set_i32("queue-size", qs as i32)
            .map_err(|e| StartError::Other(blkio_err("setting queue-size", e)))?;
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

enum StartError {
    /// The device offers VIRTIO_BLK_F_RO and we connected read-write.
    ReadOnly,
    Other(anyhow::Error),
}

fn open(socket: &Path, opts: &ConnectOptions) -> anyhow::Result<Connection> {
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

/// Allocates and maps a memory region of at least `len` bytes (rounded up to a page).
fn map_buffer(blkio: &mut Blkio, len: usize) -> anyhow::Result<MemoryRegion> {
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

fn errno_name(errno: i32) -> String {
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
fn completion_msg(c: &Completion) -> Option<String> {
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

// ---------------------------------------------------------------------------------------------
// Client: one request at a time
// ---------------------------------------------------------------------------------------------

/// Why a single request did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The request completed with an error. `errno` is positive: `EIO` for device status IOERR,
    /// `ENOTSUP` for UNSUPP, `EPROTO` for an invalid status byte; `EBADF` (read-only device),
    /// `EINVAL` (misaligned) and `ENOTSUP` (feature not offered) when libblkio refused the request
    /// itself, in which case `msg` says so.
    #[error("request failed: {}{}", errno_name(*errno), msg.as_ref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Failed {
        /// Positive errno.
        errno: i32,
        /// libblkio's message when it failed the request itself.
        msg: Option<String>,
    },
    /// No completion arrived in time. The request may still be in flight.
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    /// libblkio failed while waiting (for instance the connection is broken).
    #[error("libblkio: {0}")]
    Driver(String),
    /// The request was not submitted: bad queue index, buffer too large, ...
    #[error("{0}")]
    Usage(String),
}

impl IoError {
    /// The completion's errno, if the request completed with an error.
    pub fn errno(&self) -> Option<i32> {
        match self {
            IoError::Failed { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

/// A connection that issues one request at a time on a chosen queue and waits for it.
///
/// Data goes through a bounce buffer in a memory region shared with the device; it grows (a new
/// region is mapped, the old one unmapped) when a larger request comes along.
pub struct Client {
    conn: Connection,
    buf: MemoryRegion,
    completions: Vec<MaybeUninit<Completion>>,
    capacity: u64,
    tag: usize,
    timeout: Duration,
}

impl Client {
    /// Connects with `num_queues` interrupt-driven queues, auto-detecting a read-only device.
    pub fn connect(socket: impl AsRef<Path>, num_queues: usize) -> anyhow::Result<Self> {
        Self::connect_with(socket, &ConnectOptions::new(num_queues))
    }

    /// Connects with the given options.
    pub fn connect_with(socket: impl AsRef<Path>, opts: &ConnectOptions) -> anyhow::Result<Self> {
        let socket = socket.as_ref();
        let mut conn = open(socket, opts)?;
        let capacity = conn
            .blkio
            .get_u64("capacity")
            .map_err(|e| blkio_err("reading capacity", e))?;
        let buf = map_buffer(&mut conn.blkio, 1 << 20)?;
        let mut completions = Vec::with_capacity(64);
        completions.resize_with(64, MaybeUninit::uninit);
        Ok(Self {
            conn,
            buf,
            completions,
            capacity,
            tag: 0,
            timeout: Duration::from_secs(10),
        })
    }

    /// How long a request may take before [`IoError::Timeout`] (default 10 s).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Disk size in bytes, as the device reports it in its config space.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether the connection is read-only (the device offers `VIRTIO_BLK_F_RO`, or
    /// [`ConnectOptions::read_only`] asked for it).
    pub fn is_read_only(&self) -> bool {
        self.conn.read_only
    }

    /// Number of queues set up.
    pub fn num_queues(&self) -> usize {
        self.conn.queues.len()
    }

    /// The underlying libblkio instance, to read properties such as `request-alignment`,
    /// `max-discard-len`, `max-write-zeroes-len`, `flush-needed`, `max-queues`, `max-transfer`.
    pub fn blkio(&self) -> &Blkio {
        &self.conn.blkio
    }

    /// A `u64` libblkio property, `None` if it cannot be read.
    pub fn prop_u64(&self, name: &str) -> Option<u64> {
        self.conn.blkio.get_u64(name).ok()
    }

    /// An `i32` libblkio property, `None` if it cannot be read.
    pub fn prop_i32(&self, name: &str) -> Option<i32> {
        self.conn.blkio.get_i32(name).ok()
    }

    /// Logical block size (libblkio's `request-alignment`: `blk_size` from config space, or 512).
    pub fn block_size(&self) -> u32 {
        self.prop_i32("request-alignment").unwrap_or(512) as u32
    }

    fn ensure_buf(&mut self, len: usize) -> Result<(), IoError> {
        if len <= self.buf.len {
            return Ok(());
        }
        let new =
            map_buffer(&mut self.conn.blkio, len).map_err(|e| IoError::Driver(format!("{e:#}")))?;
        let old = std::mem::replace(&mut self.buf, new);
        self.conn.blkio.unmap_mem_region(&old);
        self.conn.blkio.free_mem_region(&old);
        Ok(())
    }

    fn submit_wait(
        &mut self,
        q: usize,
        submit: impl FnOnce(&mut Blkioq, usize),
    ) -> Result<(), IoError> {
        let nq = self.conn.queues.len();
        let queue = self
            .conn
            .queues
            .get_mut(q)
            .ok_or_else(|| IoError::Usage(format!("queue {q} does not exist ({nq} queues)")))?;
        self.tag = self.tag.wrapping_add(1);
        let tag = self.tag;
        submit(queue, tag);
        let deadline = Instant::now() + self.timeout;
        loop {
            let mut left = deadline.saturating_duration_since(Instant::now());
            match queue.do_io(&mut self.completions, 1, Some(&mut left), None) {
                Ok(n) => {
                    for c in &self.completions[..n] {
                        // SAFETY: do_io initialised the first n entries.
                        let c = unsafe { c.assume_init_ref() };
                        // Completions with other tags belong to requests that timed out earlier.
                        if c.user_data == tag {
                            return if c.ret == 0 {
                                Ok(())
                            } else {
                                Err(IoError::Failed {
                                    errno: -c.ret,
                                    msg: completion_msg(c),
                                })
                            };
                        }
                    }
                }
                Err(e) if e.errno() == Errno::TIME => return Err(IoError::Timeout(self.timeout)),
                Err(e) => return Err(IoError::Driver(format!("{} ({})", e.message(), e.errno()))),
            }
        }
    }

    /// Reads `buf.len()` bytes at `offset` on queue `q`.
    pub fn read(&mut self, q: usize, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.ensure_buf(buf.len())?;
        let (addr, len) = (self.buf.addr as *mut u8, buf.len());
        self.submit_wait(q, |queue, tag| {
            queue.read(offset, addr, len, tag, ReqFlags::empty())
        })?;
        // SAFETY: the region is mapped, at least `len` long, and the request has completed.
        buf.copy_from_slice(unsafe { std::slice::from_raw_parts(addr, len) });
        Ok(())
    }

    /// Reads `len` bytes at `offset` on queue `q` into a new vector.
    pub fn read_vec(&mut self, q: usize, offset: u64, len: usize) -> Result<Vec<u8>, IoError> {
        let mut v = vec![0u8; len];
        self.read(q, offset, &mut v)?;
        Ok(v)
    }

    /// Writes `data` at `offset` on queue `q`.
    pub fn write(&mut self, q: usize, offset: u64, data: &[u8]) -> Result<(), IoError> {
        self.write_flags(q, offset, data, ReqFlags::empty())
    }

    /// Writes with libblkio request flags (e.g. [`ReqFlags::FUA`]).
    pub fn write_flags(
        &mut self,
        q: usize,
        offset: u64,
        data: &[u8],
        flags: ReqFlags,
    ) -> Result<(), IoError> {
        self.ensure_buf(data.len())?;
        let (addr, len) = (self.buf.addr as *mut u8, data.len());
        // SAFETY: the region is mapped and at least `len` long; no request is using it.
        unsafe { std::slice::from_raw_parts_mut(addr, len) }.copy_from_slice(data);
        self.submit_wait(q, |queue, tag| queue.write(offset, addr, len, tag, flags))
    }

    /// Flushes the device's write cache (libblkio completes it locally, successfully, if the
    /// device does not offer `VIRTIO_BLK_F_FLUSH`).
    pub fn flush(&mut self, q: usize) -> Result<(), IoError> {
        self.submit_wait(q, |queue, tag| queue.flush(tag, ReqFlags::empty()))
    }

    /// Discards `len` bytes at `offset`.
    pub fn discard(&mut self, q: usize, offset: u64, len: u64) -> Result<(), IoError> {
        self.submit_wait(q, |queue, tag| {
            queue.discard(offset, len, tag, ReqFlags::empty())
        })
    }

    /// Writes zeroes to `len` bytes at `offset`; `unmap` lets the device deallocate the range
    /// (VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP).
    pub fn write_zeroes(
        &mut self,
        q: usize,
        offset: u64,
        len: u64,
        unmap: bool,
    ) -> Result<(), IoError> {
        let flags = if unmap {
            ReqFlags::empty()
        } else {
            ReqFlags::NO_UNMAP
        };
        self.submit_wait(q, |queue, tag| queue.write_zeroes(offset, len, tag, flags))
    }
}

// ---------------------------------------------------------------------------------------------
// Data pattern
// ---------------------------------------------------------------------------------------------

#[inline]
fn mix64(mut z: u64) -> u64 {
    // splitmix64 finaliser
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[inline]
fn pattern_word(seed: u64, pos: u64) -> u64 {
    mix64(pos ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Fills `buf` with the pattern for disk bytes `offset..offset + buf.len()` under `seed`: every
/// 8-byte little-endian word is a hash of its absolute disk position and the seed.
///
/// `offset` and `buf.len()` must be multiples of 8.
pub fn fill_pattern(buf: &mut [u8], offset: u64, seed: u64) {
    debug_assert!(offset.is_multiple_of(8) && buf.len().is_multiple_of(8));
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&pattern_word(seed, offset + 8 * i as u64).to_le_bytes());
    }
}

/// Checks `buf` against the pattern for disk bytes starting at `offset`. Returns the disk offset
/// of the first wrong byte's word, or `None` if all match.
pub fn check_pattern(buf: &[u8], offset: u64, seed: u64) -> Option<u64> {
    debug_assert!(offset.is_multiple_of(8) && buf.len().is_multiple_of(8));
    for (i, w) in buf.chunks_exact(8).enumerate() {
        let pos = offset + 8 * i as u64;
        if u64::from_le_bytes(w.try_into().unwrap()) != pattern_word(seed, pos) {
            return Some(pos);
        }
    }
    None
}

/// Splits `len` bytes starting at `offset` evenly into `jobs` block-aligned regions
/// `(offset, len)`, the way [`run`] assigns them to jobs. The tail that does not divide evenly is
/// left unused.
pub fn job_regions(
    offset: u64,
    len: u64,
    jobs: usize,
    block_size: usize,
) -> anyhow::Result<Vec<(u64, u64)>> {
    ensure!(jobs > 0, "jobs must be at least 1");
    let bs = block_size as u64;
    let per = len / jobs as u64 / bs * bs;
    ensure!(
        per > 0,
        "region of {len} bytes is too small for {jobs} jobs of {block_size}-byte blocks"
    );
    Ok((0..jobs as u64).map(|i| (offset + i * per, per)).collect())
}

// ---------------------------------------------------------------------------------------------
// Latency histogram
// ---------------------------------------------------------------------------------------------

const SUB_BITS: u32 = 4;
const SUB: u64 = 1 << SUB_BITS;
const BUCKETS: usize = ((64 - SUB_BITS as usize) + 1) * SUB as usize;

/// Log-linear histogram of nanosecond values: 16 linear sub-buckets per power of two, so a
/// percentile is within 1/16 (6.25%) of the true value. Fixed size; recording never allocates.
#[derive(Clone)]
pub struct LatencyHistogram {
    counts: Box<[u64]>,
    count: u64,
    sum_ns: u128,
    min_ns: u64,
    max_ns: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("count", &self.count)
            .field("min_ns", &self.min_ns)
            .field("max_ns", &self.max_ns)
            .finish()
    }
}

impl LatencyHistogram {
    /// An empty histogram (one allocation of about 8 KiB).
    pub fn new() -> Self {
        Self {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            count: 0,
            sum_ns: 0,
            min_ns: u64::MAX,
            max_ns: 0,
        }
    }

    #[inline]
    fn index(v: u64) -> usize {
        if v < SUB {
            v as usize
        } else {
            let msb = 63 - v.leading_zeros();
            let shift = msb - SUB_BITS;
            (((shift + 1) as u64) * SUB + ((v >> shift) & (SUB - 1))) as usize
        }
    }

    /// Representative value (middle) of bucket `i`.
    fn value(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            i
        } else {
            let shift = (i / SUB - 1) as u32;
            let low = (SUB | (i % SUB)) << shift;
            low + ((1u64 << shift) >> 1)
        }
    }

    /// Records one sample.
    #[inline]
    pub fn record(&mut self, d: Duration) {
        self.record_ns(d.as_nanos().min(u64::MAX as u128) as u64);
    }

    /// Records one sample given in nanoseconds.
    #[inline]
    pub fn record_ns(&mut self, ns: u64) {
        self.counts[Self::index(ns)] += 1;
        self.count += 1;
        self.sum_ns += ns as u128;
        self.min_ns = self.min_ns.min(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    /// Adds `other`'s samples to this histogram.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.count += other.count;
        self.sum_ns += other.sum_ns;
        self.min_ns = self.min_ns.min(other.min_ns);
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Smallest sample (zero if empty).
    pub fn min(&self) -> Duration {
        Duration::from_nanos(if self.count == 0 { 0 } else { self.min_ns })
    }

    /// Largest sample (zero if empty).
    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.max_ns)
    }

    /// Mean of the samples (zero if empty).
    pub fn mean(&self) -> Duration {
        if self.count == 0 {
            Duration::ZERO
        } else {
            Duration::from_nanos((self.sum_ns / self.count as u128) as u64)
        }
    }

    /// The value below which fraction `q` (0.0..=1.0) of the samples lie; zero if empty.
    pub fn percentile(&self, q: f64) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Duration::from_nanos(Self::value(i).clamp(self.min_ns, self.max_ns));
            }
        }
        Duration::from_nanos(self.max_ns)
    }
}

// ---------------------------------------------------------------------------------------------
// Workload
// ---------------------------------------------------------------------------------------------

/// What each job does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Random block-aligned reads in the job's region.
    RandRead,
    /// Random block-aligned writes in the job's region.
    RandWrite,
    /// Sequential reads through the job's region, wrapping around.
    SeqRead,
    /// Sequential writes through the job's region, wrapping around.
    SeqWrite,
    /// Write the seeded pattern to the job's region sequentially, then read it back and compare.
    Verify,
    /// Read the job's region and compare with the seeded pattern, without writing: checks data
    /// left by an earlier `Verify` run with the same seed, region, jobs and block size.
    Check,
}

impl Pattern {
    /// Whether the pattern writes (and so needs a writable device).
    pub fn writes(self) -> bool {
        matches!(
            self,
            Pattern::RandWrite | Pattern::SeqWrite | Pattern::Verify
        )
    }

    /// The name used on the command line (what [`FromStr`] accepts).
    pub fn name(self) -> &'static str {
        match self {
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::SeqRead => "read",
            Pattern::SeqWrite => "write",
            Pattern::Verify => "verify",
            Pattern::Check => "check",
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Pattern {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        Ok(match s {
            "randread" => Pattern::RandRead,
            "randwrite" => Pattern::RandWrite,
            "read" | "seqread" => Pattern::SeqRead,
            "write" | "seqwrite" => Pattern::SeqWrite,
            "verify" => Pattern::Verify,
            "check" => Pattern::Check,
            _ => bail!("unknown pattern {s:?} (randread, randwrite, read, write, verify, check)"),
        })
    }
}

/// A workload for [`run`].
///
/// Jobs: job `i` submits on queue `i % num_queues`; each queue that has jobs is driven by one
/// thread (so with `jobs == num_queues` it is one thread and one queue per job). Each job owns
/// `1/jobs` of the region, so writers never overlap.
///
/// Stop condition per job: `ops_per_job` I/Os issued, or `runtime` elapsed, whichever comes first;
/// with neither, one pass over the job's region. `Verify` writes up to that many blocks
/// sequentially (never more than the region holds), then reads back and checks everything it
/// wrote; `runtime` bounds only its write phase.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The vhost-user-blk socket to connect to.
    pub socket: PathBuf,
    /// Virtqueues to set up.
    pub num_queues: usize,
    /// Virtqueue size; `None`: big enough for each queue's requests (3 descriptors each), at
    /// least 256 and at most 1024.
    pub queue_size: Option<u32>,
    /// Busy-poll for completions instead of waiting on the call eventfd.
    pub poll: bool,
    /// Number of jobs.
    pub jobs: usize,
    /// Requests in flight per job.
    pub iodepth: usize,
    /// Bytes per request; a multiple of 512.
    pub block_size: usize,
    /// What the jobs do.
    pub pattern: Pattern,
    /// Stop issuing requests after this long.
    pub runtime: Option<Duration>,
    /// Stop each job after this many requests.
    pub ops_per_job: Option<u64>,
    /// `(offset, len)` in bytes of the part of the disk to use; `None`: the whole disk.
    pub region: Option<(u64, u64)>,
    /// Seeds the data pattern and the random offsets.
    pub seed: u64,
    /// Longest wait for any completion before the run fails.
    pub io_timeout: Duration,
}

impl Workload {
    /// One queue, one job, iodepth 1, 4 KiB random reads over the whole disk, one pass.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            num_queues: 1,
            queue_size: None,
            poll: false,
            jobs: 1,
            iodepth: 1,
            block_size: 4096,
            pattern: Pattern::RandRead,
            runtime: None,
            ops_per_job: None,
            region: None,
            seed: 0x006d_7162_6c6b, // "mqblk"
            io_timeout: Duration::from_secs(30),
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        ensure!(self.num_queues >= 1, "num_queues must be at least 1");
        ensure!(self.jobs >= 1, "jobs must be at least 1");
        ensure!(self.iodepth >= 1, "iodepth must be at least 1");
        ensure!(
            self.block_size >= 512 && self.block_size.is_multiple_of(512),
            "block size must be a positive multiple of 512, not {}",
            self.block_size
        );
        if let Some(qs) = self.queue_size {
            ensure!(
                qs.is_power_of_two(),
                "queue size must be a power of two, not {qs}"
            );
        }
        if let Some((off, len)) = self.region {
            ensure!(
                off.is_multiple_of(512),
                "region offset {off} is not a multiple of 512"
            );
            ensure!(len > 0, "region is empty");
        }
        Ok(())
    }
}

/// The first failed request of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoFailure {
    /// Job index.
    pub job: usize,
    /// Whether it was a write (else a read).
    pub write: bool,
    /// Disk offset of the request.
    pub offset: u64,
    /// Positive errno, as for [`IoError::Failed`].
    pub errno: i32,
}

impl fmt::Display for IoFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "job {}: {} at offset {} failed: {}",
            self.job,
            if self.write { "write" } else { "read" },
            self.offset,
            errno_name(self.errno)
        )
    }
}

/// Per-job results.
#[derive(Clone, Debug)]
pub struct JobReport {
    /// Job index.
    pub job: usize,
    /// The queue the job submitted on.
    pub queue: usize,
    /// The job's region `(offset, len)`.
    pub region: (u64, u64),
    /// Completed requests.
    pub ios: u64,
    /// Bytes moved by successful requests.
    pub bytes: u64,
    /// Requests that completed with an error.
    pub errors: u64,
    /// Bytes written by the Verify write phase, from the start of the region (what the read
    /// phase then checks).
    pub pattern_bytes: u64,
    /// Blocks read back that differ from the pattern.
    pub mismatches: u64,
}

/// Results of [`run`].
#[derive(Clone, Debug)]
pub struct Report {
    /// The workload's pattern.
    pub pattern: Pattern,
    /// The workload's block size.
    pub block_size: usize,
    /// Completed requests (successful or not), reads plus writes.
    pub ios: u64,
    /// Completed reads.
    pub reads: u64,
    /// Completed writes.
    pub writes: u64,
    /// Bytes moved by successful requests.
    pub bytes: u64,
    /// From the moment all jobs start until the last one finishes.
    pub elapsed: Duration,
    /// Requests that completed with an error.
    pub errors: u64,
    /// The first request that failed.
    pub first_error: Option<IoFailure>,
    /// Bytes read back and found as written (Verify, Check).
    pub verified_bytes: u64,
    /// Blocks read back that differ from the pattern (Verify, Check).
    pub mismatches: u64,
    /// Disk offset of the first differing 8-byte word.
    pub first_mismatch: Option<u64>,
    /// Submission-to-completion latency of every request.
    pub latency: LatencyHistogram,
    /// Median latency in microseconds.
    pub p50_us: f64,
    /// 99th percentile latency in microseconds.
    pub p99_us: f64,
    /// 99.9th percentile latency in microseconds.
    pub p999_us: f64,
    /// Per-job results, by job index.
    pub jobs: Vec<JobReport>,
    /// Whether the connection was read-only.
    pub read_only: bool,
}

impl Report {
    /// Completed requests per second.
    pub fn iops(&self) -> f64 {
        per_sec(self.ios as f64, self.elapsed)
    }

    /// Throughput in MB/s (10^6 bytes).
    pub fn mb_per_s(&self) -> f64 {
        per_sec(self.bytes as f64, self.elapsed) / 1e6
    }

    /// True if no request failed and nothing read back differed.
    pub fn clean(&self) -> bool {
        self.errors == 0 && self.mismatches == 0
    }
}

fn per_sec(x: f64, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 {
        x / s
    } else {
        0.0
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bs={}: {} ios ({} reads, {} writes) in {:.3} s: {:.0} IOPS, {:.1} MB/s, \
             latency p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us; {} errors",
            self.pattern,
            self.block_size,
            self.ios,
            self.reads,
            self.writes,
            self.elapsed.as_secs_f64(),
            self.iops(),
            self.mb_per_s(),
            self.p50_us,
            self.p99_us,
            self.p999_us,
            self.errors
        )?;
        if matches!(self.pattern, Pattern::Verify | Pattern::Check) {
            write!(
                f,
                ", {} bytes verified, {} mismatches",
                self.verified_bytes, self.mismatches
            )?;
        }
        if let Some(e) = &self.first_error {
            write!(f, " (first error: {e})")?;
        }
        if let Some(m) = self.first_mismatch {
            write!(f, " (first mismatch at offset {m})")?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The pattern's only phase, or Verify's write phase.
    Main,
    /// Verify's read-back phase.
    ReadBack,
    Done,
}

struct Job {
    idx: usize,
    queue: usize,
    region: (u64, u64),
    nblocks: u64,
    pattern: Pattern,
    phase: Phase,
    /// Requests to issue in the current phase (u64::MAX: until the deadline).
    target: u64,
    issued: u64,
    inflight: usize,
    next_block: u64,
    rng: u64,
    /// Verify: blocks issued by the write phase.
    written_blocks: u64,
    free: Vec<u32>,
    // results
    ios: u64,
    reads: u64,
    writes: u64,
    bytes: u64,
    errors: u64,
    first_error: Option<IoFailure>,
    verified_bytes: u64,
    mismatches: u64,
    first_mismatch: Option<u64>,
    hist: LatencyHistogram,
}

impl Job {
    fn is_write(&self) -> bool {
        match self.pattern {
            Pattern::RandWrite | Pattern::SeqWrite => true,
            Pattern::Verify => self.phase == Phase::Main,
            _ => false,
        }
    }

    fn next_offset(&mut self, bs: u64) -> u64 {
        let block = match self.pattern {
            Pattern::RandRead | Pattern::RandWrite => {
                // xorshift64*
                self.rng ^= self.rng >> 12;
                self.rng ^= self.rng << 25;
                self.rng ^= self.rng >> 27;
                self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % self.nblocks
            }
            _ => {
                let b = self.next_block;
                self.next_block = (self.next_block + 1) % self.nblocks;
                b
            }
        };
        self.region.0 + block * bs
    }

    /// Whether the job may issue another request now.
    fn can_issue(&self, now: Instant, deadline: Option<Instant>) -> bool {
        if self.phase == Phase::Done || self.issued >= self.target || self.free.is_empty() {
            return false;
        }
        // The deadline ends the main phase only (Verify's read-back always completes).
        !(self.phase == Phase::Main && deadline.is_some_and(|d| now >= d))
    }

    /// Moves to the next phase once the current one has nothing more to issue or wait for.
    fn advance(&mut self, now: Instant, deadline: Option<Instant>) {
        if self.phase == Phase::Done || self.inflight > 0 {
            return;
        }
        let exhausted = self.issued >= self.target
            || (self.phase == Phase::Main && deadline.is_some_and(|d| now >= d));
        if !exhausted {
            return;
        }
        if self.phase == Phase::Main && self.pattern == Pattern::Verify && self.issued > 0 {
            self.phase = Phase::ReadBack;
            self.written_blocks = self.issued;
            self.target = self.issued;
            self.issued = 0;
            self.next_block = 0;
        } else {
            self.phase = Phase::Done;
        }
    }

    fn fail(&mut self, write: bool, offset: u64, errno: i32) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(IoFailure {
                job: self.idx,
                write,
                offset,
                errno,
            });
        }
    }
}

struct Slot {
    buf: *mut u8,
    job: u32,
    write: bool,
    offset: u64,
    issued_at: Instant,
}

/// A queue with the jobs it serves, moved into that queue's thread.
struct QueueWork {
    queue: Blkioq,
    jobs: Vec<Job>,
    slots: Vec<Slot>,
}

// SAFETY: `Slot::buf` points into a memory region that outlives the threads (it is owned by the
// `Blkio` in `run`, which joins them before returning) and that only this queue's thread touches.
unsafe impl Send for QueueWork {}

/// Runs the workload on one connection and reports the results.
///
/// Fails if the connection or a wait for completions fails; requests that complete with an error
/// are counted in [`Report::errors`] instead.
pub fn run(w: &Workload) -> anyhow::Result<Report> {
    w.validate()?;
    let bs = w.block_size;
    let slots_per_queue = |q: usize| (q..w.jobs).step_by(w.num_queues).count() * w.iodepth;
    let busiest = slots_per_queue(0);
    let queue_size = w.queue_size.unwrap_or_else(|| {
        ((busiest * DESCRIPTORS_PER_REQUEST).next_power_of_two() as u32)
            .clamp(256, MAX_DEFAULT_QUEUE_SIZE)
    });
    let opts = ConnectOptions {
        num_queues: w.num_queues,
        queue_size: Some(queue_size),
        poll: w.poll,
        // Read patterns connect read-only so that they work on read-only devices too.
        read_only: Some(!w.pattern.writes()),
    };
    let mut conn =
        open(&w.socket, &opts).with_context(|| format!("connecting to {}", w.socket.display()))?;
    let capacity = conn
        .blkio
        .get_u64("capacity")
        .map_err(|e| blkio_err("reading capacity", e))?;
    let (roff, rlen) = w.region.unwrap_or((0, capacity));
    ensure!(
        roff.checked_add(rlen).is_some_and(|end| end <= capacity),
        "region {roff}+{rlen} exceeds the disk ({capacity} bytes)"
    );
    let regions = job_regions(roff, rlen, w.jobs, bs)?;

    let total_slots = w.jobs * w.iodepth;
    let mem = map_buffer(&mut conn.blkio, total_slots * bs)?;
    let base = mem.addr as *mut u8;

    // Build each queue's jobs and request slots up front: nothing is allocated while running.
    let mut queues: Vec<Option<Blkioq>> = conn.queues.drain(..).map(Some).collect();
    let mut work: Vec<QueueWork> = Vec::new();
    let mut next_slot = 0usize;
    for (q, queue) in queues.iter_mut().enumerate().take(w.jobs) {
        let mut jobs = Vec::new();
        let mut slots = Vec::with_capacity(slots_per_queue(q));
        for (local, j) in (q..w.jobs).step_by(w.num_queues).enumerate() {
            let (off, len) = regions[j];
            let nblocks = len / bs as u64;
            let target = match (w.pattern, w.ops_per_job, w.runtime) {
                (Pattern::Verify | Pattern::Check, Some(n), _) => n.min(nblocks),
                (Pattern::Verify, None, Some(_)) => nblocks,
                (_, Some(n), _) => n,
                (_, None, Some(_)) => u64::MAX,
                (_, None, None) => nblocks,
            };
            let mut free = Vec::with_capacity(w.iodepth);
            for _ in 0..w.iodepth {
                free.push(slots.len() as u32);
                // SAFETY: next_slot < total_slots, so the buffer lies inside `mem`.
                let buf = unsafe { base.add(next_slot * bs) };
                next_slot += 1;
                if w.pattern.writes() {
                    // Non-trivial data for plain writes; Verify refills per request.
                    // SAFETY: as above, `bs` bytes inside `mem`, not in use yet.
                    fill_pattern(
                        unsafe { std::slice::from_raw_parts_mut(buf, bs) },
                        next_slot as u64 * 8,
                        w.seed,
                    );
                }
                slots.push(Slot {
                    buf,
                    job: local as u32,
                    write: false,
                    offset: 0,
                    issued_at: Instant::now(),
                });
            }
            free.reverse();
            jobs.push(Job {
                idx: j,
                queue: q,
                region: (off, len),
                nblocks,
                pattern: w.pattern,
                phase: if target == 0 {
                    Phase::Done
                } else {
                    Phase::Main
                },
                target,
                issued: 0,
                inflight: 0,
                next_block: 0,
                rng: mix64(w.seed ^ (j as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1,
                written_blocks: 0,
                free,
                ios: 0,
                reads: 0,
                writes: 0,
                bytes: 0,
                errors: 0,
                first_error: None,
                verified_bytes: 0,
                mismatches: 0,
                first_mismatch: None,
                hist: LatencyHistogram::new(),
            });
        }
        work.push(QueueWork {
            queue: queue.take().unwrap(),
            jobs,
            slots,
        });
    }

    let barrier = Barrier::new(work.len() + 1);
    let (start, results) = std::thread::scope(|s| {
        let handles: Vec<_> = work
            .into_iter()
            .map(|qw| {
                let barrier = &barrier;
                std::thread::Builder::new()
                    .name(format!("mqblk-client-q{}", qw.jobs[0].queue))
                    .spawn_scoped(s, move || {
                        barrier.wait();
                        let start = Instant::now();
                        let r = drive_queue(qw, w, start);
                        (r, Instant::now())
                    })
                    .expect("spawning a client thread")
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let results: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        (start, results)
    });

    let mut report = Report {
        pattern: w.pattern,
        block_size: bs,
        ios: 0,
        reads: 0,
        writes: 0,
        bytes: 0,
        elapsed: Duration::ZERO,
        errors: 0,
        first_error: None,
        verified_bytes: 0,
        mismatches: 0,
        first_mismatch: None,
        latency: LatencyHistogram::new(),
        p50_us: 0.0,
        p99_us: 0.0,
        p999_us: 0.0,
        jobs: Vec::with_capacity(w.jobs),
        read_only: conn.read_only,
    };
    for (r, end) in results {
        let (_queue, jobs) = r?;
        report.elapsed = report.elapsed.max(end.saturating_duration_since(start));
        for j in jobs {
            report.ios += j.ios;
            report.reads += j.reads;
            report.writes += j.writes;
            report.bytes += j.bytes;
            report.errors += j.errors;
            if report.first_error.is_none() {
                report.first_error = j.first_error.clone();
            }
            report.verified_bytes += j.verified_bytes;
            report.mismatches += j.mismatches;
            if report.first_mismatch.is_none() {
                report.first_mismatch = j.first_mismatch;
            }
            report.latency.merge(&j.hist);
            report.jobs.push(JobReport {
                job: j.idx,
                queue: j.queue,
                region: j.region,
                ios: j.ios,
                bytes: j.bytes,
                errors: j.errors,
                pattern_bytes: j.written_blocks * bs as u64,
                mismatches: j.mismatches,
            });
        }
    }
    report.jobs.sort_by_key(|j| j.job);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    report.p50_us = us(report.latency.percentile(0.50));
    report.p99_us = us(report.latency.percentile(0.99));
    report.p999_us = us(report.latency.percentile(0.999));
    // Queues are dropped by the threads; `conn` (and with it the buffer region) goes last.
    drop(conn);
    Ok(report)
}

/// One queue's thread: keeps each of its jobs at `iodepth` requests in flight until they are
/// done. Returns the queue (so that it is dropped on this side of the join) and the jobs.
fn drive_queue(qw: QueueWork, w: &Workload, start: Instant) -> anyhow::Result<(Blkioq, Vec<Job>)> {
    let QueueWork {
        mut queue,
        mut jobs,
        mut slots,
    } = qw;
    let bs = w.block_size;
    let deadline = w.runtime.map(|r| start + r);
    let mut completions: Vec<MaybeUninit<Completion>> = Vec::with_capacity(slots.len());
    completions.resize_with(slots.len(), MaybeUninit::uninit);
    let qidx = jobs[0].queue;

    loop {
        // Submit as much as every job may.
        let mut now = Instant::now();
        let mut inflight = 0;
        let mut active = false;
        for job in jobs.iter_mut() {
            job.advance(now, deadline);
            while job.can_issue(now, deadline) {
                let si = job.free.pop().unwrap();
                let slot = &mut slots[si as usize];
                let offset = job.next_offset(bs as u64);
                let write = job.is_write();
                if write && job.pattern == Pattern::Verify {
                    // SAFETY: the slot's buffer is `bs` bytes inside the mapped region and free.
                    fill_pattern(
                        unsafe { std::slice::from_raw_parts_mut(slot.buf, bs) },
                        offset,
                        w.seed,
                    );
                }
                slot.write = write;
                slot.offset = offset;
                now = Instant::now();
                slot.issued_at = now;
                if write {
                    queue.write(offset, slot.buf, bs, si as usize, ReqFlags::empty());
                } else {
                    queue.read(offset, slot.buf, bs, si as usize, ReqFlags::empty());
                }
                job.issued += 1;
                job.inflight += 1;
            }
            inflight += job.inflight;
            active |= job.phase != Phase::Done;
        }
        if !active {
            break;
        }
        if inflight == 0 {
            // A job just changed phase; go round again to submit for the new one.
            continue;
        }

        let mut timeout = w.io_timeout;
        let n = match queue.do_io(&mut completions, 1, Some(&mut timeout), None) {
            Ok(n) => n,
            Err(e) if e.errno() == Errno::TIME => bail!(
                "queue {qidx}: no completion for {:?} with {inflight} requests in flight",
                w.io_timeout
            ),
            Err(e) => {
                return Err(blkio_err(
                    &format!("queue {qidx}: waiting for completions"),
                    e,
                ))
            }
        };
        let now = Instant::now();
        for c in &completions[..n] {
            // SAFETY: do_io initialised the first n entries.
            let c = unsafe { c.assume_init_ref() };
            let si = c.user_data;
            let slot = &slots[si];
            let job = &mut jobs[slot.job as usize];
            job.hist
                .record(now.saturating_duration_since(slot.issued_at));
            job.inflight -= 1;
            job.ios += 1;
            if slot.write {
                job.writes += 1;
            } else {
                job.reads += 1;
            }
            if c.ret != 0 {
                job.fail(slot.write, slot.offset, -c.ret);
            } else {
                job.bytes += bs as u64;
                let checks = job.pattern == Pattern::Check
                    || (job.pattern == Pattern::Verify && job.phase == Phase::ReadBack);
                if checks && !slot.write {
                    // SAFETY: the read into this buffer has completed.
                    let data = unsafe { std::slice::from_raw_parts(slot.buf, bs) };
                    match check_pattern(data, slot.offset, w.seed) {
                        None => job.verified_bytes += bs as u64,
                        Some(at) => {
                            job.mismatches += 1;
                            job.first_mismatch.get_or_insert(at);
                        }
                    }
                }
            }
            job.free.push(si as u32);
        }
    }
    Ok((queue, jobs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_monotonic_and_tight() {
        let mut last = 0;
        for v in (0..100_000u64).chain([1 << 20, 1 << 40, u64::MAX / 2, u64::MAX]) {
            let i = LatencyHistogram::index(v);
            assert!(i < BUCKETS, "{v} -> {i}");
            assert!(i >= last || v >= 100_000, "index not monotonic at {v}");
            last = i;
            let rep = LatencyHistogram::value(i);
            let err = rep.abs_diff(v) as f64 / v.max(1) as f64;
            assert!(err <= 1.0 / SUB as f64, "{v} -> bucket {i} value {rep}");
        }
    }

    #[test]
    fn histogram_percentiles() {
        let mut h = LatencyHistogram::new();
        assert_eq!(h.percentile(0.5), Duration::ZERO);
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let p = |q| h.percentile(q).as_secs_f64() * 1e6;
        assert!((p(0.5) - 500.0).abs() <= 500.0 / 16.0, "p50 {}", p(0.5));
        assert!((p(0.99) - 990.0).abs() <= 990.0 / 16.0, "p99 {}", p(0.99));
        assert!(p(1.0) <= 1000.0);
        assert_eq!(h.count(), 1000);
        let mut m = LatencyHistogram::new();
        m.record_ns(5);
        m.merge(&h);
        assert_eq!(m.count(), 1001);
        assert_eq!(m.min(), Duration::from_nanos(5));
        assert_eq!(m.max(), Duration::from_micros(1000));
    }

    #[test]
    fn pattern_detects_misplaced_and_foreign_data() {
        let mut a = vec![0u8; 4096];
        fill_pattern(&mut a, 8192, 7);
        assert_eq!(check_pattern(&a, 8192, 7), None);
        assert_eq!(check_pattern(&a, 8192 + 4096, 7), Some(8192 + 4096));
        assert_eq!(check_pattern(&a, 8192, 8), Some(8192));
        a[4000] ^= 1;
        assert_eq!(check_pattern(&a, 8192, 7), Some(8192 + 4000 / 8 * 8));
        assert!(check_pattern(&[0u8; 512], 0, 7).is_some());
    }

    #[test]
    fn job_regions_split_evenly_and_aligned() {
        let r = job_regions(4096, 10 * 4096 + 100, 3, 4096).unwrap();
        assert_eq!(
            r,
            vec![(4096, 3 * 4096), (4 * 4096, 3 * 4096), (7 * 4096, 3 * 4096)]
        );
        assert!(job_regions(0, 4096, 2, 4096).is_err());
        assert!(job_regions(0, 4096, 0, 4096).is_err());
    }

    #[test]
    fn pattern_names_round_trip() {
        for p in [
            Pattern::RandRead,
            Pattern::RandWrite,
            Pattern::SeqRead,
            Pattern::SeqWrite,
            Pattern::Verify,
            Pattern::Check,
        ] {
            assert_eq!(p.name().parse::<Pattern>().unwrap(), p);
        }
        assert!("bogus".parse::<Pattern>().is_err());
    }
}
