//! A vring as the frontend sets it up (size, addresses, base, eventfds, enable), until it is
//! complete enough to hand to its I/O thread as a `virtio_queue::Queue`.

use std::fs::File;

use virtio_queue::{Queue, QueueT};

use super::error::{Error, Result};
use crate::io::GuestMemory;

/// One vring's setup state.
#[derive(Default)]
pub struct VringSetup {
    /// Size (SET_VRING_NUM).
    pub size: u16,
    /// Guest-physical address of the descriptor table.
    pub desc: u64,
    /// Guest-physical address of the avail ring.
    pub avail: u64,
    /// Guest-physical address of the used ring.
    pub used: u64,
    /// Next avail (and used) index to start from (SET_VRING_BASE), or where it stopped.
    pub base: u16,
    /// Guest-to-backend notifications.
    pub kick: Option<File>,
    /// Backend-to-guest notifications.
    pub call: Option<File>,
    /// SET_VRING_ENABLE.
    pub enabled: bool,
    /// Running on its I/O thread.
    pub started: bool,
}

impl VringSetup {
    /// Whether the ring has what it needs to start: a kick eventfd and a size, and (when
    /// `needs_enable`: VHOST_USER_F_PROTOCOL_FEATURES was negotiated) an enable.
    pub fn ready(&self, needs_enable: bool) -> bool {
        !self.started && self.kick.is_some() && self.size > 0 && (self.enabled || !needs_enable)
    }

    /// The queue to run: addresses and indices as set up, validated against guest memory.
    pub fn queue(&self, max_size: u16, event_idx: bool, mem: &GuestMemory) -> Result<Queue> {
        let mut q = Queue::new(max_size).map_err(Error::QueueSetup)?;
        q.set_size(self.size);
        q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
        q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q.set_event_idx(event_idx);
        q.set_next_avail(self.base);
        q.set_next_used(self.base);
        q.set_ready(true);
        if !q.is_valid(mem) {
            return Err(Error::InvalidRing);
        }
        Ok(q)
    }
}
