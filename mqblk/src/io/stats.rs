//! The I/O threads' counters: one definition, read by the stats file, `mqblk bench` and every
//! later consumer.
//!
//! An I/O thread counts into its own plain [`IoCounters`] and publishes a copy into its
//! [`SharedCounters`] (relaxed stores into its own cache lines) once per loop iteration;
//! readers load and sum the threads' copies when they read. Nothing is shared between I/O
//! threads and nothing is added to the request path.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// Defines [`IoCounters`] and its atomic mirror [`SharedCounters`] from one list of fields.
macro_rules! counters {
    ($( $(#[doc = $doc:literal])+ $field:ident, )+) => {
        /// What one I/O thread (or, summed, an export) has done.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct IoCounters {
            $( $(#[doc = $doc])+ pub $field: u64, )+
        }

        impl IoCounters {
            /// Every counter's name and description, in declaration order.
            pub const FIELDS: &'static [(&'static str, &'static str)] =
                &[$( (stringify!($field), concat!($($doc),+)), )+];

            /// Adds `other` counter by counter.
            pub fn add(&mut self, other: &IoCounters) {
                $( self.$field += other.$field; )+
            }

            /// Every counter's value, in the order of [`IoCounters::FIELDS`].
            pub fn values(&self) -> Vec<u64> {
                vec![$( self.$field, )+]
            }
        }

        /// The copy of an I/O thread's counters that other threads read.
        #[derive(Debug, Default)]
        #[repr(align(64))]
        pub struct SharedCounters {
            $( $field: AtomicU64, )+
        }

        impl SharedCounters {
            /// Publishes `c` (called by the owning I/O thread only).
            pub fn publish(&self, c: &IoCounters) {
                $( self.$field.store(c.$field, Ordering::Relaxed); )+
            }

            /// The last published values.
            pub fn load(&self) -> IoCounters {
                IoCounters { $( $field: self.$field.load(Ordering::Relaxed), )+ }
            }
        }
    };
}

counters! {
    /// Requests completed (any status).
    requests,
    /// Requests that completed with IOERR or UNSUPP, or were returned unanswered.
    errors,
    /// io_uring_enter calls that carried at least one I/O to the engine.
    submits,
    /// io_uring_enter calls of any kind (submissions, waits, notification-only submits).
    enters,
    /// Requests handed to the engine.
    submitted,
    /// Guest notifications sent.
    notifies,
    /// Bytes read or written.
    bytes,
    /// Requests folded into another request's host I/O.
    merges,
    /// Kicks (guest notifications to the backend) received.
    kicks,
    /// Polls that found work.
    poll_hits,
    /// Poll windows that expired.
    poll_misses,
    /// Times the thread slept in the kernel.
    sleeps,
    /// Batch waits under heavy load.
    batch_waits,
    /// Host I/Os issued on a registered buffer (READ_FIXED/WRITE_FIXED).
    fixed_buf_ios,
    /// Host I/Os issued on the registered (fixed) file.
    fixed_file_ios,
    /// Writes issued write-through (RWF_DSYNC: the guest turned the write cache off).
    sync_writes,
    /// Requests in flight at the engine, integrated over time (request-nanoseconds): its
    /// increase over an interval, divided by the interval, is the mean number in flight, i.e.
    /// how full the thread kept the device.
    engine_in_flight_ns,
    /// Requests that waited for QoS admission (their export's or group's limits).
    throttled,
    /// Nanoseconds requests waited for QoS admission, summed over requests.
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
}

impl IoCounters {
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
        let shared = SharedCounters::default();
        shared.publish(&a);
        assert_eq!(shared.load(), a);
        a.add(&IoCounters {
            requests: 2,
            ..Default::default()
        });
        assert_eq!(a.requests, 5);
        assert_eq!(IoCounters::FIELDS.len(), a.values().len());
        assert_eq!(IoCounters::FIELDS[0].0, "requests");
        // The JSON names are the field names, and a reader tolerates fields it does not know.
        let json = serde_json::to_value(a).unwrap();
        for (name, _) in IoCounters::FIELDS {
            assert!(json.get(name).is_some(), "{name} missing from {json}");
        }
        let back: IoCounters = serde_json::from_str(r#"{"requests": 7, "future": 1}"#).unwrap();
        assert_eq!(back.requests, 7);
        assert_eq!(IoCounters::sum([&shared, &shared]).requests, 6);
        for n in [1, 3, 4, 15, 16, 31, 32, 1000] {
            a.count_notification(n);
        }
        let h: Vec<u64> = a.used_per_notify().iter().map(|b| b.1).collect();
        assert_eq!(h, vec![1, 1, 1, 1, 2, 2]);
    }
}
