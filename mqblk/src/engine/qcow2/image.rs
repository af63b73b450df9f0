//! Creating a qcow2 image or overlay, and opening one with its backing chain through imago.
//!
//! The chain is opened explicitly, bottom up, each layer a file mqblk opened itself
//! ([`header::chain`] resolved and checked it first), and imago is told never to open anything
//! on its own (`DenyImplicitOpenGate`): what is served is exactly what was checked, and every
//! file is opened before the sandbox closes the filesystem. Backing images are opened
//! read-only and are never written.

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use futures::executor::block_on;
use imago::file::File as ImagoFile;
use imago::format::PreallocateMode;
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{
    DenyImplicitOpenGate, FormatAccess, FormatCreateBuilder, FormatDriverBuilder, ShallowMapping,
    StorageOpenOptions,
};

use crate::config::qcow2::{BackingFormat, MetadataCommit, Qcow2Config};
use crate::config::Preallocation;
use crate::engine::image_lock::{ImageLock, Perms};
use crate::engine::{FailureReport, OpenError};
use crate::format::qcow2::header::{self, Layer};
use crate::format::qcow2::Qcow2Error;

use super::counters::Counters;
use super::dirty_mark::{self, DirtyMark};
use super::locks::ClusterLocks;
use super::mapping::{Target, MAX_LAYERS};
use super::mapping_journal::{MappingJournal, Position};
use super::storage::RingFile;
use super::table_io::TableIo;
use super::unpersisted::Unpersisted;
use super::write_order::WriteOrder;

/// A qcow2 image through imago, as a library caller sees it.
pub type Access = FormatAccess<RingFile>;

/// One range whose cached mappings were made stale, and the epoch that made them so.
#[derive(Debug, Clone, Copy)]
pub struct Invalidation {
    /// The epoch this invalidation began.
    pub epoch: u64,
    /// Guest byte offset.
    pub offset: u64,
    /// Guest byte length.
    pub len: u64,
}

/// How many invalidations are remembered; a thread that missed more forgets its whole cache.
pub const INVALIDATIONS_KEPT: usize = 1024;

/// An open qcow2 export: the image through imago (for metadata and the slow path), the top
/// file for the I/O threads' rings, and what keeps their mapping caches true.
pub struct Image {
    /// The image, through imago.
    pub access: Access,
    /// The top image file, opened as imago's is (same flags), for the I/O threads' rings.
    pub file: std::fs::File,
    /// The backing images' files, read-only, for the rings' reads: `backing_files[k - 1]` is
    /// the image `k` below the top.
    pub backing_files: Vec<std::fs::File>,
    /// QEMU's locks on the top image file: taken at open where they are free, always when a
    /// ring starts (`Engine::refresh`), let go when the last ring stops (`Engine::deactivate`),
    /// so that a live migration's destination takes the image over from its source.
    pub top_lock: ImageLock,
    /// QEMU's locks on the backing images, held while the image is open.
    _backing_locks: Vec<ImageLock>,
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Bumped (after the metadata changed, before the request that changed it completes)
    /// whenever a mapping a thread may have cached stops being true.
    pub epoch: AtomicU64,
    /// The last [`INVALIDATIONS_KEPT`] invalidations, oldest first.
    pub invalidations: Mutex<VecDeque<Invalidation>>,
    /// Jobs whose metadata changes (in imago's caches) are done, counted as each finishes.
    pub changed: AtomicU64,
    /// The count of `changed` the last write-back of the metadata began after: every job
    /// counted up to it has its metadata in the image file. Held through a write-back (an
    /// asynchronous lock: a worker's other jobs go on meanwhile), so that jobs finishing
    /// meanwhile are written back together by the next holder.
    pub written_back: futures::lock::Mutex<u64>,
    /// Guest clusters a metadata-path write is working on ([`cow`](super::cow)).
    pub cow_locks: ClusterLocks,
    /// Held shared by every metadata-path read and write, exclusively by zeroing: a write that
    /// read a cluster's rest before a zeroing must not write it back after, and a read must
    /// not see a compressed cluster it reads zeroed under it (`metadata::perform`).
    pub zeroing: tokio::sync::RwLock<()>,
    /// Mappings made and not yet written back ([`unpersisted`](super::unpersisted)).
    pub unpersisted: Unpersisted,
    /// Metadata-path writes under way (each may be allocating clusters).
    pub writes_in_progress: AtomicU64,
    /// Metadata-path writes finished: bumped after imago returns, so that the mappings a
    /// write created are visible before it counts.
    pub writes_done: AtomicU64,
    /// `writes_done` as a flush read it before writing the metadata back: every write counted
    /// up to here has its metadata on stable storage.
    pub writes_durable: AtomicU64,
    /// Which of the top file's writes may stay plain (`None` when read-only).
    pub write_order: Option<Arc<WriteOrder>>,
    /// The top file's tables, for mending outside imago (`None` when read-only).
    pub tables: Option<TableIo>,
    /// With `metadata-commit=flush` (and writable): the file's dirty mark, set while it lacks
    /// metadata of completed writes. `None`: each write's metadata reaches the file before it
    /// completes.
    pub dirty: Option<DirtyMark>,
    /// With `metadata-commit=journal` (and writable): where the mappings the file lacks are
    /// recorded before their writes complete.
    pub journal: Option<Mutex<MappingJournal>>,
    /// Set once the image is given up ([`Image::give_up`]).
    given_up: AtomicBool,
    /// Set once [`Image::mend_tables`] has succeeded: until then nothing may allocate in the
    /// image (imago would hand out a table a crash left counted free, or, on an image whose
    /// header no refcount block covers, recurse until its thread's stack overflows).
    mended: AtomicBool,
    /// Where a give-up is reported: the export's, shared by every image its engine opens.
    pub failure_report: Arc<OnceLock<FailureReport>>,
    /// Where its metadata path counts what it does: the export's, kept across snapshots.
    pub counters: Arc<Counters>,
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> OpenError {
    let path = path.display().to_string();
    move |err| OpenError::Io { what, path, err }
}

impl Image {
    /// Gives the image up: no metadata is written to its file from then on, and every
    /// metadata-path request fails, so the file keeps what the last write-back wrote (every
    /// acknowledged write). For a write into a new cluster whose data could not be written
    /// after its mapping (`early_maps`), and for a panic of the metadata worker, after which
    /// imago's state may be half changed.
    ///
    /// The first give-up is logged, with `why`, and reported to the export, which then shows
    /// it failed and disconnects its frontend (`export_del` and `export_add` serve the image
    /// again, from what its file holds).
    pub fn give_up(&self, why: &str) {
        if let Some(order) = &self.write_order {
            order.early.set_broken();
        }
        if self.given_up.swap(true, Ordering::AcqRel) {
            return;
        }
        let current = std::thread::current();
        let who = current.name().unwrap_or("qcow2");
        tracing::error!(
            who,
            "{why}: the qcow2 image is given up: no metadata is written to its file from now \
             on (it keeps what the last write-back wrote, every acknowledged write), and its \
             requests that need the metadata fail; export_del and export_add serve it again"
        );
        if let Some(report) = self.failure_report.get() {
            report(who, &format!("{why}: the qcow2 image is given up"));
        }
    }

    /// Whether the image was given up ([`give_up`](Self::give_up)).
    pub fn given_up(&self) -> bool {
        self.given_up.load(Ordering::Acquire)
    }

    /// The descriptor of the file of image `layer` (0: the top), for a ring entry.
    #[inline]
    pub fn layer_fd(&self, layer: u8) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        match layer {
            0 => Some(self.file.as_raw_fd()),
            k => self
                .backing_files
                .get(usize::from(k) - 1)
                .map(AsRawFd::as_raw_fd),
        }
    }

    /// Brings the image's own tables up to what the file holds, as the only backend writing
    /// it from now on (imago's caches written back first, dropped after): each table counted
    /// free is counted in use again ([`refcount_repair`](super::refcount_repair)), and the
    /// write order's mirrors of the L1 and refcount tables are read again.
    pub fn mend_tables(&self) -> std::io::Result<()> {
        let (Some(tables), Some(order)) = (&self.tables, &self.write_order) else {
            return Ok(());
        };
        // Once per start of an export's rings: what it costs is logged (docs/PERFORMANCE.md
        // 13b takes it from there).
        let began = std::time::Instant::now();
        let repaired = tables.repair_table_refcounts()?;
        tracing::debug!(
            micros = began.elapsed().as_micros() as u64,
            repaired = repaired.len(),
            "qcow2 tables' refcounts checked"
        );
        for table in repaired {
            tracing::warn!(
                offset = table,
                "a qcow2 table was counted free (its allocation was cut short by a crash): \
                 counted in use again"
            );
        }
        tables.reload(order)?;
        self.mended.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether [`mend_tables`](Self::mend_tables) has succeeded on this image (a read-only
    /// image needs no mending), so that imago may allocate in it.
    pub fn mended(&self) -> bool {
        self.write_order.is_none() || self.mended.load(Ordering::Acquire)
    }

    /// The top image file as imago holds it (writes to it through this go under imago's range
    /// locks).
    pub fn top_storage(&self) -> &RingFile {
        self.access
            .inner()
            .collect_storage_dependencies()
            .into_iter()
            .find(|f| f.write_order().is_some())
            .expect("a writable image's top file is ordered")
    }

    /// The journal, if the image has one.
    pub fn journal(&self) -> Option<std::sync::MutexGuard<'_, MappingJournal>> {
        self.journal
            .as_ref()
            .map(|j| j.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Makes the image this process's to mark, once its locks are taken (opened, or handed
    /// over by a live migration's source that has cleared its mark): in a mode that marks it
    /// dirty, a journal this process is not writing is emptied of what another process left
    /// in it (records that a later mark of this one must not be taken to cover), and the
    /// header's autoclear bit says whether a mark of this process is its journal's
    /// ([`dirty_mark::claim`]).
    pub fn claim_marks(&self) -> std::io::Result<()> {
        let (Some(_), Some(tables)) = (&self.dirty, &self.tables) else {
            return Ok(());
        };
        if let Some(mut journal) = self.journal() {
            journal.forget_others();
        }
        block_on(dirty_mark::claim(
            self.top_storage(),
            tables,
            self.journal.is_some(),
        ))
    }

    /// Where the journal's records end, read before a write-back: the records it covers.
    pub fn journal_tail(&self) -> Option<Position> {
        self.journal().map(|j| j.position())
    }

    /// After a write-back that began when the journal's tail was `upto` (and, if the image is
    /// no longer marked dirty, the mark cleared): its records are dropped, and the journal
    /// closed if nothing was recorded since.
    pub fn journal_written_back(&self, upto: Option<Position>) {
        let (Some(mut journal), Some(upto)) = (self.journal(), upto) else {
            return;
        };
        journal.checkpoint(upto);
        if !self.dirty.as_ref().is_some_and(DirtyMark::marked) {
            journal.close_if_done(upto);
        }
    }

    /// Whether every metadata-path write so far has its metadata on stable storage: only then
    /// may a write-through (`RWF_DSYNC`) write go to a cached cluster directly, since the
    /// cluster's allocation may be one of those writes'. Read in this order, a write that has
    /// allocated but not yet counted itself done is seen in progress.
    #[inline]
    pub fn metadata_durable(&self) -> bool {
        self.writes_in_progress.load(Ordering::Acquire) == 0
            && self.writes_durable.load(Ordering::Acquire)
                == self.writes_done.load(Ordering::Acquire)
    }
}

/// Where guest `offset` of `top` is, and for how many bytes it stays so: in which image of the
/// chain (counted from the top) at which file offset, or zeros; `None` for what only imago can
/// read (compressed clusters, a chain deeper than a cache holds).
pub async fn resolve(
    top: &Access,
    offset: u64,
    max: u64,
) -> std::io::Result<(Option<Target>, u64)> {
    let (mut layer, mut depth, mut offset, mut max) = (top, 0u8, offset, max);
    loop {
        let (mapping, n) = layer.get_shallow_mapping(offset, max).await?;
        return Ok(match mapping {
            ShallowMapping::Raw {
                offset, writable, ..
            } => (
                Some(Target::File {
                    layer: depth,
                    offset,
                    writable: writable && depth == 0,
                }),
                n,
            ),
            ShallowMapping::Indirect {
                layer: below,
                offset: at,
                ..
            } if depth < MAX_LAYERS => {
                (layer, depth, offset, max) = (below, depth + 1, at, n);
                continue;
            }
            ShallowMapping::Zero { .. } => (Some(Target::Zeros), n),
            // Past the end of a backing image: zeros up to the top's size.
            ShallowMapping::Eof { .. } if depth > 0 => (Some(Target::Zeros), max),
            ShallowMapping::Eof { .. } => (None, 0),
            _ => (None, n),
        });
    }
}

/// What a write does to the top image's clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    /// Every cluster is the top image's own, unshared: written in place.
    InPlace,
    /// Some are not in the top image (they read from a backing image, or as zeros because
    /// nothing is there): they are allocated.
    Allocates,
    /// Some are the top image's but cannot be written in place (compressed, shared with an
    /// internal snapshot, explicit zeros): each is replaced by a new cluster, and the old one
    /// may be freed.
    Replaces,
}

/// What a write of `len` bytes at guest `offset` does to the top image's clusters.
pub async fn write_kind(top: &Access, offset: u64, len: u64) -> std::io::Result<WriteKind> {
    let (mut at, end, mut kind) = (offset, offset + len, WriteKind::InPlace);
    while at < end {
        let (mapping, n) = top.get_shallow_mapping(at, end - at).await?;
        match mapping {
            ShallowMapping::Raw { writable: true, .. } => {}
            ShallowMapping::Indirect { .. }
            | ShallowMapping::Zero {
                explicit: false, ..
            }
            | ShallowMapping::Eof { .. } => kind = WriteKind::Allocates,
            _ => return Ok(WriteKind::Replaces),
        }
        if n == 0 {
            break;
        }
        at += n;
    }
    Ok(kind)
}

/// Whether the top image holds a compressed cluster in `len` bytes at guest `offset` (zeroing
/// frees those, and keeps the allocation of every other cluster).
pub async fn compressed_in(top: &Access, offset: u64, len: u64) -> std::io::Result<bool> {
    let (mut at, end) = (offset, offset + len);
    while at < end {
        let (mapping, n) = top.get_shallow_mapping(at, end - at).await?;
        match mapping {
            ShallowMapping::Special { .. } => return Ok(true),
            _ if n == 0 => break,
            _ => at += n,
        }
    }
    Ok(false)
}

/// Opens `path` for imago and for the rings alike: read-write unless `writable` is false, with
/// O_DIRECT if `direct`.
fn open_file(path: &Path, writable: bool, direct: bool) -> Result<std::fs::File, OpenError> {
    let mut opts = OpenOptions::new();
    opts.read(true).write(writable);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    opts.open(path).map_err(|err| match err.raw_os_error() {
        Some(libc::EINVAL) if direct => OpenError::DirectRefused(path.display().to_string()),
        _ => io_err("cannot open", path)(err),
    })
}

fn imago_file(
    file: std::fs::File,
    path: &Path,
    writable: bool,
    direct: bool,
) -> Result<ImagoFile, OpenError> {
    let opts = StorageOpenOptions::new()
        .filename(path)
        .write(writable)
        .direct(direct);
    ImagoFile::from_open_file(file, opts).map_err(io_err("cannot use", path))
}

/// `file` as imago's storage, for the metadata worker's ring.
fn ring_file(
    file: std::fs::File,
    path: &Path,
    writable: bool,
    direct: bool,
) -> Result<RingFile, OpenError> {
    RingFile::new(file, path, writable, direct).map_err(io_err("cannot use", path))
}

/// Opens one read-only layer of a backing chain over `below`; returns it, a descriptor of its
/// file for the I/O threads' rings, and its locks, taken.
fn open_backing(
    layer: &Layer,
    below: Option<Access>,
    direct: bool,
) -> Result<(Access, std::fs::File, ImageLock), OpenError> {
    let opened = open_file(&layer.path, false, direct)?;
    let lock = ImageLock::taken(&opened, &layer.path, Perms::BACKING)?;
    let for_ring = opened
        .try_clone()
        .map_err(io_err("cannot duplicate", &layer.path))?;
    let file = ring_file(opened, &layer.path, false, direct)?;
    let gate = DenyImplicitOpenGate::default();
    // On this (control) thread the storage's calls are blocking: `block_on` only drives them.
    let opened = match layer.format {
        BackingFormat::Raw => {
            block_on(Raw::builder(file).write(false).open(gate)).map(FormatAccess::new)
        }
        BackingFormat::Qcow2 => block_on(
            Qcow2::builder(file)
                .backing(below)
                .data_file(None)
                .write(false)
                .open(gate),
        )
        .map(FormatAccess::new),
    };
    let access = opened.map_err(io_err("cannot open the backing image", &layer.path))?;
    Ok((access, for_ring, lock))
}

/// How the top image of a chain is opened.
#[derive(Debug, Clone)]
pub struct TopOptions {
    /// Never written.
    pub readonly: bool,
    /// With O_DIRECT.
    pub direct: bool,
    /// When a write's metadata reaches the file.
    pub commit: MetadataCommit,
    /// Its dirty bit is a live server's mark ([`dirty_mark`](super::dirty_mark)): let through.
    pub marked_live: bool,
    /// Where its metadata path counts what it does (the export's).
    pub counters: Arc<Counters>,
}

/// Opens the qcow2 image at `path` (which must exist) with its chain, `layers`
/// (`header::chain` of `path`), as `opts` say.
pub fn open(path: &Path, layers: &[Layer], opts: TopOptions) -> Result<Image, OpenError> {
    let TopOptions {
        readonly,
        direct,
        commit,
        marked_live,
        counters,
    } = opts;
    let mut head = header::read_head(path)?;
    if marked_live {
        header::unmark_dirty(&mut head);
    }
    let top = header::parse(path, &head)?;
    let commit = match commit {
        MetadataCommit::Auto if readonly => MetadataCommit::Write,
        MetadataCommit::Auto if top.version < 3 => {
            tracing::info!(
                image = %path.display(),
                "metadata-commit=auto: a version 2 image cannot be marked dirty between \
                 flushes, so each allocating write waits for its mapping's write-back \
                 (metadata-commit=write; `qemu-img amend -o compat=1.1` upgrades the image)"
            );
            MetadataCommit::Write
        }
        commit => commit,
    };
    if !readonly && commit.at_flush() && top.version < 3 {
        return Err(Qcow2Error::FlushCommitNeedsV3(path.display().to_string()).into());
    }
    let mut below = None;
    let mut backing_files = Vec::with_capacity(layers.len() - 1);
    let mut backing_locks = Vec::with_capacity(layers.len() - 1);
    for layer in layers[1..].iter().rev() {
        let (access, file, lock) = open_backing(layer, below.take(), direct)?;
        below = Some(access);
        backing_files.push(file);
        backing_locks.push(lock);
    }
    // Counted from the top, as the chain is.
    backing_files.reverse();
    let writable = !readonly;
    let file = open_file(path, writable, direct)?;
    let for_ring = file.try_clone().map_err(io_err("cannot duplicate", path))?;
    let perms = if readonly {
        Perms::QCOW2_READONLY
    } else {
        Perms::QCOW2_WRITABLE
    };
    let top_lock = ImageLock::new(&file, path, perms)?;
    let (commit, journal) = match (writable, commit) {
        (true, MetadataCommit::Journal | MetadataCommit::Auto) => {
            match MappingJournal::open(&file, top.cluster_bits, true) {
                Ok(journal) => {
                    tracing::info!(
                        image = %path.display(),
                        journal = %journal.path().display(),
                        "metadata-commit={}: new clusters' mappings are journaled, and the \
                         tables written back at the guest's flush",
                        if commit == MetadataCommit::Auto { "auto" } else { "journal" }
                    );
                    (MetadataCommit::Journal, Some(Mutex::new(journal)))
                }
                // Nothing to replay (a crash's mark goes on to fail below, as it must): the
                // image is served as well without, at the write-back's cost.
                Err(e) if commit == MetadataCommit::Auto && !marked_live => {
                    tracing::warn!(
                        image = %path.display(),
                        err = %e,
                        "metadata-commit=auto: no metadata journal, so each allocating write \
                         waits for its mapping's write-back (metadata-commit=write); give \
                         mqblk serve a --state-dir it can write"
                    );
                    (MetadataCommit::Write, None)
                }
                Err(e) => return Err(io_err("cannot open the metadata journal of", path)(e)),
            }
        }
        _ => (commit, None),
    };
    let dirty = (writable && commit.at_flush()).then(DirtyMark::default);
    let mut top_file = ring_file(file, path, writable, direct)?;
    if writable {
        top_file = top_file
            .ordered(counters.clone())
            .map_err(io_err("cannot read the L1 and refcount tables of", path))?;
    }
    let write_order = top_file.write_order();
    let tables = writable.then(|| top_file.tables());
    // Only while imago reads the header: from then on imago and this process write it, and
    // the live server clears its mark before this image's rings start (and imago reads the
    // header again).
    if writable {
        top_file.hide_marks(marked_live);
    }
    let qcow2 = block_on(
        Qcow2::builder(top_file)
            .backing(below)
            .data_file(None)
            .write(writable)
            .open(DenyImplicitOpenGate::default()),
    )
    .map_err(io_err("cannot open the qcow2 image", path))?;
    let image = Image {
        access: FormatAccess::new(qcow2),
        file: for_ring,
        backing_files,
        top_lock,
        _backing_locks: backing_locks,
        cluster_bits: top.cluster_bits,
        epoch: AtomicU64::new(0),
        invalidations: Mutex::new(VecDeque::with_capacity(INVALIDATIONS_KEPT)),
        changed: AtomicU64::new(0),
        written_back: futures::lock::Mutex::new(0),
        cow_locks: ClusterLocks::default(),
        zeroing: tokio::sync::RwLock::new(()),
        unpersisted: Unpersisted::default(),
        writes_in_progress: AtomicU64::new(0),
        writes_done: AtomicU64::new(0),
        writes_durable: AtomicU64::new(0),
        write_order,
        tables,
        dirty,
        journal,
        given_up: AtomicBool::new(false),
        mended: AtomicBool::new(false),
        failure_report: Arc::default(),
        counters,
    };
    if writable {
        image.top_storage().show_marks();
    }
    if image.dirty.is_some() {
        dirty_mark::hold(&image.file).map_err(io_err("cannot lock a byte of", path))?;
    }
    Ok(image)
}

/// The virtual size of `layer`: a raw file's length, a qcow2 image's header size.
fn virtual_size(path: &Path, format: BackingFormat) -> Result<u64, OpenError> {
    match format {
        BackingFormat::Raw => Ok(std::fs::metadata(path)
            .map_err(io_err("cannot stat", path))?
            .len()),
        BackingFormat::Qcow2 => Ok(header::parse(path, &header::read_head(path)?)?.size),
    }
}

/// Creates the qcow2 image `path`, which must not exist: `size` bytes (with `backing`, the
/// backing image's size unless given), clusters of `cfg.cluster_size`, over `cfg.backing` if
/// given, its clusters provided as `preallocation` says. Returns its size.
pub fn create(
    path: &Path,
    size: Option<u64>,
    cfg: &Qcow2Config,
    preallocation: Preallocation,
) -> Result<u64, OpenError> {
    let backing = match (&cfg.backing, cfg.backing_format) {
        (Some(name), Some(format)) => {
            // Recorded as given: a relative name is relative to the overlay's directory.
            let resolved = match name.is_absolute() {
                true => name.clone(),
                false => path.parent().unwrap_or(Path::new(".")).join(name),
            };
            if !resolved.exists() {
                return Err(Qcow2Error::MissingBacking {
                    image: path.display().to_string(),
                    backing: resolved.display().to_string(),
                }
                .into());
            }
            Some((name.display().to_string(), format, resolved))
        }
        _ => None,
    };
    let size = match (size, &backing) {
        (Some(s), _) => s,
        (None, Some((_, format, resolved))) => virtual_size(resolved, *format)?,
        (None, None) => return Err(Qcow2Error::SizeNeeded(path.display().to_string()).into()),
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io_err("cannot create", path))?;
    let mut builder = Qcow2::<ImagoFile>::create_builder(imago_file(file, path, true, false)?)
        .size(size)
        .cluster_size(cfg.cluster_size as usize)
        .preallocate(imago_preallocation(preallocation));
    if let Some((name, format, _)) = backing {
        builder = builder.backing(name, format.name().to_string());
    }
    // imago wrote through the page cache: synced here, a preallocated image's gigabytes are not
    // left for the served image's direct I/O to wait on (nor for a power loss to cut short).
    let created = block_on(builder.create()).and_then(|()| std::fs::File::open(path)?.sync_all());
    if let Err(e) = created {
        let _ = std::fs::remove_file(path);
        return Err(io_err("cannot create", path)(e));
    }
    Ok(size)
}

/// imago's name for what `preallocation=` asks of the clusters a qcow2 image gains.
pub fn imago_preallocation(p: Preallocation) -> PreallocateMode {
    match p {
        Preallocation::Off => PreallocateMode::None,
        // Mapped, the file's space left as the storage provides it (a hole, or what mqblk's
        // storage reserves as it grows the file).
        Preallocation::Metadata => PreallocateMode::FormatAllocate,
        Preallocation::Falloc => PreallocateMode::FullAllocate,
        Preallocation::Full => PreallocateMode::WriteData,
    }
}

/// Refuses `backing=` on an image that exists with another backing file (or none): mqblk
/// creates overlays, it does not rebase them.
pub fn check_backing(path: &Path, cfg: &Qcow2Config) -> Result<(), OpenError> {
    let Some(wanted) = &cfg.backing else {
        return Ok(());
    };
    // A dirty image is refused (or replayed) once its chain is opened, not for this.
    let mut head = header::read_head(path)?;
    header::unmark_dirty(&mut head);
    let recorded = header::parse(path, &head)?.backing;
    if recorded.as_deref() != Some(&*wanted.display().to_string()) {
        return Err(Qcow2Error::BackingDiffers {
            image: path.display().to_string(),
            given: wanted.display().to_string(),
            recorded: recorded.unwrap_or_else(|| "none".into()),
        }
        .into());
    }
    Ok(())
}
