//! One I/O thread's way to an RBD image: its own image handle, whose completions librbd queues
//! on that handle and announces on the thread's eventfd (`rbd_set_image_notification`). The
//! thread's io_uring polls the eventfd; `reap` collects the queue with `rbd_poll_io_events`.
//! So a request completes on the thread that started it, as with every other engine, and the
//! request path adds no thread of its own: librbd's own threads do the network I/O.

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::Arc;

use mqblk_rbd_sys as sys;
use rustix::event::{eventfd, EventfdFlags};

use super::cluster::{Cluster, Image};
use crate::engine::{Channel, Op, Started};

/// What a librbd completion carries back (its `cb_arg`, a pointer-sized integer): the token,
/// and for a write its length, because librbd reports 0 for a write that succeeded and the
/// I/O thread checks the bytes transferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tag {
    token: u32,
    /// Bytes written (0 for anything but a write).
    write_len: u32,
    /// A write-through write with librbd's cache on: flush before it is done.
    then_flush: bool,
}

impl Tag {
    const FLUSH_BIT: u64 = 1 << 63;

    fn encode(self) -> u64 {
        u64::from(self.token)
            | u64::from(self.write_len & 0x7fff_ffff) << 32
            | if self.then_flush { Self::FLUSH_BIT } else { 0 }
    }

    fn decode(v: u64) -> Tag {
        Tag {
            token: v as u32,
            write_len: ((v >> 32) & 0x7fff_ffff) as u32,
            then_flush: v & Self::FLUSH_BIT != 0,
        }
    }
}

/// Completions collected per `rbd_poll_io_events` call.
const POLL_BATCH: usize = 64;

/// One I/O thread's image handle and completion eventfd.
pub struct RbdChannel {
    image: Image,
    events: OwnedFd,
    /// librbd's cache is on: write-through writes need a flush.
    cache: bool,
    polled: Vec<sys::rbd_completion_t>,
}

impl RbdChannel {
    /// Opens the thread's own handle on `image` and points its completions at a new eventfd.
    pub fn open(
        cluster: &Arc<Cluster>,
        image: &str,
        readonly: bool,
        cache: bool,
    ) -> io::Result<RbdChannel> {
        let image = cluster.open(image, readonly)?;
        let events = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?;
        // SAFETY: an open handle and a live eventfd, which outlives the handle (the image is
        // closed before `events` is dropped: fields drop in declaration order).
        let r = unsafe {
            sys::rbd_set_image_notification(
                image.handle,
                events.as_raw_fd(),
                sys::EVENT_TYPE_EVENTFD as i32,
            )
        };
        if r < 0 {
            return Err(io::Error::from_raw_os_error(-r));
        }
        Ok(RbdChannel {
            image,
            events,
            cache,
            polled: vec![ptr::null_mut(); POLL_BATCH],
        })
    }

    /// Starts `op` with a completion that carries `tag`. Returns the (negative) error librbd
    /// refused it with, if it did.
    fn submit(&mut self, op: &Op, tag: Tag) -> Result<(), i32> {
        let mut c: sys::rbd_completion_t = ptr::null_mut();
        // SAFETY: `c` receives a new completion with no callback: librbd queues it on this
        // handle's event queue instead. The argument is an integer, never dereferenced.
        let r = unsafe {
            sys::rbd_aio_create_completion(tag.encode() as usize as *mut c_void, None, &mut c)
        };
        if r < 0 {
            return Err(r);
        }
        let img = self.image.handle;
        // SAFETY: (every arm) `img` is this thread's open handle and `c` a fresh completion.
        // The iovecs and the guest memory they describe stay valid until the completion is
        // reaped (the contract of `Op`); librbd reads them only until then.
        let r = unsafe {
            match *op {
                Op::Read {
                    offset,
                    iovs,
                    iovcnt,
                    ..
                } => sys::rbd_aio_readv(img, iovs.cast(), iovcnt as i32, offset, c),
                Op::Write {
                    offset,
                    iovs,
                    iovcnt,
                    ..
                } => sys::rbd_aio_writev(img, iovs.cast(), iovcnt as i32, offset, c),
                Op::Flush => sys::rbd_aio_flush(img, c),
                Op::Discard { offset, len } => sys::rbd_aio_discard(img, offset, len, c),
                Op::WriteZeroes { offset, len, unmap } => {
                    // Without unmap the range must stay allocated: librbd's thick-provision
                    // flag writes the zeroes instead of deallocating.
                    let flags = if unmap {
                        0
                    } else {
                        sys::RBD_WRITE_ZEROES_FLAG_THICK_PROVISION as i32
                    };
                    sys::rbd_aio_write_zeroes(img, offset, len as usize, c, flags, 0)
                }
            }
        };
        if r < 0 {
            // SAFETY: librbd refused the operation, so it never completes: release it here.
            unsafe { sys::rbd_aio_release(c) };
            return Err(r);
        }
        Ok(())
    }
}

impl Channel for RbdChannel {
    unsafe fn start(&mut self, op: &Op, token: u64) -> Started {
        let Ok(token) = u32::try_from(token) else {
            return Started::Done(-libc::EINVAL);
        };
        // SAFETY: the contract of `Op`: valid iovecs (0 for operations without data).
        let bytes = unsafe { crate::engine::op_bytes(op) };
        if let Op::Read { .. } | Op::Write { .. } = *op {
            // librbd refuses an empty vector (the uring engine answers 0 bytes), and a
            // completion reports at most i32::MAX bytes (the tag keeps 31 bits of a length).
            if bytes == 0 {
                return Started::Done(0);
            }
            if bytes > i32::MAX as u64 {
                return Started::Done(-libc::EINVAL);
            }
        }
        let tag = match *op {
            Op::Write { sync, .. } => Tag {
                token,
                write_len: bytes as u32,
                // With the cache off every write is durable when librbd completes it.
                then_flush: sync && self.cache,
            },
            _ => Tag {
                token,
                write_len: 0,
                then_flush: false,
            },
        };
        match self.submit(op, tag) {
            Ok(()) => Started::Pending,
            Err(r) => Started::Done(r),
        }
    }

    fn completion_fd(&self) -> Option<RawFd> {
        Some(self.events.as_raw_fd())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        // Reset the eventfd first: a completion queued after this read writes it again, so
        // its poll fires again and nothing is left behind.
        let _ = rustix::io::read(&self.events, &mut [0u8; 8]);
        loop {
            // SAFETY: an open handle; librbd writes at most `polled.len()` completions into
            // the live buffer.
            let n = unsafe {
                sys::rbd_poll_io_events(
                    self.image.handle,
                    self.polled.as_mut_ptr(),
                    self.polled.len() as i32,
                )
            };
            if n <= 0 {
                return;
            }
            for i in 0..n as usize {
                let c = self.polled[i];
                // SAFETY: `c` is a completed completion this handle started; it is read, then
                // released once.
                let (arg, r) = unsafe {
                    let arg = sys::rbd_aio_get_arg(c) as usize as u64;
                    let r = sys::rbd_aio_get_return_value(c);
                    sys::rbd_aio_release(c);
                    (arg, r)
                };
                let tag = Tag::decode(arg);
                if r >= 0 && tag.then_flush {
                    let flush = Tag {
                        then_flush: false,
                        ..tag
                    };
                    match self.submit(&Op::Flush, flush) {
                        Ok(()) => continue,
                        Err(e) => done(u64::from(tag.token), e),
                    }
                    continue;
                }
                let res = match r as i64 {
                    r if r < 0 => r.max(i64::from(i32::MIN)) as i32,
                    _ if tag.write_len > 0 => tag.write_len as i32,
                    r => r.min(i64::from(i32::MAX)) as i32,
                };
                done(u64::from(tag.token), res);
            }
            if (n as usize) < self.polled.len() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Tag;

    #[test]
    fn tags_round_trip() {
        for t in [
            Tag {
                token: 0,
                write_len: 0,
                then_flush: false,
            },
            Tag {
                token: u32::MAX,
                write_len: 0x7fff_ffff,
                then_flush: true,
            },
            Tag {
                token: 17,
                write_len: 4096,
                then_flush: false,
            },
        ] {
            assert_eq!(Tag::decode(t.encode()), t);
        }
    }
}
