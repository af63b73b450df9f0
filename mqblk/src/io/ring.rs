//! The I/O thread's io_uring: setup, what each entry is for ([`Token`]), submission with exact
//! syscall accounting, and the registration of the engine's file and of guest memory.
//!
//! Everything the thread waits for arrives as a completion on this one ring: guest kicks
//! (multishot polls on the kick eventfds), control commands (a read of the wake eventfd),
//! engine I/O, and an engine's own completion fd. Guest notifications are ring entries too, so
//! one `io_uring_enter` both submits a batch and sleeps.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::policy::submit::submit_early;
use super::stats::IoCounters;
use super::GuestMemory;
use crate::config::Tuning;
use crate::sandbox::uring::{restrict_and_enable, RingAllowlist};

/// What a ring entry is for, carried in its user data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token {
    /// An engine I/O, named by the slot of its (leading) request.
    Io(u32),
    /// A guest kick on this thread's queue `local`. `generation` changes each time the queue
    /// is started, so that a poll left over from an earlier start is recognised and ignored.
    Kick {
        /// The queue, by its index among this thread's queues.
        local: u16,
        /// The start it belongs to.
        generation: u16,
    },
    /// The wake eventfd was read: control commands wait.
    Control,
    /// The engine's completion fd is readable.
    EngineEvents,
    /// A QoS wait ended: queues waiting for admission ask their buckets again.
    QosTimer,
    /// An entry whose completion carries nothing (a guest notification, a poll removal).
    Ignore,
}

const TAG_SHIFT: u32 = 56;
const PAYLOAD: u64 = (1 << TAG_SHIFT) - 1;

impl Token {
    /// The user data that carries this token.
    pub fn encode(self) -> u64 {
        let (tag, payload) = match self {
            Token::Io(slot) => (0, u64::from(slot)),
            Token::Kick { local, generation } => {
                (1, u64::from(generation) << 16 | u64::from(local))
            }
            Token::Control => (2, 0),
            Token::EngineEvents => (3, 0),
            Token::Ignore => (4, 0),
            Token::QosTimer => (5, 0),
        };
        tag << TAG_SHIFT | (payload & PAYLOAD)
    }

    /// The token a completion's user data carries.
    pub fn decode(data: u64) -> Token {
        let payload = data & PAYLOAD;
        match data >> TAG_SHIFT {
            0 => Token::Io(payload as u32),
            1 => Token::Kick {
                local: payload as u16,
                generation: (payload >> 16) as u16,
            },
            2 => Token::Control,
            3 => Token::EngineEvents,
            5 => Token::QosTimer,
            _ => Token::Ignore,
        }
    }
}

/// One completion: what it was for, its result and its flags.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    /// What the entry was for.
    pub token: Token,
    /// The operation's result (a negative errno on failure).
    pub result: i32,
    /// Completion flags (`IORING_CQE_F_MORE` for a multishot poll that goes on).
    pub flags: u32,
}

impl Completion {
    /// A multishot poll that ended with this completion and must be re-armed.
    pub fn multishot_ended(&self) -> bool {
        !cqueue::more(self.flags)
    }
}

/// The opcodes of the entries this file builds: kicks and engine completion fds (multishot
/// polls and their removal), the wake eventfd's read, QoS timers, guest notifications.
pub const OPCODES: &[u8] = &[
    opcode::PollAdd::CODE,
    opcode::PollRemove::CODE,
    opcode::Read::CODE,
    opcode::Timeout::CODE,
    opcode::Write::CODE,
];

/// The registrations made on a running ring (`IORING_REGISTER_BUFFERS`,
/// `IORING_UNREGISTER_BUFFERS`, `IORING_REGISTER_FILES` in `<linux/io_uring.h>`): guest memory
/// on each memory swap, the engine's file.
const REGISTER_OPS: &[u8] = &[0, 1, 2];

/// The submission flags entries may carry: the engine's fixed file, and notifications that
/// post no completion.
const SQE_FLAGS: squeue::Flags = squeue::Flags::FIXED_FILE.union(squeue::Flags::SKIP_SUCCESS);

/// The value written to a call eventfd; static, so it outlives the ring write.
static ONE: u64 = 1;

/// Largest fixed buffer io_uring accepts.
const MAX_FIXED_BUFFER: usize = 1 << 30;

/// The io_uring itself: plain 64-byte entries, or the 128-byte submission and 32-byte
/// completion entries that NVMe passthrough commands need (`IORING_SETUP_SQE128 |
/// IORING_SETUP_CQE32`). Which one is the engine's choice ([`Engine::wide_entries`]); a plain
/// entry goes on either.
enum Uring {
    Plain(IoUring),
    Wide(IoUring<squeue::Entry128, cqueue::Entry32>),
}

/// Evaluates `$body` with `$u` bound to whichever ring `$ring` holds.
macro_rules! on_ring {
    ($ring:expr, $u:ident => $body:expr) => {
        match $ring {
            Uring::Plain($u) => $body,
            Uring::Wide($u) => $body,
        }
    };
}

impl Uring {
    /// Room left in the submission queue.
    fn room(&mut self) -> usize {
        on_ring!(self, u => {
            let sq = u.submission();
            sq.capacity() - sq.len()
        })
    }

    /// Pushes a plain entry (widened to 128 bytes on a wide ring).
    ///
    /// # Safety
    /// As for `SubmissionQueue::push`: what the entry names stays valid until it completes.
    unsafe fn push(&mut self, sqe: &squeue::Entry) -> Result<(), squeue::PushError> {
        match self {
            // SAFETY: the caller's contract.
            Uring::Plain(u) => unsafe { u.submission().push(sqe) },
            // SAFETY: the caller's contract; the upper 64 bytes of a widened entry are zero.
            Uring::Wide(u) => unsafe { u.submission().push(&squeue::Entry128::from(sqe.clone())) },
        }
    }

    /// Pushes a 128-byte entry; a plain ring cannot take one.
    ///
    /// # Safety
    /// As for [`Uring::push`].
    unsafe fn push_wide(&mut self, sqe: &squeue::Entry128) -> Result<(), WideOnPlain> {
        match self {
            Uring::Plain(_) => Err(WideOnPlain),
            // SAFETY: the caller's contract.
            Uring::Wide(u) => unsafe { u.submission().push(sqe) }.map_err(|_| WideOnPlain),
        }
    }

    fn submit(&self) -> io::Result<usize> {
        on_ring!(self, u => u.submit())
    }

    fn submit_and_wait(&self, want: usize) -> io::Result<usize> {
        on_ring!(self, u => u.submit_and_wait(want))
    }

    fn submitter(&self) -> io_uring::Submitter<'_> {
        on_ring!(self, u => u.submitter())
    }

    fn taskrun(&mut self) -> bool {
        on_ring!(self, u => u.submission().taskrun())
    }

    fn completions_waiting(&mut self) -> bool {
        on_ring!(self, u => !u.completion().is_empty())
    }

    /// The next completion's user data, result and flags (a wide completion's extra 16 bytes,
    /// an NVMe command's result dword, are not needed: its status is the result).
    // One body for both rings: on the plain one the conversion is the identity.
    #[allow(clippy::useless_conversion)]
    fn next_completion(&mut self) -> Option<(u64, i32, u32)> {
        on_ring!(self, u => u.completion().next().map(|cqe| {
            let cqe: cqueue::Entry = cqe.into();
            (cqe.user_data(), cqe.result(), cqe.flags())
        }))
    }

    fn skip_cqe_on_success(&self) -> bool {
        on_ring!(self, u => u.params().is_feature_skip_cqe_on_success())
    }
}

/// A 128-byte entry offered to a ring of 64-byte entries (or to a full ring).
#[derive(Debug)]
struct WideOnPlain;

/// An I/O thread's ring and what it registered.
pub struct Ring {
    uring: Uring,
    /// Entries pushed since the last `io_uring_enter`.
    queued: u32,
    /// Engine I/Os among them.
    queued_io: u32,
    /// Engine I/Os submitted and not yet completed.
    io_at_device: u64,
    /// Flags of the guest-notification writes: no completion entry when they succeed (where
    /// the kernel can), so a notification never wakes this thread by itself.
    notify_flags: squeue::Flags,
    /// Set up with COOP_TASKRUN and TASKRUN_FLAG.
    taskrun_flag: bool,
    /// The engine's file is registered as fixed-file slot (its descriptor number).
    fixed_file: bool,
    /// Guest memory registered as fixed buffers: `(host start, host end)` by buffer index.
    buffers: Vec<(usize, usize)>,
    /// The duration of the last timeout entry (stable: boxed; the kernel reads it when the
    /// entry is submitted).
    timeout: Box<types::Timespec>,
}

fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
    )
}

impl Ring {
    /// An unrestricted ring (unit tests).
    #[cfg(test)]
    pub fn new(entries: u32, tuning: &Tuning) -> io::Result<Ring> {
        Ring::build(entries, tuning, false, None)
    }

    /// A ring of `entries` submission entries, set up as `tuning` asks (kernels that refuse
    /// COOP_TASKRUN, before 6.0, get a plain ring), for an I/O thread whose engine builds
    /// entries of `engine_opcodes`: in a confined daemon, the ring accepts only those and this
    /// file's (see [`crate::sandbox`]). A `wide` ring takes 128-byte entries (NVMe commands).
    pub fn confined(
        entries: u32,
        tuning: &Tuning,
        wide: bool,
        engine_opcodes: &[u8],
    ) -> io::Result<Ring> {
        let opcodes = [OPCODES, engine_opcodes];
        let allow = RingAllowlist {
            opcodes: &opcodes,
            register_ops: REGISTER_OPS,
            sqe_flags: SQE_FLAGS.bits(),
        };
        let allow = crate::sandbox::rings_confined().then_some(&allow);
        crate::sandbox::ring_setup(|| Ring::build(entries, tuning, wide, allow))
    }

    /// A ring, wide or not, restricted to `allow` if given.
    fn build(
        entries: u32,
        tuning: &Tuning,
        wide: bool,
        allow: Option<&RingAllowlist>,
    ) -> io::Result<Ring> {
        if wide {
            let mut builder = IoUring::<squeue::Entry128, cqueue::Entry32>::builder();
            Ring::setup(&mut builder, entries, tuning, allow, |b, n| {
                b.build(n).map(Uring::Wide)
            })
        } else {
            let mut builder = IoUring::builder();
            Ring::setup(&mut builder, entries, tuning, allow, |b, n| {
                b.build(n).map(Uring::Plain)
            })
        }
    }

    /// Sets `builder` up as `tuning` asks and builds the ring with `build`.
    fn setup<S: squeue::EntryMarker, C: cqueue::EntryMarker>(
        builder: &mut io_uring::Builder<S, C>,
        entries: u32,
        tuning: &Tuning,
        allow: Option<&RingAllowlist>,
        build: impl Fn(&io_uring::Builder<S, C>, u32) -> io::Result<Uring>,
    ) -> io::Result<Ring> {
        let build = |coop: bool| {
            let mut builder = builder.clone();
            if allow.is_some() {
                builder.setup_r_disabled();
            }
            builder.setup_cqsize(entries * 4);
            if tuning.sqpoll_idle_ms > 0 {
                builder.setup_sqpoll(tuning.sqpoll_idle_ms);
            }
            if coop {
                // Completions arriving while this thread runs do not interrupt it (no IPI):
                // their task work runs at its next syscall, and while it polls the ring's
                // TASKRUN flag tells it to make one. Only this thread ever submits.
                builder
                    .setup_coop_taskrun()
                    .setup_taskrun_flag()
                    .setup_single_issuer();
            }
            build(&builder, entries)
        };
        let coop = tuning.coop_taskrun && tuning.sqpoll_idle_ms == 0;
        let (uring, taskrun_flag) = match build(coop) {
            Ok(r) => (r, coop),
            Err(_) if coop => (build(false)?, false),
            Err(e) => return Err(e),
        };
        if let Some(allow) = allow {
            restrict_and_enable(&uring.submitter(), allow)?;
        }
        let notify_flags = if uring.skip_cqe_on_success() {
            squeue::Flags::SKIP_SUCCESS
        } else {
            squeue::Flags::empty()
        };
        Ok(Ring {
            uring,
            queued: 0,
            queued_io: 0,
            io_at_device: 0,
            notify_flags,
            taskrun_flag,
            fixed_file: false,
            buffers: Vec::new(),
            timeout: Box::new(types::Timespec::new()),
        })
    }

    /// Registers `fd` as fixed-file slot `fd`, so that entries keep naming it by its number
    /// and only gain IOSQE_FIXED_FILE. Without a file, or if the kernel refuses, entries use
    /// the plain descriptor.
    pub fn register_file(&mut self, fd: Option<RawFd>) {
        let Some(fd) = fd.filter(|&fd| (0..65_536).contains(&fd)) else {
            return;
        };
        let mut table = vec![-1; fd as usize + 1];
        table[fd as usize] = fd;
        match self.uring.submitter().register_files(&table) {
            Ok(()) => self.fixed_file = true,
            Err(e) => {
                tracing::warn!(err = %e, "cannot register the backing file with io_uring; using plain descriptors");
            }
        }
    }

    /// Makes room for `n` more entries, entering the kernel with what is queued if needed.
    fn ensure_room(&mut self, n: usize, c: &mut IoCounters) {
        loop {
            if self.uring.room() >= n {
                return;
            }
            self.account_enter(c);
            match self.uring.submit() {
                Ok(_) => {}
                Err(e) if transient(&e) => {
                    // Completion queue backlog: let the kernel flush it.
                    c.enters += 1;
                    let _ = self.uring.submitter().submit_and_wait(0);
                }
                Err(e) => {
                    tracing::error!(err = %e, "io_uring submit failed");
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Queues an entry.
    ///
    /// # Safety
    /// Every buffer and descriptor `sqe` names must stay valid until its completion.
    pub unsafe fn push(&mut self, sqe: squeue::Entry, token: Token, c: &mut IoCounters) {
        self.ensure_room(1, c);
        // SAFETY: the caller's contract.
        let pushed = unsafe { self.uring.push(&sqe.user_data(token.encode())) };
        debug_assert!(pushed.is_ok(), "room was ensured");
        self.queued += 1;
    }

    /// Queues an engine's entry for the I/O of slot `slot`, on the fixed file if registered.
    ///
    /// # Safety
    /// As for [`Ring::push`]: the iovecs and guest memory the entry names stay valid until its
    /// completion.
    pub unsafe fn push_io(&mut self, sqe: squeue::Entry, slot: u32, c: &mut IoCounters) {
        let sqe = if self.fixed_file {
            c.fixed_file_ios += 1;
            sqe.flags(squeue::Flags::FIXED_FILE)
        } else {
            sqe
        };
        // SAFETY: the caller's contract.
        unsafe { self.push(sqe, Token::Io(slot), c) };
        self.queued_io += 1;
    }

    /// Queues a 128-byte engine entry (an NVMe command) for the I/O of slot `slot`, on the
    /// fixed file if registered. Returns false, queuing nothing, on a ring of 64-byte entries,
    /// which only an engine that asked for a plain ring and then built wide entries would meet.
    ///
    /// # Safety
    /// As for [`Ring::push_io`].
    #[must_use]
    pub unsafe fn push_wide_io(
        &mut self,
        sqe: squeue::Entry128,
        slot: u32,
        c: &mut IoCounters,
    ) -> bool {
        if matches!(self.uring, Uring::Plain(_)) {
            return false;
        }
        let sqe = if self.fixed_file {
            c.fixed_file_ios += 1;
            sqe.flags(squeue::Flags::FIXED_FILE)
        } else {
            sqe
        };
        self.ensure_room(1, c);
        // SAFETY: the caller's contract.
        let pushed = unsafe {
            self.uring
                .push_wide(&sqe.user_data(Token::Io(slot).encode()))
        };
        debug_assert!(pushed.is_ok(), "room was ensured");
        self.queued += 1;
        self.queued_io += 1;
        true
    }

    /// Queues an 8-byte read of `fd` into `buf`, completing as `token`.
    ///
    /// # Safety
    /// `buf` and `fd` must stay valid until the completion.
    pub unsafe fn push_read_u64(
        &mut self,
        fd: RawFd,
        buf: *mut u64,
        token: Token,
        c: &mut IoCounters,
    ) {
        let sqe = opcode::Read::new(types::Fd(fd), buf.cast(), 8).build();
        // SAFETY: the caller's contract.
        unsafe { self.push(sqe, token, c) };
    }

    /// Watches `fd` for readability with a multishot poll: one completion per event, no
    /// re-arming and no syscall of ours per event.
    pub fn push_poll(&mut self, fd: RawFd, token: Token, c: &mut IoCounters) {
        let sqe = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .multi(true)
            .build();
        // SAFETY: a poll names no buffer; the caller keeps `fd` open until the poll is removed
        // and the removal submitted.
        unsafe { self.push(sqe, token, c) };
    }

    /// Queues a timer that completes as `token` after `after`.
    pub fn push_timeout(&mut self, after: std::time::Duration, token: Token, c: &mut IoCounters) {
        *self.timeout = types::Timespec::from(after);
        let sqe = opcode::Timeout::new(&*self.timeout).build();
        // SAFETY: the entry names only the boxed timespec, which lives as long as the ring. A
        // later timeout overwrites it; if that happens before this entry was submitted, this
        // timer merely gets the later duration.
        unsafe { self.push(sqe, token, c) };
    }

    /// Removes the poll that completes as `token`.
    pub fn push_poll_remove(&mut self, token: Token, c: &mut IoCounters) {
        let sqe = opcode::PollRemove::new(token.encode()).build();
        // SAFETY: names no buffer or descriptor.
        unsafe { self.push(sqe, Token::Ignore, c) };
    }

    /// Queues a guest notification (a write of 1 to the call eventfd); with a full ring, the
    /// notification is written at once instead.
    pub fn push_notify(&mut self, call: &File, c: &mut IoCounters) {
        c.notifies += 1;
        let sqe = opcode::Write::new(types::Fd(call.as_raw_fd()), (&ONE as *const u64).cast(), 8)
            .build()
            .flags(self.notify_flags)
            .user_data(Token::Ignore.encode());
        // SAFETY: `ONE` is static; the kernel holds its own reference to the call file once
        // the entry is submitted, and the queue's call file is replaced or closed only after
        // what is queued was submitted (see the control commands).
        if unsafe { self.uring.push(&sqe) }.is_ok() {
            self.queued += 1;
        } else {
            write_eventfd(call);
        }
    }

    /// Notifies the guest at once, with a write(2) of its own rather than an entry that waits
    /// for the next `io_uring_enter`: an early notification is worth something only now.
    pub fn notify_now(&mut self, call: &File, c: &mut IoCounters) {
        c.notifies += 1;
        c.early_notifies += 1;
        write_eventfd(call);
    }

    /// Notifies the guest with a write(2) in place of an `io_uring_enter` that would carry
    /// nothing else (when that pays: `IoThread::notify`).
    pub fn notify_alone(&mut self, call: &File, c: &mut IoCounters) {
        c.notifies += 1;
        c.alone_notifies += 1;
        write_eventfd(call);
    }

    /// Whether nothing waits in the submission queue for the next `io_uring_enter`.
    pub fn nothing_queued(&self) -> bool {
        self.queued == 0
    }

    /// Accounts for an `io_uring_enter` that hands over everything queued.
    fn account_enter(&mut self, c: &mut IoCounters) {
        c.enters += 1;
        if self.queued_io > 0 {
            c.submits += 1;
        }
        self.io_at_device += u64::from(self.queued_io);
        self.queued = 0;
        self.queued_io = 0;
    }

    /// Engine I/Os submitted and not yet completed.
    pub fn io_at_device(&self) -> u64 {
        self.io_at_device
    }

    /// Engine I/Os queued and not yet submitted.
    pub fn queued_io(&self) -> u64 {
        u64::from(self.queued_io)
    }

    /// Sleeps until a completion arrives or `at_most` has passed.
    pub fn wait_at_most(
        &mut self,
        at_most: std::time::Duration,
        c: &mut IoCounters,
    ) -> io::Result<()> {
        self.push_timeout(at_most, Token::Ignore, c);
        self.submit_and_wait(c)
    }

    /// Whether the engine I/Os queued so far should go to the kernel now, before the rest of
    /// the batch (`policy::submit`).
    pub fn submit_early_due(&self) -> bool {
        submit_early(u64::from(self.queued_io), self.io_at_device)
    }

    /// Whether entries wait to be submitted.
    #[cfg(test)]
    pub fn has_queued(&self) -> bool {
        self.queued > 0
    }

    /// Submits whatever is queued, now.
    pub fn submit(&mut self, c: &mut IoCounters) {
        if self.queued == 0 {
            return;
        }
        self.account_enter(c);
        if let Err(e) = self.uring.submit() {
            if !transient(&e) {
                tracing::error!(err = %e, "io_uring submit failed");
            }
        }
    }

    /// Submits what is queued and sleeps until at least one completion arrives: one syscall.
    pub fn submit_and_wait(&mut self, c: &mut IoCounters) -> io::Result<()> {
        if self.queued > 0 {
            self.account_enter(c);
        } else {
            c.enters += 1;
        }
        match self.uring.submit_and_wait(1) {
            Err(e) if !transient(&e) => Err(e),
            _ => Ok(()),
        }
    }

    /// While polling: completions wait as task work (COOP_TASKRUN), so make the one syscall
    /// that posts them.
    pub fn run_task_work(&mut self, c: &mut IoCounters) {
        if self.taskrun_flag && self.uring.taskrun() {
            c.enters += 1;
            let _ = self.uring.submit();
        }
    }

    /// Whether completions wait in the completion ring.
    pub fn has_completions(&mut self) -> bool {
        self.uring.completions_waiting()
    }

    /// The next completion, if any.
    pub fn next_completion(&mut self) -> Option<Completion> {
        let c = self
            .uring
            .next_completion()
            .map(|(data, result, flags)| Completion {
                token: Token::decode(data),
                result,
                flags,
            })?;
        if let Token::Io(_) = c.token {
            self.io_at_device = self.io_at_device.saturating_sub(1);
        }
        Some(c)
    }

    /// Registers `mem` as fixed buffers (in chunks io_uring accepts), replacing what was
    /// registered. Runs only when nothing is in flight. A refusal (an old kernel,
    /// RLIMIT_MEMLOCK without CAP_IPC_LOCK) leaves plain readv/writev.
    pub fn register_buffers(&mut self, mem: Option<&GuestMemory>) {
        if !self.buffers.is_empty() {
            self.buffers.clear();
            if let Err(e) = self.uring.submitter().unregister_buffers() {
                tracing::warn!(err = %e, "cannot unregister fixed buffers");
            }
        }
        let Some(mem) = mem else {
            return;
        };
        let chunks = buffer_chunks(mem);
        if chunks.is_empty() || chunks.len() > usize::from(u16::MAX) {
            return;
        }
        let iovs: Vec<libc::iovec> = chunks
            .iter()
            .map(|&(start, end)| libc::iovec {
                iov_base: start as *mut libc::c_void,
                iov_len: end - start,
            })
            .collect();
        // SAFETY: each iovec is a range of a live guest-memory mapping. The kernel pins those
        // pages; they stay registered (and the mapping alive, held by the I/O thread) until
        // the next swap, which unregisters them first, or until the ring is dropped.
        match unsafe { self.uring.submitter().register_buffers(&iovs) } {
            Ok(()) => {
                let bytes: usize = iovs.iter().map(|v| v.iov_len).sum();
                tracing::debug!(
                    buffers = iovs.len(),
                    bytes,
                    "guest memory registered as fixed buffers"
                );
                self.buffers = chunks;
            }
            Err(e) => {
                tracing::warn!(err = %e, "cannot register guest memory as fixed buffers; using readv/writev");
            }
        }
    }

    /// The registered buffer that wholly holds a single-iovec I/O, if any. (An iovec never
    /// straddles two: iovecs come from per-region slices, and a chunk boundary inside a region
    /// only matters to an iovec that crosses it, which then simply goes through readv/writev.)
    pub fn buffer_index(&self, iovs: &[libc::iovec]) -> Option<u16> {
        let [iov] = iovs else {
            return None;
        };
        if self.buffers.is_empty() {
            return None;
        }
        let start = iov.iov_base as usize;
        let end = start.checked_add(iov.iov_len)?;
        self.buffers
            .iter()
            .position(|&(s, e)| s <= start && end <= e)
            .map(|i| i as u16)
    }
}

/// Guest memory as `(host start, host end)` ranges of at most [`MAX_FIXED_BUFFER`] bytes.
fn buffer_chunks(mem: &GuestMemory) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for r in mem.iter() {
        let start = r.as_ptr() as usize;
        let end = start + r.len() as usize;
        let mut at = start;
        while at < end {
            let next = (at + MAX_FIXED_BUFFER).min(end);
            out.push((at, next));
            at = next;
        }
    }
    out
}

/// Writes 1 to an eventfd (a guest notification outside the ring).
pub fn write_eventfd(f: &File) {
    let v = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live stack buffer to a descriptor the caller keeps open.
    // An eventfd write fails only when its counter would overflow, which then means the
    // notification is pending anyway.
    unsafe { libc::write(f.as_raw_fd(), v.as_ptr().cast(), 8) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip() {
        for t in [
            Token::Io(0),
            Token::Io(u32::MAX),
            Token::Kick {
                local: 63,
                generation: 0xffff,
            },
            Token::Kick {
                local: 0,
                generation: 1,
            },
            Token::Control,
            Token::EngineEvents,
            Token::QosTimer,
            Token::Ignore,
        ] {
            assert_eq!(Token::decode(t.encode()), t);
        }
        // An unknown tag is never mistaken for I/O.
        assert_eq!(Token::decode(0xff << 56 | 5), Token::Ignore);
    }

    #[test]
    fn a_confined_ring_refuses_opcodes_outside_its_allowlist() {
        // As an I/O thread of a confined daemon serving a file (here a RAM disk, the same
        // engine) creates it.
        let spec = crate::config::parse_export_spec("socket=s,engine=mem,size=1M").unwrap();
        let engine = crate::engine::open(&spec).unwrap();
        let opcodes = [OPCODES, engine.ring_opcodes()];
        let allow = RingAllowlist {
            opcodes: &opcodes,
            register_ops: REGISTER_OPS,
            sqe_flags: SQE_FLAGS.bits(),
        };
        let mut ring = Ring::build(8, &Tuning::default(), false, Some(&allow)).unwrap();
        let mut c = IoCounters::default();
        let file = tempfile::tempfile().unwrap();
        let fd = types::Fd(file.as_raw_fd());
        let forbidden = [
            opcode::Nop::new().build(),
            opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), c"/etc/passwd".as_ptr()).build(),
            opcode::Connect::new(fd, std::ptr::null(), 0).build(),
        ];
        let allowed = opcode::Fsync::new(fd).build();
        for (i, sqe) in forbidden.iter().chain([&allowed]).enumerate() {
            // SAFETY: the entries name a static path, a live file and no buffer.
            unsafe { ring.push(sqe.clone(), Token::Io(i as u32), &mut c) };
        }
        let mut results = vec![None; 4];
        while results.iter().any(Option::is_none) {
            ring.submit_and_wait(&mut c).unwrap();
            while let Some(done) = ring.next_completion() {
                let Token::Io(i) = done.token else {
                    panic!("unexpected {done:?}")
                };
                results[i as usize] = Some(done.result);
            }
        }
        assert_eq!(
            results,
            [
                Some(-libc::EACCES),
                Some(-libc::EACCES),
                Some(-libc::EACCES),
                Some(0)
            ],
            "NOP, OPENAT and CONNECT refused, FSYNC (the engine's) done"
        );
        // A flag outside the allowlist (IO_LINK) is refused too.
        let linked = allowed.clone().flags(squeue::Flags::IO_LINK);
        // SAFETY: as above.
        unsafe { ring.push(linked, Token::Io(0), &mut c) };
        ring.submit_and_wait(&mut c).unwrap();
        assert_eq!(
            ring.next_completion().map(|d| d.result),
            Some(-libc::EACCES)
        );
        // A registration outside it: a personality.
        let e = ring.uring.submitter().register_personality().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EACCES));
    }

    #[test]
    fn one_enter_per_batch_is_counted() {
        let mut ring = Ring::new(8, &Tuning::default()).unwrap();
        let mut c = IoCounters::default();
        let nop = opcode::Nop::new().build();
        for _ in 0..3 {
            // SAFETY: a NOP names nothing.
            unsafe { ring.push(nop.clone(), Token::Ignore, &mut c) };
        }
        assert!(ring.has_queued());
        ring.submit_and_wait(&mut c).unwrap();
        assert_eq!((c.enters, c.submits), (1, 0));
        let mut n = 0;
        while ring.next_completion().is_some() {
            n += 1;
        }
        // The kernel may post a batch's completions in more than one go.
        assert!((1..=3).contains(&n));
        // More entries than the ring holds: the overflow is entered on the way.
        for _ in 0..20 {
            // SAFETY: as above.
            unsafe { ring.push(nop.clone(), Token::Ignore, &mut c) };
        }
        assert!(c.enters >= 3, "{c:?}");
    }
}
