//! In-flight I/O tracking (vhost-user protocol feature INFLIGHT_SHMFD, split virtqueues).
//!
//! The backend keeps, in a shared-memory region that the frontend holds on to, which heads of
//! each queue are in flight and in what order they were fetched. If mqblk dies, the frontend
//! reconnects to the next mqblk and hands the region back (SET_INFLIGHT_FD); that mqblk
//! resubmits every request that was in flight, in fetch order, so none is lost or left waiting.
//!
//! The layout is the one the vhost-user specification gives ("Inflight I/O tracking"), so the
//! region can move between backend implementations:
//!
//! ```text
//! per queue (aligned to 64 bytes):
//!   u64 features; u16 version; u16 desc_num; u16 last_batch_head; u16 used_idx;
//!   struct { u8 inflight; u8 padding[5]; u16 next; u64 counter; } desc[queue_size];
//! ```
//!
//! Protocol, per request (the non-batched form, one used element at a time):
//! - on fetch: `desc[head].counter = counter++`, then `desc[head].inflight = 1`;
//! - before publishing the used element: `last_batch_head = head`;
//! - after the used ring's idx is updated: `desc[head].inflight = 0`, then `used_idx = idx`.
//!
//! On reconnect: if `used_idx` differs from the used ring's idx, the process died between the
//! two steps above for `last_batch_head`, whose request did complete: clear its flag. Every head
//! still flagged is resubmitted, ordered by counter, and the next avail index is the used index
//! plus the number resubmitted.
//!
//! The region is written by one I/O thread per queue and read by the frontend only when it
//! reconnects; every access goes through atomics because the memory is shared with another
//! process.
//!
//! After the queues, mqblk's regions carry [`STATE_SIZE`] bytes of device state that must
//! survive a restart of mqblk itself, because the frontend does not send it again: the cache
//! mode the guest chose (CONFIG_WCE). The frontend treats the region as opaque bytes of the
//! size the backend gave, so this stays within the protocol; a region without the state (from
//! another backend) is used as it is.
//!
//! ```text
//! state: u64 magic "mqblkst1"; u8 writeback_saved; u8 writeback; padding to 64 bytes
//! ```

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{fence, AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::shm::{self, FaultGuard, Protection};

/// Version written into initialised queue regions.
pub const INFLIGHT_VERSION: u16 = 1;
const HEADER: usize = 16;
const DESC: usize = 16;

/// Bytes of one queue's region.
pub fn queue_region_size(queue_size: u16) -> usize {
    (HEADER + DESC * queue_size as usize).next_multiple_of(64)
}

/// Bytes of device state after the queues' regions.
pub const STATE_SIZE: usize = 64;
const STATE_MAGIC: u64 = u64::from_le_bytes(*b"mqblkst1");

/// A mapped in-flight region.
pub struct InflightRegion {
    ptr: *mut u8,
    len: usize,
    queue_size: u16,
    num_queues: u16,
    /// Present when the file could not be sealed against shrinking (see [`crate::shm`]);
    /// dropped after the mapping (fields drop after `drop`).
    guard: Option<FaultGuard>,
    _file: File,
}

// SAFETY: the mapping is plain shared memory; after construction it is only accessed through
// atomics (see `InflightQueue`), and each queue's part is written by one thread at a time.
unsafe impl Send for InflightRegion {}
// SAFETY: as above: all shared access is atomic.
unsafe impl Sync for InflightRegion {}

impl Drop for InflightRegion {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; nothing uses them after drop
        // (queue handles hold an Arc to the region).
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len);
        }
    }
}

impl InflightRegion {
    /// Allocates a zeroed region for GET_INFLIGHT_FD; returns it and the file to send.
    pub fn create(num_queues: u16, queue_size: u16) -> io::Result<(InflightRegion, File)> {
        if num_queues == 0 || queue_size == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let size = queue_region_size(queue_size) * num_queues as usize + STATE_SIZE;
        // Sealed: the frontend that receives it cannot truncate it under the I/O threads.
        let file = shm::seal::sized_memfd(c"mqblk-inflight", size as u64)?;
        let send = file.try_clone()?;
        let region = Self::map(file, 0, size as u64, num_queues, queue_size, None)?;
        Ok((region, send))
    }

    /// Maps a region handed over by SET_INFLIGHT_FD, checking it is large enough, and protects
    /// it from a later truncation (sealed, or guarded: a fault in it shuts `connection` down).
    pub fn map(
        file: File,
        offset: u64,
        size: u64,
        num_queues: u16,
        queue_size: u16,
        connection: Option<BorrowedFd<'_>>,
    ) -> io::Result<InflightRegion> {
        let need = queue_region_size(queue_size) as u64 * u64::from(num_queues);
        if num_queues == 0 || queue_size == 0 || size < need || size > (1 << 30) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let protection = Protection::of(&file);
        let file_len = file.metadata()?.len();
        if offset.checked_add(size).is_none_or(|end| end > file_len) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a fresh shared mapping of `size` bytes of `file` at `offset` (both checked
        // against the file's length); the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let guard = match protection.guard(ptr as *const u8, size as usize, connection) {
            Ok(g) => g,
            Err(e) => {
                // SAFETY: exactly what mmap returned; nothing else refers to it yet.
                unsafe { libc::munmap(ptr, size as usize) };
                return Err(e);
            }
        };
        Ok(InflightRegion {
            ptr: ptr as *mut u8,
            len: size as usize,
            queue_size,
            num_queues,
            guard,
            _file: file,
        })
    }

    /// Whether the frontend truncated the region's file while it was mapped (a fault was
    /// contained).
    pub fn faulted(&self) -> bool {
        self.guard.as_ref().is_some_and(FaultGuard::faulted)
    }

    /// The region's size in bytes (never zero).
    pub fn size(&self) -> usize {
        self.len
    }

    /// Offset of the device state, if the region has room for it after the queues.
    fn state_offset(&self) -> Option<usize> {
        let off = queue_region_size(self.queue_size) * self.num_queues as usize;
        (self.len >= off + STATE_SIZE).then_some(off)
    }

    fn state<T>(&self, off: usize, field: usize) -> &T {
        debug_assert!(off + field + std::mem::size_of::<T>() <= self.len);
        // SAFETY: `off` comes from `state_offset`, so `off + STATE_SIZE <= len` and every
        // field (at most 16 bytes in) lies inside the mapping; `off` is a multiple of 64, so
        // the u64 magic is aligned; the mapping lives as long as `self`; atomics make the
        // shared access sound.
        unsafe { &*(self.ptr.add(off + field) as *const T) }
    }

    /// The cache mode a previous mqblk saved here (true: write-back), if any.
    pub fn saved_writeback(&self) -> Option<bool> {
        let off = self.state_offset()?;
        if self.state::<AtomicU64>(off, 0).load(Ordering::Acquire) != STATE_MAGIC
            || self.state::<AtomicU8>(off, 8).load(Ordering::Relaxed) != 1
        {
            return None;
        }
        Some(self.state::<AtomicU8>(off, 9).load(Ordering::Relaxed) != 0)
    }

    /// Saves the cache mode for a restarted mqblk (nothing, in a region without room).
    pub fn save_writeback(&self, writeback: bool) {
        let Some(off) = self.state_offset() else {
            return;
        };
        self.state::<AtomicU8>(off, 9)
            .store(u8::from(writeback), Ordering::Relaxed);
        self.state::<AtomicU8>(off, 8).store(1, Ordering::Relaxed);
        self.state::<AtomicU64>(off, 0)
            .store(STATE_MAGIC, Ordering::Release);
    }

    /// The tracking handle of queue `q`, if the region covers it.
    pub fn queue(self: &Arc<Self>, q: usize) -> Option<InflightQueue> {
        if q >= self.num_queues as usize {
            return None;
        }
        let stride = queue_region_size(self.queue_size);
        Some(InflightQueue {
            region: self.clone(),
            // In bounds: q < num_queues and len >= num_queues * stride (checked in `map`).
            offset: q * stride,
            size: self.queue_size,
            counter: 0,
        })
    }
}

/// One queue's part of the in-flight region, owned by the I/O thread serving the queue.
pub struct InflightQueue {
    region: Arc<InflightRegion>,
    offset: usize,
    size: u16,
    counter: u64,
}

impl InflightQueue {
    fn at<T>(&self, off: usize) -> &T {
        debug_assert!(self.offset + off + std::mem::size_of::<T>() <= self.region.len);
        // SAFETY: `off` is within this queue's part (callers pass header offsets or
        // `desc_off(head)` with `head < size`), which lies inside the mapping; the offsets are
        // naturally aligned for T (regions are 64-byte aligned, descriptors 16-byte); the
        // mapping lives as long as `region`; atomics make the shared access sound.
        unsafe { &*(self.region.ptr.add(self.offset + off) as *const T) }
    }
    fn version(&self) -> &AtomicU16 {
        self.at(8)
    }
    fn desc_num(&self) -> &AtomicU16 {
        self.at(10)
    }
    fn last_batch_head(&self) -> &AtomicU16 {
        self.at(12)
    }
    fn used_idx(&self) -> &AtomicU16 {
        self.at(14)
    }
    fn desc_off(head: u16) -> usize {
        HEADER + DESC * head as usize
    }
    fn inflight(&self, head: u16) -> &AtomicU8 {
        self.at(Self::desc_off(head))
    }
    fn counter_of(&self, head: u16) -> &AtomicU64 {
        self.at(Self::desc_off(head) + 8)
    }

    /// Whether `head` can be tracked (it is below the region's queue size).
    pub fn covers(&self, head: u16) -> bool {
        head < self.size
    }

    /// Records that `head` was fetched from the avail ring and is about to be submitted.
    pub fn on_fetch(&mut self, head: u16) {
        if !self.covers(head) {
            return;
        }
        self.counter_of(head).store(self.counter, Ordering::Relaxed);
        self.counter += 1;
        self.inflight(head).store(1, Ordering::Release);
    }

    /// Call before publishing `head`'s used element.
    pub fn before_used(&self, head: u16) {
        if self.covers(head) {
            self.last_batch_head().store(head, Ordering::Release);
        }
    }

    /// Call after the used ring's idx became `used_idx` with `head`'s element in it.
    pub fn after_used(&self, head: u16, used_idx: u16) {
        // The used idx store (Release, by `Vq::add_used`) precedes these in program order.
        fence(Ordering::SeqCst);
        if self.covers(head) {
            self.inflight(head).store(0, Ordering::Release);
        }
        self.used_idx().store(used_idx, Ordering::Release);
    }

    /// Brings the region in line with the used ring after a (re)connect and returns the heads to
    /// resubmit in fetch order. A region never used before (version 0) is initialised instead.
    pub fn recover(&mut self, ring_used_idx: u16) -> Vec<u16> {
        if self.version().load(Ordering::Acquire) == 0 {
            for h in 0..self.size {
                self.inflight(h).store(0, Ordering::Relaxed);
                self.counter_of(h).store(0, Ordering::Relaxed);
            }
            self.desc_num().store(self.size, Ordering::Relaxed);
            self.last_batch_head().store(0, Ordering::Relaxed);
            self.used_idx().store(ring_used_idx, Ordering::Relaxed);
            self.version().store(INFLIGHT_VERSION, Ordering::Release);
            self.counter = 0;
            return Vec::new();
        }
        if self.used_idx().load(Ordering::Acquire) != ring_used_idx {
            // Died between publishing last_batch_head's used element and clearing its flag.
            let h = self.last_batch_head().load(Ordering::Acquire);
            if self.covers(h) {
                self.inflight(h).store(0, Ordering::Release);
            }
            self.used_idx().store(ring_used_idx, Ordering::Release);
        }
        let mut list: Vec<(u64, u16)> = (0..self.size)
            .filter(|&h| self.inflight(h).load(Ordering::Acquire) == 1)
            .map(|h| (self.counter_of(h).load(Ordering::Relaxed), h))
            .collect();
        list.sort_unstable();
        self.counter = list.last().map(|&(c, _)| c.wrapping_add(1)).unwrap_or(0);
        list.into_iter().map(|(_, h)| h).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_aligned() {
        assert_eq!(queue_region_size(128), 16 + 16 * 128 + 48);
        assert_eq!(queue_region_size(1024) % 64, 0);
    }

    #[test]
    fn fresh_region_is_initialised_and_tracks() {
        let (r, _f) = InflightRegion::create(2, 8).unwrap();
        let r = Arc::new(r);
        let mut q = r.queue(1).unwrap();
        assert!(r.queue(2).is_none());
        assert!(q.recover(0).is_empty());
        assert_eq!(q.version().load(Ordering::Relaxed), INFLIGHT_VERSION);
        q.on_fetch(3);
        q.on_fetch(5);
        q.on_fetch(1);
        // 5 completes first.
        q.before_used(5);
        q.after_used(5, 1);
        // A new backend picks the region up: 3 and 1 are resubmitted, in fetch order.
        let mut q2 = r.queue(1).unwrap();
        assert_eq!(q2.recover(1), vec![3, 1]);
        // Queue 0 was untouched.
        let mut q0 = r.queue(0).unwrap();
        assert!(q0.recover(0).is_empty());
    }

    #[test]
    fn death_between_used_idx_and_flag_clear() {
        let (r, _f) = InflightRegion::create(1, 8).unwrap();
        let r = Arc::new(r);
        let mut q = r.queue(0).unwrap();
        q.recover(0);
        q.on_fetch(2);
        q.on_fetch(4);
        // Used element for 4 published (ring idx 1) but the process died before after_used.
        q.before_used(4);
        let mut q2 = r.queue(0).unwrap();
        assert_eq!(q2.recover(1), vec![2]);
        // The counter continues after the highest resubmitted one.
        q2.on_fetch(6);
        let mut q3 = r.queue(0).unwrap();
        assert_eq!(q3.recover(1), vec![2, 6]);
    }

    #[test]
    fn bad_regions_are_refused() {
        let (_, f) = InflightRegion::create(1, 8).unwrap();
        let size = queue_region_size(8) as u64;
        assert!(InflightRegion::map(f.try_clone().unwrap(), 0, size, 2, 8, None).is_err());
        assert!(InflightRegion::map(f.try_clone().unwrap(), 64, size, 1, 8, None).is_err());
        assert!(InflightRegion::map(f.try_clone().unwrap(), 0, size, 0, 8, None).is_err());
        assert!(InflightRegion::map(f, 0, size, 1, 8, None).is_ok());
    }
}
