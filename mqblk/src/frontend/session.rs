//! One frontend connection: the vhost-user requests, handled on the `vhost` crate's request
//! handler directly (not `vhost-user-backend`), so that the data plane is ours. Each vring is
//! handed to its I/O thread as a configured `virtio_queue::Queue`, and the thread owns it until
//! the frontend stops the ring.
//!
//! The control plane takes a mutex per connection (the `vhost` crate's `Mutex<T>` adapter);
//! nothing on the per-request path does.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::sync_channel;
use std::sync::Arc;

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVirtioFeatures,
    VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{Backend, GpuBackend, Result as VhuResult, VhostUserBackendReqHandlerMut};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_blk::VIRTIO_BLK_F_CONFIG_WCE;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vm_memory::ByteValued;

use super::backend_channel::BackendChannel;
use super::device::Device;
use super::disk_wait::DiskWait;
use super::error::{Error, Result};
use super::features::{self, protocol_features};
use super::memory::{MemoryTable, MAX_MEM_SLOTS};
use super::migration::Migration;
use super::vring::VringSetup;
use crate::blk::{CONFIG_SPACE_LEN, CONFIG_WRITEBACK_OFFSET};
use crate::io::dirty_log::DirtyLog;
use crate::io::inflight::InflightRegion;
use crate::io::{self, Command, GuestMemory};

/// One frontend connection's state.
pub struct Session {
    device: Arc<Device>,
    acked_features: u64,
    acked_protocol: u64,
    memory: MemoryTable,
    vrings: Vec<VringSetup>,
    /// The guest's cache mode (CONFIG_WCE): write-back unless it chose write-through.
    writeback: bool,
    inflight: Option<Arc<InflightRegion>>,
    /// The frontend's channel for backend requests (SET_BACKEND_REQ_FD), if it gave one.
    backend_channel: Option<BackendChannel>,
    /// Dirty logging while the frontend migrates the VM.
    migration: Migration,
    /// The frontend's connection, which a contained fault in memory it shared shuts down.
    connection: Option<OwnedFd>,
    /// Rings set up whose start waits until the engine can take up the disk.
    disk_wait: DiskWait,
}

impl Session {
    /// A fresh session for a new connection to `device` (`connection`: a duplicate of the
    /// connection's socket, shut down if the frontend truncates memory it shared).
    pub fn new(device: Arc<Device>, connection: Option<OwnedFd>) -> Self {
        let nq = device.config().queues as usize;
        let table_connection = connection.as_ref().and_then(|c| c.try_clone().ok());
        Session {
            device,
            acked_features: 0,
            acked_protocol: 0,
            memory: MemoryTable::new(table_connection),
            vrings: (0..nq).map(|_| VringSetup::default()).collect(),
            writeback: true,
            inflight: None,
            backend_channel: None,
            migration: Migration::new(nq),
            connection,
            disk_wait: DiskWait::default(),
        }
    }

    /// Keeps the channel the frontend is about to hand over with SET_BACKEND_REQ_FD (see
    /// [`backend_channel`](super::backend_channel)).
    pub fn set_backend_channel(&mut self, sock: File) {
        self.backend_channel = Some(BackendChannel::new(sock));
    }

    /// What is needed to tell the frontend that the configuration space changed (an online
    /// resize): a handle on its channel and whether it acknowledges (REPLY_ACK). The caller
    /// sends and waits without holding the session (see [`BackendChannel::try_clone`]). None
    /// when this frontend gave no channel (it did not negotiate BACKEND_REQ): it sees the
    /// change only when it reads the configuration again.
    pub fn config_change_channel(&self) -> Option<std::io::Result<(BackendChannel, bool)>> {
        let reply_ack = self.acked_protocol & VhostUserProtocolFeatures::REPLY_ACK.bits() != 0;
        self.backend_channel
            .as_ref()
            .map(|ch| ch.try_clone().map(|c| (c, reply_ack)))
    }

    fn check_index(&self, index: u32) -> Result<usize> {
        let i = index as usize;
        if i < self.vrings.len() {
            Ok(i)
        } else {
            Err(Error::NoSuchQueue(index))
        }
    }

    fn protocol_negotiated(&self) -> bool {
        self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
    }

    /// Starts vring `i` on its I/O thread if it is fully set up and enabled.
    fn maybe_start(&mut self, i: usize) {
        let event_idx = features::has(self.acked_features, VIRTIO_RING_F_EVENT_IDX);
        let Some(mem) = self.memory.current() else {
            return;
        };
        if !self.vrings[i].ready(self.protocol_negotiated()) {
            return;
        }
        let mut q = match self.vrings[i].queue(self.device.config().queue_size, event_idx, &mem) {
            Ok(q) => q,
            Err(e) => {
                tracing::error!(queue = i, err = %e, "queue not started");
                return;
            }
        };
        let v = &self.vrings[i];
        let Some(Ok(kick)) = v.kick.as_ref().map(File::try_clone) else {
            return;
        };
        let call = v.call.as_ref().and_then(|c| c.try_clone().ok());
        if !self.vrings.iter().any(|v| v.started) {
            // Nothing of this export is in flight: the moment to re-read what the engine
            // caches of the storage, which a migration's source may have changed.
            if let Err(e) = self.device.engine().refresh() {
                if e.kind() == std::io::ErrorKind::ResourceBusy {
                    self.disk_wait.failed(i, &e);
                } else {
                    // Not something that passes (the image's metadata, the store): tried
                    // again only when the frontend starts the ring again.
                    self.disk_wait.abandoned();
                    tracing::error!(queue = i, err = %e, "cannot take up the disk; queue not started");
                }
                return;
            }
            self.disk_wait.ended();
        }
        // With in-flight tracking, the ring restarts from what the region says: everything
        // completed is in the used ring, everything fetched but not completed is resubmitted.
        let mut resubmit = Vec::new();
        let mut track = self.inflight.as_ref().and_then(|r| r.queue(i));
        if let Some(t) = track.as_mut() {
            match q.used_idx(&*mem, std::sync::atomic::Ordering::Acquire) {
                Ok(used) => {
                    resubmit = t.recover(used.0);
                    let next_avail = used.0.wrapping_add(resubmit.len() as u16);
                    if !resubmit.is_empty() {
                        tracing::info!(
                            queue = i,
                            resubmitted = resubmit.len(),
                            used_idx = used.0,
                            next_avail,
                            "resubmitting requests that were in flight before the reconnect"
                        );
                    }
                    q.set_next_avail(next_avail);
                    q.set_next_used(used.0);
                }
                Err(e) => {
                    tracing::error!(queue = i, err = ?e, "cannot read the used ring; queue not started");
                    return;
                }
            }
        }
        let v = &mut self.vrings[i];
        v.started = true;
        let (thread, local) = self.device.thread_of(i);
        thread.send(Command::Start {
            local,
            index: i,
            queue: q,
            kick,
            call,
            inflight: track,
            resubmit,
        });
        super::test_hooks::after_start(i);
    }

    /// Whether rings wait for the disk (see [`disk_wait`](super::disk_wait)): the listener
    /// then calls [`Session::start_waiting_rings`] every [`RETRY`](super::disk_wait::RETRY).
    pub fn waits_for_disk(&self) -> bool {
        self.disk_wait.waiting()
    }

    /// Tries again to start the rings that wait for the disk.
    pub fn start_waiting_rings(&mut self) {
        if !self.disk_wait.waiting() {
            return;
        }
        let attempts = self.disk_wait.attempts();
        for i in 0..self.vrings.len() {
            if !self.vrings[i].started {
                self.maybe_start(i);
            }
        }
        if self.disk_wait.waiting() && self.disk_wait.attempts() == attempts {
            // No ring got as far as taking up the disk: none is set up to start any more.
            self.disk_wait.abandoned();
        }
    }

    /// Runs `f` with every started ring stopped (its requests completed, nothing new
    /// fetched), then starts them again where they stopped: the guest sees a pause.
    pub fn quiesced<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let running: Vec<usize> = (0..self.vrings.len())
            .filter(|&i| self.vrings[i].started)
            .collect();
        for &i in &running {
            self.stop(i);
        }
        let r = f();
        for &i in &running {
            self.maybe_start(i);
        }
        r
    }

    /// Stops vring `i` once its in-flight requests complete; records where it stopped.
    fn stop(&mut self, i: usize) {
        if !self.vrings[i].started {
            return;
        }
        let (tx, rx) = sync_channel(1);
        let (thread, local) = self.device.thread_of(i);
        thread.send(Command::Stop { local, reply: tx });
        if let Ok(next) = rx.recv() {
            self.vrings[i].base = next;
        }
        self.vrings[i].started = false;
    }

    /// Hands every I/O thread the new guest memory and waits until each has it (a thread
    /// swaps only when none of its requests is in flight).
    fn set_memory(&mut self, mem: Option<Arc<GuestMemory>>) {
        io::send_all_and_wait(self.device.threads(), |_, reply| Command::SetMem {
            mem: mem.clone(),
            reply,
        });
    }

    fn set_writeback(&mut self, writeback: bool) {
        self.writeback = writeback;
        for t in self.device.threads() {
            t.send(Command::SetWriteback(writeback));
        }
    }

    /// The frontend went away: drain every ring and forget the guest.
    pub fn disconnect(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop(i);
        }
        self.set_memory(None);
        let truncated_memory = self.memory.faulted();
        let truncated_inflight = self.inflight.as_ref().is_some_and(|r| r.faulted());
        if truncated_memory || truncated_inflight {
            tracing::warn!(
                export = %self.device.config().id,
                what = if truncated_memory { "guest memory" } else { "the in-flight region" },
                "the frontend truncated a file it shared while it was mapped: the fault was contained and its connection closed"
            );
        }
        self.memory.clear();
        for v in &mut self.vrings {
            *v = VringSetup::default();
        }
        self.acked_features = 0;
        self.acked_protocol = 0;
        self.inflight = None;
        self.backend_channel = None;
        self.migration = Migration::new(self.vrings.len());
        self.migration.apply(&self.device);
        self.set_writeback(true);
        self.disk_wait = DiskWait::default();
    }

    /// Vring `i`'s size, or the largest the export allows while the frontend has not set it.
    fn ring_size(&self, i: usize) -> u16 {
        match self.vrings[i].size {
            0 => self.device.config().queue_size,
            n => n,
        }
    }

    fn config_bytes(&self) -> [u8; CONFIG_SPACE_LEN] {
        let mut c = self.device.config_space();
        c.set_writeback(self.writeback);
        let mut b = [0u8; CONFIG_SPACE_LEN];
        b.copy_from_slice(c.as_slice());
        b
    }

    /// Refuses an in-flight region description with no queues, more queues than the export
    /// has, or queues of size 0 or larger than it allows.
    fn check_inflight_shape(&self, msg: &VhostUserInflight, what: &'static str) -> Result<()> {
        let cfg = self.device.config();
        if msg.num_queues == 0
            || msg.num_queues > cfg.queues
            || msg.queue_size == 0
            || msg.queue_size > cfg.queue_size
        {
            return Err(Error::InflightShape {
                what,
                num_queues: msg.num_queues,
                queue_size: msg.queue_size,
            });
        }
        Ok(())
    }
}

impl VhostUserBackendReqHandlerMut for Session {
    fn set_owner(&mut self) -> VhuResult<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> VhuResult<()> {
        self.disconnect();
        Ok(())
    }

    fn reset_device(&mut self) -> VhuResult<()> {
        self.disconnect();
        Ok(())
    }

    fn get_features(&mut self) -> VhuResult<u64> {
        Ok(self.device.features())
    }

    fn set_features(&mut self, features: u64) -> VhuResult<()> {
        let offered = self.device.features();
        if features & !offered != 0 {
            return Err(Error::UnofferedFeatures(features & !offered).into());
        }
        self.acked_features = features;
        let log_all = features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0;
        if self.migration.set_log_all(log_all) {
            self.migration.apply(&self.device);
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy_listening: Option<bool>,
    ) -> VhuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        let mem = self.memory.set(ctx, files)?;
        self.set_memory(Some(mem));
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VhuResult<()> {
        let i = self.check_index(index)?;
        let max = self.device.config().queue_size;
        if num == 0 || num > u32::from(max) || !num.is_power_of_two() {
            return Err(Error::QueueSize { num, max }.into());
        }
        self.vrings[i].size = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        log: u64,
    ) -> VhuResult<()> {
        let i = self.check_index(index)?;
        let desc = self.memory.frontend_to_guest(descriptor)?;
        let used = self.memory.frontend_to_guest(used)?;
        let avail = self.memory.frontend_to_guest(available)?;
        // VIRTIO 2.7: descriptor table 16-byte, avail ring 2-byte, used ring 4-byte aligned.
        // (The frontend's addresses may be aligned while the guest-physical ones are not.)
        if desc % 16 != 0 || avail % 2 != 0 || used % 4 != 0 {
            return Err(Error::MisalignedRing { desc, avail, used }.into());
        }
        let used_log = flags
            .contains(VhostUserVringAddrFlags::VHOST_VRING_F_LOG)
            .then_some(log);
        let size = self.ring_size(i);
        if self.migration.set_used_log(i, used_log, size)? {
            self.migration.apply(&self.device);
        }
        let v = &mut self.vrings[i];
        (v.desc, v.used, v.avail) = (desc, used, avail);
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VhuResult<()> {
        let i = self.check_index(index)?;
        self.vrings[i].base = base as u16;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VhuResult<VhostUserVringState> {
        let i = self.check_index(index)?;
        self.stop(i);
        // The destination's backend (another host, after a migration) must read what this
        // ring wrote.
        if let Err(e) = self.device.engine().sync_host_cache() {
            tracing::error!(queue = i, err = %e, "cannot write back the host cache of the disk");
        }
        if !self.vrings.iter().any(|v| v.started) {
            // No ring runs: the next writer of the storage may be another backend. (Whether
            // this ring ran until now does not tell: QEMU disables its rings first, with
            // SET_VRING_ENABLE, and then asks for their bases.)
            self.device.engine().deactivate();
        }
        let v = &mut self.vrings[i];
        // The ring stays stopped until the frontend kicks it again.
        v.kick = None;
        Ok(VhostUserVringState::new(index, u32::from(v.base)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VhuResult<()> {
        let i = self.check_index(u32::from(index))?;
        self.stop(i);
        self.vrings[i].kick = fd;
        self.maybe_start(i);
        Ok(())
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VhuResult<()> {
        let i = self.check_index(u32::from(index))?;
        if self.vrings[i].started {
            let call = fd.as_ref().and_then(|f| f.try_clone().ok());
            let (thread, local) = self.device.thread_of(i);
            thread.send(Command::SetCall { local, call });
        }
        self.vrings[i].call = fd;
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> VhuResult<()> {
        self.check_index(u32::from(index))?;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VhuResult<VhostUserProtocolFeatures> {
        Ok(protocol_features())
    }

    fn set_protocol_features(&mut self, features: u64) -> VhuResult<()> {
        let unoffered = features & !protocol_features().bits();
        if unoffered != 0 {
            return Err(Error::UnofferedFeatures(unoffered).into());
        }
        self.acked_protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VhuResult<u64> {
        Ok(u64::from(self.device.config().queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VhuResult<()> {
        let i = self.check_index(index)?;
        self.vrings[i].enabled = enable;
        if enable {
            self.maybe_start(i);
        } else {
            self.stop(i);
        }
        Ok(())
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VhuResult<Vec<u8>> {
        let (off, len) = (offset as usize, size as usize);
        match off.checked_add(len) {
            Some(end) if end <= CONFIG_SPACE_LEN => Ok(self.config_bytes()[off..end].to_vec()),
            _ => Err(Error::ConfigAccess { offset, len }.into()),
        }
    }

    fn set_config(
        &mut self,
        offset: u32,
        buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VhuResult<()> {
        // Only the writeback byte is writable, and only with CONFIG_WCE.
        let wce = features::has(self.acked_features, VIRTIO_BLK_F_CONFIG_WCE);
        let off = offset as usize;
        let refused = Error::ConfigAccess {
            offset,
            len: buf.len(),
        };
        let Some(end) = off.checked_add(buf.len()) else {
            return Err(refused.into());
        };
        if !wce || !(off..end).contains(&CONFIG_WRITEBACK_OFFSET) || end > CONFIG_SPACE_LEN {
            return Err(refused.into());
        }
        let wb = buf[CONFIG_WRITEBACK_OFFSET - off] != 0;
        if wb != self.writeback {
            tracing::info!(writeback = wb, "guest changed the cache mode");
        }
        self.set_writeback(wb);
        if let Some(r) = &self.inflight {
            r.save_writeback(wb);
        }
        Ok(())
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VhuResult<()> {
        Err(Error::Unsupported("gpu socket").into())
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VhuResult<File> {
        Err(Error::Unsupported("shared object").into())
    }

    fn get_inflight_fd(&mut self, msg: &VhostUserInflight) -> VhuResult<(VhostUserInflight, File)> {
        self.check_inflight_shape(msg, "GET_INFLIGHT_FD")?;
        let (region, file) =
            InflightRegion::create(msg.num_queues, msg.queue_size).map_err(Error::Inflight)?;
        let size = region.size() as u64;
        region.save_writeback(self.writeback);
        self.inflight = Some(Arc::new(region));
        Ok((
            VhostUserInflight::new(size, 0, msg.num_queues, msg.queue_size),
            file,
        ))
    }

    fn set_inflight_fd(&mut self, msg: &VhostUserInflight, file: File) -> VhuResult<()> {
        self.check_inflight_shape(msg, "SET_INFLIGHT_FD")?;
        let region = InflightRegion::map(
            file,
            msg.mmap_offset,
            msg.mmap_size,
            msg.num_queues,
            msg.queue_size,
            self.connection.as_ref().map(|c| c.as_fd()),
        )
        .map_err(Error::Inflight)?;
        // A restart: the frontend does not repeat the guest's CONFIG_WCE choice, but the
        // previous mqblk saved it in the region.
        match region.saved_writeback() {
            Some(wb) if wb != self.writeback => {
                tracing::info!(
                    writeback = wb,
                    "cache mode restored from the in-flight region"
                );
                self.set_writeback(wb);
            }
            Some(_) => {}
            None => region.save_writeback(self.writeback),
        }
        self.inflight = Some(Arc::new(region));
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VhuResult<u64> {
        Ok(MAX_MEM_SLOTS)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        _postcopy_listening: Option<bool>,
    ) -> VhuResult<Option<VhostUserMemoryRegionBase>> {
        let mem = self.memory.add(region, fd)?;
        self.set_memory(Some(mem));
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VhuResult<()> {
        let mem = self.memory.remove(region)?;
        self.set_memory(Some(mem));
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VhuResult<Option<File>> {
        Err(Error::Unsupported("device state transfer").into())
    }

    fn check_device_state(&mut self) -> VhuResult<()> {
        Err(Error::Unsupported("device state transfer").into())
    }

    fn get_shmem_config(&mut self) -> VhuResult<VhostUserShMemConfig> {
        Err(Error::Unsupported("shared memory regions").into())
    }

    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> VhuResult<()> {
        let map = DirtyLog::map(file, log.mmap_offset, log.mmap_size).map_err(Error::from)?;
        let sizes: Vec<u16> = (0..self.vrings.len()).map(|i| self.ring_size(i)).collect();
        self.migration.set_log(map, self.memory.end(), &sizes)?;
        self.migration.apply(&self.device);
        Ok(())
    }
}
