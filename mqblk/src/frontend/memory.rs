//! The guest memory table the frontend shares: mapping its regions (SET_MEM_TABLE,
//! ADD_MEM_REG, REM_MEM_REG) and translating the frontend's own addresses of the rings into
//! guest-physical ones.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Weak};

use vhost::vhost_user::message::VhostUserMemoryRegion;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use super::error::{Error, Result};
use crate::io::GuestMemory;
use crate::shm::{FaultGuard, Protection};

/// Memory slots we accept (CONFIGURE_MEM_SLOTS); QEMU's own limit.
pub const MAX_MEM_SLOTS: u64 = 509;

/// One region as the frontend described it.
struct Mapping {
    user_addr: u64,
    size: u64,
    gpa: u64,
}

type Region = GuestRegionMmap<()>;

/// The frontend's memory regions, mapped.
#[derive(Default)]
pub struct MemoryTable {
    mem: Option<Arc<GuestMemory>>,
    mappings: Vec<Mapping>,
    /// The connection a fault in an unsealable region shuts down.
    connection: Option<OwnedFd>,
    /// The fault guards of regions whose files could not be sealed, each with its region. A
    /// guard goes only once its region is unmapped: the I/O threads may still use a region
    /// after the table has dropped it, until they take the next memory.
    guards: Vec<(Weak<Region>, FaultGuard)>,
}

/// Maps one region, refusing one that does not lie within its file, and protects the mapping
/// from a later truncation of the file (sealed, or guarded: see [`crate::shm`]).
fn map_region(
    region: &VhostUserMemoryRegion,
    file: File,
    connection: Option<&OwnedFd>,
) -> Result<(Arc<Region>, Option<FaultGuard>)> {
    let bad = |why: String| Error::BadRegion(why);
    if region.memory_size == 0 {
        return Err(bad("size 0".into()));
    }
    let size = usize::try_from(region.memory_size).map_err(|_| bad("too large".into()))?;
    let protection = Protection::of(&file);
    let file_len = file
        .metadata()
        .map_err(|e| bad(format!("cannot stat its file: {e}")))?
        .len();
    let end = region.mmap_offset.checked_add(region.memory_size);
    if end.is_none_or(|end| end > file_len) {
        return Err(bad(format!(
            "{} bytes at offset {} extend past the end of its {file_len}-byte file",
            { region.memory_size },
            { region.mmap_offset }
        )));
    }
    let mmap = MmapRegion::from_file(FileOffset::new(file, region.mmap_offset), size)
        .map_err(|e| bad(format!("cannot map: {e}")))?;
    let guard = protection
        .guard(mmap.as_ptr(), mmap.size(), connection.map(|c| c.as_fd()))
        .map_err(|e| {
            bad(format!(
                "its file cannot be sealed against shrinking, nor its mapping guarded: {e}"
            ))
        })?;
    let r = GuestRegionMmap::new(mmap, GuestAddress(region.guest_phys_addr))
        .ok_or_else(|| bad("guest-physical range overflows".into()))?;
    Ok((Arc::new(r), guard))
}

impl MemoryTable {
    /// An empty table for the frontend on `connection`.
    pub fn new(connection: Option<OwnedFd>) -> Self {
        MemoryTable {
            connection,
            ..MemoryTable::default()
        }
    }

    /// Maps a region and keeps its guard, if it needs one.
    fn map(&mut self, region: &VhostUserMemoryRegion, file: File) -> Result<Arc<Region>> {
        let (r, guard) = map_region(region, file, self.connection.as_ref())?;
        if let Some(g) = guard {
            self.guards.push((Arc::downgrade(&r), g));
        }
        Ok(r)
    }

    /// Lets go of the guards of regions nobody maps any more.
    fn drop_unused_guards(&mut self) {
        self.guards.retain(|(r, _)| r.strong_count() > 0);
    }

    /// Whether the frontend truncated a file it shared while it was mapped (a fault was
    /// contained).
    pub fn faulted(&self) -> bool {
        self.guards.iter().any(|(_, g)| g.faulted())
    }

    /// The current guest memory, if any.
    pub fn current(&self) -> Option<Arc<GuestMemory>> {
        self.mem.clone()
    }

    /// Replaces the whole table (SET_MEM_TABLE).
    pub fn set(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: Vec<File>,
    ) -> Result<Arc<GuestMemory>> {
        if regions.len() != files.len() {
            return Err(Error::BadMemoryTable("a file per region is needed".into()));
        }
        let mut mapped = Vec::with_capacity(regions.len());
        let mut mappings = Vec::with_capacity(regions.len());
        for (r, f) in regions.iter().zip(files) {
            mapped.push(self.map(r, f)?);
            mappings.push(Mapping {
                user_addr: r.user_addr,
                size: r.memory_size,
                gpa: r.guest_phys_addr,
            });
        }
        let mem = GuestMemoryMmap::from_arc_regions(mapped)
            .map_err(|e| Error::BadMemoryTable(e.to_string()))?;
        self.mappings = mappings;
        Ok(self.install(mem))
    }

    /// Adds one region (ADD_MEM_REG).
    pub fn add(&mut self, region: &VhostUserMemoryRegion, file: File) -> Result<Arc<GuestMemory>> {
        if self.mappings.len() as u64 >= MAX_MEM_SLOTS {
            return Err(Error::TooManyRegions(MAX_MEM_SLOTS));
        }
        let r = self.map(region, file)?;
        let mem = match &self.mem {
            Some(m) => m.insert_region(r),
            None => GuestMemoryMmap::from_arc_regions(vec![r]),
        }
        .map_err(|e| Error::BadMemoryTable(e.to_string()))?;
        self.mappings.push(Mapping {
            user_addr: region.user_addr,
            size: region.memory_size,
            gpa: region.guest_phys_addr,
        });
        Ok(self.install(mem))
    }

    /// Removes one region (REM_MEM_REG).
    pub fn remove(&mut self, region: &VhostUserMemoryRegion) -> Result<Arc<GuestMemory>> {
        let cur = self
            .mem
            .as_ref()
            .ok_or_else(|| Error::BadMemoryTable("no memory to remove a region from".into()))?;
        let (mem, _) = cur
            .remove_region(GuestAddress(region.guest_phys_addr), region.memory_size)
            .map_err(|e| Error::BadMemoryTable(e.to_string()))?;
        self.mappings
            .retain(|m| !(m.gpa == region.guest_phys_addr && m.size == region.memory_size));
        Ok(self.install(mem))
    }

    fn install(&mut self, mem: GuestMemory) -> Arc<GuestMemory> {
        let mem = Arc::new(mem);
        self.mem = Some(mem.clone());
        self.drop_unused_guards();
        mem
    }

    /// Forgets every region (the frontend went away). Call it once the I/O threads have let go
    /// of the memory, so that the guards of its regions go with it.
    pub fn clear(&mut self) {
        self.mem = None;
        self.mappings.clear();
        self.drop_unused_guards();
    }

    /// The end of the highest region: the guest-physical bytes a dirty log must cover.
    pub fn end(&self) -> u64 {
        self.mappings
            .iter()
            .map(|m| m.gpa.saturating_add(m.size))
            .max()
            .unwrap_or(0)
    }

    /// The guest-physical address of the frontend's address `addr` (SET_VRING_ADDR gives the
    /// rings in the frontend's own address space).
    pub fn frontend_to_guest(&self, addr: u64) -> Result<u64> {
        self.mappings
            .iter()
            .find(|m| addr >= m.user_addr && addr - m.user_addr < m.size)
            .map(|m| m.gpa + (addr - m.user_addr))
            .ok_or(Error::UnmappedAddress(addr))
    }
}
