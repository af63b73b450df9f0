//! One split virtqueue of mqblk's own frontend ([`SplitQueue`]): its place in guest memory
//! ([`RingLayout`]), requests queued on fixed descriptor chains, made visible and kicked once per
//! wait, and completions taken from the used ring after a wait on the call eventfd or a busy
//! poll.
//!
//! Request `tag` (the runner's slot index, below `slots`) always uses descriptors `3 * tag` to
//! `3 * tag + 2` and the tag's own header and status byte, so nothing is allocated or searched
//! for per request, and the used ring's id gives the tag back (`id / 3`).

use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use super::queue_eventfd;

/// Descriptors per request: header, data, status.
pub(crate) const DESCRIPTORS_PER_REQUEST: usize = 3;

const VRING_DESC_F_NEXT: u16 = 1;
const VRING_DESC_F_WRITE: u16 = 2;
const VRING_AVAIL_F_NO_INTERRUPT: u16 = 1;
const VRING_USED_F_NO_NOTIFY: u16 = 1;
const VIRTIO_BLK_T_IN: u32 = 0;
const VIRTIO_BLK_T_OUT: u32 = 1;
const VIRTIO_BLK_S_OK: u8 = 0;
const VIRTIO_BLK_S_IOERR: u8 = 1;
const VIRTIO_BLK_S_UNSUPP: u8 = 2;
/// The status byte before the device writes it: no valid status.
const STATUS_PENDING: u8 = 0xff;
/// Header bytes: type, reserved, sector.
const HEADER_LEN: usize = 16;

/// Where a queue's parts lie, as offsets from the queue's start, each on its own 4 KiB.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingLayout {
    pub(crate) size: u16,
    slots: usize,
    pub(crate) desc: usize,
    pub(crate) avail: usize,
    pub(crate) used: usize,
    headers: usize,
    statuses: usize,
    end: usize,
}

impl RingLayout {
    /// A ring of `size` entries for `slots` requests.
    pub(crate) fn new(size: u16, slots: usize) -> Self {
        let n = size as usize;
        let page = |b: usize| b.div_ceil(4096) * 4096;
        let desc = 0;
        let avail = desc + page(16 * n);
        let used = avail + page(6 + 2 * n);
        let headers = used + page(6 + 8 * n);
        let statuses = headers + page(HEADER_LEN * slots);
        let end = statuses + page(slots);
        RingLayout {
            size,
            slots,
            desc,
            avail,
            used,
            headers,
            statuses,
            end,
        }
    }

    /// Bytes the queue takes.
    pub(crate) fn bytes(&self) -> usize {
        self.end
    }
}

/// A split virtqueue in guest memory, driven from one thread.
pub(crate) struct SplitQueue {
    /// Guest memory's first byte (guest-physical address 0).
    mem: *mut u8,
    /// The queue's offset in guest memory.
    start: usize,
    layout: RingLayout,
    kick: EventFd,
    call: EventFd,
    poll: bool,
    /// VIRTIO_RING_F_EVENT_IDX was negotiated: notifications are asked for with the
    /// avail_event and used_event fields, and the ring flags mean nothing.
    event_idx: bool,
    /// The avail index as queued (the device sees `published`).
    next_avail: u16,
    published: u16,
    last_used: u16,
}

// SAFETY: the pointer is into guest memory that outlives the queue (see FrontendConnection);
// the queue's part of it is touched only by the thread that holds the queue (and the device).
unsafe impl Send for SplitQueue {}

impl SplitQueue {
    /// The queue at `start` in the guest memory at `mem`, zeroed, with new eventfds; with
    /// `poll`, it asks the device for no interrupts (by the flag; under `event_idx`, used_event
    /// stays at 0 and so asks for one interrupt every 65536 completions, which no one reads).
    ///
    /// # Safety
    /// `mem + start .. mem + start + layout.bytes()` must be mapped, outlive the queue, and be
    /// used by nothing else.
    pub(crate) unsafe fn new(
        mem: *mut u8,
        start: usize,
        layout: RingLayout,
        poll: bool,
        event_idx: bool,
    ) -> anyhow::Result<Self> {
        std::ptr::write_bytes(mem.add(start), 0, layout.bytes());
        let q = SplitQueue {
            mem,
            start,
            layout,
            kick: queue_eventfd()?,
            call: queue_eventfd()?,
            poll,
            event_idx,
            next_avail: 0,
            published: 0,
            last_used: 0,
        };
        if poll && !event_idx {
            q.write::<u16>(q.layout.avail, VRING_AVAIL_F_NO_INTERRUPT.to_le());
        }
        Ok(q)
    }

    /// This process's address of the queue's part at `offset` (what SET_VRING_ADDR carries).
    pub(crate) fn user_addr(&self, offset: usize) -> u64 {
        self.mem as u64 + (self.start + offset) as u64
    }

    pub(crate) fn kick(&self) -> &EventFd {
        &self.kick
    }

    pub(crate) fn call(&self) -> &EventFd {
        &self.call
    }

    /// The guest-physical address of the queue's part at `offset`.
    fn gpa(&self, offset: usize) -> u64 {
        (self.start + offset) as u64
    }

    fn write<T>(&self, offset: usize, v: T) {
        // SAFETY: offsets come from the layout, inside the queue's part of guest memory, and
        // are aligned for T (each part starts on a page; fields are at multiples of their size).
        unsafe { std::ptr::write_volatile(self.mem.add(self.start + offset) as *mut T, v) }
    }

    fn read<T>(&self, offset: usize) -> T {
        // SAFETY: as in `write`.
        unsafe { std::ptr::read_volatile(self.mem.add(self.start + offset) as *const T) }
    }

    fn write_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = self.layout.desc + 16 * i as usize;
        self.write(at, addr.to_le());
        self.write(at + 8, len.to_le());
        self.write(at + 12, flags.to_le());
        self.write(at + 14, next.to_le());
    }

    /// Queues a read (`write` false) or write of `len` bytes at disk `offset` with the data at
    /// `buf` in guest memory, as request `tag`. The device sees it at the next
    /// [`SplitQueue::wait`].
    pub(crate) fn queue(&mut self, tag: usize, write: bool, offset: u64, buf: *mut u8, len: usize) {
        debug_assert!(tag < self.layout.slots);
        let head = (DESCRIPTORS_PER_REQUEST * tag) as u16;
        let hdr = self.layout.headers + HEADER_LEN * tag;
        let status = self.layout.statuses + tag;
        let kind = if write {
            VIRTIO_BLK_T_OUT
        } else {
            VIRTIO_BLK_T_IN
        };
        self.write(hdr, kind.to_le());
        self.write(hdr + 4, 0u32);
        self.write(hdr + 8, (offset / 512).to_le());
        self.write(status, STATUS_PENDING);
        let data_gpa = buf as u64 - self.mem as u64;
        let data_flags = if write {
            VRING_DESC_F_NEXT
        } else {
            VRING_DESC_F_NEXT | VRING_DESC_F_WRITE
        };
        self.write_desc(
            head,
            self.gpa(hdr),
            HEADER_LEN as u32,
            VRING_DESC_F_NEXT,
            head + 1,
        );
        self.write_desc(head + 1, data_gpa, len as u32, data_flags, head + 2);
        self.write_desc(head + 2, self.gpa(status), 1, VRING_DESC_F_WRITE, 0);
        let slot = self.layout.avail + 4 + 2 * (self.next_avail % self.layout.size) as usize;
        self.write(slot, head.to_le());
        self.next_avail = self.next_avail.wrapping_add(1);
    }

    /// Makes the queued requests visible to the device, and kicks it unless it said not to.
    fn publish(&mut self) {
        if self.published == self.next_avail {
            return;
        }
        // The descriptors and ring entries before the index that exposes them.
        fence(Ordering::Release);
        self.write(self.layout.avail + 2, self.next_avail.to_le());
        let (old, new) = (self.published, self.next_avail);
        self.published = new;
        // The index before reading what the device asked for: a device that asks for kicks
        // and then looks at the index again sees ours, or we see its request.
        fence(Ordering::SeqCst);
        let kick = if self.event_idx {
            // avail_event, after the used ring's entries.
            let at = self.layout.used + 4 + 8 * self.layout.size as usize;
            need_event(u16::from_le(self.read(at)), new, old)
        } else {
            u16::from_le(self.read(self.layout.used)) & VRING_USED_F_NO_NOTIFY == 0
        };
        if kick {
            let _ = self.kick.write(1);
        }
    }

    /// Under EVENT_IDX, asks for an interrupt at the next completion (used_event, after the
    /// avail ring's entries, set to the next used index to be seen).
    fn ask_for_interrupt(&self) {
        let at = self.layout.avail + 4 + 2 * self.layout.size as usize;
        self.write(at, self.last_used.to_le());
        // The request before looking at the used index again: a completion the device adds
        // after reading used_event is seen by the next harvest, or interrupts us.
        fence(Ordering::SeqCst);
    }

    /// Appends `(tag, ret)` for each request the device has completed since the last call, ret
    /// as libblkio gives it (0, -EIO, -ENOTSUP, -EPROTO). Returns how many.
    fn harvest(&mut self, done: &mut Vec<(usize, i32)>) -> usize {
        let used_idx = u16::from_le(self.read(self.layout.used + 2));
        // The entries and the data after the index that announced them.
        fence(Ordering::Acquire);
        let mut n = 0;
        while self.last_used != used_idx {
            let at = self.layout.used + 4 + 8 * (self.last_used % self.layout.size) as usize;
            let id = u32::from_le(self.read(at)) as usize;
            let tag = id / DESCRIPTORS_PER_REQUEST;
            let ret = match self.read::<u8>(self.layout.statuses + tag) {
                VIRTIO_BLK_S_OK => 0,
                VIRTIO_BLK_S_IOERR => -libc::EIO,
                VIRTIO_BLK_S_UNSUPP => -libc::ENOTSUP,
                _ => -libc::EPROTO,
            };
            done.push((tag, ret));
            self.last_used = self.last_used.wrapping_add(1);
            n += 1;
        }
        n
    }

    /// Makes the queued requests visible, then waits up to `timeout` for at least one
    /// completion and appends them to `done`. `Ok(false)`: none within `timeout`.
    pub(crate) fn wait(
        &mut self,
        done: &mut Vec<(usize, i32)>,
        timeout: Duration,
    ) -> std::io::Result<bool> {
        self.publish();
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            if self.harvest(done) > 0 {
                return Ok(true);
            }
            if self.poll {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(1024) && Instant::now() >= deadline {
                    return Ok(false);
                }
                std::hint::spin_loop();
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            if self.event_idx {
                self.ask_for_interrupt();
                if self.harvest(done) > 0 {
                    return Ok(true);
                }
            }
            // A completion between the harvest above and this poll has signalled the eventfd
            // already, so poll returns at once: no wakeup is lost.
            let mut pfd = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&self.call),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            } else if r > 0 {
                // Resets the counter; WouldBlock (a spurious wakeup) is harmless.
                let _ = self.call.read();
            }
        }
    }
}

/// Whether a notification is due under EVENT_IDX: the other side asked for one at index
/// `event`, and the index moved from `old` to `new` (the virtio spec's vring_need_event).
fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

#[cfg(test)]
mod tests {
    use super::need_event;

    #[test]
    fn a_notification_is_due_when_the_index_passes_the_event() {
        // The device wants a kick once index 5 is made available.
        assert!(need_event(5, 6, 5));
        assert!(need_event(5, 8, 3));
        assert!(!need_event(5, 5, 3));
        assert!(!need_event(5, 9, 6));
        // Across the wrap of the 16-bit index.
        assert!(need_event(0xffff, 1, 0xfffe));
        assert!(!need_event(2, 1, 0xfffe));
    }
}
