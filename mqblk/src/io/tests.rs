//! The I/O thread as a whole, in-process: a real thread, ring and virtqueue in real (anonymous)
//! guest memory, driven the way the frontend drives it, on a fake engine that completes
//! through its own completion fd, the path an asynchronous engine (librbd) takes.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::event::{poll, EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::fs::{memfd_create, MemfdFlags};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::{spawn, Command, GuestMemory, IoThreadConfig, IoThreadHandle, Throttle};
use crate::blk::{Limits, Status};
use crate::config::{QosConfig, Tuning};
use crate::engine::{Channel, Engine, Op, Started};

const QSIZE: u16 = 16;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const CAPACITY: u64 = 1 << 20;

fn eventfd() -> File {
    File::from(rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).unwrap())
}

fn signal(f: &File) {
    assert_eq!(rustix::io::write(f, &1u64.to_ne_bytes()), Ok(8));
}

/// Waits up to `timeout` for an eventfd to be signalled, and consumes the signal.
fn wait_signalled(f: &File, timeout: Duration) -> bool {
    let timeout = Timespec::try_from(timeout).unwrap();
    if poll(&mut [PollFd::new(f, PollFlags::IN)], Some(&timeout)) != Ok(1) {
        return false;
    }
    let _ = rustix::io::read(f, &mut [0u8; 8]);
    true
}

/// What the fake engine saw.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Read { offset: u64, bytes: usize },
    Write { offset: u64, first: u8 },
    Flush,
}

/// An engine that completes asynchronously: `start` fills reads with the offset's low byte,
/// queues the result and signals its completion eventfd; `reap` hands the results over.
struct FakeEngine {
    seen: Arc<Mutex<Vec<Seen>>>,
}

struct FakeChannel {
    seen: Arc<Mutex<Vec<Seen>>>,
    done: VecDeque<(u64, i32)>,
    events: File,
}

impl Engine for FakeEngine {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn capacity(&self) -> u64 {
        CAPACITY
    }
    fn block_size(&self) -> u32 {
        512
    }
    fn resize(&self, _size: Option<u64>) -> Result<u64, crate::engine::ResizeError> {
        Err(crate::engine::ResizeError::SizeNeeded("fake"))
    }
    fn channel(&self) -> std::io::Result<Box<dyn Channel>> {
        Ok(Box::new(FakeChannel {
            seen: self.seen.clone(),
            done: VecDeque::new(),
            events: eventfd(),
        }))
    }
}

impl Channel for FakeChannel {
    unsafe fn start(&mut self, op: &Op, token: u64) -> Started {
        let (seen, res) = match *op {
            Op::Read {
                offset,
                iovs,
                iovcnt,
                ..
            } => {
                // SAFETY: the contract of `Op`: valid, writable iovecs until completion.
                let iovs = unsafe { std::slice::from_raw_parts(iovs, iovcnt as usize) };
                let mut bytes = 0;
                for v in iovs {
                    // SAFETY: as above.
                    unsafe {
                        std::ptr::write_bytes(v.iov_base.cast::<u8>(), offset as u8, v.iov_len)
                    };
                    bytes += v.iov_len;
                }
                (Seen::Read { offset, bytes }, bytes as i32)
            }
            Op::Write {
                offset,
                iovs,
                iovcnt,
                ..
            } => {
                // SAFETY: as above.
                let iovs = unsafe { std::slice::from_raw_parts(iovs, iovcnt as usize) };
                // SAFETY: as above; every iovec is at least one byte here.
                let first = unsafe { *iovs[0].iov_base.cast::<u8>() };
                let bytes: usize = iovs.iter().map(|v| v.iov_len).sum();
                (Seen::Write { offset, first }, bytes as i32)
            }
            Op::Flush => (Seen::Flush, 0),
            _ => return Started::Done(-libc::EOPNOTSUPP),
        };
        self.seen.lock().unwrap().push(seen);
        self.done.push_back((token, res));
        signal(&self.events);
        Started::Pending
    }
    fn completion_fd(&self) -> Option<RawFd> {
        Some(self.events.as_raw_fd())
    }
    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        let _ = rustix::io::read(&self.events, &mut [0u8; 8]);
        while let Some((t, r)) = self.done.pop_front() {
            done(t, r);
        }
    }
}

/// A guest: memory, a split virtqueue laid out by hand, and its eventfds.
struct Guest {
    mem: Arc<GuestMemory>,
    kick: File,
    call: File,
    next_desc: u16,
    avail_idx: u16,
}

impl Guest {
    fn new() -> Self {
        Guest {
            mem: Arc::new(GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()),
            kick: eventfd(),
            call: eventfd(),
            next_desc: 0,
            avail_idx: 0,
        }
    }

    fn queue(&self) -> Queue {
        let mut q = Queue::new(QSIZE).unwrap();
        q.set_size(QSIZE);
        q.set_desc_table_address(Some(DESC as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_ready(true);
        assert!(q.is_valid(&*self.mem));
        q
    }

    /// Posts a request: header, optional data buffer, status byte. Returns its head and the
    /// addresses of its data and status.
    fn post(&mut self, kind: u32, sector: u64, data: Option<(u32, bool)>) -> (u16, u64, u64) {
        let head = self.next_desc;
        let base = 0x1_0000 + u64::from(head) * 0x2000;
        let (hdr, data_addr, status) = (base, base + 0x200, base + 0x1800);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(hdr)).unwrap();
        self.mem.write_obj(0xffu8, GuestAddress(status)).unwrap();
        let next = VRING_DESC_F_NEXT as u16;
        let write = VRING_DESC_F_WRITE as u16;
        let mut descs = vec![(hdr, 16, next)];
        if let Some((len, device_writes)) = data {
            descs.push((data_addr, len, next | if device_writes { write } else { 0 }));
        }
        descs.push((status, 1, write));
        for (k, &(addr, len, flags)) in descs.iter().enumerate() {
            let i = self.next_desc + k as u16;
            let flags = if k + 1 == descs.len() {
                flags & !next
            } else {
                flags
            };
            let d = Descriptor::new(addr, len, flags, i + 1);
            self.mem
                .write_obj(d, GuestAddress(DESC + 16 * u64::from(i)))
                .unwrap();
        }
        self.next_desc += descs.len() as u16;
        let slot = u64::from(self.avail_idx % QSIZE);
        self.mem
            .write_obj(head, GuestAddress(AVAIL + 4 + 2 * slot))
            .unwrap();
        self.avail_idx += 1;
        self.mem
            .write_obj(self.avail_idx, GuestAddress(AVAIL + 2))
            .unwrap();
        (head, data_addr, status)
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    /// The used element `i`: (id, len).
    fn used(&self, i: u16) -> (u32, u32) {
        let at = USED + 4 + 8 * u64::from(i);
        (
            self.mem.read_obj(GuestAddress(at)).unwrap(),
            self.mem.read_obj(GuestAddress(at + 4)).unwrap(),
        )
    }

    fn byte(&self, addr: u64) -> u8 {
        self.mem.read_obj(GuestAddress(addr)).unwrap()
    }

    /// Kicks and waits until `n` requests have been used.
    fn kick_and_wait(&self, n: u16) {
        signal(&self.kick);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.used_idx() < n {
            assert!(
                std::time::Instant::now() < deadline,
                "requests not completed"
            );
            wait_signalled(&self.call, Duration::from_millis(100));
        }
    }
}

fn start_thread(guest: &Guest, seen: Arc<Mutex<Vec<Seen>>>) -> IoThreadHandle {
    start_throttled(guest, seen, None)
}

fn start_throttled(
    guest: &Guest,
    seen: Arc<Mutex<Vec<Seen>>>,
    throttle: Option<Arc<Throttle>>,
) -> IoThreadHandle {
    let cfg = IoThreadConfig {
        name: "mqblk-io-test".into(),
        failure: Arc::new(super::Failure::new().unwrap()),
        cpu: None,
        queue_sizes: vec![QSIZE],
        limits: Limits {
            capacity_sectors: CAPACITY >> 9,
            max_descriptors: 8,
            readonly: false,
            max_discard_sectors: 1 << 20,
            max_write_zeroes_sectors: 1 << 20,
        },
        serial: b"test".to_vec(),
        tuning: Tuning::default(),
        throttle,
    };
    let t = spawn(cfg, Arc::new(FakeEngine { seen })).unwrap();
    let (tx, rx) = sync_channel(1);
    t.send(Command::SetMem {
        mem: Some(guest.mem.clone()),
        reply: tx,
    });
    rx.recv().unwrap();
    t.send(Command::Start {
        local: 0,
        index: 0,
        queue: guest.queue(),
        kick: guest.kick.try_clone().unwrap(),
        call: Some(guest.call.try_clone().unwrap()),
        inflight: None,
        resubmit: Vec::new(),
    });
    t
}

#[test]
fn requests_go_through_an_asynchronous_engine_and_bad_ones_never_reach_it() {
    let mut guest = Guest::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut t = start_thread(&guest, seen.clone());

    let (r_head, r_data, r_status) = guest.post(VIRTIO_BLK_T_IN, 8, Some((4096, true)));
    let (w_head, w_data, w_status) = guest.post(VIRTIO_BLK_T_OUT, 16, Some((512, false)));
    guest
        .mem
        .write_slice(&[0x5a; 512], GuestAddress(w_data))
        .unwrap();
    let (f_head, _, f_status) = guest.post(VIRTIO_BLK_T_FLUSH, 0, None);
    // Past the end of the disk: refused with IOERR before the engine sees it.
    let (bad_head, _, bad_status) = guest.post(VIRTIO_BLK_T_IN, CAPACITY >> 9, Some((512, true)));
    guest.kick_and_wait(4);

    let used: Vec<(u32, u32)> = (0..4).map(|i| guest.used(i)).collect();
    let find = |head: u16| {
        used.iter()
            .find(|u| u.0 == u32::from(head))
            .copied()
            .unwrap()
    };
    assert_eq!(
        find(r_head).1,
        4096 + 1,
        "a read's used length counts its data and status"
    );
    assert_eq!(find(w_head).1, 1);
    assert_eq!(find(f_head).1, 1);
    assert_eq!(find(bad_head).1, 1);
    assert_eq!(guest.byte(r_status), Status::Ok as u8);
    assert_eq!(guest.byte(w_status), Status::Ok as u8);
    assert_eq!(guest.byte(f_status), Status::Ok as u8);
    assert_eq!(guest.byte(bad_status), Status::IoErr as u8);
    assert_eq!(
        guest.byte(r_data),
        (8u64 << 9) as u8,
        "the engine's data reached guest memory"
    );
    assert_eq!(guest.byte(r_data + 4095), (8u64 << 9) as u8);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen.contains(&Seen::Read {
        offset: 8 << 9,
        bytes: 4096
    }));
    assert!(seen.contains(&Seen::Write {
        offset: 16 << 9,
        first: 0x5a
    }));
    assert!(seen.contains(&Seen::Flush));

    t.shutdown();
    let c = super::IoCounters::sum([t.counters()]);
    assert_eq!((c.requests, c.errors, c.submitted), (4, 1, 3), "{c:?}");
    assert_eq!(c.bytes, 4096 + 512);
}

#[test]
fn a_stop_waits_for_in_flight_requests_and_reports_the_next_avail_index() {
    let mut guest = Guest::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut t = start_thread(&guest, seen);
    guest.post(VIRTIO_BLK_T_IN, 0, Some((512, true)));
    guest.post(VIRTIO_BLK_T_IN, 1, Some((512, true)));
    guest.kick_and_wait(2);
    let (tx, rx) = sync_channel(1);
    t.send(Command::Stop {
        local: 0,
        reply: tx,
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), 2);
    // A stopped queue takes nothing more.
    guest.post(VIRTIO_BLK_T_IN, 2, Some((512, true)));
    signal(&guest.kick);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(guest.used_idx(), 2);
    t.shutdown();
}

/// A log of `bytes` bytes in a memfd, and a second handle on the file to read it.
fn dirty_log(bytes: u64) -> (Arc<super::dirty_log::DirtyLog>, File) {
    let f = File::from(
        memfd_create(
            c"io-test-log",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .unwrap(),
    );
    f.set_len(bytes).unwrap();
    let view = f.try_clone().unwrap();
    (
        Arc::new(super::dirty_log::DirtyLog::map(f, 0, bytes).unwrap()),
        view,
    )
}

fn set_dirty_log(t: &IoThreadHandle, log: Option<Arc<super::dirty_log::DirtyLog>>, used: u64) {
    let (tx, rx) = sync_channel(1);
    t.send(Command::SetDirtyLog {
        log,
        used: vec![Some(used)],
        reply: tx,
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
}

/// The pages marked in a log file.
fn marked(view: &File, bytes: usize) -> Vec<u64> {
    let mut v = vec![0u8; bytes];
    std::os::unix::fs::FileExt::read_exact_at(view, &mut v, 0).unwrap();
    (0..bytes as u64 * 8)
        .filter(|&p| v[(p / 8) as usize] & (1 << (p % 8)) != 0)
        .collect()
}

#[test]
fn while_logging_every_page_the_thread_writes_is_marked_and_nothing_else() {
    let mut guest = Guest::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut t = start_thread(&guest, seen);
    // 1 MiB of guest memory: 256 pages, 32 bytes of log.
    let (log, view) = dirty_log(32);
    set_dirty_log(&t, Some(log), USED);

    // A read: header and data from 0x10000 (4 KiB of data: pages 0x10 and 0x11), status in
    // page 0x11. A write: header and (device-readable) data in page 0x16, status in page 0x17.
    let (_, r_data, r_status) = guest.post(VIRTIO_BLK_T_IN, 8, Some((4096, true)));
    let (_, w_data, w_status) = guest.post(VIRTIO_BLK_T_OUT, 16, Some((512, false)));
    assert_eq!(
        (r_data >> 12, (r_data + 4095) >> 12, r_status >> 12),
        (0x10, 0x11, 0x11)
    );
    assert_eq!((w_data >> 12, w_status >> 12), (0x16, 0x17));
    guest.kick_and_wait(2);
    assert_eq!(
        marked(&view, 32),
        vec![USED >> 12, 0x10, 0x11, 0x17],
        "the used ring, the read's data and both status bytes; not the write's data, the \
         descriptors or the avail ring"
    );

    // Logging off: a second read marks nothing.
    set_dirty_log(&t, None, USED);
    let (_, data2, _) = guest.post(VIRTIO_BLK_T_IN, 24, Some((512, true)));
    guest.kick_and_wait(3);
    assert_eq!(data2 >> 12, 0x1c);
    assert_eq!(marked(&view, 32), vec![USED >> 12, 0x10, 0x11, 0x17]);
    t.shutdown();
    let c = super::IoCounters::sum([t.counters()]);
    assert!(c.dirty_pages >= 5, "{c:?}");
    assert_eq!(c.dirty_log_misses, 0);
}

/// Buckets of `iops` requests per second.
fn iops_limit(iops: u64) -> Arc<Throttle> {
    let mut q = QosConfig::default();
    q.iops_total.rate = iops;
    Arc::new(Throttle::new(&q))
}

#[test]
fn throttled_requests_wait_without_losing_their_queue_s_order() {
    let mut guest = Guest::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    // 10 per second: a bucket of 1, so two go at once, then one every 100 ms.
    let mut t = start_throttled(&guest, seen.clone(), Some(iops_limit(10)));
    guest.post(VIRTIO_BLK_T_IN, 0, Some((512, true)));
    guest.post(VIRTIO_BLK_T_OUT, 1, Some((512, false)));
    guest.post(VIRTIO_BLK_T_IN, 2, Some((512, true)));
    // A flush is not limited, but it may not overtake the read before it.
    guest.post(VIRTIO_BLK_T_FLUSH, 0, None);
    guest.post(VIRTIO_BLK_T_IN, 3, Some((512, true)));
    let started = std::time::Instant::now();
    guest.kick_and_wait(5);
    let took = started.elapsed();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            Seen::Read {
                offset: 0,
                bytes: 512
            },
            Seen::Write {
                offset: 512,
                first: 0
            },
            Seen::Read {
                offset: 1024,
                bytes: 512
            },
            Seen::Flush,
            Seen::Read {
                offset: 1536,
                bytes: 512
            },
        ]
    );
    // Two waits of about 100 ms each.
    assert!(
        took >= Duration::from_millis(180) && took < Duration::from_secs(2),
        "{took:?}"
    );
    t.shutdown();
    let c = super::IoCounters::sum([t.counters()]);
    assert_eq!(c.throttled, 2, "{c:?}");
    assert!(c.throttled_ns >= 150_000_000, "{c:?}");
    // Waiting is sleeping: a handful of loop iterations, not a spin.
    assert!(c.sleeps < 50, "{c:?}");
}

#[test]
fn a_stop_or_a_lifted_limit_does_not_wait_for_the_buckets() {
    let mut guest = Guest::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    // 1 per second: one at once, the next after 0.9 s.
    let mut t = start_throttled(&guest, seen.clone(), Some(iops_limit(1)));
    // Apart, so that no two merge into one host I/O.
    for sector in [0, 8, 16] {
        guest.post(VIRTIO_BLK_T_IN, sector, Some((512, true)));
    }
    signal(&guest.kick);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(guest.used_idx(), 1, "the second request waits");
    // Lifting the limit lets the waiting request and the rest go at once.
    t.send(Command::SetThrottle(None));
    guest.kick_and_wait(3);
    assert_eq!(seen.lock().unwrap().len(), 3);

    // A stop does not wait for the limits either; what was never popped stays in the ring.
    let mut guest = Guest::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut t2 = start_throttled(&guest, seen, Some(iops_limit(1)));
    // Apart, so that no two merge into one host I/O.
    for sector in [0, 8, 16] {
        guest.post(VIRTIO_BLK_T_IN, sector, Some((512, true)));
    }
    signal(&guest.kick);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(guest.used_idx(), 1);
    let (tx, rx) = sync_channel(1);
    let asked = std::time::Instant::now();
    t2.send(Command::Stop {
        local: 0,
        reply: tx,
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), 2);
    assert!(
        asked.elapsed() < Duration::from_millis(500),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(guest.used_idx(), 2);
    t.shutdown();
    t2.shutdown();
}

/// What dirty logging costs the request path: an I/O thread on the null engine serving 4 KiB
/// reads, 64 in flight on one 256-entry queue, with logging off and on (log, used ring),
/// alternating 1 s runs. Prints requests per second; run it in a release build:
/// `cargo test -p mqblk --release --lib dirty_logging_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn dirty_logging_cost_on_the_null_engine() {
    const Q: u16 = 256;
    const N: u16 = 64;
    const MEM: u64 = 16 << 20;
    let (desc, avail, used) = (0u64, 0x1000u64, 0x2000u64);
    let mem = Arc::new(GuestMemory::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap());
    // Request i: header at 0x4000 + 16 i, 4 KiB of data at 1 MiB + 4 KiB i, status at 0x8000 + i.
    let next = VRING_DESC_F_NEXT as u16;
    let write = VRING_DESC_F_WRITE as u16;
    for i in 0..N {
        let (hdr, data, status) = (
            0x4000 + 16 * u64::from(i),
            (1 << 20) + 4096 * u64::from(i),
            0x8000 + u64::from(i),
        );
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&VIRTIO_BLK_T_IN.to_le_bytes());
        h[8..16].copy_from_slice(&(u64::from(i) * 8).to_le_bytes());
        mem.write_slice(&h, GuestAddress(hdr)).unwrap();
        let d = 3 * i;
        for (k, (addr, len, flags)) in [
            (hdr, 16, next),
            (data, 4096, next | write),
            (status, 1, write),
        ]
        .into_iter()
        .enumerate()
        {
            let idx = d + k as u16;
            let dsc = Descriptor::new(addr, len, flags, idx + 1);
            mem.write_obj(dsc, GuestAddress(desc + 16 * u64::from(idx)))
                .unwrap();
        }
    }
    let mut q = Queue::new(Q).unwrap();
    q.set_size(Q);
    q.set_desc_table_address(Some(desc as u32), Some(0));
    q.set_avail_ring_address(Some(avail as u32), Some(0));
    q.set_used_ring_address(Some(used as u32), Some(0));
    q.set_ready(true);
    let (kick, call) = (eventfd(), eventfd());
    let cfg = IoThreadConfig {
        name: "mqblk-io-cost".into(),
        failure: Arc::new(super::Failure::new().unwrap()),
        cpu: None,
        queue_sizes: vec![Q],
        limits: Limits {
            capacity_sectors: MEM >> 9,
            max_descriptors: 8,
            readonly: false,
            max_discard_sectors: 1 << 20,
            max_write_zeroes_sectors: 1 << 20,
        },
        serial: b"cost".to_vec(),
        tuning: Tuning::default(),
        throttle: None,
    };
    let mut t = spawn(cfg, Arc::new(crate::engine::NullEngine::new(MEM, true))).unwrap();
    let (tx, rx) = sync_channel(1);
    t.send(Command::SetMem {
        mem: Some(mem.clone()),
        reply: tx,
    });
    rx.recv().unwrap();
    t.send(Command::Start {
        local: 0,
        index: 0,
        queue: q,
        kick: kick.try_clone().unwrap(),
        call: Some(call.try_clone().unwrap()),
        inflight: None,
        resubmit: Vec::new(),
    });
    let (log, _view) = dirty_log(MEM / 4096 / 8);
    let mut avail_idx = 0u16;
    // Posts all N requests, kicks, and waits until they are used: one round.
    let mut round = || {
        for i in 0..N {
            let slot = u64::from(avail_idx.wrapping_add(i) % Q);
            mem.write_obj(3 * i, GuestAddress(avail + 4 + 2 * slot))
                .unwrap();
        }
        avail_idx = avail_idx.wrapping_add(N);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        mem.write_obj(avail_idx, GuestAddress(avail + 2)).unwrap();
        signal(&kick);
        while mem.read_obj::<u16>(GuestAddress(used + 2)).unwrap() != avail_idx {
            wait_signalled(&call, Duration::from_millis(100));
        }
    };
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for run in 0..10 {
        let on = run % 2 == 1;
        set_dirty_log(&t, on.then(|| log.clone()), used);
        let start = std::time::Instant::now();
        let mut done = 0u64;
        while start.elapsed() < Duration::from_secs(1) {
            round();
            done += u64::from(N);
        }
        rates[usize::from(on)].push(done as f64 / start.elapsed().as_secs_f64());
    }
    t.shutdown();
    let c = super::IoCounters::sum([t.counters()]);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (off, on) = (median(&mut rates[0]), median(&mut rates[1]));
    eprintln!(
        "dirty logging cost, null engine, 4 KiB reads, 64 in flight: off {off:.0} req/s, on \
         {on:.0} req/s ({:+.1}%); runs off {:?}, on {:?}; {} pages marked",
        (on / off - 1.0) * 100.0,
        rates[0].iter().map(|r| *r as u64).collect::<Vec<_>>(),
        rates[1].iter().map(|r| *r as u64).collect::<Vec<_>>(),
        c.dirty_pages
    );
    assert!(c.dirty_pages > 0);
}
