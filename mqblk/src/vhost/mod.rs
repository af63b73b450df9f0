//! The vhost-user device: features, config space, memory table, vring setup, and the
//! queue-to-thread map.
//!
//! This is the control plane. It is written on the `vhost` crate's request handler directly
//! (not `vhost-user-backend`) so that the data plane is ours: each queue is handed to its I/O
//! thread as a configured `virtio_queue::Queue`, and the thread owns it until the frontend
//! stops the ring. GET/SET_INFLIGHT_FD slot in here when in-flight tracking is added.
//!
//! The control plane takes a mutex per connection (the `vhost` crate's `Mutex<T>` adapter);
//! nothing on the per-request path does.

pub mod inflight;

use std::fs::File;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVirtioFeatures,
    VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    Backend, Error as VhuError, GpuBackend, Result as VhuResult, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::{Queue, QueueT};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::blk::{BlkConfig, Limits, CONFIG_SPACE_LEN, CONFIG_WRITEBACK_OFFSET};
use crate::config::ExportConfig;
use crate::engine::Engine;
use crate::queue::worker::{self, Command, Mem, WorkerConfig, WorkerHandle};
use inflight::InflightRegion;

/// Memory slots we accept (CONFIGURE_MEM_SLOTS); QEMU's own limit.
pub const MAX_MEM_SLOTS: u64 = 509;
/// Largest discard / write-zeroes, in sectors (512 MiB).
pub const MAX_DWZ_SECTORS: u32 = 1 << 20;

/// The virtio features an export offers.
pub fn device_features(readonly: bool) -> u64 {
    let mut f = 1u64 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_EVENT_IDX
        | 1 << VIRTIO_RING_F_INDIRECT_DESC
        | 1 << VIRTIO_BLK_F_SEG_MAX
        | 1 << VIRTIO_BLK_F_BLK_SIZE
        | 1 << VIRTIO_BLK_F_TOPOLOGY
        | 1 << VIRTIO_BLK_F_FLUSH
        | 1 << VIRTIO_BLK_F_CONFIG_WCE
        | 1 << VIRTIO_BLK_F_MQ
        | 1 << VIRTIO_BLK_F_DISCARD
        | 1 << VIRTIO_BLK_F_WRITE_ZEROES
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    if readonly {
        f |= 1 << VIRTIO_BLK_F_RO;
    }
    f
}

/// The vhost-user protocol features an export offers.
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
}

/// What an export's connections share: its settings, its storage and its I/O threads.
pub struct ExportShared {
    /// Settings.
    pub cfg: ExportConfig,
    /// Storage.
    pub engine: Arc<dyn Engine>,
    /// I/O threads; queue q is served by `workers[cfg.thread_of_queue(q)]`.
    pub workers: Vec<WorkerHandle>,
    /// Advertised device configuration.
    pub blk: BlkConfig,
}

impl ExportShared {
    /// Opens nothing: builds the device around an engine and starts the I/O threads.
    pub fn new(cfg: ExportConfig, engine: Arc<dyn Engine>) -> std::io::Result<Self> {
        let bs = engine.block_size();
        let seg_max = (u32::from(cfg.queue_size) - 2).clamp(1, worker::IOV_MAX as u32 - 2);
        let blk = BlkConfig {
            capacity_sectors: engine.capacity() >> 9,
            seg_max,
            blk_size: bs,
            physical_block_exp: if bs >= 4096 { 0 } else { 3 },
            min_io_size: 1,
            opt_io_size: 0,
            writeback: 1,
            num_queues: cfg.queues,
            max_discard_sectors: MAX_DWZ_SECTORS,
            discard_sector_alignment: (bs / 512).max(1),
            max_write_zeroes_sectors: MAX_DWZ_SECTORS,
        };
        let limits = Limits {
            capacity_sectors: blk.capacity_sectors,
            // seg_max data segments plus header and status, with slack for split headers.
            max_descriptors: seg_max as usize + 4,
            readonly: cfg.readonly,
            max_discard_sectors: MAX_DWZ_SECTORS,
            max_write_zeroes_sectors: MAX_DWZ_SECTORS,
        };
        let nthreads = cfg.num_threads();
        let mut serial = cfg.serial.as_bytes().to_vec();
        serial.truncate(crate::config::MAX_SERIAL_LEN);
        let sock_name = cfg
            .socket
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut workers = Vec::with_capacity(nthreads);
        for t in 0..nthreads {
            let nq = (0..cfg.queues as usize)
                .filter(|&q| cfg.thread_of_queue(q) == t)
                .count();
            let wc = WorkerConfig {
                name: format!("mqblk-io{t}-{}", &sock_name[..sock_name.len().min(6)]),
                cpu: cfg.cpus.get(t).copied(),
                queue_sizes: vec![cfg.queue_size; nq],
                limits,
                serial: serial.clone(),
                tuning: cfg.tuning,
            };
            workers.push(worker::spawn(wc, engine.clone())?);
        }
        Ok(ExportShared {
            cfg,
            engine,
            workers,
            blk,
        })
    }

    fn worker_of(&self, q: usize) -> (&WorkerHandle, usize) {
        let t = self.cfg.thread_of_queue(q);
        (&self.workers[t], q / self.cfg.num_threads())
    }

    /// Drains and stops all I/O threads.
    pub fn shutdown(&mut self) {
        for w in &mut self.workers {
            w.shutdown();
        }
    }
}

#[derive(Default)]
struct Vring {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    base: u16,
    kick: Option<File>,
    call: Option<File>,
    enabled: bool,
    started: bool,
}

struct Mapping {
    user_addr: u64,
    size: u64,
    gpa: u64,
}

/// One frontend connection's device state.
pub struct Device {
    export: Arc<ExportShared>,
    acked_features: u64,
    acked_protocol: u64,
    mem: Option<Arc<Mem>>,
    mappings: Vec<Mapping>,
    vrings: Vec<Vring>,
    writeback: bool,
    inflight: Option<Arc<InflightRegion>>,
}

fn einval() -> VhuError {
    VhuError::InvalidParam
}

/// Refuses an in-flight region description (GET_ or SET_INFLIGHT_FD) with no queues, more
/// queues than the export has, or queues of size 0 or larger than it allows.
fn check_inflight_shape(cfg: &ExportConfig, msg: &VhostUserInflight, what: &str) -> VhuResult<()> {
    if msg.num_queues == 0
        || msg.num_queues > cfg.queues
        || msg.queue_size == 0
        || msg.queue_size > cfg.queue_size
    {
        tracing::warn!(
            num_queues = msg.num_queues,
            queue_size = msg.queue_size,
            "{what} with an invalid queue count or size"
        );
        return Err(einval());
    }
    Ok(())
}

impl Device {
    /// A fresh device for a new connection.
    pub fn new(export: Arc<ExportShared>) -> Self {
        let nq = export.cfg.queues as usize;
        Device {
            export,
            acked_features: 0,
            acked_protocol: 0,
            mem: None,
            mappings: Vec::new(),
            vrings: (0..nq).map(|_| Vring::default()).collect(),
            writeback: true,
            inflight: None,
        }
    }

    fn vring(&mut self, index: u32) -> VhuResult<&mut Vring> {
        self.vrings.get_mut(index as usize).ok_or_else(einval)
    }

    fn vmm_to_gpa(&self, addr: u64) -> VhuResult<u64> {
        for m in &self.mappings {
            if addr >= m.user_addr && addr - m.user_addr < m.size {
                return Ok(m.gpa + (addr - m.user_addr));
            }
        }
        Err(einval())
    }

    fn protocol_negotiated(&self) -> bool {
        self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
    }

    /// Starts vring `i` on its I/O thread if it is fully set up and enabled.
    fn maybe_start(&mut self, i: usize) {
        let event_idx = self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let enabled_ok = self.vrings[i].enabled || !self.protocol_negotiated();
        let Some(mem) = self.mem.clone() else { return };
        let v = &mut self.vrings[i];
        if v.started || !enabled_ok || v.kick.is_none() || v.size == 0 {
            return;
        }
        let mut q = match Queue::new(self.export.cfg.queue_size) {
            Ok(q) => q,
            Err(e) => {
                tracing::error!(queue = i, err = ?e, "cannot create queue");
                return;
            }
        };
        q.set_size(v.size);
        q.set_desc_table_address(Some(v.desc as u32), Some((v.desc >> 32) as u32));
        q.set_avail_ring_address(Some(v.avail as u32), Some((v.avail >> 32) as u32));
        q.set_used_ring_address(Some(v.used as u32), Some((v.used >> 32) as u32));
        q.set_event_idx(event_idx);
        q.set_next_avail(v.base);
        q.set_next_used(v.base);
        q.set_ready(true);
        if !q.is_valid(&*mem) {
            tracing::error!(
                queue = i,
                "frontend gave an invalid ring (size or addresses); queue not started"
            );
            return;
        }
        // With in-flight tracking, the rings restart from what the region says: everything
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
        let kick = match v.kick.as_ref().map(|k| k.try_clone()) {
            Some(Ok(k)) => k,
            _ => return,
        };
        let call = v.call.as_ref().and_then(|c| c.try_clone().ok());
        v.started = true;
        let (w, local) = self.export.worker_of(i);
        w.send(Command::Start {
            local,
            index: i,
            queue: q,
            kick,
            call,
            inflight: track,
            resubmit,
        });
    }

    /// Stops vring `i` after its in-flight requests complete; records next_avail as the base.
    fn stop(&mut self, i: usize) {
        if !self.vrings[i].started {
            return;
        }
        let (tx, rx) = sync_channel(1);
        let (w, local) = self.export.worker_of(i);
        w.send(Command::Stop { local, reply: tx });
        if let Ok(next) = rx.recv() {
            self.vrings[i].base = next;
        }
        self.vrings[i].started = false;
    }

    fn set_memory(&mut self, mem: Option<Arc<Mem>>) {
        self.mem = mem.clone();
        for w in &self.export.workers {
            let (tx, rx) = sync_channel(1);
            w.send(Command::SetMem {
                mem: mem.clone(),
                reply: tx,
            });
            let _ = rx.recv();
        }
    }

    /// Called when the frontend goes away: drain every ring and forget the guest.
    pub fn disconnect(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop(i);
        }
        self.set_memory(None);
        self.mappings.clear();
        for v in &mut self.vrings {
            *v = Vring::default();
        }
        self.acked_features = 0;
        self.acked_protocol = 0;
        self.writeback = true;
        self.inflight = None;
        for w in &self.export.workers {
            w.send(Command::SetWriteback(true));
        }
    }

    fn map_region(region: &VhostUserMemoryRegion, file: File) -> VhuResult<GuestRegionMmap<()>> {
        if region.memory_size == 0 {
            return Err(einval());
        }
        let size = usize::try_from(region.memory_size).map_err(|_| einval())?;
        // A mapping past the end of its file would SIGBUS the I/O thread that touches it (and
        // with it the whole daemon): the region must lie within the file.
        let file_len = file.metadata().map_err(VhuError::ReqHandlerError)?.len();
        let end = region.mmap_offset.checked_add(region.memory_size);
        if end.is_none_or(|end| end > file_len) {
            tracing::warn!(
                size = { region.memory_size },
                offset = { region.mmap_offset },
                file_len,
                "memory region extends past the end of its file; refused"
            );
            return Err(einval());
        }
        let mmap = MmapRegion::from_file(FileOffset::new(file, region.mmap_offset), size)
            .map_err(|e| VhuError::ReqHandlerError(std::io::Error::other(e.to_string())))?;
        GuestRegionMmap::new(mmap, GuestAddress(region.guest_phys_addr)).ok_or_else(einval)
    }

    fn config_bytes(&self) -> [u8; CONFIG_SPACE_LEN] {
        let mut b = self.export.blk.to_bytes();
        b[CONFIG_WRITEBACK_OFFSET] = u8::from(self.writeback);
        b
    }
}

impl VhostUserBackendReqHandlerMut for Device {
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
        Ok(device_features(self.export.cfg.readonly))
    }

    fn set_features(&mut self, features: u64) -> VhuResult<()> {
        let offered = device_features(self.export.cfg.readonly);
        if features & !offered != 0 {
            tracing::warn!(
                features = format_args!("{features:#x}"),
                "frontend acked features we did not offer"
            );
            return Err(einval());
        }
        self.acked_features = features;
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy_listening: Option<bool>,
    ) -> VhuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if ctx.len() != files.len() {
            return Err(einval());
        }
        let mut regions = Vec::with_capacity(ctx.len());
        let mut mappings = Vec::with_capacity(ctx.len());
        for (r, f) in ctx.iter().zip(files) {
            regions.push(Self::map_region(r, f)?);
            mappings.push(Mapping {
                user_addr: r.user_addr,
                size: r.memory_size,
                gpa: r.guest_phys_addr,
            });
        }
        let mem = GuestMemoryMmap::from_regions(regions).map_err(|_| einval())?;
        self.mappings = mappings;
        self.set_memory(Some(Arc::new(mem)));
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VhuResult<()> {
        let max = u32::from(self.export.cfg.queue_size);
        if num == 0 || num > max || !num.is_power_of_two() {
            tracing::warn!(index, num, max, "frontend asked for an invalid queue size");
            return Err(einval());
        }
        self.vring(index)?.size = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VhuResult<()> {
        let desc = self.vmm_to_gpa(descriptor)?;
        let used = self.vmm_to_gpa(used)?;
        let avail = self.vmm_to_gpa(available)?;
        // VIRTIO 2.7: descriptor table 16-byte, avail ring 2-byte, used ring 4-byte aligned.
        // (The frontend's addresses may be aligned while the guest-physical ones are not.)
        if desc % 16 != 0 || avail % 2 != 0 || used % 4 != 0 {
            tracing::warn!(
                index,
                desc,
                avail,
                used,
                "misaligned ring addresses; refused"
            );
            return Err(einval());
        }
        let v = self.vring(index)?;
        v.desc = desc;
        v.used = used;
        v.avail = avail;
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VhuResult<()> {
        let v = self.vring(index)?;
        v.base = base as u16;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VhuResult<VhostUserVringState> {
        self.vring(index)?;
        let i = index as usize;
        self.stop(i);
        let v = &mut self.vrings[i];
        // The ring is stopped until the frontend kicks it again.
        v.kick = None;
        Ok(VhostUserVringState::new(index, u32::from(v.base)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VhuResult<()> {
        self.vring(u32::from(index))?;
        let i = index as usize;
        self.stop(i);
        self.vrings[i].kick = fd;
        self.maybe_start(i);
        Ok(())
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VhuResult<()> {
        self.vring(u32::from(index))?;
        let i = index as usize;
        if self.vrings[i].started {
            let call = fd.as_ref().and_then(|f| f.try_clone().ok());
            let (w, local) = self.export.worker_of(i);
            w.send(Command::SetCall { local, call });
        }
        self.vrings[i].call = fd;
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> VhuResult<()> {
        self.vring(u32::from(index))?;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VhuResult<VhostUserProtocolFeatures> {
        Ok(protocol_features())
    }

    fn set_protocol_features(&mut self, features: u64) -> VhuResult<()> {
        if features & !protocol_features().bits() != 0 {
            return Err(einval());
        }
        self.acked_protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VhuResult<u64> {
        Ok(u64::from(self.export.cfg.queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VhuResult<()> {
        self.vring(index)?;
        let i = index as usize;
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
        let (off, size) = (offset as usize, size as usize);
        let end = off.checked_add(size).ok_or_else(einval)?;
        if end > CONFIG_SPACE_LEN {
            return Err(einval());
        }
        Ok(self.config_bytes()[off..end].to_vec())
    }

    fn set_config(
        &mut self,
        offset: u32,
        buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VhuResult<()> {
        // Only the writeback byte is writable, and only with CONFIG_WCE.
        let wce = self.acked_features & (1 << VIRTIO_BLK_F_CONFIG_WCE) != 0;
        let off = offset as usize;
        let end = off.checked_add(buf.len()).ok_or_else(einval)?;
        if !wce || !(off..end).contains(&CONFIG_WRITEBACK_OFFSET) || end > CONFIG_SPACE_LEN {
            return Err(einval());
        }
        let wb = buf[CONFIG_WRITEBACK_OFFSET - off] != 0;
        if wb != self.writeback {
            tracing::info!(writeback = wb, "guest changed the cache mode");
        }
        self.writeback = wb;
        for w in &self.export.workers {
            w.send(Command::SetWriteback(wb));
        }
        if let Some(r) = &self.inflight {
            r.save_writeback(wb);
        }
        Ok(())
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VhuResult<()> {
        Err(VhuError::InvalidOperation("gpu socket"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VhuResult<File> {
        Err(VhuError::InvalidOperation("shared object"))
    }

    fn get_inflight_fd(&mut self, msg: &VhostUserInflight) -> VhuResult<(VhostUserInflight, File)> {
        check_inflight_shape(&self.export.cfg, msg, "GET_INFLIGHT_FD")?;
        let (region, file) = InflightRegion::create(msg.num_queues, msg.queue_size)
            .map_err(VhuError::ReqHandlerError)?;
        let size = region.size() as u64;
        region.save_writeback(self.writeback);
        self.inflight = Some(Arc::new(region));
        Ok((
            VhostUserInflight::new(size, 0, msg.num_queues, msg.queue_size),
            file,
        ))
    }

    fn set_inflight_fd(&mut self, msg: &VhostUserInflight, file: File) -> VhuResult<()> {
        check_inflight_shape(&self.export.cfg, msg, "SET_INFLIGHT_FD")?;
        let region = InflightRegion::map(
            file,
            msg.mmap_offset,
            msg.mmap_size,
            msg.num_queues,
            msg.queue_size,
        )
        .map_err(|e| {
            tracing::warn!(err = %e, "SET_INFLIGHT_FD region refused");
            VhuError::ReqHandlerError(e)
        })?;
        // A restart: the frontend does not repeat the guest's CONFIG_WCE choice, but the
        // previous mqblk saved it in the region.
        match region.saved_writeback() {
            Some(wb) => {
                if wb != self.writeback {
                    tracing::info!(
                        writeback = wb,
                        "cache mode restored from the in-flight region"
                    );
                    self.writeback = wb;
                    for w in &self.export.workers {
                        w.send(Command::SetWriteback(wb));
                    }
                }
            }
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
        if self.mappings.len() as u64 >= MAX_MEM_SLOTS {
            return Err(einval());
        }
        let r = Self::map_region(region, fd)?;
        let mem = match &self.mem {
            Some(m) => m.insert_region(Arc::new(r)).map_err(|_| einval())?,
            None => GuestMemoryMmap::from_regions(vec![r]).map_err(|_| einval())?,
        };
        self.mappings.push(Mapping {
            user_addr: region.user_addr,
            size: region.memory_size,
            gpa: region.guest_phys_addr,
        });
        self.set_memory(Some(Arc::new(mem)));
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VhuResult<()> {
        let Some(cur) = &self.mem else {
            return Err(einval());
        };
        let (mem, _) = cur
            .remove_region(GuestAddress(region.guest_phys_addr), region.memory_size)
            .map_err(|_| einval())?;
        self.mappings
            .retain(|m| !(m.gpa == region.guest_phys_addr && m.size == region.memory_size));
        self.set_memory(Some(Arc::new(mem)));
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VhuResult<Option<File>> {
        Err(VhuError::InvalidOperation("device state"))
    }

    fn check_device_state(&mut self) -> VhuResult<()> {
        Err(VhuError::InvalidOperation("device state"))
    }

    fn get_shmem_config(&mut self) -> VhuResult<VhostUserShMemConfig> {
        Err(VhuError::InvalidOperation("shmem config"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VhuResult<()> {
        Err(VhuError::InvalidOperation("dirty log"))
    }
}
