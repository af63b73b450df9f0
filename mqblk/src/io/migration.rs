//! The I/O thread's part of live migration: while the frontend logs dirty pages
//! (VHOST_F_LOG_ALL with a log from SET_LOG_BASE), every guest page this thread writes is
//! marked in the frontend's [`DirtyLog`] after it is written and before the used entry that
//! publishes it: the data of reads (which io_uring wrote straight into guest memory), status
//! bytes, GET_ID data, and (for rings with VHOST_VRING_F_LOG) the used ring.
//!
//! The frontend stops a ring (GET_VRING_BASE) only after this thread has completed and marked
//! every request of it, and syncs the log after that: nothing written is left unmarked.
//!
//! With logging off the request path pays one branch per completion (`is_on`).

use std::sync::Arc;

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use super::dirty_log::{DirtyLog, LOG_PAGE};
use super::stats::IoCounters;
use super::GuestMemory;
use crate::blk::Segment;
use crate::log_limit::LogLimiter;

/// One I/O thread's dirty logging state.
pub(super) struct DirtyTracking {
    /// The log, while logging is on.
    log: Option<Arc<DirtyLog>>,
    /// By local queue: the guest address at which the used ring's writes are logged
    /// (log_guest_addr of SET_VRING_ADDR), for rings with VHOST_VRING_F_LOG.
    used: Vec<Option<u64>>,
    warn: LogLimiter,
}

/// Pages of the range `gpa..gpa + len` (`len` > 0).
fn pages(gpa: u64, len: u64) -> u64 {
    gpa.saturating_add(len - 1) / LOG_PAGE - gpa / LOG_PAGE + 1
}

impl DirtyTracking {
    /// Logging off, for a thread of `queues` queues.
    pub(super) fn new(queues: usize) -> Self {
        DirtyTracking {
            log: None,
            used: vec![None; queues],
            warn: LogLimiter::new(),
        }
    }

    /// Turns logging on (`Some`) or off, with the used-ring log addresses by local queue.
    pub(super) fn set(&mut self, log: Option<Arc<DirtyLog>>, mut used: Vec<Option<u64>>) {
        used.resize(self.used.len(), None);
        self.log = log;
        self.used = used;
    }

    /// Whether writes are logged now.
    #[inline]
    pub(super) fn is_on(&self) -> bool {
        self.log.is_some()
    }

    /// Marks `gpa..gpa + len`.
    fn mark(&mut self, gpa: u64, len: u64, c: &mut IoCounters) {
        let Some(log) = self.log.as_deref() else {
            return;
        };
        if len == 0 {
            return;
        }
        let missed = log.mark(gpa, len);
        c.dirty_pages += pages(gpa, len) - missed;
        if missed > 0 {
            c.dirty_log_misses += missed;
            if let Some(d) = self.warn.allow() {
                tracing::warn!(
                    gpa,
                    len,
                    log_bytes = log.len(),
                    dropped_logs = d,
                    "a write lies beyond the frontend's dirty log; the migration may not copy it"
                );
            }
        }
    }

    /// Marks what the engine wrote into guest memory through `iovs` (host addresses of `mem`:
    /// each lies within one region, as `slots::map_segments` split them).
    pub(super) fn host_writes(
        &mut self,
        mem: &GuestMemory,
        iovs: &[libc::iovec],
        c: &mut IoCounters,
    ) {
        // The region of the previous iovec is tried first: (host base, length, guest base).
        let mut last: Option<(usize, usize, u64)> = None;
        for v in iovs {
            let host = v.iov_base as usize;
            let within = |&(base, len, _): &(usize, usize, u64)| {
                host >= base && host - base < len && v.iov_len <= len - (host - base)
            };
            let region = match last.filter(within) {
                Some(r) => Some(r),
                None => mem
                    .iter()
                    .filter_map(|r| {
                        let base = r.get_host_address(MemoryRegionAddress(0)).ok()? as usize;
                        Some((base, r.len() as usize, r.start_addr().0))
                    })
                    .find(within),
            };
            match region {
                Some((base, _, gpa)) => {
                    last = region;
                    self.mark(gpa + (host - base) as u64, v.iov_len as u64, c);
                }
                None => {
                    // Cannot happen: the iovecs were mapped from this memory.
                    c.dirty_log_misses += 1;
                    if let Some(d) = self.warn.allow() {
                        tracing::error!(
                            dropped_logs = d,
                            "a buffer written is not in guest memory; not marked dirty"
                        );
                    }
                }
            }
        }
    }

    /// Marks guest memory written through vm-memory at guest-physical addresses.
    pub(super) fn guest_writes(&mut self, segs: &[Segment], c: &mut IoCounters) {
        for s in segs {
            self.mark(s.addr.0, u64::from(s.len), c);
        }
    }

    /// Marks a status byte.
    pub(super) fn status_byte(&mut self, addr: GuestAddress, c: &mut IoCounters) {
        self.mark(addr.0, 1, c);
    }

    /// Marks the used ring of local queue `local` (`size` entries: flags, idx, the ring and
    /// avail_event), if the frontend asked for it: once per used entry, this covers the entry,
    /// the index and the notification fields written since the last one in 1 to 3 pages.
    pub(super) fn used_ring(&mut self, local: usize, size: u16, c: &mut IoCounters) {
        if let Some(Some(at)) = self.used.get(local).copied() {
            self.mark(at, used_ring_len(size), c);
        }
    }
}

/// Bytes of a split used ring of `size` entries, with its avail_event field.
pub fn used_ring_len(size: u16) -> u64 {
    6 + 8 * u64::from(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::{memfd_create, MemfdFlags};
    use std::fs::File;
    use vm_memory::GuestMemoryBackend;

    fn log_file(len: u64) -> (File, File) {
        let f = File::from(
            memfd_create(
                c"migration-test",
                MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
            )
            .unwrap(),
        );
        f.set_len(len).unwrap();
        let view = f.try_clone().unwrap();
        (f, view)
    }

    fn bits(f: &File, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        std::os::unix::fs::FileExt::read_exact_at(f, &mut v, 0).unwrap();
        v
    }

    fn host(mem: &GuestMemory, gpa: u64, len: usize) -> libc::iovec {
        libc::iovec {
            iov_base: mem.get_host_address(GuestAddress(gpa)).unwrap().cast(),
            iov_len: len,
        }
    }

    #[test]
    fn host_buffers_are_marked_at_their_guest_addresses() {
        // Two regions: guest 0..64 KiB and 1 MiB..1 MiB + 64 KiB.
        let mem = GuestMemory::from_ranges(&[
            (GuestAddress(0), 0x1_0000),
            (GuestAddress(0x10_0000), 0x1_0000),
        ])
        .unwrap();
        let (f, view) = log_file(64);
        let mut t = DirtyTracking::new(1);
        let mut c = IoCounters::default();
        let iovs = [host(&mem, 0x2000, 0x2000), host(&mem, 0x10_3000, 10)];
        t.host_writes(&mem, &iovs, &mut c);
        assert_eq!(bits(&view, 64), vec![0; 64], "logging off: nothing marked");
        t.set(Some(Arc::new(DirtyLog::map(f, 0, 64).unwrap())), vec![]);
        assert!(t.is_on());
        t.host_writes(&mem, &iovs, &mut c);
        let b = bits(&view, 64);
        // Pages 2 and 3; page 0x103 = byte 32, bit 3.
        assert_eq!(b[0], 0b1100);
        assert_eq!(b[32], 0b1000);
        assert_eq!(b.iter().filter(|&&x| x != 0).count(), 2);
        assert_eq!((c.dirty_pages, c.dirty_log_misses), (3, 0));
    }

    #[test]
    fn used_ring_status_and_segments() {
        let (f, view) = log_file(64);
        let mut t = DirtyTracking::new(2);
        t.set(
            Some(Arc::new(DirtyLog::map(f, 0, 64).unwrap())),
            vec![None, Some(0x5ffe)],
        );
        let mut c = IoCounters::default();
        t.used_ring(0, 256, &mut c);
        assert_eq!(bits(&view, 64), vec![0; 64], "queue 0 has no VRING_F_LOG");
        // 2054 bytes from 0x5ffe: pages 5 and 6.
        t.used_ring(1, 256, &mut c);
        t.status_byte(GuestAddress(0x9fff), &mut c);
        t.guest_writes(
            &[Segment {
                addr: GuestAddress(0x10_0000),
                len: 20,
            }],
            &mut c,
        );
        let b = bits(&view, 64);
        assert_eq!(b[0], 0b0110_0000);
        assert_eq!(b[1], 0b0000_0010);
        assert_eq!(b[32], 0b1);
        assert_eq!(c.dirty_pages, 4);
        // Beyond the log's 512 pages: counted, not written.
        t.guest_writes(
            &[Segment {
                addr: GuestAddress(0x200_0000),
                len: 4096,
            }],
            &mut c,
        );
        assert_eq!(c.dirty_log_misses, 1);
        t.set(None, vec![]);
        assert!(!t.is_on());
    }

    #[test]
    fn page_counts() {
        assert_eq!(pages(0, 1), 1);
        assert_eq!(pages(4095, 2), 2);
        assert_eq!(pages(4096, 8192), 2);
        assert_eq!(pages(u64::MAX, 1), 1);
        assert_eq!(used_ring_len(256), 2054);
    }
}
