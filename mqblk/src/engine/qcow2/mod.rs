//! `format=qcow2`: qcow2 images and their backing chains, through imago, on the per-queue data
//! path. (What can be known from an image's header, and its errors, are in
//! [`format::qcow2`](crate::format::qcow2).)
//!
//! imago (a qcow2 library by a QEMU block-layer maintainer) owns the format: the header, the L1
//! and L2 tables, refcounts, allocation, copy-on-write from backing images, zero clusters,
//! compressed clusters, resize and image creation. mqblk keeps the data path: each I/O thread
//! caches where guest clusters are ([`mapping`]): in which image of the chain at which file
//! offset, or nowhere (zeros). A read of cached clusters becomes one entry on the thread's own
//! ring at that file offset, as for a raw image (or is answered at once with zeros); a write,
//! when its clusters are allocated in the top image. What the cache cannot serve goes to the
//! image's metadata worker ([`metadata`]), which does it through imago, many requests at once
//! on a ring of its own, and answers with the mappings the thread may cache from then on.
//!
//! The hazard of caching mappings is a mapping that changes while a thread still holds it:
//! - A write on the metadata path may allocate a cluster that threads hold as "in a backing
//!   file" or "zeros"; a write-zeroes or discard turns clusters into zero clusters. Each bumps
//!   the image's epoch and logs the range it touched, after the metadata changed and before
//!   the request completes, and each thread forgets the logged ranges before it next uses its
//!   cache; mappings read before a bump are dropped when they arrive after it.
//! - A cluster that is freed and given to another guest offset would leave a thread writing
//!   into another offset's data. mqblk never frees a cluster while it serves an image:
//!   zeroed clusters keep their place in the file (with `unmap`, the file's blocks are punched
//!   out), so a stale mapping can only point at the cluster's own place.
//! - A snapshot replaces the top image while no request is in flight; each thread takes the
//!   new one, with an empty cache, before its next request.

mod channel;
mod cluster_buffers;
#[cfg(test)]
mod counted_wakes;
mod counters;
mod cow;
mod data_writes;
mod dirty_mark;
mod early_maps;
mod executor;
mod fresh_space;
mod image;
mod jobs;
mod journal_replay;
mod locks;
mod mapping;
pub mod mapping_journal;
mod metadata;
mod refcount_repair;
mod storage;
pub mod table_budget;
mod table_io;
mod test_hooks;
mod unpersisted;
mod uring_io;
mod write_order;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use futures::executor::block_on;
use rustix::event::{eventfd, EventfdFlags};

use crate::config::qcow2::{BackingFormat, MetadataCommit, Qcow2Config};
use crate::config::{ExportConfig, Preallocation};
use crate::engine::image_lock::LockError;
use crate::engine::{
    self, Channel, Engine, FailureReport, Limits, OpenError, ResizeError, SnapshotError,
};
pub use crate::format::qcow2::Qcow2Error;
use crate::format::qcow2::{self as qcow2_format, header};
use channel::Qcow2Channel;
use counters::Counters;
pub use counters::MetadataCounters;
use image::Image;
use jobs::{Jobs, Replies};
use mapping::MappingCache;
use table_budget::TableLease;

/// The image being written (the top of the chain) and the worker of its metadata path,
/// replaced as a whole by a snapshot.
pub struct Top {
    /// The image.
    pub image: Arc<Image>,
    /// Its metadata worker's queue (it ends when every holder is gone).
    pub jobs: Jobs,
    /// Where it is.
    pub path: PathBuf,
}

/// What the engine shares with its channels.
pub struct Shared {
    /// The current top.
    pub top: Mutex<Top>,
    /// Bumped when `top` is replaced: each channel takes the new one before its next request.
    pub generation: AtomicU64,
}

/// A qcow2 export's storage.
pub struct Qcow2Engine {
    shared: Arc<Shared>,
    block_size: u32,
    l2_cache_size: u64,
    table_memory_max: u64,
    metadata_commit: MetadataCommit,
    /// How `resize` provides the clusters it adds.
    preallocation: Preallocation,
    writable: bool,
    direct: bool,
    /// Names the metadata worker's thread.
    worker_name: String,
    /// Where its images report being given up (set by the export).
    failure_report: Arc<OnceLock<FailureReport>>,
    /// What its metadata path did, counted by every top it serves.
    counters: Arc<Counters>,
    /// Its share of the daemon's budget for tables (see [`table_budget`]), grown by a
    /// snapshot.
    tables: Mutex<TableLease>,
    /// Held by `refresh`, `resize` and `snapshot`, which come from different threads (a ring
    /// starting, the API) and must not drop imago's caches while another allocates.
    control: Mutex<()>,
}

/// Opens (or creates, with `size=` or `backing=`) the qcow2 image of `cfg`.
pub fn open(cfg: &ExportConfig) -> Result<Qcow2Engine, OpenError> {
    let path = cfg
        .path
        .as_deref()
        .expect("config checked: qcow2 has a path");
    open_path(path, cfg)
}

/// `mqblk replay-journal`: serves nothing. Opens the existing qcow2 image at `path` as an
/// export in `metadata-commit=journal` would (over a backing file of `backing_format` where
/// the image's header does not record one), which replays its journal if a crash of mqblk
/// left the image marked ([`journal_replay`]), and closes it: unmarked, for QEMU's tools or
/// an export in another mode. An image the journal did not mark is left as it is; returns
/// whether it was marked.
pub fn replay_journal(
    path: &Path,
    backing_format: Option<BackingFormat>,
) -> Result<bool, OpenError> {
    let head = header::read_head(path)?;
    if !header::marked_by_journal(&head) {
        // Left as it is: refused, in its one line, if it is marked otherwise.
        header::parse(path, &head)?;
        return Ok(false);
    }
    if marked_by_a_live_server(path)? {
        return Err(LockError::InUse {
            path: path.display().to_string(),
            conflict: "serves it, marked by its journal's daemon".into(),
        }
        .into());
    }
    let mut cfg = ExportConfig {
        path: Some(path.to_path_buf()),
        format: crate::config::qcow2::ImageFormat::Qcow2,
        ..ExportConfig::default()
    };
    cfg.qcow2.backing_format = backing_format;
    cfg.qcow2.metadata_commit = MetadataCommit::Journal;
    drop(open_path(path, &cfg)?);
    Ok(true)
}

/// [`dirty_mark::marked_by_a_live_server`], its error an [`OpenError`].
fn marked_by_a_live_server(path: &Path) -> Result<bool, OpenError> {
    dirty_mark::marked_by_a_live_server(path).map_err(|err| OpenError::Io {
        what: "cannot read the header of",
        path: path.display().to_string(),
        err,
    })
}

fn open_path(path: &Path, cfg: &ExportConfig) -> Result<Qcow2Engine, OpenError> {
    if !path.exists() {
        if cfg.readonly {
            return Err(Qcow2Error::SizeNeeded(path.display().to_string()).into());
        }
        image::create(path, cfg.size, &cfg.qcow2, cfg.preallocation)?;
    } else {
        image::check_backing(path, &cfg.qcow2)?;
    }
    let commit = cfg.qcow2.metadata_commit;
    // Another daemon's mark (a live migration's source in flush mode, whatever this one's
    // mode), not a crash's: see `dirty_mark`.
    let marked_live = !cfg.readonly && marked_by_a_live_server(path)?;
    // `metadata-commit=journal`: a crash's mark, which the journal's records may cover
    // (`journal_replay`), let through to be replayed once the image's locks are taken. Only
    // a mark the header says is the journal's: another program's (QEMU's, after a repair of
    // the crash) is refused as dirty.
    let marked_by_journal =
        !cfg.readonly && !marked_live && header::marked_by_journal(&header::read_head(path)?);
    let crashed_journal = cfg.may_keep_qcow2_journal() && marked_by_journal;
    let journal = qcow2_format::journal_path(path).map_err(|err| OpenError::Io {
        what: "cannot read the metadata of",
        path: path.display().to_string(),
        err,
    })?;
    let journal_made = std::fs::metadata(&journal).is_ok_and(|m| m.len() > 0);
    if marked_by_journal && !crashed_journal && journal_made {
        // Refused as dirty otherwise, and the repair named there drops what the journal holds.
        return Err(Qcow2Error::MarkedByJournal {
            image: path.display().to_string(),
            journal: journal.display().to_string(),
        }
        .into());
    }
    if crashed_journal && !journal_made {
        return Err(Qcow2Error::JournalMissing {
            image: path.display().to_string(),
            journal: journal.display().to_string(),
        }
        .into());
    }
    // The chain's share of the daemon's budget, taken before imago loads any of its tables.
    let layers = header::chain(
        path,
        cfg.qcow2.table_memory_max,
        marked_live || crashed_journal,
    )?;
    let tables = table_budget::budget().lease(header::tables_bytes(&layers), path)?;
    let counters = Arc::new(Counters::default());
    let opts = image::TopOptions {
        readonly: cfg.readonly,
        direct: cfg.direct,
        commit,
        marked_live: marked_live || crashed_journal,
        counters: counters.clone(),
    };
    let image = image::open(path, &layers, opts)?;
    let locked = match image.top_lock.take() {
        Ok(()) => true,
        // No replay while another process has the image.
        Err(e) if crashed_journal => return Err(e.into()),
        // A live migration's source still serving it, or a conflict that the first ring's
        // start refuses (`refresh`).
        Err(e @ LockError::InUse { .. }) => {
            tracing::info!(
                "{e}: opened; its rings start once the image is free (as a live migration's \
                 destination's do once the source stops its rings)"
            );
            false
        }
        Err(e) => return Err(e.into()),
    };
    if marked_live {
        tracing::info!(
            image = %path.display(),
            "the image is marked dirty by a live server (metadata-commit=flush): opened, as a \
             live migration's destination; its rings start once that server unmarks it"
        );
    }
    let failure_report = image.failure_report.clone();
    let size = image.access.size();
    if let Some(given) = cfg.size.filter(|&s| s != size) {
        return Err(OpenError::SizeMismatch {
            path: path.display().to_string(),
            given,
            actual: size,
        });
    }
    let block_size = if cfg.direct {
        engine::uring::probe_direct_block_size(&image.file, size)
    } else {
        512
    };
    let cluster = 1u64 << image.cluster_bits;
    if cluster < u64::from(block_size) {
        return Err(Qcow2Error::ClusterBelowBlock {
            path: path.display().to_string(),
            cluster,
            block: block_size,
        }
        .into());
    }
    if crashed_journal {
        journal_replay::recover(&image, path)?;
    }
    if locked && !marked_live {
        image.claim_marks().map_err(|err| OpenError::Io {
            what: "cannot write the header of",
            path: path.display().to_string(),
            err,
        })?;
    }
    let worker_name = format!("qcow2-{}", cfg.id);
    let image = Arc::new(image);
    let jobs = start_worker(&image, &worker_name, path)?;
    Ok(Qcow2Engine {
        shared: Arc::new(Shared {
            top: Mutex::new(Top {
                jobs,
                image,
                path: path.to_path_buf(),
            }),
            generation: AtomicU64::new(0),
        }),
        block_size,
        l2_cache_size: cfg.qcow2.l2_cache_size,
        table_memory_max: cfg.qcow2.table_memory_max,
        metadata_commit: cfg.qcow2.metadata_commit,
        preallocation: cfg.preallocation,
        writable: !cfg.readonly,
        direct: cfg.direct,
        worker_name,
        failure_report,
        counters,
        tables: Mutex::new(tables),
        control: Mutex::new(()),
    })
}

/// Starts the metadata worker of `image` (at `path`, for the error).
fn start_worker(image: &Arc<Image>, name: &str, path: &Path) -> Result<Jobs, OpenError> {
    metadata::start_worker(image, name).map_err(|err| OpenError::Io {
        what: "cannot start the metadata worker of",
        path: path.display().to_string(),
        err,
    })
}

impl Qcow2Engine {
    fn top(&self) -> std::sync::MutexGuard<'_, Top> {
        self.shared.top.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn image(&self) -> Arc<Image> {
        self.top().image.clone()
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, TableLease> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn control(&self) -> std::sync::MutexGuard<'_, ()> {
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the top image's locks (again, if held: they may have been let go when the last
    /// ring stopped) and returns the image: another process's conflicting locks refuse it.
    fn lock_top(&self) -> io::Result<Arc<Image>> {
        let top = self.top();
        top.image.top_lock.take().map_err(|e| match e {
            LockError::Io { err, .. } => err,
            // Busy: the session tries again until the other process lets go.
            e @ LockError::InUse { .. } => io::Error::new(io::ErrorKind::ResourceBusy, e),
        })?;
        Ok(top.image.clone())
    }

    /// What [`Engine::refresh`] does, with `control` held: our own metadata written back
    /// first (none is dirty unless this backend wrote since its last flush, which a
    /// migration's switch-over includes), the image's tables mended, then everything imago
    /// caches dropped and the mutable header fields read again.
    fn refresh_image(image: &Image) -> io::Result<()> {
        // imago reads the header again below, and refuses it marked dirty.
        let answered = image.dirty.as_ref().map(|d| d.answered());
        let recorded = image.journal_tail();
        block_on(image.access.flush())?;
        clear_dirty_mark(image, answered)?;
        image.journal_written_back(recorded);
        // With `metadata-commit=write` this process never marks the file, so any mark is
        // another's.
        let marked_here = image
            .dirty
            .as_ref()
            .is_some_and(dirty_mark::DirtyMark::marked);
        if let Some(tables) = &image.tables {
            if !marked_here && dirty_mark::on_file(tables)? {
                // Another server's mark: it still serves the image (a migration's source whose
                // rings have not stopped), and nothing here may touch it yet.
                return Err(io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    "the image is still marked dirty by the server it came from \
                     (metadata-commit=flush), which must stop its queues first",
                ));
            }
        }
        // Before imago reads a refcount again, and allocates.
        image.mend_tables()?;
        // The image is this process's to mark now (a migration's source, if any, let it go).
        image.claim_marks()?;
        let writable = image.tables.is_some();
        if writable {
            image.top_storage().hide_marks(false);
        }
        // SAFETY: no request is in flight (the contract of `refresh`, and of `resize` while
        // the image is not mended: no ring starts before it is), so neither imago nor any
        // thread holds a mapping; the on-disk state is consistent (just flushed here, or by
        // the backend that changed it).
        let read_again = block_on(unsafe { image.access.invalidate_cache() });
        if writable {
            image.top_storage().show_marks();
        }
        read_again?;
        metadata::invalidate(image, 0, u64::MAX / 2);
        Ok(())
    }

    /// The snapshot itself (see [`Engine::snapshot`]): the top made durable, a new overlay
    /// over it, the overlay opened and made the top.
    fn take_snapshot(&self, overlay: &Path) -> Result<(), OpenError> {
        let mut top = self.top();
        let old = top.image.clone();
        let io = |what: &'static str, path: &Path| {
            let path = path.display().to_string();
            move |err: io::Error| OpenError::Io { what, path, err }
        };
        if overlay.exists() {
            return Err(Qcow2Error::SnapshotExists(overlay.display().to_string()).into());
        }
        write_back_all(&old).map_err(io("cannot flush", &top.path))?;
        let backing = top
            .path
            .canonicalize()
            .map_err(io("cannot resolve", &top.path))?;
        let cfg = Qcow2Config {
            backing: Some(backing),
            backing_format: Some(BackingFormat::Qcow2),
            cluster_size: 1 << old.cluster_bits,
            l2_cache_size: self.l2_cache_size,
            table_memory_max: self.table_memory_max,
            metadata_commit: self.metadata_commit,
        };
        image::create(overlay, Some(old.access.size()), &cfg, Preallocation::Off)?;
        let opened = header::chain(overlay, self.table_memory_max, false)
            .map_err(OpenError::from)
            .and_then(|layers| {
                // The overlay's tables on top of the chain's, held before imago loads them;
                // given back if the overlay does not become the top.
                let held = self.tables().bytes();
                self.tables()
                    .grow_to(header::tables_bytes(&layers), overlay)?;
                let opts = image::TopOptions {
                    readonly: false,
                    direct: self.direct,
                    commit: self.metadata_commit,
                    marked_live: false,
                    counters: self.counters.clone(),
                };
                let opened = image::open(overlay, &layers, opts).and_then(|mut new| {
                    new.top_lock.take()?;
                    new.failure_report = self.failure_report.clone();
                    // Made just now, by imago, and not yet allocated in: what a ring's start
                    // would do before the guest's requests reach it (see `Image::mended`).
                    new.mend_tables()
                        .map_err(io("cannot check the tables of", overlay))?;
                    new.claim_marks()
                        .map_err(io("cannot write the header of", overlay))?;
                    let new = Arc::new(new);
                    let jobs = start_worker(&new, &self.worker_name, overlay)?;
                    Ok((new, jobs))
                });
                if opened.is_err() {
                    self.tables()
                        .grow_to(held, overlay)
                        .expect("a lease can always go back to what it held");
                }
                opened
            });
        let (image, jobs) = match opened {
            Ok(o) => o,
            Err(e) => {
                let _ = std::fs::remove_file(overlay);
                return Err(e);
            }
        };
        // The old top's worker ends once its channels let go of its queue; its imago
        // instance has nothing left to write (just flushed) and is dropped with the last of
        // them.
        *top = Top {
            image,
            jobs,
            path: overlay.to_path_buf(),
        };
        self.shared.generation.fetch_add(1, Ordering::Release);
        Ok(())
    }
}

/// Data and what imago holds of the metadata on stable storage, and the image no longer
/// marked dirty (from a control thread: blocking). As a guest flush does (`metadata::flush`):
/// the write order syncs the data of new clusters before the first L2 table written, and the
/// last sync covers the rest.
fn write_back_all(image: &Image) -> io::Result<()> {
    let answered = image.dirty.as_ref().map(|d| d.answered());
    let recorded = image.journal_tail();
    block_on(image.access.flush())?;
    block_on(image.access.sync())?;
    clear_dirty_mark(image, answered)?;
    image.journal_written_back(recorded);
    Ok(())
}

/// With `metadata-commit=flush`: the dirty mark cleared after a write-back that began when
/// the mark's count of completions read `answered` (see [`dirty_mark`]).
fn clear_dirty_mark(image: &Image, answered: Option<u64>) -> io::Result<()> {
    match (&image.dirty, answered) {
        (Some(d), Some(before)) if d.marked() => block_on(d.clear(image.top_storage(), before)),
        _ => Ok(()),
    }
}

impl Drop for Qcow2Engine {
    /// The export is gone (its I/O threads drained and joined): what imago still holds of
    /// the metadata is written back, so that a clean shutdown leaves nothing to a flush the
    /// guest did not send. A given-up image writes nothing more (what imago holds may be
    /// half changed).
    fn drop(&mut self) {
        if !self.writable || self.image().given_up() {
            return;
        }
        if let Err(e) = write_back_all(&self.image()) {
            tracing::error!(err = %e, "cannot write the qcow2 metadata back at shutdown");
        }
    }
}

impl Engine for Qcow2Engine {
    fn name(&self) -> &'static str {
        "qcow2"
    }

    fn capacity(&self) -> u64 {
        self.image().access.size() & !511
    }

    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn channel(&self) -> io::Result<Box<dyn Channel>> {
        let top = self.top();
        let image = top.image.clone();
        let clusters = image.access.size().div_ceil(1 << image.cluster_bits);
        Ok(Box::new(Qcow2Channel {
            shared: self.shared.clone(),
            generation: self.shared.generation.load(Ordering::Acquire),
            jobs: top.jobs.clone(),
            replies: Arc::new(Replies {
                done: Mutex::new(Vec::new()),
                event: eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?,
            }),
            cache: MappingCache::new(image.cluster_bits, clusters, self.l2_cache_size),
            epoch: image.epoch.load(Ordering::Acquire),
            image,
            reaped: Vec::new(),
            since_hints: Vec::new(),
            wake_worker: false,
        }))
    }

    fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError> {
        // Before the image is taken: a snapshot may be replacing it.
        let _control = self.control();
        let image = self.lock_top()?;
        let actual = image.access.size();
        match size {
            None => Err(ResizeError::SizeNeeded("qcow2")),
            Some(s) if s < actual => Err(ResizeError::Shrink { actual }),
            Some(s) => {
                if !image.mended() {
                    // Growing allocates (a new L1 table), and until a ring has started no
                    // one has mended the image: an export resized before its frontend
                    // connects, or one whose tables were refused then, which this refuses
                    // again. (A header no refcount block covers once sent imago's allocator
                    // into a recursion that overflowed the API thread's stack, ending the
                    // daemon, after it had written a refcount block over the header.)
                    Self::refresh_image(&image)?;
                }
                // An overlay (a snapshot's, or one served as it is) grows unpreallocated:
                // clusters mapped ahead would hide its backing image's data.
                let preallocation = match image.backing_files.is_empty() {
                    true => self.preallocation,
                    false => Preallocation::Off,
                };
                block_on(
                    image
                        .access
                        .resize_grow(s, image::imago_preallocation(preallocation)),
                )?;
                block_on(image.access.flush())?;
                block_on(image.access.sync())?;
                Ok(s)
            }
        }
    }

    fn sync_host_cache(&self) -> io::Result<()> {
        // Everything the next backend to open the image (after a migration) needs: data,
        // and the metadata imago holds in memory.
        write_back_all(&self.image())
    }

    fn refresh(&self) -> io::Result<()> {
        let _control = self.control();
        let image = self.lock_top()?;
        Self::refresh_image(&image)
    }

    fn deactivate(&self) {
        // After `sync_host_cache`: nothing of this backend's is left to write.
        self.image().top_lock.release();
    }

    fn snapshot(&self, overlay: &Path) -> Result<(), SnapshotError> {
        if !self.writable {
            return Err(SnapshotError::ReadOnly);
        }
        let _control = self.control();
        Ok(self.take_snapshot(overlay)?)
    }

    fn ring_opcodes(&self) -> &'static [u8] {
        engine::uring::RW_OPCODES
    }

    fn table_memory(&self) -> Option<u64> {
        Some(self.tables().bytes())
    }

    fn metadata_counters(&self) -> Option<MetadataCounters> {
        Some(self.counters.load())
    }

    fn report_failures_to(&self, report: FailureReport) {
        let _ = self.failure_report.set(report);
    }

    fn limits(&self) -> Limits {
        Limits {
            discard: self.writable,
            write_zeroes: self.writable,
            cuts_runs: true,
            ..Limits::default()
        }
    }
}
