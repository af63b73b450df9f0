//! The `memory_table` target: the frontend's messages that map its memory (SET_MEM_TABLE,
//! ADD_MEM_REG, REM_MEM_REG) through [`mqblk::frontend::memory::MemoryTable`], with the
//! frontend truncating its files in between and the guest's accesses landing anywhere.
//!
//! The frontend owns three memfds (up to 16 pages each), each created with or without
//! MFD_ALLOW_SEALING and possibly sealed against shrinking or further seals before it is
//! handed over. Each operation is one message or one action:
//! - a memory table or one added region: each region names a file, a guest address, a size, an
//!   offset into the file and a frontend address (every one a [`Num`]: small, at an edge,
//!   huge, or wrapping);
//! - a removed region;
//! - a truncation (or growth) of a file by the frontend;
//! - a guest access (a read, or a write) of any range of guest memory;
//! - a translation of a frontend address to a guest address (SET_VRING_ADDR's).
//!
//! Checked: nothing crashes, however the files shrink: a file that could be sealed is sealed
//! against shrinking once mapped (a shrink then fails), and a mapping of one that could not is
//! guarded (a fault in it is contained, and the table reports it); a region accepted lies
//! within its file, page-aligned, and has a size; an access that lies inside one mapped region
//! succeeds; a translation answers exactly what the model of the regions mapped says.

use std::fs::File;

use arbitrary::Arbitrary;
use mqblk::frontend::memory::MemoryTable;
use vhost::vhost_user::message::VhostUserMemoryRegion;
use vm_memory::{Bytes, GuestAddress};

use crate::dirty_log::Num;

const PAGE: u64 = 4096;
/// Files the frontend shares.
pub const NFILES: usize = 3;
/// Operations an input holds (at most).
pub const NOPS: usize = 16;

/// One of the frontend's files.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct FileSpec {
    /// Length in pages (mod 17).
    pub pages: u8,
    /// Created with MFD_ALLOW_SEALING.
    pub sealable: bool,
    /// Sealed against shrinking before it is handed over (QEMU's memory).
    pub pre_sealed: bool,
    /// Sealed against further seals before it is handed over (then mqblk cannot seal it).
    pub seal_seal: bool,
}

/// One region of a memory table.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct RegionSpec {
    /// Which file (mod [`NFILES`]).
    pub file: u8,
    /// Guest-physical address (near: 1 MiB).
    pub gpa: Num,
    /// Size (near: the file's length less the offset).
    pub size: Num,
    /// Offset into the file (near: the file's length).
    pub offset: Num,
    /// The frontend's address of it (near: 2^46).
    pub user: Num,
}

/// One message or action.
#[derive(Arbitrary, Debug, Clone)]
pub enum Action {
    /// SET_MEM_TABLE (up to 4 regions).
    Set(Vec<RegionSpec>),
    /// ADD_MEM_REG.
    Add(RegionSpec),
    /// REM_MEM_REG of the `nth` region mapped (mod their count), or of a made-up one.
    Remove {
        /// Which mapped region, if `made_up` is false.
        nth: u8,
        /// Remove a region that may not be there.
        made_up: bool,
        /// Its address, when made up.
        gpa: Num,
        /// Its size, when made up.
        size: Num,
    },
    /// The frontend resizes file `file` (mod [`NFILES`]) to `pages` (mod 17) pages.
    Resize {
        /// Which file.
        file: u8,
        /// Its new length in pages.
        pages: u8,
    },
    /// The guest reads (or writes) `len` (mod 3 pages) bytes at `gpa`.
    Access {
        /// Where (near: 1 MiB).
        gpa: Num,
        /// How much.
        len: u16,
        /// A write rather than a read.
        write: bool,
    },
    /// Translates the frontend address of the `nth` region mapped plus `delta`, or a made-up
    /// address.
    Translate {
        /// Which mapped region.
        nth: u8,
        /// How far into it.
        delta: Num,
        /// Use `delta` as the address itself.
        made_up: bool,
    },
}

/// Everything the frontend and the guest control, for the `memory_table` target.
#[derive(Arbitrary, Debug, Clone)]
pub struct TableInput {
    /// The frontend's files.
    pub files: [FileSpec; NFILES],
    /// What happens, in order (the first [`NOPS`]).
    pub actions: Vec<Action>,
}

/// A region the model says is mapped.
#[derive(Debug, Clone, Copy)]
struct Mapped {
    gpa: u64,
    size: u64,
    user: u64,
}

fn memfd(spec: &FileSpec) -> File {
    use rustix::fs::{MemfdFlags, SealFlags};
    let flags = if spec.sealable {
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING
    } else {
        MemfdFlags::CLOEXEC
    };
    let f = File::from(rustix::fs::memfd_create(c"fuzz-guest", flags).expect("memfd_create"));
    f.set_len(u64::from(spec.pages % 17) * PAGE).expect("sizing a memfd");
    if spec.sealable && spec.pre_sealed {
        rustix::fs::fcntl_add_seals(&f, SealFlags::SHRINK).expect("F_SEAL_SHRINK");
    }
    if spec.sealable && spec.seal_seal {
        rustix::fs::fcntl_add_seals(&f, SealFlags::SEAL).expect("F_SEAL_SEAL");
    }
    f
}

fn region(spec: &RegionSpec, files: &[File]) -> (VhostUserMemoryRegion, usize) {
    let i = spec.file as usize % NFILES;
    let len = files[i].metadata().map(|m| m.len()).unwrap_or(0);
    let offset = spec.offset.resolve(len);
    let size = spec.size.resolve(len.wrapping_sub(offset));
    let r = VhostUserMemoryRegion::new(
        spec.gpa.resolve(1 << 20),
        size,
        spec.user.resolve(1 << 46),
        offset,
    );
    (r, i)
}

/// What an accepted region must satisfy: a size, page-aligned, inside its file.
fn check_accepted(r: &VhostUserMemoryRegion, file: &File) {
    let len = file.metadata().expect("fstat").len();
    let (size, offset) = (r.memory_size, r.mmap_offset);
    assert!(size > 0, "a region of size 0 was mapped");
    assert_eq!(offset % PAGE, 0, "a region at an unaligned offset was mapped");
    assert!(
        offset.checked_add(size).is_some_and(|end| end <= len),
        "a region past the end of its {len}-byte file was mapped: {size} bytes at {offset}"
    );
}

fn shrink_refused(file: &File) -> bool {
    let len = file.metadata().expect("fstat").len();
    len > 0 && file.set_len(len - 1).is_err()
}

/// Runs one input.
pub fn run_memory_table(input: &TableInput) {
    let files: Vec<File> = input.files.iter().map(memfd).collect();
    let mut table = MemoryTable::new(None);
    let mut mapped: Vec<Mapped> = Vec::new();
    // Files some mapping has used: sealed against shrinking if they could be.
    let mut used = [false; NFILES];
    for action in input.actions.iter().take(NOPS) {
        match action {
            Action::Set(specs) => {
                let specs = &specs[..specs.len().min(4)];
                let regions: Vec<_> = specs.iter().map(|s| region(s, &files)).collect();
                let clones: Vec<File> = regions
                    .iter()
                    .map(|(_, i)| files[*i].try_clone().expect("dup"))
                    .collect();
                let msgs: Vec<_> = regions.iter().map(|(r, _)| *r).collect();
                if table.set(&msgs, clones).is_ok() {
                    mapped.clear();
                    for (r, i) in &regions {
                        check_accepted(r, &files[*i]);
                        used[*i] = true;
                        mapped.push(Mapped {
                            gpa: r.guest_phys_addr,
                            size: r.memory_size,
                            user: r.user_addr,
                        });
                    }
                }
            }
            Action::Add(spec) => {
                let (r, i) = region(spec, &files);
                if table
                    .add(&r, files[i].try_clone().expect("dup"))
                    .is_ok()
                {
                    check_accepted(&r, &files[i]);
                    used[i] = true;
                    mapped.push(Mapped {
                        gpa: r.guest_phys_addr,
                        size: r.memory_size,
                        user: r.user_addr,
                    });
                }
            }
            Action::Remove {
                nth,
                made_up,
                gpa,
                size,
            } => {
                let (g, s) = match mapped.get(*nth as usize % mapped.len().max(1)) {
                    Some(m) if !made_up => (m.gpa, m.size),
                    _ => (gpa.resolve(1 << 20), size.resolve(PAGE)),
                };
                let r = VhostUserMemoryRegion::new(g, s, 0, 0);
                let had = mapped.iter().any(|m| m.gpa == g && m.size == s);
                if table.remove(&r).is_ok() {
                    assert!(had, "a region that was not mapped was removed: {g:#x}+{s:#x}");
                    mapped.retain(|m| !(m.gpa == g && m.size == s));
                } else {
                    assert!(!had, "a mapped region could not be removed: {g:#x}+{s:#x}");
                }
            }
            Action::Resize { file, pages } => {
                let i = *file as usize % NFILES;
                let sealed = used[i] && input.files[i].sealable && !input.files[i].seal_seal
                    || input.files[i].sealable && input.files[i].pre_sealed;
                let new = u64::from(pages % 17) * PAGE;
                let old = files[i].metadata().expect("fstat").len();
                let r = files[i].set_len(new);
                if sealed && new < old {
                    assert!(r.is_err(), "a file sealed against shrinking shrank");
                }
            }
            Action::Access { gpa, len, write } => {
                let Some(mem) = table.current() else { continue };
                let gpa = gpa.resolve(1 << 20);
                let len = u64::from(*len) % (3 * PAGE);
                let inside = mapped.iter().any(|m| {
                    gpa >= m.gpa
                        && gpa.checked_add(len).is_some_and(|end| end <= m.gpa + m.size)
                });
                let mut buf = vec![0x5au8; len as usize];
                let r = if *write {
                    mem.write_slice(&buf, GuestAddress(gpa))
                } else {
                    mem.read_slice(&mut buf, GuestAddress(gpa))
                };
                if inside && len > 0 {
                    assert!(r.is_ok(), "an access inside a mapped region failed: {r:?}");
                }
            }
            Action::Translate {
                nth,
                delta,
                made_up,
            } => {
                let addr = match mapped.get(*nth as usize % mapped.len().max(1)) {
                    Some(m) if !made_up => m.user.wrapping_add(delta.resolve(m.size) % m.size),
                    _ => delta.resolve(1 << 46),
                };
                let want = mapped
                    .iter()
                    .find(|m| addr >= m.user && addr - m.user < m.size)
                    .map(|m| m.gpa + (addr - m.user));
                assert_eq!(table.frontend_to_guest(addr).ok(), want, "address {addr:#x}");
            }
        }
    }
    // A file mapped and sealable (and not sealed against seals) is sealed against shrinking.
    for (i, f) in files.iter().enumerate() {
        let spec = &input.files[i];
        if used[i] && spec.sealable && !spec.seal_seal && spec.pages % 17 > 0 {
            assert!(shrink_refused(f), "file {i} was mapped but not sealed");
        }
    }
    table.clear();
}
