//! [`LatencyHistogram`]: request latencies, recorded without allocating, read as percentiles.

use std::fmt;
use std::time::Duration;

const SUB_BITS: u32 = 4;
const SUB: u64 = 1 << SUB_BITS;
const BUCKETS: usize = ((64 - SUB_BITS as usize) + 1) * SUB as usize;

/// Log-linear histogram of nanosecond values: 16 linear sub-buckets per power of two, so a
/// percentile is within 1/16 (6.25%) of the true value. Fixed size; recording never allocates.
#[derive(Clone)]
pub struct LatencyHistogram {
    counts: Box<[u64]>,
    count: u64,
    sum_ns: u128,
    min_ns: u64,
    max_ns: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("count", &self.count)
            .field("min_ns", &self.min_ns)
            .field("max_ns", &self.max_ns)
            .finish()
    }
}

impl LatencyHistogram {
    /// An empty histogram (one allocation of about 8 KiB).
    pub fn new() -> Self {
        Self {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            count: 0,
            sum_ns: 0,
            min_ns: u64::MAX,
            max_ns: 0,
        }
    }

    #[inline]
    fn index(v: u64) -> usize {
        if v < SUB {
            v as usize
        } else {
            let msb = 63 - v.leading_zeros();
            let shift = msb - SUB_BITS;
            (((shift + 1) as u64) * SUB + ((v >> shift) & (SUB - 1))) as usize
        }
    }

    /// Representative value (middle) of bucket `i`.
    fn value(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            i
        } else {
            let shift = (i / SUB - 1) as u32;
            let low = (SUB | (i % SUB)) << shift;
            low + ((1u64 << shift) >> 1)
        }
    }

    /// Records one sample.
    #[inline]
    pub fn record(&mut self, d: Duration) {
        self.record_ns(d.as_nanos().min(u64::MAX as u128) as u64);
    }

    /// Records one sample given in nanoseconds.
    #[inline]
    pub fn record_ns(&mut self, ns: u64) {
        self.counts[Self::index(ns)] += 1;
        self.count += 1;
        self.sum_ns += ns as u128;
        self.min_ns = self.min_ns.min(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    /// Adds `other`'s samples to this histogram.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.count += other.count;
        self.sum_ns += other.sum_ns;
        self.min_ns = self.min_ns.min(other.min_ns);
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Smallest sample (zero if empty).
    pub fn min(&self) -> Duration {
        Duration::from_nanos(if self.count == 0 { 0 } else { self.min_ns })
    }

    /// Largest sample (zero if empty).
    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.max_ns)
    }

    /// Mean of the samples (zero if empty).
    pub fn mean(&self) -> Duration {
        if self.count == 0 {
            Duration::ZERO
        } else {
            Duration::from_nanos((self.sum_ns / self.count as u128) as u64)
        }
    }

    /// The value below which fraction `q` (0.0..=1.0) of the samples lie; zero if empty.
    pub fn percentile(&self, q: f64) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Duration::from_nanos(Self::value(i).clamp(self.min_ns, self.max_ns));
            }
        }
        Duration::from_nanos(self.max_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_monotonic_and_tight() {
        let mut last = 0;
        for v in (0..100_000u64).chain([1 << 20, 1 << 40, u64::MAX / 2, u64::MAX]) {
            let i = LatencyHistogram::index(v);
            assert!(i < BUCKETS, "{v} -> {i}");
            assert!(i >= last || v >= 100_000, "index not monotonic at {v}");
            last = i;
            let rep = LatencyHistogram::value(i);
            let err = rep.abs_diff(v) as f64 / v.max(1) as f64;
            assert!(err <= 1.0 / SUB as f64, "{v} -> bucket {i} value {rep}");
        }
    }

    #[test]
    fn histogram_percentiles() {
        let mut h = LatencyHistogram::new();
        assert_eq!(h.percentile(0.5), Duration::ZERO);
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let p = |q| h.percentile(q).as_secs_f64() * 1e6;
        assert!((p(0.5) - 500.0).abs() <= 500.0 / 16.0, "p50 {}", p(0.5));
        assert!((p(0.99) - 990.0).abs() <= 990.0 / 16.0, "p99 {}", p(0.99));
        assert!(p(1.0) <= 1000.0);
        assert_eq!(h.count(), 1000);
        let mut m = LatencyHistogram::new();
        m.record_ns(5);
        m.merge(&h);
        assert_eq!(m.count(), 1001);
        assert_eq!(m.min(), Duration::from_nanos(5));
        assert_eq!(m.max(), Duration::from_micros(1000));
    }
}
