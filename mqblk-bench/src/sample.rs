//! What one run of one point measured: [`Sample`], with [`MqblkCounters`], mqblk's own
//! counters and the ratios drawn from them.

use serde::Serialize;

use mqblk::engine::qcow2::MetadataCounters;
use mqblk::io::IoCounters;

/// mqblk's own counters for one sample (from `mqblk serve --stats-file`, its exports
/// summed), and the ratios the report shows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MqblkCounters {
    /// I/O threads.
    pub threads: u64,
    /// The I/O threads' counters (the daemon's one definition of them).
    #[serde(flatten)]
    pub counters: IoCounters,
    /// submitted / submits.
    pub reqs_per_submit: Option<f64>,
    /// merges / requests.
    pub merges_per_io: Option<f64>,
    /// notifies / requests.
    pub notifies_per_io: Option<f64>,
    /// kicks / requests.
    pub kicks_per_io: Option<f64>,
    /// (enters + early_notifies + alone_notifies) / requests: the I/O threads' syscalls per
    /// I/O (io_uring_enter, and the write(2) of each notification not sent through the ring).
    pub enters_per_io: Option<f64>,
    /// Mean requests in flight at the engine while the client ran (all I/O threads): how
    /// full the backend kept the device, to compare with jobs × iodepth.
    pub in_flight: Option<f64>,
    /// A qcow2 image's metadata-path counters (the daemon's one definition of them).
    pub metadata: Option<MetadataCounters>,
    /// qcow2: metadata-path requests / requests (what the I/O threads' caches could not serve).
    pub metadata_per_io: Option<f64>,
    /// qcow2: mean µs per write-back of the image's tables (a group commit's wait).
    pub write_back_us: Option<f64>,
    /// qcow2: mean µs per sync of the image file.
    pub sync_us: Option<f64>,
}

impl MqblkCounters {
    /// The counters of `threads` I/O threads (and of a qcow2 image's metadata path, if it
    /// served one), with the ratios.
    pub fn new(threads: u64, c: IoCounters, metadata: Option<MetadataCounters>) -> Self {
        let per = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
        let m = metadata.unwrap_or_default();
        MqblkCounters {
            metadata,
            metadata_per_io: metadata.and_then(|m| per(m.requests, c.requests)),
            write_back_us: per(m.write_back_ns, m.write_backs * 1000),
            sync_us: per(m.sync_ns, m.syncs * 1000),
            threads,
            reqs_per_submit: per(c.submitted, c.submits),
            merges_per_io: per(c.merges, c.requests),
            notifies_per_io: per(c.notifies, c.requests),
            kicks_per_io: per(c.kicks, c.requests),
            enters_per_io: per(c.enters + c.early_notifies + c.alone_notifies, c.requests),
            in_flight: None,
            counters: c,
        }
    }

    /// Sets `in_flight` from the counters, for a client that ran `elapsed_s`.
    pub fn with_elapsed(mut self, elapsed_s: f64) -> Self {
        self.in_flight =
            (elapsed_s > 0.0).then(|| self.counters.engine_in_flight_ns as f64 / (elapsed_s * 1e9));
        self
    }
}

/// One run of one point.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sample {
    /// Which repeat (0-based).
    pub repeat: usize,
    /// Why it failed, if it did (the numbers are then zero).
    pub error: Option<String>,
    /// Requests completed.
    pub ios: u64,
    /// Seconds the client ran.
    pub elapsed_s: f64,
    /// Requests per second.
    pub iops: f64,
    /// 10^6 bytes per second.
    pub mb_per_s: f64,
    /// Median latency, µs (issue to completion as the client sees it).
    pub p50_us: f64,
    /// 99th percentile latency, µs.
    pub p99_us: f64,
    /// 99.9th percentile latency, µs.
    pub p999_us: f64,
    /// Backend process CPU (user + system) during the run, s (from /proc/PID/stat).
    pub backend_cpu_s: Option<f64>,
    /// Client CPU during the run, s (this process; for native fio: fio's).
    pub client_cpu_s: Option<f64>,
    /// Backend CPU seconds per million I/Os.
    pub backend_cpu_s_per_mio: Option<f64>,
    /// Backend + client CPU seconds per million I/Os.
    pub total_cpu_s_per_mio: Option<f64>,
    /// CPU used by other processes on the machine during the run, % of all CPUs (from
    /// /proc/stat): a noise indicator.
    pub others_cpu_pct: Option<f64>,
    /// Backend's peak resident set (VmHWM), KiB.
    pub peak_rss_kib: Option<u64>,
    /// Backend's largest RssAnon seen during the run (sampled every 50 ms), KiB.
    pub rss_anon_kib: Option<u64>,
    /// mqblk's counters.
    pub mqblk: Option<MqblkCounters>,
}

impl Sample {
    /// A sample of repeat `repeat` that failed with `error` (its numbers are zero).
    pub fn failed(repeat: usize, error: String) -> Sample {
        Sample {
            repeat,
            error: Some(error),
            ..Sample::default()
        }
    }

    #[cfg(test)]
    /// A successful sample of 1000 requests at `iops`, 4 KiB each, that cost the backend `cpu` s
    /// per million I/Os.
    pub(crate) fn test(iops: f64, cpu: f64) -> Sample {
        Sample {
            ios: 1000,
            iops,
            mb_per_s: iops * 4096.0 / 1e6,
            backend_cpu_s_per_mio: Some(cpu),
            ..Sample::default()
        }
    }

    #[cfg(test)]
    /// [`Sample::test`] as the sample of repeat `repeat`.
    pub(crate) fn test_at(repeat: usize, iops: f64, cpu: f64) -> Sample {
        Sample {
            repeat,
            ..Sample::test(iops, cpu)
        }
    }
}
