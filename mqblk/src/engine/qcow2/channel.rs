//! One I/O thread's way to a qcow2 export: its ring for what its mapping cache holds, the
//! metadata worker for the rest.

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::image::Image;
use super::mapping::{MappingCache, Target};
use super::metadata::{self, IoVecs, Job, Jobs, Replies, Reply, Work};
use super::Shared;
use crate::engine::{self, Channel, Op, Started};

/// A thread's mapping cache, its line to the metadata worker and its reply queue.
pub struct Qcow2Channel {
    pub(super) shared: Arc<Shared>,
    /// The generation of the top it uses.
    pub(super) generation: u64,
    pub(super) image: Arc<Image>,
    pub(super) jobs: Jobs,
    pub(super) replies: Arc<Replies>,
    pub(super) cache: MappingCache,
    /// The image's epoch the cache is true for.
    pub(super) epoch: u64,
    /// Reaped replies, kept to reuse the allocation.
    pub(super) reaped: Vec<Reply>,
}

impl Qcow2Channel {
    /// Brings the cache up to the image's epoch: forgets what invalidations since made stale.
    #[inline]
    fn catch_up(&mut self) {
        if self.shared.generation.load(Ordering::Acquire) != self.generation {
            self.take_new_top();
        }
        let now = self.image.epoch.load(Ordering::Acquire);
        if now == self.epoch {
            return;
        }
        let cache = &mut self.cache;
        if !metadata::catch_up(&self.image, self.epoch, |offset, len| {
            cache.invalidate(offset, len)
        }) {
            cache.clear();
        }
        self.epoch = now;
    }

    /// A snapshot replaced the top (while no request was in flight): writes go to the new
    /// one, and nothing cached of the old one holds.
    #[cold]
    fn take_new_top(&mut self) {
        let top = self.shared.top.lock().unwrap_or_else(|e| e.into_inner());
        self.generation = self.shared.generation.load(Ordering::Acquire);
        self.image = top.image.clone();
        self.jobs = top.jobs.clone();
        self.epoch = self.image.epoch.load(Ordering::Acquire);
        self.cache.clear();
    }

    fn to_worker(&self, work: Work, token: u64) -> Started {
        match self.jobs.send(Job::new(work, token, self.replies.clone())) {
            Ok(()) => Started::Pending,
            // The export is shutting down, or its worker panicked and the image was given up.
            Err(metadata::WorkerGone) => Started::Done(-libc::EIO),
        }
    }
}

impl Channel for Qcow2Channel {
    unsafe fn start(&mut self, op: &Op, token: u64) -> Started {
        self.catch_up();
        match *op {
            Op::Read {
                offset,
                iovs,
                iovcnt,
                ..
            }
            | Op::Write {
                offset,
                iovs,
                iovcnt,
                ..
            } => {
                // SAFETY: the caller's contract: `iovcnt` valid iovecs.
                let len = unsafe { engine::op_bytes(op) };
                let write = matches!(op, Op::Write { .. });
                // A write-through write goes to its cluster directly only once the cluster's
                // allocation is durable too (see `Image::metadata_durable`).
                let direct_ok = match *op {
                    Op::Write { sync: true, .. } => self.image.metadata_durable(),
                    _ => true,
                };
                match self.cache.lookup(offset, len, write).filter(|_| direct_ok) {
                    // (A completion's byte count is an i32: larger reads take the other way.)
                    Some(Target::Zeros) if len <= i32::MAX as u64 => {
                        // SAFETY: a read's iovecs are valid for writes of their length (the
                        // caller's contract); zeroing them completes it.
                        unsafe { zero_iovecs(iovs, iovcnt) };
                        return Started::Done(len as i32);
                    }
                    Some(Target::File {
                        layer, offset: at, ..
                    }) => {
                        if let Some(fd) = self.image.layer_fd(layer) {
                            return Started::Ring(engine::rw_entry(fd, &with_offset(op, at)));
                        }
                    }
                    Some(Target::Zeros) | None => {}
                }
                let iovs = IoVecs {
                    ptr: iovs,
                    count: iovcnt,
                };
                let work = match *op {
                    Op::Write { sync, .. } => Work::Write { offset, iovs, sync },
                    _ => Work::Read { offset, iovs },
                };
                self.to_worker(work, token)
            }
            Op::Flush => self.to_worker(Work::Flush, token),
            Op::Discard { offset, len } => self.to_worker(
                Work::Zero {
                    offset,
                    len,
                    unmap: true,
                },
                token,
            ),
            Op::WriteZeroes { offset, len, unmap } => {
                self.to_worker(Work::Zero { offset, len, unmap }, token)
            }
        }
    }

    fn run_end(&self, offset: u64, len: u64) -> u64 {
        self.cache.run_end(offset, len)
    }

    fn completion_fd(&self) -> Option<RawFd> {
        Some(metadata::event_fd(&self.replies))
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        // Reset the eventfd first: a reply queued after this read writes it again.
        let _ = rustix::io::read(&self.replies.event, &mut [0u8; 8]);
        std::mem::swap(
            &mut *self.replies.done.lock().unwrap_or_else(|e| e.into_inner()),
            &mut self.reaped,
        );
        self.catch_up();
        for reply in self.reaped.drain(..) {
            // Hints read before the latest invalidation may be stale: dropped.
            if reply.epoch == self.epoch {
                for h in &reply.hints {
                    self.cache.insert(h.guest, h.target, h.len);
                }
            }
            done(reply.token, reply.result);
        }
    }
}

/// `op` (a read or a write) at another offset.
fn with_offset(op: &Op, offset: u64) -> Op {
    match *op {
        Op::Read {
            iovs,
            iovcnt,
            buf_index,
            ..
        } => Op::Read {
            offset,
            iovs,
            iovcnt,
            buf_index,
        },
        Op::Write {
            iovs,
            iovcnt,
            sync,
            buf_index,
            ..
        } => Op::Write {
            offset,
            iovs,
            iovcnt,
            sync,
            buf_index,
        },
        other => other,
    }
}

/// Fills the memory of `iovcnt` iovecs at `iovs` with zeros.
///
/// # Safety
/// `iovs` must point to `iovcnt` iovecs, each describing memory valid for writes of its
/// length.
unsafe fn zero_iovecs(iovs: *const libc::iovec, iovcnt: u32) {
    // SAFETY: the caller's contract.
    let iovs = unsafe { std::slice::from_raw_parts(iovs, iovcnt as usize) };
    for v in iovs {
        // SAFETY: the caller's contract: valid for writes of `iov_len` bytes.
        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
    }
}
