//! The metadata path: what an I/O thread's mapping cache cannot serve, done by one worker per
//! image through imago, off the I/O threads.
//!
//! An I/O thread hands a request here when its clusters are not all in its cache: a read of a
//! backing image, an unallocated, zero or compressed cluster, an allocating write (with its
//! copy-on-write from the backing image), a flush, a discard or a write-zeroes. The worker
//! runs up to [`RUNNING`] of them at once as tasks over imago's asynchronous interface, their
//! I/O on its own ring ([`uring_io`]), then answers on the thread's reply queue and eventfd
//! ([`jobs`](super::jobs)), which the thread's ring polls, with the mappings the thread may
//! cache from then on. imago serializes what must be serialized (allocation, its L2 and
//! refcount caches) with its own locks; a copy-on-write reads the rest of its cluster outside
//! them ([`cow`]).
//!
//! One worker, not several: the tasks of one thread wait for imago's locks without waking
//! another thread, and one ring carries all the I/O. Measured (docs/PERFORMANCE.md section 13):
//! 1.4-1.6x the allocating writes of two or four workers, at 0.5-0.7x the CPU per write.
//!
//! With `metadata-commit=write`, metadata a job changed is written to the image file before
//! the job completes, after the job's data: mqblk may crash while the guest lives on, so what
//! it acknowledged must be in the kernel's hands, metadata included. What a metadata write
//! depends on (the refcount block that counts a new cluster, and the cluster's data, before
//! the L2 table that maps it) reaches stable storage before it
//! ([`write_order`](super::write_order)): a new cluster holds backing data the guest never
//! wrote, which an L2 entry on disk without it would lose in a power loss. The worker does that
//! as a group commit: one write-back, with one sync before its L2 tables, covers every job that
//! finished before it began. A guest flush syncs data written into new clusters first, then
//! writes back whatever imago still holds and syncs everything.
//!
//! With `metadata-commit=flush` a job's metadata waits for the guest's flush instead, as with
//! QEMU's qcow2 driver, and a job completes once its data is written and the file is marked
//! dirty ([`dirty_mark`](super::dirty_mark)), which the flush clears. `metadata-commit=journal`
//! does the same, and records the mappings a job made in the image's journal before the job
//! completes ([`mapping_journal`](super::mapping_journal)); a job whose records do not fit
//! waits for a write-back, as with `write`, and a journal half full has one started. The
//! default, `auto`, is `journal` wherever the image can keep one, else `write`.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use imago::io_buffers::{IoVector, IoVectorMut};
use imago::{Mapping, ShallowMapping};

use rustix::event::{eventfd, EventfdFlags};

use super::cluster_buffers::{self, region_bytes, Region};
use super::cow;
use super::data_writes;
use super::executor::Executor;
use super::image::{
    compressed_in, resolve, write_kind, Image, Invalidation, WriteKind, INVALIDATIONS_KEPT,
};
use super::jobs::{Hint, IoVecs, Job, Jobs, ToSignal, Work};
use super::mapping::Target;
use super::mapping_journal::{self, Mapped};
use super::test_hooks;
use super::uring_io;

/// Clusters around a miss whose mappings a reply carries (a 32 MiB window at 64 KiB clusters):
/// one trip warms the cache for the neighbourhood, not one cluster.
const HINT_WINDOW_CLUSTERS: u64 = 512;

/// Starts the metadata worker of `image`, a thread named `name`; returns its queue. It ends
/// when every holder of the queue is gone.
pub fn start_worker(image: &Arc<Image>, name: &str) -> io::Result<Jobs> {
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    // The copy-on-writes' buffers, registered with the ring (`cluster_buffers`).
    let cluster = 1usize << image.cluster_bits;
    let mut region = Region::new(
        region_bytes(RUNNING, cluster),
        image.access.mem_align().max(4096),
    );
    let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC)?);
    let image = image.clone();
    let worker_wake = wake.clone();
    let worker = name.to_string();
    // The ring is made on the worker's own thread, as an I/O thread makes its own: in a
    // confined daemon that cannot lift the locked-memory limit, `ring_setup` exempts the ring
    // and its registered region from the limit, and then drops every capability of the
    // thread, which a control thread must keep. Its result comes back here, so that a failure
    // is the caller's error, not a worker that is missing.
    let (made_tx, made_rx) = std::sync::mpsc::sync_channel::<io::Result<()>>(1);
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let made = crate::sandbox::ring_setup(|| {
                uring_io::worker_ring(
                    RING_ENTRIES,
                    crate::sandbox::rings_confined(),
                    region.as_mut().map(Region::iovec),
                )
            });
            let (ring, registered) = match made {
                Ok(made) => {
                    let _ = made_tx.send(Ok(()));
                    made
                }
                Err(e) => {
                    let _ = made_tx.send(Err(e));
                    return;
                }
            };
            // A panic (a bug of imago's or ours that an image or a request reached) ends the
            // worker and this image's metadata path, never the daemon: `serve` gives the
            // image up as it unwinds, every job it held answers EIO as it is dropped, and
            // the jobs still queued do as `rx` goes.
            let fixed = region.as_mut().filter(|_| registered).map(Region::iovec);
            if let Some(region) = region {
                cluster_buffers::install(region, cluster);
            }
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                serve(&image, &rx, ring, worker_wake, fixed)
            }));
            if served.is_err() {
                tracing::error!(worker, "qcow2 metadata worker ended by a panic");
            }
        })?;
    made_rx.recv().map_err(|_| {
        io::Error::other("the qcow2 metadata worker ended before its ring was made")
    })??;
    Ok(Jobs::new(tx, wake))
}

/// Gives the image up if dropped by a panic. Declared after everything else in [`serve`], it
/// is dropped first of what `serve` holds as a panic unwinds, before the jobs it holds answer
/// EIO (the job that panicked has already answered, as the unwinding left it).
struct GiveUpOnPanic<'a>(&'a Image);

impl Drop for GiveUpOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.give_up("the metadata worker panicked");
        }
    }
}

/// How long a finished job that needs a commit may wait for the jobs still at work to join
/// it. imago writes back whole tables (64 KiB, 8192 entries each, serialised on the worker's
/// CPU), so a commit costs about the same for one job as for thirty: measured on an empty
/// 8 GiB overlay at iodepth 32 (docs/PERFORMANCE.md section 13), waiting up to 3 ms gave
/// 1.07x (1 job) and 1.32x (2 jobs) the IOPS of committing at once, at 0.71-0.75x the CPU per
/// write and a lower p99. A job alone (iodepth 1) never waits: nothing else is at work.
const COMMIT_AFTER: Duration = Duration::from_millis(3);

/// Most jobs the worker runs at once (each with at most one I/O in flight on its ring).
const RUNNING: usize = 32;

/// A worker ring's entries: every running job's I/O, a group commit's and the wake-up read.
const RING_ENTRIES: u32 = 64;

/// What a worker's task returns.
enum Outcome {
    /// A job, performed: it completes now, or after the next group commit.
    Performed(Box<Performed>),
    /// A group commit, done, with the jobs it persisted and its result.
    Committed(Vec<Performed>, io::Result<()>),
    /// A write-back that made room in the journal, done.
    JournalWrittenBack(io::Result<()>),
}

/// A job whose work is done, and what its reply will carry.
struct Performed {
    job: Job,
    done: Done,
    hints: Vec<Hint>,
    epoch: u64,
}

/// The worker: takes jobs from the image's queue and runs up to [`RUNNING`] at once, their I/O
/// on its own ring. A job whose metadata changes must reach the image file before it completes
/// waits for the next group commit, which covers every such job finished before it began (one
/// write-back of imago's tables for all of them).
fn serve(
    image: &Arc<Image>,
    jobs: &Receiver<Job>,
    ring: io_uring::IoUring,
    wake: Arc<OwnedFd>,
    fixed: Option<libc::iovec>,
) {
    let reactor = uring_io::Reactor::new(ring, wake.clone(), fixed);
    uring_io::install(reactor.clone());
    let mut tasks = Executor::<Outcome>::new(wake);
    let mut outcomes = Vec::new();
    let mut commits = GroupCommit::default();
    let mut to_signal = ToSignal::default();
    let mut journal_write_back = false;
    let _give_up = GiveUpOnPanic(image);
    loop {
        if tasks.live() == 0 {
            // Idle: the first job blocking.
            match jobs.recv() {
                Ok(job) => tasks.spawn(run_job(image.clone(), job)),
                Err(_) => return,
            }
        }
        while tasks.live() < RUNNING {
            match jobs.try_recv() {
                Ok(job) => tasks.spawn(run_job(image.clone(), job)),
                Err(_) => break,
            }
        }
        tasks.run(&mut |o| outcomes.push(o));
        for outcome in outcomes.drain(..) {
            match outcome {
                Outcome::Performed(p) if completes_now(image, &p) => {
                    to_signal.add(&p.job.replies);
                    reply(image, *p, &Ok(()));
                }
                Outcome::Performed(p) => commits.add(*p),
                Outcome::Committed(batch, persisted) => {
                    commits.running = false;
                    for p in batch {
                        to_signal.add(&p.job.replies);
                        reply(image, p, &persisted);
                    }
                }
                Outcome::JournalWrittenBack(result) => {
                    journal_write_back = false;
                    if let Err(e) = result {
                        // The jobs whose records do not fit write back themselves, and fail
                        // with its error if it lasts.
                        tracing::warn!(err = %e, "qcow2 metadata journal: write-back failed");
                    }
                }
            }
        }
        to_signal.signal_all();
        if !journal_write_back && image.journal().is_some_and(|j| j.wants_write_back()) {
            journal_write_back = true;
            tasks.spawn(make_room_in_journal(image.clone()));
        }
        let limit = match commits.take_due(tasks.live()) {
            Ok(batch) => {
                tasks.spawn(commit(image.clone(), batch));
                continue;
            }
            Err(limit) => limit,
        };
        if tasks.live() > 0 {
            if let Err(e) = reactor.wait_at_most(limit) {
                // Nothing in flight can complete any more, and the memory it names must not
                // be given back: the daemon cannot go on safely.
                tracing::error!(err = %e, "qcow2 metadata worker's ring failed");
                std::process::abort();
            }
        }
    }
}

/// The jobs that wait for a group commit, and whether one is running (one at a time).
#[derive(Default)]
struct GroupCommit {
    waiting: Vec<Performed>,
    /// When the oldest of `waiting` finished.
    since: Option<Instant>,
    running: bool,
}

impl GroupCommit {
    fn add(&mut self, p: Performed) {
        self.since.get_or_insert_with(Instant::now);
        self.waiting.push(p);
    }

    /// The jobs to commit now, if a commit is due: none is running, and no job is still at
    /// work (`at_work`: it would join if it finished first) or the oldest has waited
    /// [`COMMIT_AFTER`]. Otherwise how long until one may be due (`None`: not before
    /// something else happens).
    fn take_due(&mut self, at_work: usize) -> Result<Vec<Performed>, Option<Duration>> {
        if self.running || self.waiting.is_empty() {
            return Err(None);
        }
        let waited = self.since.map_or(Duration::ZERO, |t| t.elapsed());
        if at_work > 0 && waited < COMMIT_AFTER {
            return Err(Some(COMMIT_AFTER - waited));
        }
        self.running = true;
        self.since = None;
        Ok(std::mem::take(&mut self.waiting))
    }
}

/// Whether a performed job completes without a group commit: it changed no metadata, or the
/// metadata waits for the guest's flush (`metadata-commit=flush`) and the file is marked dirty
/// meanwhile ([`dirty_mark`](super::dirty_mark)).
fn completes_now(image: &Image, p: &Performed) -> bool {
    match p.done.persist {
        Persist::Nothing => true,
        Persist::WriteBack => image.dirty.as_ref().is_some_and(|d| d.marked()),
        Persist::Tables | Persist::Sync => false,
    }
}

/// Performs a job and reads the mappings its reply will carry.
async fn run_job(image: Arc<Image>, mut job: Job) -> Outcome {
    let mut done = perform(&image, &mut job.work).await;
    image.counters.performed();
    let (hints, epoch) = match done.hint {
        Some((offset, len)) if done.result >= 0 => hints(&image, offset, len).await,
        _ => (Vec::new(), 0),
    };
    // A reply must not rely on a mapping another job made and has not written back
    // (`unpersisted`): a crash of mqblk before that job's commit would lose the mapping and
    // the write acknowledged into it. A write into such clusters completes after the next
    // group commit, which writes back everything made before it began; such mappings are not
    // handed to the thread to cache (it asks again later). While a zeroing is under way, any
    // reply with mappings waits for the commit (zeroings are rare).
    let (mut hints, epoch) = (hints, epoch);
    if done.result >= 0 && done.persist == Persist::Nothing && done.hint.is_some() {
        let pending = &image.unpersisted;
        let bits = image.cluster_bits;
        let relies = match done.wrote {
            Some((offset, len)) => pending.touches(offset, len, bits),
            None => pending.zeroing(),
        };
        if relies {
            done.persist = Persist::WriteBack;
        }
        // With `metadata-commit=flush` such a reply waits for no write-back (only for the
        // file's dirty mark), so it goes without the mappings others are still making: one
        // may be mapped before its data.
        if !relies || image.dirty.is_some() {
            hints.retain(|h| {
                !matches!(h.target, Target::File { layer: 0, .. })
                    || !pending.touches(h.guest, h.len, bits)
            });
        }
    }
    // `metadata-commit=journal`: a job whose mappings (made or relied on) are not recorded
    // (`perform` records them while it holds the clusters) has its tables written back.
    if done.result >= 0
        && done.persist == Persist::WriteBack
        && image.journal.is_some()
        && !done.journaled
    {
        done.persist = Persist::Tables;
    }
    Outcome::Performed(Box::new(Performed {
        job,
        done,
        hints,
        epoch,
    }))
}

/// With `metadata-commit=journal`: records in the image's journal what every cluster of
/// `offset..offset + len` maps to now, if the caller's job changed a mapping there (`changed`)
/// or relies on one another job has not recorded yet; true if recorded. Called while the job
/// still holds its clusters (or the zeroing lock), so that no other job's cluster mapped ahead
/// of its data can be among them.
async fn journal_mappings(image: &Image, offset: u64, len: u64, changed: bool) -> bool {
    if image.journal.is_none()
        || !(changed || image.unpersisted.touches(offset, len, image.cluster_bits))
    {
        return false;
    }
    let bits = image.cluster_bits;
    let capacity = mapping_journal::capacity_for(bits);
    let (first, end) = (
        offset >> bits,
        (offset + len.max(1)).next_multiple_of(1 << bits) >> bits,
    );
    if end - first > capacity {
        return false;
    }
    let mut records = Vec::with_capacity((end - first) as usize);
    let (mut at, end) = (first << bits, (end << bits).min(image.access.size()));
    while at < end {
        let Ok((mapping, n)) = image.access.get_shallow_mapping(at, end - at).await else {
            return false;
        };
        if n == 0 {
            return false;
        }
        for cluster in (at >> bits)..=((at + n - 1) >> bits) {
            let mapped = match mapping {
                ShallowMapping::Raw {
                    offset: host,
                    writable: true,
                    ..
                } => Mapped::Data(host + (cluster << bits) - at),
                ShallowMapping::Zero { .. } => Mapped::Zero,
                _ => return false,
            };
            records.push((cluster, mapped));
        }
        at += n;
    }
    image.journal().is_some_and(|mut j| j.append(&records))
}

/// Writes the tables back to make room in the journal, whose records it then drops.
async fn make_room_in_journal(image: Arc<Image>) -> Outcome {
    let changed = image.changed.fetch_add(1, Ordering::AcqRel) + 1;
    Outcome::JournalWrittenBack(write_back(&image, changed).await)
}

/// A group commit: what the jobs of `batch` changed reaches the image file (and stable
/// storage, for a write-through write) before any of them completes.
async fn commit(image: Arc<Image>, batch: Vec<Performed>) -> Outcome {
    let persist = batch
        .iter()
        .map(|p| p.done.persist)
        .max()
        .unwrap_or_default();
    let changed = image.changed.fetch_add(1, Ordering::AcqRel) + 1;
    let persisted = match (persist, &image.dirty) {
        (Persist::Nothing, _) => Ok(()),
        // `metadata-commit=flush`: the jobs complete once the file says it lacks their
        // metadata.
        (Persist::WriteBack, Some(dirty)) => dirty.mark(image.top_storage()).await,
        (Persist::WriteBack, None) | (Persist::Tables, _) => write_back(&image, changed).await,
        (Persist::Sync, _) => flush(&image).await,
    };
    Outcome::Committed(batch, persisted)
}

/// Completes a performed job: its reply, with `persisted`'s error if it failed.
fn reply(image: &Image, p: Performed, persisted: &io::Result<()>) {
    let Performed {
        mut job,
        done,
        mut hints,
        epoch,
    } = p;
    let mut result = done.result;
    if let (Err(e), true) = (persisted, result >= 0 && done.persist != Persist::Nothing) {
        result = errno(e);
        hints.clear();
    }
    if done.is_write {
        image.writes_in_progress.fetch_sub(1, Ordering::AcqRel);
    }
    if let (Some(dirty), Persist::WriteBack) = (&image.dirty, done.persist) {
        dirty.answering();
    }
    match done.unpersisted {
        Some(Unpersisting::Write { offset, len }) => {
            image
                .unpersisted
                .remove_write(offset, len, image.cluster_bits)
        }
        Some(Unpersisting::Zeroing) => image.unpersisted.remove_zeroing(),
        None => {}
    }
    job.answer(result, hints, epoch);
}

fn errno(e: &io::Error) -> i32 {
    -e.raw_os_error().unwrap_or(libc::EIO)
}

/// What a job's metadata changes need before it may complete.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
enum Persist {
    /// Nothing changed.
    #[default]
    Nothing,
    /// Written to the image file (a crash of mqblk must not lose it), or, with
    /// `metadata-commit=flush` or `journal`, the file marked dirty.
    WriteBack,
    /// Written to the image file, whatever the mode (a journal could not record it).
    Tables,
    /// On stable storage (a write-through write).
    Sync,
}

/// What a job counts for in `Image::unpersisted`.
#[derive(Debug, Clone, Copy)]
enum Unpersisting {
    /// A write not in place, over this range.
    Write { offset: u64, len: u64 },
    /// A zeroing.
    Zeroing,
}

/// A performed job, before its metadata is persisted and it completes.
#[derive(Debug, Default)]
struct Done {
    /// Bytes transferred, 0, or a negative errno.
    result: i32,
    /// What it needs persisted.
    persist: Persist,
    /// A write (counted in `writes_in_progress` until it completes).
    is_write: bool,
    /// What it counts for in `Image::unpersisted` until it completes: it may change mappings.
    unpersisted: Option<Unpersisting>,
    /// A write that changed no mapping: the range it wrote.
    wrote: Option<(u64, u64)>,
    /// Its mappings are recorded in the journal (`metadata-commit=journal`).
    journaled: bool,
    /// The range whose neighbourhood to send mappings of: `(offset, len)`, with `len` 0 for
    /// the window around `offset`.
    hint: Option<(u64, u64)>,
}

/// Does one job's I/O and metadata work (in imago's caches).
async fn perform(image: &Image, work: &mut Work) -> Done {
    let failed = |e: io::Error| Done {
        result: errno(&e),
        ..Done::default()
    };
    if let Work::Read { iovs, .. } | Work::Write { iovs, .. } = work {
        // A completion reports its bytes as an i32: a larger request (a guest can build one
        // from segments that repeat its memory) fails before it moves anything, as the
        // kernel would cut it short on a ring.
        // SAFETY: the iovecs are valid until the reply (`IoVecs`).
        let vecs = unsafe { std::slice::from_raw_parts(iovs.ptr, iovs.count as usize) };
        if vecs.iter().map(|v| v.iov_len as u64).sum::<u64>() > i32::MAX as u64 {
            return failed(io::Error::from_raw_os_error(libc::EINVAL));
        }
    }
    if image.given_up() {
        return failed(io::Error::from_raw_os_error(libc::EIO));
    }
    match work {
        Work::Read { offset, iovs } => {
            // SAFETY: the iovecs are valid until the reply (`IoVecs`); a read writes into them.
            let (bufs, len) = unsafe { slices(iovs) };
            // No zeroing meanwhile: one that zeroes a compressed cluster this read is reading
            // changes its mapping under imago, which then reads the rest of the request again
            // from inside itself, one level deeper for each such cluster.
            let _zeroing = image.zeroing.read().await;
            // A new cluster may be mapped before its data is written (`early_maps`): its
            // write holds it until then.
            let _clusters = image
                .cow_locks
                .lock_range(*offset, len as u64, image.cluster_bits)
                .await;
            let mut v = IoVectorMut::with_capacity(bufs.len());
            for b in bufs {
                v.push(b);
            }
            match image.access.readv(v, *offset).await {
                Ok(()) => Done {
                    result: len as i32,
                    hint: Some((*offset, 0)),
                    ..Done::default()
                },
                Err(e) => failed(e),
            }
        }
        Work::Write { offset, iovs, sync } => {
            // SAFETY: as for the read; a write only reads them.
            let (bufs, len) = unsafe { slices(iovs) };
            let bufs: Vec<&[u8]> = bufs.into_iter().map(|b| &*b).collect();
            // imago's writes of these are data, not written through (`data_writes`).
            let _data = data_writes::register(&bufs);
            image.writes_in_progress.fetch_add(1, Ordering::AcqRel);
            // Held until the write is done (see `cow`).
            let _zeroing = image.zeroing.read().await;
            let _clusters = image
                .cow_locks
                .lock_range(*offset, len as u64, image.cluster_bits)
                .await;
            test_hooks::before_write(*offset);
            // A write into clusters allocated in place (a thread's cache miss, not an
            // allocation) changes no mapping, unless something else changed them meanwhile
            // (which bumps the epoch).
            let epoch = image.epoch.load(Ordering::Acquire);
            let kind = write_kind(&image.access, *offset, len as u64).await;
            let in_place = matches!(kind, Ok(WriteKind::InPlace));
            if !matches!(kind, Ok(WriteKind::InPlace | WriteKind::Allocates)) {
                // A replaced cluster is freed after the L2 entry stops using it.
                may_free(image);
            }
            if !in_place {
                // Before any mapping it makes can be seen.
                image
                    .unpersisted
                    .add_write(*offset, len as u64, image.cluster_bits);
            }
            let result = match cow::write_into_new_cluster(image, *offset, &bufs, len as u64).await
            {
                Some(written) => written,
                None => {
                    let mut v = IoVector::with_capacity(bufs.len());
                    for b in &bufs {
                        v.push(b);
                    }
                    image.access.writev(v, *offset).await
                }
            };
            image.writes_done.fetch_add(1, Ordering::AcqRel);
            let changed = !in_place || image.epoch.load(Ordering::Acquire) != epoch;
            if changed {
                // It may have allocated clusters threads hold as in a backing file or zeros.
                invalidate(image, *offset, len as u64);
            }
            let journaled =
                result.is_ok() && journal_mappings(image, *offset, len as u64, changed).await;
            Done {
                result: match result {
                    Ok(()) => len as i32,
                    Err(e) => errno(&e),
                },
                persist: match (*sync, changed) {
                    (true, _) => Persist::Sync,
                    (false, true) => Persist::WriteBack,
                    (false, false) => Persist::Nothing,
                },
                is_write: true,
                unpersisted: (!in_place).then_some(Unpersisting::Write {
                    offset: *offset,
                    len: len as u64,
                }),
                wrote: (!changed).then_some((*offset, len as u64)),
                journaled,
                // An allocation: only its own clusters (their neighbours are allocated one by
                // one too); a miss: the window around it, as for a read.
                hint: Some((*offset, if changed { len as u64 } else { 0 })),
            }
        }
        Work::Flush => match flush(image).await {
            Ok(()) => Done::default(),
            Err(e) => failed(e),
        },
        Work::Zero { offset, len, unmap } => {
            image.unpersisted.add_zeroing();
            // imago keeps the allocation of what it zeroes, but frees a compressed cluster.
            if !matches!(compressed_in(&image.access, *offset, *len).await, Ok(false)) {
                may_free(image);
            }
            let done = match zero(image, *offset, *len, *unmap).await {
                Ok(journaled) => Done {
                    persist: Persist::WriteBack,
                    journaled,
                    ..Done::default()
                },
                Err(e) => failed(e),
            };
            Done {
                unpersisted: Some(Unpersisting::Zeroing),
                ..done
            }
        }
    }
}

/// From now on, clusters of `image` may be freed (see [`WriteOrder`](super::write_order)).
fn may_free(image: &Image) {
    if let Some(order) = &image.write_order {
        order.may_free();
    }
}

/// The iovecs as byte slices, and their total length, for as long as `iovs` is borrowed.
///
/// The guest may change that memory while imago reads or writes it, as it may while the kernel
/// does for a ring's readv or writev; imago's own bridge from vm-memory's volatile slices builds
/// the same slices.
///
/// # Safety
/// `iovs` must describe valid, writable memory that stays mapped, and that no other Rust
/// reference in this process covers, while the slices live.
unsafe fn slices(iovs: &mut IoVecs) -> (Vec<&mut [u8]>, usize) {
    // SAFETY: the caller's contract.
    let vecs = unsafe { std::slice::from_raw_parts(iovs.ptr, iovs.count as usize) };
    let mut total = 0;
    let bufs = vecs
        .iter()
        .filter(|v| v.iov_len > 0)
        .map(|v| {
            total += v.iov_len;
            // SAFETY: the caller's contract; each iovec is one live range of guest memory.
            unsafe { std::slice::from_raw_parts_mut(v.iov_base.cast::<u8>(), v.iov_len) }
        })
        .collect();
    (bufs, total)
}

/// Writes what imago holds of the metadata (L2 tables, refcount blocks) to the image file, without
/// syncing, once the changes counted `changed` are done: before a write or a zeroing on the
/// metadata path completes, so that a crash of mqblk loses none of it (the kernel has it), as a
/// crash loses nothing of a raw image. A guest that survives mqblk (it reconnects, and in-flight
/// tracking resubmits only what had not completed) must find every completed write.
///
/// A group commit: imago writes whole tables, which costs more than the change, so the jobs
/// that finish while one write-back runs wait for the next, which covers them all (a
/// write-back that began after a job's changes were counted covers them).
async fn write_back(image: &Image, changed: u64) -> io::Result<()> {
    let mut written_back = image.written_back.lock().await;
    if *written_back >= changed {
        return Ok(());
    }
    let upto = image.changed.load(Ordering::Acquire);
    let recorded = image.journal_tail();
    let began = Instant::now();
    image.access.flush().await?;
    image.counters.wrote_back(began);
    *written_back = upto;
    image.journal_written_back(recorded);
    Ok(())
}

/// Makes every completed write and the metadata that points at it durable (and clears the
/// image's dirty mark, if nothing completed meanwhile).
async fn flush(image: &Image) -> io::Result<()> {
    let answered = image.dirty.as_ref().map(|d| d.answered());
    let recorded = image.journal_tail();
    let done = image.writes_done.load(Ordering::Acquire);
    // The data of new clusters reaches stable storage before the L2 entries that map them
    // through the sync the write order puts before the first L2 table written (`write_order`),
    // and everything else through the final sync: one of its own first would only repeat it.
    image.access.flush().await?;
    image.access.sync().await?;
    image.writes_durable.fetch_max(done, Ordering::AcqRel);
    // Unmarked (no allocation since the last flush), nothing to clear: the top file is looked
    // up in imago only when it is.
    if let (Some(dirty), Some(before)) = (&image.dirty, answered) {
        if dirty.marked() {
            test_hooks::BEFORE_CLEARING_THE_DIRTY_MARK.wait().await;
            dirty.clear(image.top_storage(), before).await?;
        }
    }
    image.journal_written_back(recorded);
    Ok(())
}

/// Zeroes `len` bytes at `offset` through imago, keeping the clusters allocated (so no thread's
/// cached mapping can ever point at a cluster given to another guest offset), invalidates the
/// threads' caches over the range, then (with `unmap`) punches the file's blocks of the whole
/// clusters out: they read as zeroes and cost no space. Returns whether its mappings are
/// recorded in the journal (`metadata-commit=journal`).
async fn zero(image: &Image, offset: u64, len: u64, unmap: bool) -> io::Result<bool> {
    let cluster = 1u64 << image.cluster_bits;
    let mut punch = Vec::new();
    if unmap {
        let (start, end) = (
            offset.next_multiple_of(cluster),
            (offset + len) / cluster * cluster,
        );
        let mut at = start;
        while at < end {
            let (mapping, n) = image.access.get_mapping(at, end - at).await?;
            if n == 0 {
                break;
            }
            if let Mapping::Raw {
                offset: host,
                writable: true,
                ..
            } = mapping
            {
                punch.push((host, n));
            }
            at += n;
        }
    }
    // No write may have read a cluster's rest before this and write it back after.
    let _zeroing = image.zeroing.write().await;
    image.access.write_zeroes(offset, len).await?;
    invalidate(image, offset, len);
    for (host, n) in punch {
        let mode = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        match rustix::fs::fallocate(&image.file, mode, host, n) {
            Ok(()) | Err(rustix::io::Errno::OPNOTSUPP) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(journal_mappings(image, offset, len, true).await)
}

/// Tells the I/O threads that their mappings of `offset..offset + len` are stale: a new
/// epoch, remembered with its range. Each thread checks the epoch before it uses its cache.
pub fn invalidate(image: &Image, offset: u64, len: u64) {
    let mut log = image
        .invalidations
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let epoch = image.epoch.load(Ordering::Acquire) + 1;
    if log.len() == INVALIDATIONS_KEPT {
        log.pop_front();
    }
    log.push_back(Invalidation { epoch, offset, len });
    image.epoch.store(epoch, Ordering::Release);
}

/// Where the clusters of `offset..offset + len` are (with `len` 0, the clusters of the window
/// around `offset`), as far as a thread may cache it, and the epoch that is true in (read
/// first: a change after it bumps the epoch past it).
async fn hints(image: &Image, offset: u64, len: u64) -> (Vec<Hint>, u64) {
    let epoch = image.epoch.load(Ordering::Acquire);
    let cluster = 1u64 << image.cluster_bits;
    let (start, end) = match len {
        0 => {
            let window = HINT_WINDOW_CLUSTERS << image.cluster_bits;
            let start = offset / window * window;
            (start, start + window)
        }
        _ => (
            offset / cluster * cluster,
            (offset + len).next_multiple_of(cluster),
        ),
    };
    let end = end.min(image.access.size());
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let Ok((target, n)) = resolve(&image.access, at, end - at).await else {
            break;
        };
        if n == 0 {
            break;
        }
        if let Some(target) = target {
            out.push(Hint {
                guest: at,
                target,
                len: n,
            });
        }
        at += n;
    }
    (out, epoch)
}

/// Calls `each` with every invalidation made after epoch `seen`, newest first. Returns false
/// when some of those are no longer kept (a thread must then forget everything it cached, and
/// trust no mapping read at `seen`).
pub fn invalidations_since(image: &Image, seen: u64, mut each: impl FnMut(&Invalidation)) -> bool {
    let log = image
        .invalidations
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    match log.front() {
        Some(first) if first.epoch <= seen + 1 => {
            for i in log.iter().rev().take_while(|i| i.epoch > seen) {
                each(i);
            }
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::super::jobs::Replies;
    use super::*;

    fn performed() -> Performed {
        let replies = Arc::new(Replies {
            done: Mutex::new(Vec::new()),
            event: eventfd(0, EventfdFlags::CLOEXEC).unwrap(),
        });
        Performed {
            job: Job::new(Work::Flush, 1, replies),
            done: Done {
                persist: Persist::WriteBack,
                ..Done::default()
            },
            hints: Vec::new(),
            epoch: 0,
        }
    }

    #[test]
    fn a_commit_waits_for_the_jobs_at_work_but_not_longer_than_its_bound() {
        let mut c = GroupCommit::default();
        assert!(matches!(c.take_due(0), Err(None)), "nothing waits");
        c.add(performed());
        // Others at work: wait for them, at most COMMIT_AFTER.
        match c.take_due(3) {
            Err(Some(d)) => assert!(d <= COMMIT_AFTER),
            _ => panic!("a commit must wait while jobs are at work"),
        }
        std::thread::sleep(COMMIT_AFTER);
        c.add(performed());
        let batch = c
            .take_due(3)
            .unwrap_or_else(|_| panic!("due after COMMIT_AFTER"));
        assert_eq!(batch.len(), 2);
        // One at a time.
        c.add(performed());
        assert!(matches!(c.take_due(0), Err(None)));
        c.running = false;
        // Nothing else at work: at once.
        assert_eq!(c.take_due(0).map(|b| b.len()).ok(), Some(1));
    }
}
