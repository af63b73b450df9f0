//! The virtio-blk device of one export: its configuration space and its I/O threads, which
//! outlive frontend connections. A [`Session`](super::session::Session) (one connection) starts
//! and stops its queues on these threads.

use std::sync::{Arc, Mutex};

use super::features::device_features;
use crate::blk::{ConfigSpace, Geometry, Limits};
use crate::config::{ExportConfig, MAX_SERIAL_LEN};
use crate::engine::{Engine, ResizeError};
use crate::io::{
    self, Command, Failure, IoCounters, IoThreadConfig, IoThreadHandle, Throttle, IOV_MAX,
};

/// An export's virtio-blk device.
pub struct Device {
    cfg: ExportConfig,
    engine: Arc<dyn Engine>,
    threads: Vec<IoThreadHandle>,
    /// Set when an I/O thread dies (see [`io::Failure`]).
    failure: Arc<Failure>,
    /// Changes only on an online resize (control plane).
    config_space: Mutex<ConfigSpace>,
}

impl Device {
    /// The device around an opened engine; starts its I/O threads, admitting requests through
    /// `throttle` if given (the export's QoS buckets, or its group's).
    pub fn new(
        cfg: ExportConfig,
        engine: Arc<dyn Engine>,
        throttle: Option<Arc<Throttle>>,
    ) -> std::io::Result<Device> {
        let block_size = engine.block_size();
        let seg_max = (u32::from(cfg.queue_size) - 2).clamp(1, IOV_MAX as u32 - 2);
        let storage = engine.limits();
        let geometry = Geometry {
            capacity_sectors: engine.capacity() >> 9,
            seg_max,
            blk_size: block_size,
            num_queues: cfg.queues,
            max_discard_sectors: if storage.discard {
                storage.max_discard_sectors
            } else {
                0
            },
            max_write_zeroes_sectors: if storage.write_zeroes {
                storage.max_write_zeroes_sectors
            } else {
                0
            },
            write_zeroes_may_unmap: storage.write_zeroes_may_unmap,
        };
        let limits = Limits {
            capacity_sectors: geometry.capacity_sectors,
            // seg_max data segments plus header and status, with slack for split headers.
            max_descriptors: seg_max as usize + 4,
            readonly: cfg.readonly,
            max_discard_sectors: geometry.max_discard_sectors,
            max_write_zeroes_sectors: geometry.max_write_zeroes_sectors,
        };
        let mut serial = cfg.serial.as_bytes().to_vec();
        serial.truncate(MAX_SERIAL_LEN);
        // Thread names hold 15 bytes: "mqblk-ioN-" and the start of the export's id.
        let short_name: String = cfg.id.chars().take(6).collect();
        let nthreads = cfg.num_threads();
        let failure = Arc::new(Failure::new()?);
        let reported = failure.clone();
        engine.report_failures_to(Arc::new(move |who, why| reported.record(who, why)));
        let mut threads = Vec::with_capacity(nthreads);
        for t in 0..nthreads {
            let nq = (0..cfg.queues as usize)
                .filter(|&q| cfg.thread_of_queue(q) == t)
                .count();
            let tc = IoThreadConfig {
                name: format!("mqblk-io{t}-{short_name}"),
                cpu: cfg.cpus.get(t).copied(),
                queue_sizes: vec![cfg.queue_size; nq],
                limits,
                serial: serial.clone(),
                tuning: cfg.tuning,
                throttle: throttle.clone(),
                failure: failure.clone(),
            };
            match io::spawn(tc, engine.clone()) {
                Ok(h) => threads.push(h),
                Err(e) => {
                    for mut h in threads {
                        h.shutdown();
                    }
                    return Err(e);
                }
            }
        }
        Ok(Device {
            cfg,
            engine,
            threads,
            failure,
            config_space: Mutex::new(ConfigSpace::new(&geometry)),
        })
    }

    /// The virtio features the device offers.
    pub fn features(&self) -> u64 {
        let storage = self.engine.limits();
        device_features(self.cfg.readonly, storage.discard, storage.write_zeroes)
    }

    /// Whether (and why) an I/O thread of the device died, or its engine failed.
    pub fn failure(&self) -> &Failure {
        &self.failure
    }

    /// The export's settings.
    pub fn config(&self) -> &ExportConfig {
        &self.cfg
    }

    /// The storage.
    pub fn engine(&self) -> &Arc<dyn Engine> {
        &self.engine
    }

    /// The configuration space in write-back mode (a session sets the cache mode it has).
    pub fn config_space(&self) -> ConfigSpace {
        *self.config_space.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resizes the disk to `size` bytes, or (`None`) to what its backing store now holds, and
    /// returns the new capacity. The order keeps every request inside the store: a disk that
    /// shrinks first stops taking requests past the new end and waits for those in flight,
    /// then the store shrinks; a disk that grows first grows its store. The frontend still has
    /// to be told ([`Session::config_change_channel`](super::Session::config_change_channel)).
    /// One at a time: the caller serialises resizes (the daemon's export holds a lock through
    /// the resize and the frontend's acknowledgement).
    pub fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError> {
        let current = self.engine.capacity();
        if let Some(s) = size.filter(|&s| s == 0 || s % 512 != 0) {
            return Err(ResizeError::BadSize(s));
        }
        let new = match size {
            Some(s) if s < current => {
                self.set_thread_capacity(s >> 9);
                match self.engine.resize(Some(s)) {
                    Ok(new) => new,
                    Err(e) => {
                        // The store kept its size: so do the threads.
                        self.set_thread_capacity(current >> 9);
                        return Err(e);
                    }
                }
            }
            _ => {
                let new = self.engine.resize(size)?;
                self.set_thread_capacity(new >> 9);
                new
            }
        };
        self.config_space
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_capacity_sectors(new >> 9);
        Ok(new)
    }

    /// Gives every I/O thread the new capacity and waits until each has finished the
    /// requests it had in flight before.
    fn set_thread_capacity(&self, sectors: u64) {
        io::send_all_and_wait(&self.threads, |_, reply| Command::SetCapacity {
            sectors,
            reply,
        });
    }

    /// The I/O threads.
    pub fn threads(&self) -> &[IoThreadHandle] {
        &self.threads
    }

    /// The thread serving queue `q`, and the queue's index among that thread's queues.
    pub fn thread_of(&self, q: usize) -> (&IoThreadHandle, usize) {
        let t = self.cfg.thread_of_queue(q);
        (&self.threads[t], q / self.cfg.num_threads())
    }

    /// Admits requests through `throttle` from now on (`None`: no limit). Requests waiting
    /// under the previous buckets ask the new ones.
    pub fn set_throttle(&self, throttle: Option<Arc<Throttle>>) {
        for t in &self.threads {
            t.send(Command::SetThrottle(throttle.clone()));
        }
    }

    /// The I/O threads' counters, summed.
    pub fn counters(&self) -> IoCounters {
        IoCounters::sum(self.threads.iter().map(|t| t.counters()))
    }

    /// Whether every I/O thread still runs.
    pub fn threads_running(&self) -> bool {
        self.threads.iter().all(|t| t.is_running())
    }

    /// Drains and stops the I/O threads.
    pub fn shutdown(&mut self) {
        for t in &mut self.threads {
            t.shutdown();
        }
    }
}
