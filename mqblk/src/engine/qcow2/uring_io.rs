//! A metadata worker's own io_uring. The image files' reads, writes and syncs of every job the
//! worker runs are entries on it, in flight together (a batch of copy-on-writes shares its
//! submissions and its wait), and each job waits for its entry as a future ([`RingOp`]).
//!
//! The ring belongs to its thread ([`install`], [`current`]). A thread without one (a control
//! thread opening, resizing or snapshotting an image) makes the same calls blocking: see
//! [`storage`](super::storage).

use std::cell::{Cell, RefCell, UnsafeCell};
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

use crate::sandbox::uring::{restrict_and_enable, RingAllowlist};

/// The `user_data` of the wake eventfd's read.
const WAKE: u64 = u64::MAX;

/// The opcodes of the entries a worker's ring takes ([`Io`] and the wake eventfd's read; a
/// timeout reaches nothing outside the ring).
pub const OPCODES: &[u8] = &[
    opcode::Readv::CODE,
    opcode::Writev::CODE,
    opcode::ReadFixed::CODE,
    opcode::WriteFixed::CODE,
    opcode::Fsync::CODE,
    opcode::Read::CODE,
    opcode::Timeout::CODE,
];

/// A metadata worker's ring of `entries`; `confined` (a confined daemon): it takes only
/// [`OPCODES`], as the I/O threads' rings take only theirs. seccomp sees `io_uring_enter`,
/// never what a ring does, so an unrestricted ring would let the worker, which runs imago on
/// guest requests, open files or sockets past the syscall filter. `fixed`, if given, is
/// registered as the ring's buffer 0 (before any restriction), if the kernel lets it: returned
/// with the ring as `true`. (Its memory must outlive the ring's operations on it.)
pub fn worker_ring(
    entries: u32,
    confined: bool,
    fixed: Option<libc::iovec>,
) -> io::Result<(IoUring, bool)> {
    let mut builder = IoUring::builder();
    if confined {
        builder.setup_r_disabled();
    }
    let ring = builder.build(entries)?;
    // A refusal (the locked-memory limit, for a daemon without CAP_IPC_LOCK) only costs the
    // pinning the registration saves.
    // SAFETY: the caller's contract: the memory stays valid while the ring may use it.
    let registered = match fixed.map(|iov| unsafe { ring.submitter().register_buffers(&[iov]) }) {
        Some(Err(e)) => {
            tracing::debug!(err = %e, "qcow2 worker: copy-on-write buffers not registered");
            false
        }
        done => done.is_some(),
    };
    if confined {
        let allow = RingAllowlist {
            opcodes: &[OPCODES],
            register_ops: &[],
            sqe_flags: 0,
        };
        restrict_and_enable(&ring.submitter(), &allow)?;
    }
    Ok((ring, registered))
}

/// `fdatasync` of `file`: on this thread's ring if it has one, blocking otherwise.
pub async fn sync_data(file: &std::fs::File) -> io::Result<()> {
    match current() {
        Some(ring) => {
            // SAFETY: a sync names no memory.
            let res = unsafe { ring.start(file.as_raw_fd(), Io::Sync { data_only: true }, 0) };
            match res.await {
                0.. => Ok(()),
                e => Err(io::Error::from_raw_os_error(-e)),
            }
        }
        None => Ok(rustix::fs::fdatasync(file)?),
    }
}

/// Waits `d` on this thread's ring (blocking without one).
pub async fn sleep(d: Duration) {
    match current() {
        // SAFETY: a timeout names no memory of the caller's (its time is the slot's).
        Some(ring) => drop(unsafe { ring.start(-1, Io::Sleep(d), 0) }.await),
        None => std::thread::sleep(d),
    }
}

/// One read of `fd` at `offset` into `buf`: on this thread's ring if it has one, blocking
/// otherwise. Returns the bytes read (0 at the end of the file).
pub async fn read_at(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let iov = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    let res = match current() {
        // SAFETY: `buf` is borrowed until the read completes: it is awaited here, and a drop
        // of the operation waits for it.
        Some(ring) => unsafe { ring.start(fd, Io::Read(&iov), offset) }.await as isize,
        // SAFETY: `buf` is valid and writable for the call.
        None => unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), offset as i64) },
    };
    match res {
        0.. => Ok(res as usize),
        _ if current().is_some() => Err(io::Error::from_raw_os_error(-res as i32)),
        _ => Err(io::Error::last_os_error()),
    }
}

/// What a [`RingOp`] does.
pub enum Io<'a> {
    /// `preadv` into these buffers.
    Read(&'a [libc::iovec]),
    /// `pwritev` from these buffers.
    Write(&'a [libc::iovec]),
    /// `pwritev2` with `RWF_DSYNC`: durable when it completes.
    WriteThrough(&'a [libc::iovec]),
    /// `fdatasync` (true) or `fsync` (false).
    Sync { data_only: bool },
    /// Nothing, for this long (a timeout; completes with -ETIME).
    Sleep(Duration),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    InFlight,
    Done(i32),
}

/// One ring entry's bookkeeping, reused.
struct Slot {
    state: State,
    /// The entry's iovec array: it must outlive the entry, so the slot owns a copy.
    iovecs: Vec<libc::iovec>,
    /// A sleep's time, which the kernel reads when the entry is submitted (boxed: the slots
    /// move when more are made).
    sleep: Option<Box<types::Timespec>>,
    waker: Option<Waker>,
}

/// A worker's ring and the entries in flight on it.
pub struct Reactor {
    ring: RefCell<IoUring>,
    slots: RefCell<Vec<Slot>>,
    free: RefCell<Vec<usize>>,
    /// Written by a waker on another thread (an imago lock released there): its read on the
    /// ring completes, and the worker's wait returns.
    wake: Arc<OwnedFd>,
    /// Where the wake eventfd's counter is read to.
    wake_buf: Box<UnsafeCell<u64>>,
    /// The wake read needs arming again.
    wake_disarmed: Cell<bool>,
    /// The addresses of the ring's registered buffer 0, if it has one.
    fixed: Option<std::ops::Range<usize>>,
}

thread_local! {
    static CURRENT: RefCell<Option<Rc<Reactor>>> = const { RefCell::new(None) };
}

/// Makes `reactor` this thread's ring.
pub fn install(reactor: Rc<Reactor>) {
    CURRENT.with(|c| *c.borrow_mut() = Some(reactor));
}

/// This thread's ring, if it has one.
pub fn current() -> Option<Rc<Reactor>> {
    CURRENT.with(|c| c.borrow().clone())
}

impl Reactor {
    /// `ring`, whose waits also end when `wake` is written, and whose buffer 0 (if `fixed`)
    /// is that memory.
    pub fn new(ring: IoUring, wake: Arc<OwnedFd>, fixed: Option<libc::iovec>) -> Rc<Reactor> {
        Rc::new(Reactor {
            ring: RefCell::new(ring),
            slots: RefCell::new(Vec::new()),
            free: RefCell::new(Vec::new()),
            wake,
            wake_buf: Box::new(UnsafeCell::new(0)),
            wake_disarmed: Cell::new(true),
            fixed: fixed.map(|v| v.iov_base as usize..v.iov_base as usize + v.iov_len),
        })
    }

    /// Whether `v` is one buffer inside the registered one.
    fn in_fixed(&self, v: &[libc::iovec]) -> bool {
        match (&self.fixed, v) {
            (Some(fixed), [one]) => {
                let start = one.iov_base as usize;
                fixed.start <= start && start + one.iov_len <= fixed.end
            }
            _ => false,
        }
    }

    /// Queues `io` on `fd` at `offset` (submitted at the next [`wait`](Self::wait)).
    ///
    /// # Safety
    /// The buffers `io` describes must stay valid (and, for a read, writable) until the
    /// returned operation completes or is dropped (which waits for it).
    pub unsafe fn start(self: &Rc<Self>, fd: RawFd, io: Io<'_>, offset: u64) -> RingOp {
        let id = self.free.borrow_mut().pop().unwrap_or_else(|| {
            let mut slots = self.slots.borrow_mut();
            slots.push(Slot {
                state: State::Free,
                iovecs: Vec::new(),
                sleep: None,
                waker: None,
            });
            slots.len() - 1
        });
        let entry = {
            let mut slots = self.slots.borrow_mut();
            let slot = &mut slots[id];
            slot.state = State::InFlight;
            slot.iovecs.clear();
            let fd = types::Fd(fd);
            match io {
                // One buffer of the registered region: its pages are pinned already.
                Io::Read(v) | Io::Write(v) | Io::WriteThrough(v) if self.in_fixed(v) => {
                    let (ptr, len) = (v[0].iov_base.cast::<u8>(), v[0].iov_len as u32);
                    match io {
                        Io::Read(_) => opcode::ReadFixed::new(fd, ptr, len, 0)
                            .offset(offset)
                            .build(),
                        Io::Write(_) => opcode::WriteFixed::new(fd, ptr, len, 0)
                            .offset(offset)
                            .build(),
                        _ => opcode::WriteFixed::new(fd, ptr, len, 0)
                            .offset(offset)
                            .rw_flags(libc::RWF_DSYNC)
                            .build(),
                    }
                }
                Io::Read(v) | Io::Write(v) | Io::WriteThrough(v) => {
                    slot.iovecs.extend_from_slice(v);
                    // The array lives in the slot's own allocation until the slot is reused,
                    // which is after the completion.
                    let (ptr, len) = (slot.iovecs.as_ptr(), slot.iovecs.len() as u32);
                    match io {
                        Io::Read(_) => opcode::Readv::new(fd, ptr, len).offset(offset).build(),
                        Io::Write(_) => opcode::Writev::new(fd, ptr, len).offset(offset).build(),
                        _ => opcode::Writev::new(fd, ptr, len)
                            .offset(offset)
                            .rw_flags(libc::RWF_DSYNC)
                            .build(),
                    }
                }
                Io::Sync { data_only } => {
                    let flags = match data_only {
                        true => types::FsyncFlags::DATASYNC,
                        false => types::FsyncFlags::empty(),
                    };
                    opcode::Fsync::new(fd).flags(flags).build()
                }
                Io::Sleep(d) => {
                    let ts = slot.sleep.insert(Box::new(types::Timespec::from(d)));
                    opcode::Timeout::new(&**ts).build()
                }
            }
        };
        self.push(entry.user_data(id as u64));
        RingOp {
            reactor: self.clone(),
            id: Some(id),
        }
    }

    fn push(&self, entry: squeue::Entry) {
        let mut ring = self.ring.borrow_mut();
        loop {
            // SAFETY: the entry's buffers are valid until its completion (`start`'s contract;
            // the iovec arrays and the wake buffer are owned by the reactor).
            if unsafe { ring.submission().push(&entry) }.is_ok() {
                return;
            }
            // Full: hand what is queued to the kernel and try again.
            let _ = ring.submit();
        }
    }

    /// Submits what is queued and waits until at least one entry completes or the thread is
    /// woken; then records every completion and wakes the tasks waiting for them.
    pub fn wait(&self) -> io::Result<()> {
        self.wait_at_most(None)
    }

    /// [`wait`](Self::wait), returning after `limit` at the latest.
    pub fn wait_at_most(&self, limit: Option<Duration>) -> io::Result<()> {
        if self.wake_disarmed.replace(false) {
            let buf = self.wake_buf.get().cast::<u8>();
            let read = opcode::Read::new(types::Fd(self.wake.as_raw_fd()), buf, 8).build();
            self.push(read.user_data(WAKE));
        }
        // A kernel without timed waits (before 5.11) waits for the next completion instead,
        // which comes: a limit is only asked for while other jobs are at work.
        let limit = limit.filter(|_| self.ring.borrow().params().is_feature_ext_arg());
        let submitted = match limit {
            None => self.ring.borrow_mut().submit_and_wait(1),
            Some(limit) => {
                let ts = types::Timespec::from(limit);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.borrow().submitter().submit_with_args(1, &args)
            }
        };
        match submitted {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::ETIME)
                ) => {}
            Err(e) => return Err(e),
        }
        let mut wakers = Vec::new();
        {
            let mut ring = self.ring.borrow_mut();
            let mut slots = self.slots.borrow_mut();
            for cqe in ring.completion() {
                if cqe.user_data() == WAKE {
                    self.wake_disarmed.set(true);
                    continue;
                }
                let slot = &mut slots[cqe.user_data() as usize];
                slot.state = State::Done(cqe.result());
                wakers.extend(slot.waker.take());
            }
        }
        // Outside the borrows: a waker may poll nothing here, but stays free to.
        for w in wakers {
            w.wake();
        }
        Ok(())
    }

    fn state(&self, id: usize) -> State {
        self.slots.borrow()[id].state
    }

    fn release(&self, id: usize) {
        self.slots.borrow_mut()[id].state = State::Free;
        self.free.borrow_mut().push(id);
    }
}

impl Drop for Reactor {
    /// The wake read names `wake_buf`: it is completed (by a wake-up of our own) before the
    /// buffer goes.
    fn drop(&mut self) {
        if self.wake_disarmed.get() {
            return;
        }
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        while !self.wake_disarmed.get() {
            if self.wait().is_err() {
                // It may still complete into the buffer: leave the buffer to it.
                let buf = std::mem::replace(&mut self.wake_buf, Box::new(UnsafeCell::new(0)));
                std::mem::forget(buf);
                return;
            }
        }
    }
}

/// An entry in flight on a worker's ring; resolves to its result (bytes or a negative errno).
/// Dropped before it completes, it waits for the completion, so that the kernel never writes
/// into or reads from memory given back.
pub struct RingOp {
    reactor: Rc<Reactor>,
    id: Option<usize>,
}

impl Future for RingOp {
    type Output = i32;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<i32> {
        let Some(id) = self.id else {
            return Poll::Ready(-libc::EINVAL);
        };
        match self.reactor.state(id) {
            State::Done(res) => {
                self.reactor.release(id);
                self.id = None;
                Poll::Ready(res)
            }
            _ => {
                self.reactor.slots.borrow_mut()[id].waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl Drop for RingOp {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else {
            return;
        };
        while self.reactor.state(id) == State::InFlight {
            if let Err(e) = self.reactor.wait() {
                // The ring no longer works: nothing can complete the entry, and the memory it
                // names must not be given back.
                tracing::error!(err = %e, "qcow2 worker ring failed with an I/O in flight");
                std::process::abort();
            }
        }
        self.reactor.release(id);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::io::Write;
    use std::task::{Context, Poll};

    use rustix::event::{eventfd, EventfdFlags};

    use super::*;

    pub(in crate::engine::qcow2) fn reactor() -> Rc<Reactor> {
        let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC).unwrap());
        Reactor::new(IoUring::new(8).unwrap(), wake, None)
    }

    /// A file of `len` bytes, each its offset modulo 251.
    fn patterned(len: usize) -> std::fs::File {
        let mut f = tempfile::tempfile().unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        f.write_all(&bytes).unwrap();
        f
    }

    /// Polls `fut` to its end, waiting on `r` whenever it is pending.
    pub(in crate::engine::qcow2) fn drive<T>(r: &Reactor, fut: impl Future<Output = T>) -> T {
        let mut fut = std::pin::pin!(fut);
        let waker = futures::task::noop_waker();
        loop {
            if let Poll::Ready(v) = fut.as_mut().poll(&mut Context::from_waker(&waker)) {
                return v;
            }
            r.wait().unwrap();
        }
    }

    #[test]
    fn reads_in_flight_together_complete_with_their_bytes() {
        let f = patterned(8192);
        let r = reactor();
        install(r.clone());
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        let fd = f.as_raw_fd();
        let (x, y) = drive(
            &r,
            futures::future::join(read_at(fd, &mut a, 4096), read_at(fd, &mut b, 0)),
        );
        assert_eq!((x.unwrap(), y.unwrap()), (4096, 4096));
        assert!(a
            .iter()
            .enumerate()
            .all(|(i, &v)| v == ((i + 4096) % 251) as u8));
        assert!(b.iter().enumerate().all(|(i, &v)| v == (i % 251) as u8));
        // Past the end: 0 bytes.
        assert_eq!(drive(&r, read_at(fd, &mut a, 8192)).unwrap(), 0);
    }

    #[test]
    fn a_dropped_operation_is_complete_before_its_buffer_is_given_back() {
        let f = patterned(4096);
        let r = reactor();
        let mut buf = vec![0u8; 4096];
        let iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: `buf` outlives the operation (dropped right here, which waits for it).
        let op = unsafe { r.start(f.as_raw_fd(), Io::Read(&iov), 0) };
        drop(op);
        // Never polled nor submitted before the drop: only the drop's wait read the file.
        assert!(buf.iter().enumerate().all(|(i, &v)| v == (i % 251) as u8));
        // Its slot was given back and is reused.
        assert_eq!(r.free.borrow().len(), 1);
    }

    #[test]
    fn a_thread_without_a_ring_reads_blocking() {
        let f = patterned(4096);
        std::thread::spawn(move || {
            assert!(current().is_none());
            let mut buf = vec![0u8; 100];
            let n = futures::executor::block_on(read_at(f.as_raw_fd(), &mut buf, 10)).unwrap();
            assert_eq!(n, 100);
            assert_eq!(buf[0], 10);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_write_on_another_thread_ends_the_wait() {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        // The waiting ring on a thread of its own: a wake-up that did not end the wait fails
        // the test after a timeout instead of hanging it.
        std::thread::spawn(move || {
            let r = reactor();
            let wake = r.wake.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                rustix::io::write(&*wake, &1u64.to_ne_bytes()).unwrap();
            });
            // Nothing in flight but the wake-up read: only the other thread ends this.
            r.wait().unwrap();
            done_tx.send(r.wake_disarmed.get()).unwrap();
        });
        let woken = done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the wait did not end");
        assert!(woken);
    }

    /// One buffer inside the registered region goes as a fixed-buffer read (which the kernel
    /// refuses where nothing is registered: so the reactor did use it), anything else as a
    /// readv; and a registration the kernel refuses leaves a ring that works, without it.
    #[test]
    fn a_buffer_in_the_registered_region_is_read_as_a_fixed_one() {
        use super::super::cluster_buffers::Region;
        let file = patterned(8192);
        let fd = file.as_raw_fd();
        let mut region = Region::new(4096, 4096).unwrap();
        let iov = region.iovec();
        // SAFETY: `region` outlives both reactors and every read below.
        let buf = unsafe { std::slice::from_raw_parts_mut(iov.iov_base.cast::<u8>(), 4096) };
        let wake = || Arc::new(eventfd(0, EventfdFlags::CLOEXEC).unwrap());

        let (ring, registered) = worker_ring(8, false, Some(iov)).unwrap();
        assert!(registered);
        let r = Reactor::new(ring, wake(), Some(iov));
        install(r.clone());
        assert_eq!(drive(&r, read_at(fd, buf, 4096)).unwrap(), 4096);
        assert!(buf
            .iter()
            .enumerate()
            .all(|(i, &b)| b == ((i + 4096) % 251) as u8));
        let mut outside = vec![0u8; 512];
        assert_eq!(drive(&r, read_at(fd, &mut outside, 0)).unwrap(), 512);

        // Told of a region its ring never registered, the reactor's fixed read fails.
        let (ring, _) = worker_ring(8, false, None).unwrap();
        let r = Reactor::new(ring, wake(), Some(iov));
        install(r.clone());
        let err = drive(&r, read_at(fd, buf, 0)).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");

        // Memory the kernel cannot pin (nothing is mapped at page 1): refused, and the ring
        // works on.
        let unmapped = libc::iovec {
            iov_base: 4096 as *mut libc::c_void,
            iov_len: 4096,
        };
        let (ring, registered) = worker_ring(8, false, Some(unmapped)).unwrap();
        assert!(!registered);
        let r = Reactor::new(ring, wake(), None);
        install(r.clone());
        assert_eq!(drive(&r, read_at(fd, &mut outside, 0)).unwrap(), 512);
    }

    #[test]
    fn a_confined_worker_ring_refuses_opcodes_outside_its_allowlist() {
        let (mut ring, _) = worker_ring(8, true, None).unwrap();
        let file = patterned(4096);
        let fd = types::Fd(file.as_raw_fd());
        let mut buf = [0u8; 512];
        let iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        let entries = [
            opcode::Nop::new().build(),
            opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), c"/etc/passwd".as_ptr()).build(),
            opcode::Connect::new(fd, std::ptr::null(), 0).build(),
            opcode::Readv::new(fd, iov.as_ptr(), 1).build(),
            opcode::Fsync::new(fd).build(),
        ];
        for (i, e) in entries.iter().enumerate() {
            // SAFETY: the entries name a static path, a live file and a buffer that outlives
            // the wait below.
            unsafe { ring.submission().push(&e.clone().user_data(i as u64)) }.unwrap();
        }
        // A refused entry ends a submission: submit again until each has its completion.
        let mut results = vec![None; entries.len()];
        while results.iter().any(Option::is_none) {
            ring.submit_and_wait(1).unwrap();
            for c in ring.completion() {
                results[c.user_data() as usize] = Some(c.result());
            }
        }
        let refused = Some(-libc::EACCES);
        assert_eq!(
            results,
            [refused, refused, refused, Some(512), Some(0)],
            "NOP, OPENAT and CONNECT refused; READV and FSYNC done"
        );
        assert!(buf.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        // Unconfined (the daemon with --sandbox off, or a kernel without ring restrictions).
        let (mut open, _) = worker_ring(8, false, None).unwrap();
        // SAFETY: no memory named.
        unsafe { open.submission().push(&opcode::Nop::new().build()) }.unwrap();
        open.submit_and_wait(1).unwrap();
        assert_eq!(open.completion().next().map(|c| c.result()), Some(0));
    }
}
