//! One I/O thread's way to a qcow2 export: its ring for what its mapping cache holds, the
//! metadata worker for the rest.

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::image::{Image, Invalidation};
use super::jobs::{self, Hint, IoVecs, Job, Jobs, Replies, Reply, Work};
use super::locks::{clusters, overlap};
use super::mapping::{MappingCache, Target};
use super::metadata;
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
    /// The invalidations made since the oldest reaped reply's hints were read (reused).
    pub(super) since_hints: Vec<Invalidation>,
    /// Jobs were sent this round: the worker is woken at its end (`end_round`).
    pub(super) wake_worker: bool,
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
        if !metadata::invalidations_since(&self.image, self.epoch, |i| {
            cache.invalidate(i.offset, i.len)
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

    fn send_to_worker(&mut self, work: Work, token: u64) -> Started {
        match self.jobs.send(Job::new(work, token, self.replies.clone())) {
            Ok(()) => {
                self.wake_worker = true;
                Started::Pending
            }
            // The export is shutting down, or its worker panicked and the image was given up.
            Err(jobs::WorkerGone) => Started::Done(-libc::EIO),
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
                self.send_to_worker(work, token)
            }
            Op::Flush => self.send_to_worker(Work::Flush, token),
            Op::Discard { offset, len } => self.send_to_worker(
                Work::Zero {
                    offset,
                    len,
                    unmap: true,
                },
                token,
            ),
            Op::WriteZeroes { offset, len, unmap } => {
                self.send_to_worker(Work::Zero { offset, len, unmap }, token)
            }
        }
    }

    fn run_end(&self, offset: u64, len: u64) -> u64 {
        self.cache.run_end(offset, len)
    }

    fn completion_fd(&self) -> Option<RawFd> {
        Some(jobs::event_fd(&self.replies))
    }

    fn end_round(&mut self) {
        if std::mem::take(&mut self.wake_worker) {
            self.jobs.wake();
        }
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        // Reset the eventfd first: a reply queued after this read writes it again.
        let _ = rustix::io::read(&self.replies.event, &mut [0u8; 8]);
        std::mem::swap(
            &mut *self.replies.done.lock().unwrap_or_else(|e| e.into_inner()),
            &mut self.reaped,
        );
        self.catch_up();
        // A reply's hints were read at its epoch. Of those read before the latest
        // invalidation, the clusters no invalidation since has touched still hold. With
        // allocations in a group commit each bumping the epoch, dropping every such reply's
        // hints would lose most of them, and each lost one sends the next request for its
        // cluster to the worker.
        let oldest = self
            .reaped
            .iter()
            .filter(|r| r.epoch != self.epoch && !r.hints.is_empty())
            .map(|r| r.epoch)
            .min();
        self.since_hints.clear();
        let known = match oldest {
            Some(seen) => {
                metadata::invalidations_since(&self.image, seen, |i| self.since_hints.push(*i))
            }
            None => true,
        };
        let bits = self.image.cluster_bits;
        for reply in self.reaped.drain(..) {
            if reply.epoch == self.epoch {
                for h in &reply.hints {
                    self.cache.insert(h.guest, h.target, h.len);
                }
            } else if known && reply.epoch < self.epoch {
                for h in &reply.hints {
                    insert_untouched(&mut self.cache, h, reply.epoch, &self.since_hints, bits);
                }
            }
            done(reply.token, reply.result);
        }
    }
}

/// Caches the clusters of `hint` (read at epoch `read_at`) that none of the invalidations in
/// `since` made after `read_at` touched.
fn insert_untouched(
    cache: &mut MappingCache,
    hint: &Hint,
    read_at: u64,
    since: &[Invalidation],
    bits: u32,
) {
    let touched = |range: &std::ops::RangeInclusive<u64>| {
        since
            .iter()
            .any(|i| i.epoch > read_at && overlap(&clusters(i.offset, i.len, bits), range))
    };
    let range = clusters(hint.guest, hint.len, bits);
    if !touched(&range) {
        return cache.insert(hint.guest, hint.target, hint.len);
    }
    let first = hint.guest >> bits;
    for c in range.filter(|&c| !touched(&(c..=c))) {
        cache.insert(
            c << bits,
            hint.target.advance((c - first) << bits),
            1 << bits,
        );
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

#[cfg(test)]
mod tests {
    use super::*;

    const BITS: u32 = 16;
    const C: u64 = 1 << BITS;

    fn backing(offset: u64) -> Target {
        Target::File {
            layer: 1,
            offset,
            writable: false,
        }
    }

    fn invalidation(epoch: u64, offset: u64, len: u64) -> Invalidation {
        Invalidation { epoch, offset, len }
    }

    /// A hint read at epoch 5 over clusters 0..8, while clusters 2 and 5..6 were allocated at
    /// epochs 6 and 7: those are left out, the rest is cached; what was invalidated at or
    /// before the read does not count.
    #[test]
    fn a_hint_read_before_an_invalidation_keeps_only_the_clusters_it_did_not_touch() {
        let mut cache = MappingCache::new(BITS, 64, 1 << 20);
        let hint = Hint {
            guest: 0,
            target: backing(10 * C),
            len: 8 * C,
        };
        let since = [
            invalidation(7, 5 * C + 100, C),
            invalidation(6, 2 * C, 512),
            invalidation(5, 0, 8 * C),
        ];
        insert_untouched(&mut cache, &hint, 5, &since, BITS);
        for c in 0..8 {
            let cached = cache.lookup(c * C, 4096, false);
            if [2, 5, 6].contains(&c) {
                assert_eq!(cached, None, "cluster {c} was invalidated after the read");
            } else {
                assert_eq!(cached, Some(backing((10 + c) * C)), "cluster {c}");
            }
        }
        // Nothing after the read: the whole run, as one.
        let mut cache = MappingCache::new(BITS, 64, 1 << 20);
        insert_untouched(&mut cache, &hint, 7, &since, BITS);
        assert_eq!(cache.lookup(0, 8 * C, false), Some(backing(10 * C)));
    }
}
