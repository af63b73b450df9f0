//! [`Report`]: what a [`run`](crate::run) counted, in all and per job, and [`FailedRequest`], the
//! first request of a run that failed.

use std::fmt;
use std::time::Duration;

use crate::connect::errno_name;
use crate::histogram::LatencyHistogram;
use crate::workload::Pattern;

/// A request of a run that completed with an error ([`Report::first_error`] keeps the
/// first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedRequest {
    /// Job index.
    pub job: usize,
    /// Whether it was a write (else a read).
    pub write: bool,
    /// Disk offset of the request.
    pub offset: u64,
    /// Positive errno, as for [`RequestError::Failed`](crate::RequestError::Failed).
    pub errno: i32,
}

impl fmt::Display for FailedRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "job {}: {} at offset {} failed: {}",
            self.job,
            if self.write { "write" } else { "read" },
            self.offset,
            errno_name(self.errno)
        )
    }
}

/// Per-job results.
#[derive(Clone, Debug)]
pub struct JobReport {
    /// Job index.
    pub job: usize,
    /// The queue the job submitted on.
    pub queue: usize,
    /// The job's region `(offset, len)`.
    pub region: (u64, u64),
    /// Completed requests.
    pub ios: u64,
    /// Bytes moved by successful requests.
    pub bytes: u64,
    /// Requests that completed with an error.
    pub errors: u64,
    /// Bytes written by the Verify write phase, from the start of the region (what the read
    /// phase then checks).
    pub pattern_bytes: u64,
    /// Blocks read back that differ from the pattern.
    pub mismatches: u64,
}

/// Results of [`run`](crate::run).
#[derive(Clone, Debug)]
pub struct Report {
    /// The workload's pattern.
    pub pattern: Pattern,
    /// The workload's block size.
    pub block_size: usize,
    /// Completed requests (successful or not), reads plus writes.
    pub ios: u64,
    /// Completed reads.
    pub reads: u64,
    /// Completed writes.
    pub writes: u64,
    /// Bytes moved by successful requests.
    pub bytes: u64,
    /// From the moment all jobs start until the last one finishes.
    pub elapsed: Duration,
    /// Requests that completed with an error.
    pub errors: u64,
    /// The first request that failed.
    pub first_error: Option<FailedRequest>,
    /// Bytes read back and found as written (Verify, Check).
    pub verified_bytes: u64,
    /// Blocks read back that differ from the pattern (Verify, Check).
    pub mismatches: u64,
    /// Disk offset of the first differing 8-byte word.
    pub first_mismatch: Option<u64>,
    /// Submission-to-completion latency of every request.
    pub latency: LatencyHistogram,
    /// Median latency in microseconds.
    pub p50_us: f64,
    /// 99th percentile latency in microseconds.
    pub p99_us: f64,
    /// 99.9th percentile latency in microseconds.
    pub p999_us: f64,
    /// Per-job results, by job index.
    pub jobs: Vec<JobReport>,
    /// Whether the connection was read-only.
    pub read_only: bool,
}

impl Report {
    /// Completed requests per second.
    pub fn iops(&self) -> f64 {
        per_sec(self.ios as f64, self.elapsed)
    }

    /// Throughput in MB/s (10^6 bytes).
    pub fn mb_per_s(&self) -> f64 {
        per_sec(self.bytes as f64, self.elapsed) / 1e6
    }

    /// True if no request failed and nothing read back differed.
    pub fn clean(&self) -> bool {
        self.errors == 0 && self.mismatches == 0
    }
}

fn per_sec(x: f64, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 {
        x / s
    } else {
        0.0
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bs={}: {} ios ({} reads, {} writes) in {:.3} s: {:.0} IOPS, {:.1} MB/s, \
             latency p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us; {} errors",
            self.pattern,
            self.block_size,
            self.ios,
            self.reads,
            self.writes,
            self.elapsed.as_secs_f64(),
            self.iops(),
            self.mb_per_s(),
            self.p50_us,
            self.p99_us,
            self.p999_us,
            self.errors
        )?;
        if matches!(self.pattern, Pattern::Verify | Pattern::Check) {
            write!(
                f,
                ", {} bytes verified, {} mismatches",
                self.verified_bytes, self.mismatches
            )?;
        }
        if let Some(e) = &self.first_error {
            write!(f, " (first error: {e})")?;
        }
        if let Some(m) = self.first_mismatch {
            write!(f, " (first mismatch at offset {m})")?;
        }
        Ok(())
    }
}

/// What one job counted while it ran; [`Report::from_jobs`] adds them up.
#[derive(Default)]
pub(crate) struct JobCounts {
    pub(crate) ios: u64,
    pub(crate) reads: u64,
    pub(crate) writes: u64,
    pub(crate) bytes: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<FailedRequest>,
    pub(crate) verified_bytes: u64,
    pub(crate) mismatches: u64,
    pub(crate) first_mismatch: Option<u64>,
    pub(crate) latency: LatencyHistogram,
}

impl Report {
    /// The report of a run of `pattern` requests of `block_size` bytes that took `elapsed`:
    /// each job's place and what it counted, in the order the first error and mismatch are
    /// taken from.
    pub(crate) fn from_jobs(
        pattern: Pattern,
        block_size: usize,
        read_only: bool,
        elapsed: Duration,
        jobs: impl IntoIterator<Item = (JobReport, JobCounts)>,
    ) -> Report {
        let mut r = Report {
            pattern,
            block_size,
            ios: 0,
            reads: 0,
            writes: 0,
            bytes: 0,
            elapsed,
            errors: 0,
            first_error: None,
            verified_bytes: 0,
            mismatches: 0,
            first_mismatch: None,
            latency: LatencyHistogram::new(),
            p50_us: 0.0,
            p99_us: 0.0,
            p999_us: 0.0,
            jobs: Vec::new(),
            read_only,
        };
        for (job, c) in jobs {
            r.ios += c.ios;
            r.reads += c.reads;
            r.writes += c.writes;
            r.bytes += c.bytes;
            r.errors += c.errors;
            r.first_error = r.first_error.or(c.first_error);
            r.verified_bytes += c.verified_bytes;
            r.mismatches += c.mismatches;
            r.first_mismatch = r.first_mismatch.or(c.first_mismatch);
            r.latency.merge(&c.latency);
            r.jobs.push(job);
        }
        r.jobs.sort_by_key(|j| j.job);
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        r.p50_us = us(r.latency.percentile(0.50));
        r.p99_us = us(r.latency.percentile(0.99));
        r.p999_us = us(r.latency.percentile(0.999));
        r
    }
}
