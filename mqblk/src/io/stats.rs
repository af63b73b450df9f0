//! The I/O threads' counters: one definition, read by the stats file, `mqblk bench` and every
//! later consumer.
//!
//! An I/O thread counts into its own plain [`IoCounters`] and publishes a copy into its
//! [`SharedCounters`] (relaxed stores into its own cache lines) once per loop iteration;
//! readers load and sum the threads' copies when they read. Nothing is shared between I/O
//! threads and nothing is added to the request path.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::blk::ReqType;

/// Buckets of the per-type latency histogram: bucket `i` counts latencies of at most 2^i µs
/// (1 µs to about 4.2 s), the last one everything longer.
pub const LATENCY_BUCKETS: usize = 24;

/// A counter cell, or an array of them: what a field of the `counters!` list may be.
trait CounterCell: Copy {
    /// Its atomic mirror in [`SharedCounters`].
    type Shared: std::fmt::Debug + Default;
    fn store(&self, to: &Self::Shared);
    fn load(from: &Self::Shared) -> Self;
    fn add(&mut self, other: &Self);
}

impl CounterCell for u64 {
    type Shared = AtomicU64;
    fn store(&self, to: &AtomicU64) {
        to.store(*self, Ordering::Relaxed);
    }
    fn load(from: &AtomicU64) -> u64 {
        from.load(Ordering::Relaxed)
    }
    fn add(&mut self, other: &u64) {
        *self += other;
    }
}

impl<T: CounterCell, const N: usize> CounterCell for [T; N]
where
    [T::Shared; N]: std::fmt::Debug + Default,
{
    type Shared = [T::Shared; N];
    fn store(&self, to: &Self::Shared) {
        for (v, s) in self.iter().zip(to) {
            v.store(s);
        }
    }
    fn load(from: &Self::Shared) -> Self {
        std::array::from_fn(|i| T::load(&from[i]))
    }
    fn add(&mut self, other: &Self) {
        for (v, o) in self.iter_mut().zip(other) {
            v.add(o);
        }
    }
}

/// A field's type: `u64` unless the list names one.
macro_rules! counter_ty {
    () => {
        u64
    };
    ($ty:ty) => {
        $ty
    };
}

/// Defines [`IoCounters`] and its atomic mirror [`SharedCounters`] from one list of fields
/// (each a `u64`, or an array of them written `name: [u64; N]`).
macro_rules! counters {
    ($( $(#[doc = $doc:literal])+ $field:ident $(: $ty:ty)?, )+) => {
        /// What one I/O thread (or, summed, an export) has done.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct IoCounters {
            $( $(#[doc = $doc])+ pub $field: counter_ty!($($ty)?), )+
        }

        /// Each counter's description, its doc comment (without the leading space): what the
        /// metrics that show a counter give as their help.
        #[derive(Debug, Clone, Copy)]
        pub struct CounterHelp {
            $( $(#[doc = $doc])+ pub $field: &'static str, )+
        }

        impl IoCounters {
            /// Every counter's description.
            pub const HELP: CounterHelp = CounterHelp {
                $( $field: concat!($($doc),+).trim_ascii_start(), )+
            };

            /// Every counter's name and description, in declaration order.
            pub const FIELDS: &'static [(&'static str, &'static str)] =
                &[$( (stringify!($field), Self::HELP.$field), )+];

            /// Adds `other` counter by counter.
            pub fn add(&mut self, other: &IoCounters) {
                $( CounterCell::add(&mut self.$field, &other.$field); )+
            }
        }

        /// The copy of an I/O thread's counters that other threads read, and the one gauge
        /// published with them.
        #[derive(Debug, Default)]
        #[repr(align(64))]
        pub struct SharedCounters {
            $( $field: <counter_ty!($($ty)?) as CounterCell>::Shared, )+
            in_flight: AtomicU64,
        }

        impl SharedCounters {
            /// Publishes `c` and the number of requests in flight at the engine now (called
            /// by the owning I/O thread only).
            pub fn publish(&self, c: &IoCounters, in_flight: u64) {
                $( c.$field.store(&self.$field); )+
                self.in_flight.store(in_flight, Ordering::Relaxed);
            }

            /// The last published values.
            pub fn load(&self) -> IoCounters {
                IoCounters { $( $field: CounterCell::load(&self.$field), )+ }
            }

            /// Requests in flight at the engine, as last published.
            pub fn in_flight(&self) -> u64 {
                self.in_flight.load(Ordering::Relaxed)
            }
        }
    };
}

counters! {
    /// Requests completed (any status).
    requests,
    /// Requests that completed with IOERR or UNSUPP, or were returned unanswered.
    errors,
    /// io_uring_enter calls that handed at least one I/O to the engine (requests handed to
    /// the engine over these: the requests per submit).
    submits,
    /// io_uring_enter calls of any kind (submissions, waits, notification-only submits).
    enters,
    /// Requests handed to the engine.
    submitted,
    /// Notifications sent to the guest (used-buffer interrupts).
    notifies,
    /// Of those, the ones sent at a round's first used entry (`io::policy::notify`), each a
    /// write(2) of its own rather than an io_uring entry.
    early_notifies,
    /// Of those, the ones written with write(2) in place of an io_uring_enter that would have
    /// carried nothing else, for requests the engine answered at once (`IoThread::notify`).
    alone_notifies,
    /// Bytes read or written.
    bytes,
    /// Requests folded into another request's host I/O.
    merges,
    /// Engine operations that parts of split host I/Os became (a request larger than the
    /// engine takes, such as an NVMe controller's MDTS, is cut into parts).
    split_parts,
    /// Notifications received from the guest (kicks).
    kicks,
    /// Busy-poll windows that found work.
    poll_hits,
    /// Busy-poll windows that expired without work.
    poll_misses,
    /// Polls that went on past their window because requests were at the engine, to catch
    /// their completions (`poll-engine-us`).
    poll_engine_waits,
    /// Of those, the ones that ended without work.
    poll_engine_waits_missed,
    /// Rate trials of adaptive polling: a span polling, then one sleeping, to see whether
    /// polling serves more (`io::policy::poll`).
    poll_trials,
    /// Of those, the ones in which sleeping served at least 95% of polling's rate: votes to
    /// sleep (two in a row put a polling thread to sleep until the next trial).
    poll_sleep_votes,
    /// Times the I/O thread slept in the kernel waiting for work.
    sleeps,
    /// Batch waits under heavy load.
    batch_waits,
    /// Host I/Os issued on a registered buffer (READ_FIXED/WRITE_FIXED).
    fixed_buf_ios,
    /// Host I/Os issued on the registered (fixed) file.
    fixed_file_ios,
    /// Writes issued write-through (RWF_DSYNC: the guest turned the write cache off).
    sync_writes,
    /// Guest pages marked in the frontend's dirty log while it migrates the VM (read data,
    /// status bytes, used rings).
    dirty_pages,
    /// Pages written beyond the frontend's dirty log (a log too small for guest memory): the
    /// migration may not copy them (each is also logged).
    dirty_log_misses,
    /// Requests in flight at the engine, integrated over time: its rate is the mean number in
    /// flight, i.e. how full the thread kept the device.
    engine_in_flight_ns,
    /// Requests that waited for QoS admission (their export's or group's limits).
    throttled,
    /// Time requests waited for QoS admission, summed over requests.
    throttled_ns,
    /// Guest notifications that published 1 used entry.
    used_per_notify_1,
    /// Guest notifications that published 2 or 3 used entries.
    used_per_notify_2_3,
    /// Guest notifications that published 4 to 7 used entries.
    used_per_notify_4_7,
    /// Guest notifications that published 8 to 15 used entries.
    used_per_notify_8_15,
    /// Guest notifications that published 16 to 31 used entries.
    used_per_notify_16_31,
    /// Guest notifications that published 32 or more used entries.
    used_per_notify_32_up,
    /// Requests answered, by request type (op), whatever their status.
    // By `blk::ReqType`: GET_ID has none and is counted in `requests` only.
    op_requests: [u64; ReqType::COUNT],
    /// Bytes read, written, discarded or zeroed by requests answered OK, by request type.
    op_bytes: [u64; ReqType::COUNT],
    /// Requests answered with an error status (IOERR or UNSUPP), by request type; malformed
    /// ones included once their header named the type.
    op_errors: [u64; ReqType::COUNT],
    /// Latency of the requests answered, summed by request type: from the I/O thread's loop
    /// iteration that took a request off its virtqueue to the one that answered it.
    op_latency_ns: [u64; ReqType::COUNT],
    /// Latency of the requests answered, by request type: from the I/O thread's loop
    /// iteration that took a request off its virtqueue to the one that answered it.
    // A histogram: bucket i counts those of at most 2^i µs, the last bucket the rest.
    op_latency: [[u64; LATENCY_BUCKETS]; ReqType::COUNT],
}

impl IoCounters {
    /// Counts an answered request of type `ty`: `ok` with `bytes` transferred (or discarded,
    /// zeroed), after `latency_ns`. Plain increments: this runs for every request.
    #[inline]
    pub fn count_request(&mut self, ty: ReqType, ok: bool, bytes: u64, latency_ns: u64) {
        let i = ty as usize;
        self.op_requests[i] += 1;
        if ok {
            self.op_bytes[i] += bytes;
        } else {
            self.op_errors[i] += 1;
        }
        self.op_latency_ns[i] += latency_ns;
        self.op_latency[i][latency_bucket(latency_ns)] += 1;
    }

    /// Counts a guest notification that published `used` entries in its histogram bucket.
    pub fn count_notification(&mut self, used: u32) {
        match used {
            0 | 1 => self.used_per_notify_1 += 1,
            2..=3 => self.used_per_notify_2_3 += 1,
            4..=7 => self.used_per_notify_4_7 += 1,
            8..=15 => self.used_per_notify_8_15 += 1,
            16..=31 => self.used_per_notify_16_31 += 1,
            _ => self.used_per_notify_32_up += 1,
        }
    }

    /// The notification histogram: (smallest count of the bucket, notifications).
    pub fn used_per_notify(&self) -> [(u32, u64); 6] {
        [
            (1, self.used_per_notify_1),
            (2, self.used_per_notify_2_3),
            (4, self.used_per_notify_4_7),
            (8, self.used_per_notify_8_15),
            (16, self.used_per_notify_16_31),
            (32, self.used_per_notify_32_up),
        ]
    }

    /// The sum of several threads' published counters.
    pub fn sum<'a>(threads: impl IntoIterator<Item = &'a SharedCounters>) -> IoCounters {
        let mut total = IoCounters::default();
        for t in threads {
            total.add(&t.load());
        }
        total
    }
}

/// The latency histogram bucket of `ns`: the smallest i with `ns` <= 2^i µs, or the last.
#[inline]
pub fn latency_bucket(ns: u64) -> usize {
    let us = ns.div_ceil(1000);
    if us <= 1 {
        return 0;
    }
    // ceil(log2(us)) for us >= 2.
    ((u64::BITS - (us - 1).leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
}

/// The upper bound of latency bucket `i` in seconds; `None` for the last, unbounded one.
pub fn latency_bucket_bound(i: usize) -> Option<f64> {
    (i + 1 < LATENCY_BUCKETS).then(|| (1u64 << i) as f64 * 1e-6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_definition_everywhere() {
        let mut a = IoCounters {
            requests: 3,
            sync_writes: 1,
            ..Default::default()
        };
        a.count_request(ReqType::Discard, true, 4096, 1500);
        a.count_request(ReqType::Discard, false, 4096, 0);
        let shared = SharedCounters::default();
        shared.publish(&a, 7);
        assert_eq!(shared.load(), a);
        assert_eq!(shared.in_flight(), 7);
        a.add(&IoCounters {
            requests: 2,
            ..Default::default()
        });
        assert_eq!(a.requests, 5);
        assert_eq!(IoCounters::FIELDS[0].0, "requests");
        let d = ReqType::Discard as usize;
        assert_eq!(
            (
                a.op_requests[d],
                a.op_bytes[d],
                a.op_errors[d],
                a.op_latency_ns[d]
            ),
            (2, 4096, 1, 1500)
        );
        assert_eq!((a.op_latency[d][0], a.op_latency[d][1]), (1, 1));
        let mut twice = a;
        twice.add(&a);
        assert_eq!(twice.op_latency[d][1], 2, "arrays add element by element");
        // The JSON names are the field names, and a reader tolerates fields it does not know.
        let json = serde_json::to_value(a).unwrap();
        for (name, _) in IoCounters::FIELDS {
            assert!(json.get(name).is_some(), "{name} missing from {json}");
        }
        let back: IoCounters = serde_json::from_str(r#"{"requests": 7, "future": 1}"#).unwrap();
        assert_eq!(back.requests, 7);
        assert_eq!(IoCounters::sum([&shared, &shared]).requests, 6);
        assert_eq!(IoCounters::sum([&shared, &shared]).op_bytes[d], 8192);
        for n in [1, 3, 4, 15, 16, 31, 32, 1000] {
            a.count_notification(n);
        }
        let h: Vec<u64> = a.used_per_notify().iter().map(|b| b.1).collect();
        assert_eq!(h, vec![1, 1, 1, 1, 2, 2]);
    }

    #[test]
    fn latency_buckets_are_powers_of_two_microseconds() {
        for (ns, bucket) in [
            (0, 0),
            (1000, 0),
            (1001, 1),
            (2000, 1),
            (2001, 2),
            (4000, 2),
            (1_000_000, 10),
            (1_024_000, 10),
            (1_024_001, 11),
            ((1 << 22) * 1000, 22),
            ((1 << 22) * 1000 + 1, 23),
            (u64::MAX, 23),
        ] {
            assert_eq!(latency_bucket(ns), bucket, "{ns} ns");
        }
        assert_eq!(latency_bucket_bound(0), Some(1e-6));
        assert_eq!(latency_bucket_bound(10), Some(1024e-6));
        assert!(latency_bucket_bound(LATENCY_BUCKETS - 2).is_some());
        assert_eq!(latency_bucket_bound(LATENCY_BUCKETS - 1), None);
        // Every finite bound holds what its bucket takes.
        for i in 0..LATENCY_BUCKETS - 1 {
            let bound_ns = (latency_bucket_bound(i).unwrap() * 1e9).round() as u64;
            assert_eq!(latency_bucket(bound_ns), i);
            assert_eq!(latency_bucket(bound_ns + 1), i + 1);
        }
    }
}
