//! The QoS buckets: QEMU's throttling semantics (its `util/throttle.c`), as a pure type on a
//! clock the caller passes in.
//!
//! Each of the six limits (iops and bytes; total, read, write) is a leaky bucket. A request
//! that is let through pours its units into the buckets of its direction and of the totals;
//! each bucket leaks at its average rate. A request may go while every bucket it concerns
//! has room:
//!
//! - the bucket holds up to `max * burst_length` units, where `max` is the burst rate, or a
//!   tenth of the average when no burst rate is set (so that short bursts, e.g. a guest's
//!   scheduler alternating reads and writes every 100 ms, are not cut into single requests);
//! - with a burst longer than a second, a second level leaks at the burst rate and holds up
//!   to a tenth of a second's worth of it, so that the burst runs at `max` units per second
//!   rather than all at once.
//!
//! So from idle a guest gets `max * burst_length` units above the average (spent at `max` per
//! second), and then exactly the average. A full bucket makes the request wait until enough
//! has leaked: `extra / rate`. With `iops_size`, a request larger than that counts as
//! `len / iops_size` requests in the iops buckets.

use crate::config::qos::{Bucket, Limit, QosConfig};

const NS_PER_SEC: f64 = 1e9;

/// A request's direction, as the limits see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Reads.
    Read,
    /// Writes (and write-zeroes).
    Write,
}

/// One limit's bucket.
#[derive(Debug, Clone, Copy, Default)]
struct LeakyBucket {
    /// Units per second leaked (the average rate); 0: no limit.
    avg: f64,
    /// Burst rate, or a tenth of `avg` without one.
    max: f64,
    /// Seconds a burst at `max` may last.
    burst_length: f64,
    /// Units poured and not yet leaked at `avg`.
    level: f64,
    /// Units poured and not yet leaked at `max` (only with `burst_length > 1`).
    burst_level: f64,
}

impl LeakyBucket {
    fn new(l: &Limit) -> Self {
        let avg = l.rate as f64;
        LeakyBucket {
            avg,
            max: if l.max > 0 { l.max as f64 } else { avg / 10.0 },
            burst_length: l.max_length.max(1) as f64,
            level: 0.0,
            burst_level: 0.0,
        }
    }

    fn bursts(&self) -> bool {
        self.burst_length > 1.0
    }

    fn leak(&mut self, dt_ns: f64) {
        self.level = (self.level - self.avg * dt_ns / NS_PER_SEC).max(0.0);
        if self.bursts() {
            self.burst_level = (self.burst_level - self.max * dt_ns / NS_PER_SEC).max(0.0);
        }
    }

    fn pour(&mut self, units: f64) {
        self.level += units;
        if self.bursts() {
            self.burst_level += units;
        }
    }

    /// Nanoseconds until this bucket lets a request through (0: now).
    fn wait_ns(&self) -> u64 {
        if self.avg == 0.0 {
            return 0;
        }
        let extra = self.level - self.max * self.burst_length;
        if extra > 0.0 {
            return (extra * NS_PER_SEC / self.avg) as u64;
        }
        if self.bursts() {
            let extra = self.burst_level - self.max / 10.0;
            if extra > 0.0 {
                return (extra * NS_PER_SEC / self.max) as u64;
            }
        }
        0
    }
}

/// Index of a limit's bucket in [`Buckets`].
fn index(b: Bucket) -> usize {
    Bucket::ALL
        .iter()
        .position(|&x| x == b)
        .expect("every bucket is listed")
}

/// The buckets a request of `dir` concerns: `(iops buckets, bytes buckets)`.
fn concerned(dir: Dir) -> ([usize; 2], [usize; 2]) {
    match dir {
        Dir::Read => (
            [index(Bucket::IopsTotal), index(Bucket::IopsRead)],
            [index(Bucket::BpsTotal), index(Bucket::BpsRead)],
        ),
        Dir::Write => (
            [index(Bucket::IopsTotal), index(Bucket::IopsWrite)],
            [index(Bucket::BpsTotal), index(Bucket::BpsWrite)],
        ),
    }
}

/// The six buckets of an export (or of a throttle group), on a nanosecond clock.
#[derive(Debug, Clone)]
pub struct Buckets {
    buckets: [LeakyBucket; 6],
    iops_size: u64,
    /// When the buckets last leaked.
    last_ns: u64,
}

impl Buckets {
    /// Empty buckets for `cfg`, at time `now_ns`.
    pub fn new(cfg: &QosConfig, now_ns: u64) -> Self {
        Buckets {
            buckets: cfg.limits().map(|l| LeakyBucket::new(&l)),
            iops_size: cfg.iops_size,
            last_ns: now_ns,
        }
    }

    /// Leaks what the time since the last call lets out (a clock that went back leaks
    /// nothing).
    fn leak(&mut self, now_ns: u64) {
        let dt = now_ns.saturating_sub(self.last_ns);
        self.last_ns = self.last_ns.max(now_ns);
        if dt > 0 {
            for b in &mut self.buckets {
                b.leak(dt as f64);
            }
        }
    }

    /// Nanoseconds a request of `dir` must wait at `now_ns` (0: it may go now): the longest
    /// wait of the buckets it concerns.
    pub fn wait_ns(&mut self, dir: Dir, now_ns: u64) -> u64 {
        self.leak(now_ns);
        let (ops, bytes) = concerned(dir);
        ops.iter()
            .chain(&bytes)
            .map(|&i| self.buckets[i].wait_ns())
            .max()
            .unwrap_or(0)
    }

    /// Pours a request of `dir` and `bytes` into its buckets: it is let through.
    pub fn account(&mut self, dir: Dir, bytes: u64) {
        let units = if self.iops_size > 0 && bytes > self.iops_size {
            bytes as f64 / self.iops_size as f64
        } else {
            1.0
        };
        let (ops, byte_buckets) = concerned(dir);
        for i in ops {
            self.buckets[i].pour(units);
        }
        for i in byte_buckets {
            self.buckets[i].pour(bytes as f64);
        }
    }

    /// Lets a request through (and accounts it) if it may go at `now_ns`; else how many
    /// nanoseconds it must wait. (The throttle does this itself, taking turns.)
    #[cfg(test)]
    pub fn admit(&mut self, dir: Dir, bytes: u64, now_ns: u64) -> Result<(), u64> {
        match self.wait_ns(dir, now_ns) {
            0 => {
                self.account(dir, bytes);
                Ok(())
            }
            wait => Err(wait),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn cfg(f: impl FnOnce(&mut QosConfig)) -> QosConfig {
        let mut q = QosConfig::default();
        f(&mut q);
        q.check().unwrap();
        q
    }

    /// A client that always has another request of `dir` and `bytes` ready: returns the
    /// times (ns) at which requests were let through until `until_ns`, waiting exactly as
    /// long as the buckets ask (the I/O thread's timer).
    fn drive(b: &mut Buckets, dir: Dir, bytes: u64, until_ns: u64) -> Vec<u64> {
        let mut now = 0;
        let mut out = Vec::new();
        while now < until_ns {
            match b.admit(dir, bytes, now) {
                Ok(()) => out.push(now),
                Err(wait) => now += wait.max(1),
            }
        }
        out
    }

    /// Buckets of 100 IOPS with bursts at 1000 IOPS for `max_length` seconds.
    fn iops_burst(max_length: u64) -> Buckets {
        let limit = Limit {
            rate: 100,
            max: 1000,
            max_length,
        };
        Buckets::new(&cfg(|q| q.iops_total = limit), 0)
    }

    fn count_until(times: &[u64], t: u64) -> usize {
        times.iter().filter(|&&x| x < t).count()
    }

    #[test]
    fn a_rate_is_kept_after_a_tenth_of_a_second_s_worth() {
        let mut b = Buckets::new(&cfg(|q| q.iops_total.rate = 1000), 0);
        let t = drive(&mut b, Dir::Read, 4096, 10 * SEC);
        // 10 s at 1000/s, plus the bucket's 100 at once.
        assert!((10_099..=10_102).contains(&t.len()), "{}", t.len());
        assert_eq!(
            count_until(&t, 1),
            101,
            "a tenth of a second's worth at once"
        );
        // Then evenly: 1 ms apart.
        let gaps: Vec<u64> = t[200..210].windows(2).map(|w| w[1] - w[0]).collect();
        assert!(
            gaps.iter().all(|&g| (999_000..=1_001_000).contains(&g)),
            "{gaps:?}"
        );
    }

    #[test]
    fn a_burst_runs_at_its_rate_for_its_length_then_the_average() {
        let t = drive(&mut iops_burst(10), Dir::Write, 4096, 40 * SEC);
        // At 1000/s (plus a tenth of a second's worth at once), not all at once.
        let first = count_until(&t, SEC);
        assert!((1099..=1102).contains(&first), "{first}");
        let five = count_until(&t, 5 * SEC);
        assert!((5099..=5102).contains(&five), "{five}");
        // The bucket (1000 * 10) fills at 1000 - 100 per second: the burst ends after
        // 10000 / 900 s, having let 10000 more through than the average would.
        let total = t.len() as f64;
        let expected = 40.0 * 100.0 + 10_000.0;
        assert!((total - expected).abs() < 150.0, "{total} vs {expected}");
        // 100 per second for the last 10 s.
        let late = count_until(&t, 40 * SEC) - count_until(&t, 30 * SEC);
        assert!(
            (999..=1001).contains(&late),
            "the average after the burst: {late}"
        );
    }

    #[test]
    fn a_one_second_burst_comes_at_once() {
        let t = drive(&mut iops_burst(1), Dir::Read, 512, 2 * SEC);
        assert_eq!(
            count_until(&t, 1),
            1001,
            "QEMU: no burst rate with a length of 1"
        );
    }

    #[test]
    fn directions_have_their_own_limits_and_share_the_totals() {
        let mut b = Buckets::new(&cfg(|q| q.iops_read.rate = 100), 0);
        for _ in 0..10_000 {
            assert!(
                b.admit(Dir::Write, 4096, 0).is_ok(),
                "writes are not limited"
            );
        }
        let mut b = Buckets::new(&cfg(|q| q.iops_read.rate = 100), 0);
        let t = drive(&mut b, Dir::Read, 4096, 10 * SEC);
        assert!((1009..=1012).contains(&t.len()), "{}", t.len());
        // A total limit counts both directions.
        let mut b = Buckets::new(&cfg(|q| q.iops_total.rate = 100), 0);
        for _ in 0..10 {
            b.admit(Dir::Write, 4096, 0).unwrap();
        }
        assert!(
            b.admit(Dir::Read, 4096, 0).is_ok(),
            "exactly full is not over"
        );
        assert!(b.wait_ns(Dir::Read, 0) > 0);
        assert!(b.wait_ns(Dir::Write, 0) > 0);
    }

    #[test]
    fn bytes_and_iops_size() {
        // 1 MiB/s in 64 KiB requests: 16 per second.
        let mut b = Buckets::new(&cfg(|q| q.bps_total.rate = 1 << 20), 0);
        let t = drive(&mut b, Dir::Write, 64 << 10, 10 * SEC);
        assert!((161..=163).contains(&t.len()), "{}", t.len());
        // 100 IOPS where a 16 KiB request counts as 4: 25 per second.
        let sized = || {
            Buckets::new(
                &cfg(|q| {
                    q.iops_total.rate = 100;
                    q.iops_size = 4096;
                }),
                0,
            )
        };
        let t = drive(&mut sized(), Dir::Read, 16 << 10, 10 * SEC);
        assert!((251..=254).contains(&t.len()), "{}", t.len());
        // Smaller requests count as one.
        let t = drive(&mut sized(), Dir::Read, 512, 10 * SEC);
        assert!((1009..=1012).contains(&t.len()), "{}", t.len());
    }

    #[test]
    fn the_wait_is_the_time_to_leak_the_excess() {
        let mut b = Buckets::new(&cfg(|q| q.iops_total.rate = 1000), 0);
        for _ in 0..101 {
            b.admit(Dir::Read, 512, 0).unwrap();
        }
        // 101 in a bucket of 100 leaking 1000/s: 1 ms.
        assert_eq!(b.wait_ns(Dir::Read, 0), 1_000_000);
        assert!((599_990..=600_000).contains(&b.wait_ns(Dir::Read, 400_000)));
        assert!(b.admit(Dir::Read, 512, 1_000_000).is_ok());
        // An idle bucket does not store credit beyond its size.
        let n = drive(
            &mut Buckets::new(&cfg(|q| q.iops_total.rate = 1000), 0),
            Dir::Read,
            512,
            1,
        );
        let mut b = Buckets::new(&cfg(|q| q.iops_total.rate = 1000), 0);
        let mut later = 0;
        while b.admit(Dir::Read, 512, 100 * SEC).is_ok() {
            later += 1;
        }
        assert_eq!(later, n.len());
        // A clock that goes back leaks nothing.
        assert!(b.wait_ns(Dir::Read, SEC) > 0);
    }

    #[test]
    fn unlimited_never_waits() {
        let mut b = Buckets::new(&QosConfig::default(), 0);
        for _ in 0..10_000 {
            assert!(b.admit(Dir::Write, 1 << 20, 0).is_ok());
        }
    }
}
