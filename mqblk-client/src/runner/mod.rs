//! [`run`]: a [`Workload`] on one connection (libblkio's or mqblk's own frontend's, by
//! [`Workload::driver`]), one thread per queue, all starting together, and the [`Report`] of
//! what they counted.

mod job;
mod queue;
mod request_queue;

use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::Context;

use self::job::Job;
use self::queue::{QueueWork, Slot};
use self::request_queue::{BlkioQueue, RequestQueue};
use crate::connect::{map_buffer, open, ConnectOptions};
use crate::data_pattern::fill_pattern;
use crate::frontend::FrontendConnection;
use crate::report::Report;
use crate::workload::{Driver, Workload};

/// Largest queue size asked for by default: libvhost-user (qemu-storage-daemon) and mqblk's
/// default both accept 1024 but not more.
const MAX_DEFAULT_QUEUE_SIZE: u32 = 1024;

/// Descriptors libblkio uses per request.
const DESCRIPTORS_PER_REQUEST: usize = 3;

/// Runs the workload on one connection and reports the results.
///
/// Fails if the connection or a wait for completions fails; requests that complete with an error
/// are counted in [`Report::errors`] instead.
pub fn run(w: &Workload) -> anyhow::Result<Report> {
    w.validate()?;
    match w.driver {
        Driver::Libblkio => run_libblkio(w),
        Driver::Frontend => run_frontend(w),
    }
}

fn run_libblkio(w: &Workload) -> anyhow::Result<Report> {
    let mut conn = open(&w.socket, &connect_options(w))
        .with_context(|| format!("connecting to {}", w.socket.display()))?;
    let regions = w.job_regions(conn.capacity()?)?;
    let mem = map_buffer(&mut conn.blkio, w.jobs * w.iodepth * w.block_size)?;
    // Queues without jobs stay in `conn` until the end, as every queue does while it runs.
    let used = conn.queues.len().min(w.jobs);
    let queues = conn.queues.drain(..used).enumerate().map(|(q, queue)| {
        let slots = jobs_of_queue(w, q).count() * w.iodepth;
        BlkioQueue::new(queue, slots)
    });
    let work = plan(w, queues, &regions, mem.addr as *mut u8);
    let report = report(w, conn.read_only, drive(w, work)?);
    // Queues are dropped by the threads; `conn` (and with it the buffer region) goes last.
    drop(conn);
    Ok(report)
}

fn run_frontend(w: &Workload) -> anyhow::Result<Report> {
    let options = connect_options(w);
    let queue_size = options.queue_size.expect("connect_options sets it") as u16;
    let busiest = jobs_of_queue(w, 0).count() * w.iodepth;
    let mut conn = FrontendConnection::open(
        &w.socket,
        w.num_queues,
        queue_size,
        busiest,
        w.jobs * w.iodepth * w.block_size,
        w.poll,
        w.pattern.writes(),
    )
    .with_context(|| format!("connecting to {} (mqblk's frontend)", w.socket.display()))?;
    let regions = w.job_regions(conn.capacity)?;
    let used = conn.queues.len().min(w.jobs);
    let base = conn.data_area();
    let work = plan(w, conn.queues.drain(..used), &regions, base);
    let report = report(w, conn.read_only, drive(w, work)?);
    drop(conn);
    Ok(report)
}

fn report(w: &Workload, read_only: bool, (elapsed, jobs): (Duration, Vec<Job>)) -> Report {
    Report::from_jobs(
        w.pattern,
        w.block_size,
        read_only,
        elapsed,
        jobs.into_iter().map(|j| j.into_report(w.block_size)),
    )
}

/// The jobs queue `q` serves: job `j` submits on queue `j % num_queues`.
fn jobs_of_queue(w: &Workload, q: usize) -> impl Iterator<Item = usize> {
    (q..w.jobs).step_by(w.num_queues)
}

/// Read patterns connect read-only, so that they work on read-only devices too. The queue size,
/// unless the workload sets one, holds the busiest queue's requests (queue 0's).
fn connect_options(w: &Workload) -> ConnectOptions {
    let busiest = jobs_of_queue(w, 0).count() * w.iodepth;
    let queue_size = w.queue_size.unwrap_or_else(|| {
        ((busiest * DESCRIPTORS_PER_REQUEST).next_power_of_two() as u32)
            .clamp(256, MAX_DEFAULT_QUEUE_SIZE)
    });
    ConnectOptions {
        num_queues: w.num_queues,
        queue_size: Some(queue_size),
        poll: w.poll,
        read_only: Some(!w.pattern.writes()),
    }
}

/// Builds each queue's jobs and request slots up front, so that nothing is allocated while
/// running. `base` is the buffer region: `jobs * iodepth` slots of `block_size` bytes.
fn plan<Q: RequestQueue>(
    w: &Workload,
    queues: impl Iterator<Item = Q>,
    regions: &[(u64, u64)],
    base: *mut u8,
) -> Vec<QueueWork<Q>> {
    let bs = w.block_size;
    let mut next_slot = 0usize;
    let mut work = Vec::new();
    for (q, queue) in queues.enumerate() {
        let mut jobs = Vec::new();
        let mut slots = Vec::with_capacity(jobs_of_queue(w, q).count() * w.iodepth);
        for (local, j) in jobs_of_queue(w, q).enumerate() {
            let mut free = Vec::with_capacity(w.iodepth);
            for _ in 0..w.iodepth {
                free.push(slots.len() as u32);
                // SAFETY: next_slot < jobs * iodepth, so the buffer lies inside the region.
                let buf = unsafe { base.add(next_slot * bs) };
                next_slot += 1;
                if w.pattern.writes() {
                    // Non-trivial data for plain writes; Verify refills per request.
                    // SAFETY: as above, `bs` bytes inside the region, not in use yet.
                    fill_pattern(
                        unsafe { std::slice::from_raw_parts_mut(buf, bs) },
                        next_slot as u64 * 8,
                        w.seed,
                    );
                }
                slots.push(Slot {
                    buf,
                    job: local as u32,
                    write: false,
                    offset: 0,
                    issued_at: Instant::now(),
                });
            }
            free.reverse();
            jobs.push(Job::new(j, q, regions[j], w, free));
        }
        work.push(QueueWork { queue, jobs, slots });
    }
    work
}

/// Drives each queue on a thread of its own, all released at once. Returns the time from that
/// start until the last thread finished, and every job, in queue order.
fn drive<Q: RequestQueue>(
    w: &Workload,
    work: Vec<QueueWork<Q>>,
) -> anyhow::Result<(Duration, Vec<Job>)> {
    let barrier = Barrier::new(work.len() + 1);
    let (start, results) = std::thread::scope(|s| {
        let handles: Vec<_> = work
            .into_iter()
            .map(|qw| {
                let barrier = &barrier;
                std::thread::Builder::new()
                    .name(format!("mqblk-client-q{}", qw.jobs[0].queue))
                    .spawn_scoped(s, move || {
                        barrier.wait();
                        let start = Instant::now();
                        let r = qw.drive(w, start);
                        (r, Instant::now())
                    })
                    .expect("spawning a client thread")
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let results: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        (start, results)
    });
    let mut elapsed = Duration::ZERO;
    let mut jobs = Vec::with_capacity(w.jobs);
    for (r, end) in results {
        let (_queue, queue_jobs) = r?;
        elapsed = elapsed.max(end.saturating_duration_since(start));
        jobs.extend(queue_jobs);
    }
    Ok((elapsed, jobs))
}
