//! [`Client`]: one request at a time on a chosen queue, and [`RequestError`], why one did not
//! succeed. What the integration tests use to probe the daemon request by request.

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, Errno, MemoryRegion, ReqFlags};

use crate::connect::{completion_msg, errno_name, map_buffer, open, ConnectOptions, Connection};

/// Why a [`Client`] request did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
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

impl RequestError {
    /// The completion's errno, if the request completed with an error.
    pub fn errno(&self) -> Option<i32> {
        match self {
            RequestError::Failed { errno, .. } => Some(*errno),
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
        let capacity = conn.capacity()?;
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

    /// How long a request may take before [`RequestError::Timeout`] (default 10 s).
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

    fn ensure_buf(&mut self, len: usize) -> Result<(), RequestError> {
        if len <= self.buf.len {
            return Ok(());
        }
        let new = map_buffer(&mut self.conn.blkio, len)
            .map_err(|e| RequestError::Driver(format!("{e:#}")))?;
        let old = std::mem::replace(&mut self.buf, new);
        self.conn.blkio.unmap_mem_region(&old);
        self.conn.blkio.free_mem_region(&old);
        Ok(())
    }

    /// Submits one request on queue `q` (`submit` gets the queue and the request's tag) and
    /// waits for its completion.
    fn submit_wait(
        &mut self,
        q: usize,
        submit: impl FnOnce(&mut Blkioq, usize),
    ) -> Result<(), RequestError> {
        let nq = self.conn.queues.len();
        let queue = self.conn.queues.get_mut(q).ok_or_else(|| {
            RequestError::Usage(format!("queue {q} does not exist ({nq} queues)"))
        })?;
        self.tag = self.tag.wrapping_add(1);
        let tag = self.tag;
        submit(queue, tag);
        let timeout = self.timeout;
        let deadline = Instant::now() + timeout;
        loop {
            let mut left = deadline.saturating_duration_since(Instant::now());
            let n = queue
                .do_io(&mut self.completions, 1, Some(&mut left), None)
                .map_err(|e| match e.errno() {
                    Errno::TIME => RequestError::Timeout(timeout),
                    errno => RequestError::Driver(format!("{} ({errno})", e.message())),
                })?;
            for c in &self.completions[..n] {
                // SAFETY: do_io initialised the first n entries.
                let c = unsafe { c.assume_init_ref() };
                // Completions with other tags belong to requests that timed out earlier.
                if c.user_data == tag {
                    return match c.ret {
                        0 => Ok(()),
                        ret => Err(RequestError::Failed {
                            errno: -ret,
                            msg: completion_msg(c),
                        }),
                    };
                }
            }
        }
    }

    /// Reads `buf.len()` bytes at `offset` on queue `q`.
    pub fn read(&mut self, q: usize, offset: u64, buf: &mut [u8]) -> Result<(), RequestError> {
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
    pub fn read_vec(&mut self, q: usize, offset: u64, len: usize) -> Result<Vec<u8>, RequestError> {
        let mut v = vec![0u8; len];
        self.read(q, offset, &mut v)?;
        Ok(v)
    }

    /// Writes `data` at `offset` on queue `q`.
    pub fn write(&mut self, q: usize, offset: u64, data: &[u8]) -> Result<(), RequestError> {
        self.write_flags(q, offset, data, ReqFlags::empty())
    }

    /// Writes with libblkio request flags (e.g. [`ReqFlags::FUA`]).
    pub fn write_flags(
        &mut self,
        q: usize,
        offset: u64,
        data: &[u8],
        flags: ReqFlags,
    ) -> Result<(), RequestError> {
        self.ensure_buf(data.len())?;
        let (addr, len) = (self.buf.addr as *mut u8, data.len());
        // SAFETY: the region is mapped and at least `len` long; no request is using it.
        unsafe { std::slice::from_raw_parts_mut(addr, len) }.copy_from_slice(data);
        self.submit_wait(q, |queue, tag| queue.write(offset, addr, len, tag, flags))
    }

    /// Flushes the device's write cache (libblkio completes it locally, successfully, if the
    /// device does not offer `VIRTIO_BLK_F_FLUSH`).
    pub fn flush(&mut self, q: usize) -> Result<(), RequestError> {
        self.submit_wait(q, |queue, tag| queue.flush(tag, ReqFlags::empty()))
    }

    /// Discards `len` bytes at `offset`.
    pub fn discard(&mut self, q: usize, offset: u64, len: u64) -> Result<(), RequestError> {
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
    ) -> Result<(), RequestError> {
        let flags = if unmap {
            ReqFlags::empty()
        } else {
            ReqFlags::NO_UNMAP
        };
        self.submit_wait(q, |queue, tag| queue.write_zeroes(offset, len, tag, flags))
    }

    /// Puts every request of `reqs` in flight before waiting for any (each queue's are
    /// submitted together), then waits for them all; their results, in order. For requests of
    /// different queues that must reach the device at the same time.
    pub fn together(&mut self, reqs: &[Concurrent<'_>]) -> Vec<Result<(), RequestError>> {
        let timeout = self.timeout;
        self.together_until(reqs, reqs.len())
            .into_iter()
            .map(|r| r.unwrap_or(Err(RequestError::Timeout(timeout))))
            .collect()
    }

    /// [`together`](Self::together), returning as soon as `wanted` of them have completed:
    /// `None` for those that had not (they may still be in flight). For a test that acts on a
    /// completion the moment it arrives.
    pub fn together_until(
        &mut self,
        reqs: &[Concurrent<'_>],
        wanted: usize,
    ) -> Vec<Option<Result<(), RequestError>>> {
        let bytes: usize = reqs.iter().map(Concurrent::data_len).sum();
        if let Err(e) = self.ensure_buf(bytes) {
            return reqs
                .iter()
                .map(|_| Some(Err(RequestError::Usage(e.to_string()))))
                .collect();
        }
        let nq = self.conn.queues.len();
        let mut results: Vec<Option<Result<(), RequestError>>> =
            reqs.iter().map(|_| None).collect();
        let first_tag = self.tag.wrapping_add(1);
        self.tag = self.tag.wrapping_add(reqs.len());
        let mut at = 0;
        for (i, r) in reqs.iter().enumerate() {
            let q = r.queue();
            let Some(queue) = self.conn.queues.get_mut(q) else {
                results[i] = Some(Err(RequestError::Usage(format!(
                    "queue {q} does not exist ({nq} queues)"
                ))));
                continue;
            };
            let tag = first_tag.wrapping_add(i);
            match *r {
                Concurrent::Write { offset, data, .. } => {
                    let addr = (self.buf.addr + at) as *mut u8;
                    // SAFETY: the region is mapped and holds `bytes`; this part is this
                    // request's alone.
                    unsafe { std::slice::from_raw_parts_mut(addr, data.len()) }
                        .copy_from_slice(data);
                    at += data.len();
                    queue.write(offset, addr, data.len(), tag, ReqFlags::empty());
                }
                Concurrent::WriteZeroes { offset, len, .. } => {
                    queue.write_zeroes(offset, len, tag, ReqFlags::NO_UNMAP);
                }
                Concurrent::Flush { .. } => queue.flush(tag, ReqFlags::empty()),
            }
        }
        // Submit on every queue first: libblkio submits a queue's requests when it is polled.
        for queue in self.conn.queues.iter_mut() {
            let mut zero = Duration::ZERO;
            // Completions reaped here are lost to the loop below, so ask for none: with
            // `max_completions` 0 nothing is reaped, only submitted.
            let _ = queue.do_io(&mut self.completions[..0], 0, Some(&mut zero), None);
        }
        let deadline = Instant::now() + self.timeout;
        while results.iter().filter(|r| r.is_some()).count() < wanted.min(reqs.len()) {
            if Instant::now() >= deadline {
                break;
            }
            // Each queue polled in turn (a queue waited on alone could hide the others').
            std::thread::sleep(Duration::from_micros(50));
            for queue in self.conn.queues.iter_mut() {
                let n = match queue.do_io(&mut self.completions, 0, None, None) {
                    Ok(n) => n,
                    Err(e) => {
                        let msg = format!("{} ({})", e.message(), e.errno());
                        for r in results.iter_mut().filter(|r| r.is_none()) {
                            *r = Some(Err(RequestError::Driver(msg.clone())));
                        }
                        return results;
                    }
                };
                for c in &self.completions[..n] {
                    // SAFETY: do_io initialised the first n entries.
                    let c = unsafe { c.assume_init_ref() };
                    let i = c.user_data.wrapping_sub(first_tag);
                    if let Some(slot) = results.get_mut(i).filter(|s| s.is_none()) {
                        *slot = Some(match c.ret {
                            0 => Ok(()),
                            ret => Err(RequestError::Failed {
                                errno: -ret,
                                msg: completion_msg(c),
                            }),
                        });
                    }
                }
            }
        }
        results
    }
}

/// One request of [`Client::together`].
#[derive(Debug, Clone, Copy)]
pub enum Concurrent<'a> {
    /// Write `data` at `offset` on queue `q`.
    Write {
        /// The queue.
        q: usize,
        /// Byte offset.
        offset: u64,
        /// What to write.
        data: &'a [u8],
    },
    /// Write zeroes to `len` bytes at `offset` on queue `q`, keeping them allocated.
    WriteZeroes {
        /// The queue.
        q: usize,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// A flush on queue `q`.
    Flush {
        /// The queue.
        q: usize,
    },
}

impl Concurrent<'_> {
    fn queue(&self) -> usize {
        match *self {
            Concurrent::Write { q, .. }
            | Concurrent::WriteZeroes { q, .. }
            | Concurrent::Flush { q } => q,
        }
    }

    fn data_len(&self) -> usize {
        match *self {
            Concurrent::Write { data, .. } => data.len(),
            Concurrent::WriteZeroes { .. } | Concurrent::Flush { .. } => 0,
        }
    }
}
