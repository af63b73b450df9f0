//! What [`run`](crate::run) does: the [`Pattern`] each job follows and the [`Workload`] (queues,
//! jobs, depth, block size, how long, where on the disk).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, ensure};

/// What each job does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Random block-aligned reads in the job's region.
    RandRead,
    /// Random block-aligned writes in the job's region.
    RandWrite,
    /// Sequential reads through the job's region, wrapping around.
    SeqRead,
    /// Sequential writes through the job's region, wrapping around.
    SeqWrite,
    /// Write the seeded pattern to the job's region sequentially, then read it back and compare.
    Verify,
    /// Read the job's region and compare with the seeded pattern, without writing: checks data
    /// left by an earlier `Verify` run with the same seed, region, jobs and block size.
    Check,
}

impl Pattern {
    /// Whether the pattern writes (and so needs a writable device).
    pub fn writes(self) -> bool {
        matches!(
            self,
            Pattern::RandWrite | Pattern::SeqWrite | Pattern::Verify
        )
    }

    /// The name used on the command line (what [`FromStr`] accepts).
    pub fn name(self) -> &'static str {
        match self {
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::SeqRead => "read",
            Pattern::SeqWrite => "write",
            Pattern::Verify => "verify",
            Pattern::Check => "check",
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Pattern {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        Ok(match s {
            "randread" => Pattern::RandRead,
            "randwrite" => Pattern::RandWrite,
            "read" | "seqread" => Pattern::SeqRead,
            "write" | "seqwrite" => Pattern::SeqWrite,
            "verify" => Pattern::Verify,
            "check" => Pattern::Check,
            _ => bail!("unknown pattern {s:?} (randread, randwrite, read, write, verify, check)"),
        })
    }
}

/// The vhost-user frontend a [`run`](crate::run) drives the device with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Driver {
    /// libblkio's `virtio-blk-vhost-user` driver (what fio's libblkio engine uses).
    #[default]
    Libblkio,
    /// mqblk's own frontend (`frontend/`): memory shared with SET_MEM_TABLE, so that backends
    /// without CONFIGURE_MEM_SLOTS, such as SPDK's vhost target, can be driven.
    Frontend,
}

impl Driver {
    /// The name used on the command line (what [`FromStr`] accepts).
    pub fn name(self) -> &'static str {
        match self {
            Driver::Libblkio => "libblkio",
            Driver::Frontend => "frontend",
        }
    }
}

impl FromStr for Driver {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        Ok(match s {
            "libblkio" => Driver::Libblkio,
            "frontend" => Driver::Frontend,
            _ => bail!("unknown client {s:?} (libblkio, frontend)"),
        })
    }
}

/// A workload for [`run`](crate::run).
///
/// Jobs: job `i` submits on queue `i % num_queues`; each queue that has jobs is driven by one
/// thread (so with `jobs == num_queues` it is one thread and one queue per job). Each job owns
/// `1/jobs` of the region, so writers never overlap.
///
/// Stop condition per job: `ops_per_job` I/Os issued, or `runtime` elapsed, whichever comes first;
/// with neither, one pass over the job's region. `Verify` writes up to that many blocks
/// sequentially (never more than the region holds), then reads back and checks everything it
/// wrote; `runtime` bounds only its write phase.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The vhost-user-blk socket to connect to.
    pub socket: PathBuf,
    /// The frontend that drives it.
    pub driver: Driver,
    /// Virtqueues to set up.
    pub num_queues: usize,
    /// Virtqueue size; `None`: big enough for each queue's requests (3 descriptors each), at
    /// least 256 and at most 1024.
    pub queue_size: Option<u32>,
    /// Busy-poll for completions instead of waiting on the call eventfd.
    pub poll: bool,
    /// Number of jobs.
    pub jobs: usize,
    /// Requests in flight per job.
    pub iodepth: usize,
    /// Bytes per request; a multiple of 512.
    pub block_size: usize,
    /// What the jobs do.
    pub pattern: Pattern,
    /// Stop issuing requests after this long.
    pub runtime: Option<Duration>,
    /// Stop each job after this many requests.
    pub ops_per_job: Option<u64>,
    /// `(offset, len)` in bytes of the part of the disk to use; `None`: the whole disk.
    pub region: Option<(u64, u64)>,
    /// Seeds the data pattern and the random offsets.
    pub seed: u64,
    /// Longest wait for any completion before the run fails.
    pub io_timeout: Duration,
}

impl Workload {
    /// One queue, one job, iodepth 1, 4 KiB random reads over the whole disk, one pass.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            driver: Driver::Libblkio,
            num_queues: 1,
            queue_size: None,
            poll: false,
            jobs: 1,
            iodepth: 1,
            block_size: 4096,
            pattern: Pattern::RandRead,
            runtime: None,
            ops_per_job: None,
            region: None,
            seed: 0x006d_7162_6c6b, // "mqblk"
            io_timeout: Duration::from_secs(30),
        }
    }

    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        ensure!(self.num_queues >= 1, "num_queues must be at least 1");
        ensure!(self.jobs >= 1, "jobs must be at least 1");
        ensure!(self.iodepth >= 1, "iodepth must be at least 1");
        ensure!(
            self.block_size >= 512 && self.block_size.is_multiple_of(512),
            "block size must be a positive multiple of 512, not {}",
            self.block_size
        );
        if let Some(qs) = self.queue_size {
            ensure!(
                qs.is_power_of_two(),
                "queue size must be a power of two, not {qs}"
            );
        }
        if let Some((off, len)) = self.region {
            ensure!(
                off.is_multiple_of(512),
                "region offset {off} is not a multiple of 512"
            );
            ensure!(len > 0, "region is empty");
        }
        Ok(())
    }

    /// Each job's `(offset, len)` on a disk of `capacity` bytes: [`Workload::region`] (the whole
    /// disk if unset) split by [`job_regions`].
    pub(crate) fn job_regions(&self, capacity: u64) -> anyhow::Result<Vec<(u64, u64)>> {
        let (roff, rlen) = self.region.unwrap_or((0, capacity));
        ensure!(
            roff.checked_add(rlen).is_some_and(|end| end <= capacity),
            "region {roff}+{rlen} exceeds the disk ({capacity} bytes)"
        );
        job_regions(roff, rlen, self.jobs, self.block_size)
    }

    /// Requests a job issues in its main phase over a region of `nblocks` blocks, by the stop
    /// conditions above (`u64::MAX`: until the runtime is up).
    pub(crate) fn requests_per_job(&self, nblocks: u64) -> u64 {
        match (self.pattern, self.ops_per_job, self.runtime) {
            (Pattern::Verify | Pattern::Check, Some(n), _) => n.min(nblocks),
            (Pattern::Verify, None, Some(_)) => nblocks,
            (_, Some(n), _) => n,
            (_, None, Some(_)) => u64::MAX,
            (_, None, None) => nblocks,
        }
    }
}

/// Splits `len` bytes starting at `offset` evenly into `jobs` block-aligned regions
/// `(offset, len)`, the way [`run`](crate::run) assigns them to jobs. The tail that does not divide evenly is
/// left unused.
pub fn job_regions(
    offset: u64,
    len: u64,
    jobs: usize,
    block_size: usize,
) -> anyhow::Result<Vec<(u64, u64)>> {
    ensure!(jobs > 0, "jobs must be at least 1");
    let bs = block_size as u64;
    let per = len / jobs as u64 / bs * bs;
    ensure!(
        per > 0,
        "region of {len} bytes is too small for {jobs} jobs of {block_size}-byte blocks"
    );
    Ok((0..jobs as u64).map(|i| (offset + i * per, per)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_regions_split_evenly_and_aligned() {
        let r = job_regions(4096, 10 * 4096 + 100, 3, 4096).unwrap();
        assert_eq!(
            r,
            vec![(4096, 3 * 4096), (4 * 4096, 3 * 4096), (7 * 4096, 3 * 4096)]
        );
        assert!(job_regions(0, 4096, 2, 4096).is_err());
        assert!(job_regions(0, 4096, 0, 4096).is_err());
    }

    #[test]
    fn pattern_names_round_trip() {
        for p in [
            Pattern::RandRead,
            Pattern::RandWrite,
            Pattern::SeqRead,
            Pattern::SeqWrite,
            Pattern::Verify,
            Pattern::Check,
        ] {
            assert_eq!(p.name().parse::<Pattern>().unwrap(), p);
        }
        assert!("bogus".parse::<Pattern>().is_err());
    }
}
