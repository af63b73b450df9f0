//! `format=qcow2`: qcow2 images and their backing chains, through imago, on the per-queue data
//! path. (What can be known from an image's header, and its errors, are in
//! [`format::qcow2`](crate::format::qcow2).)
//!
//! imago (a qcow2 library by a QEMU block-layer maintainer) owns the format: the header, the L1
//! and L2 tables, refcounts, allocation, copy-on-write from backing images, zero clusters,
//! compressed clusters, resize and image creation. mqblk keeps the data path: each I/O thread
//! caches where guest clusters are in the image file ([`mapping`]) and turns a request on
//! cached clusters into one entry on its own ring at the file offset, as for a raw image. What
//! the cache cannot serve goes to a few metadata workers per export ([`metadata`]), which do
//! it through imago and answer with the mappings the thread may cache from then on.
//!
//! The one hazard of caching mappings is a cluster that moves while a thread still points at
//! it. mqblk never frees a cluster while it serves an image: discard and write-zeroes turn
//! clusters into zero clusters that keep their place in the file (with `unmap`, the file's
//! blocks are punched out), so a stale mapping can only point at the cluster's own place.
//! Such a mapping is still stale (a write there would be lost behind the zero flag), so every
//! zeroing bumps the image's epoch with the range it made stale, before the request
//! completes, and each thread forgets that range before it next uses its cache.

mod channel;
mod image;
mod mapping;
mod metadata;

use std::io;
use std::path::Path;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use rustix::event::{eventfd, EventfdFlags};

use crate::config::ExportConfig;
use crate::engine::{self, Channel, Engine, Limits, OpenError, ResizeError};
pub use crate::format::qcow2::Qcow2Error;
use channel::Qcow2Channel;
use image::Image;
use mapping::MappingCache;
use metadata::{Job, Replies};

/// How many metadata workers an export with `threads` I/O threads gets: enough that backing
/// reads and allocations of different threads run side by side, few enough to stay rare.
fn worker_count(threads: usize) -> usize {
    threads.clamp(2, 8)
}

/// A qcow2 export's storage.
pub struct Qcow2Engine {
    image: Arc<Image>,
    jobs: Mutex<Sender<Job>>,
    block_size: u32,
    l2_cache_size: u64,
    writable: bool,
    _workers: Vec<std::thread::JoinHandle<()>>,
}

/// Opens (or creates, with `size=` or `backing=`) the qcow2 image of `cfg`.
pub fn open(cfg: &ExportConfig) -> Result<Qcow2Engine, OpenError> {
    let path = cfg
        .path
        .as_deref()
        .expect("config checked: qcow2 has a path");
    Ok(open_path(path, cfg)?)
}

fn open_path(path: &Path, cfg: &ExportConfig) -> Result<Qcow2Engine, Qcow2Error> {
    if !path.exists() {
        if cfg.readonly {
            return Err(Qcow2Error::SizeNeeded(path.display().to_string()));
        }
        image::create(path, cfg.size, &cfg.qcow2)?;
    } else {
        image::check_backing(path, &cfg.qcow2)?;
    }
    let image = image::open(path, cfg.readonly, cfg.direct)?;
    let block_size = if cfg.direct {
        engine::uring::probe_direct_block_size(&image.file, image.access.size())
    } else {
        512
    };
    let cluster = 1u64 << image.cluster_bits;
    if cluster < u64::from(block_size) {
        return Err(Qcow2Error::ClusterBelowBlock {
            path: path.display().to_string(),
            cluster,
            block: block_size,
        });
    }
    let image = Arc::new(image);
    let (jobs, workers) = metadata::start_workers(
        &image,
        worker_count(cfg.num_threads()),
        &format!("qcow2-{}", cfg.id),
    )
    .map_err(|err| Qcow2Error::Io {
        what: "cannot start the metadata workers of",
        path: path.display().to_string(),
        err,
    })?;
    Ok(Qcow2Engine {
        image,
        jobs: Mutex::new(jobs),
        block_size,
        l2_cache_size: cfg.qcow2.l2_cache_size,
        writable: !cfg.readonly,
        _workers: workers,
    })
}

impl Engine for Qcow2Engine {
    fn name(&self) -> &'static str {
        "qcow2"
    }

    fn capacity(&self) -> u64 {
        self.image.access.size() & !511
    }

    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn channel(&self) -> io::Result<Box<dyn Channel>> {
        let clusters = self
            .image
            .access
            .size()
            .div_ceil(1 << self.image.cluster_bits);
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Ok(Box::new(Qcow2Channel {
            image: self.image.clone(),
            jobs,
            replies: Arc::new(Replies {
                done: Mutex::new(Vec::new()),
                event: eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?,
            }),
            cache: MappingCache::new(self.image.cluster_bits, clusters, self.l2_cache_size),
            epoch: self.image.epoch.load(std::sync::atomic::Ordering::Acquire),
            reaped: Vec::new(),
        }))
    }

    fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError> {
        let actual = self.image.access.size();
        match size {
            None => Err(ResizeError::SizeNeeded("qcow2")),
            Some(s) if s < actual => Err(ResizeError::Shrink { actual }),
            Some(s) => {
                self.image
                    .access
                    .resize_grow(s, imago::format::PreallocateMode::None)?;
                self.image.access.flush()?;
                self.image.access.sync()?;
                Ok(s)
            }
        }
    }

    fn sync_host_cache(&self) -> io::Result<()> {
        // Everything the next backend to open the image (after a migration) needs: data,
        // and the metadata imago holds in memory.
        rustix::fs::fdatasync(&self.image.file)?;
        self.image.access.flush()?;
        self.image.access.sync()
    }

    fn refresh(&self) -> io::Result<()> {
        // Our own metadata first (none is dirty unless this backend wrote since its last
        // flush, which a migration's switch-over includes), then everything imago caches
        // is dropped and the mutable header fields re-read.
        self.image.access.flush()?;
        // SAFETY: no request is in flight (the contract of `refresh`), so neither imago nor
        // any thread holds a mapping; the on-disk state is consistent (just flushed here, or
        // by the backend that changed it).
        unsafe { self.image.access.invalidate_cache() }?;
        metadata::invalidate(&self.image, 0, u64::MAX / 2);
        Ok(())
    }

    fn ring_opcodes(&self) -> &'static [u8] {
        engine::uring::RW_OPCODES
    }

    fn limits(&self) -> Limits {
        Limits {
            discard: self.writable,
            write_zeroes: self.writable,
            ..Limits::default()
        }
    }
}
