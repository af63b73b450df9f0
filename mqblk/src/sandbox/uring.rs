//! io_uring's own allowlist. seccomp sees `io_uring_enter`, never the operations a ring
//! performs (an `IORING_OP_OPENAT` or `IORING_OP_CONNECT` would pass it by), so each I/O
//! thread's ring is created disabled, told which opcodes, submission flags and registrations it
//! may take (`IORING_REGISTER_RESTRICTIONS`), and only then enabled. Anything else completes
//! with -EACCES.

use std::io;

use io_uring::register::Restriction;
use io_uring::{opcode, IoUring, Submitter};

/// What a ring may do once enabled.
#[derive(Debug, Clone, Copy)]
pub struct RingAllowlist<'a> {
    /// Opcodes, in groups (the thread's own, its engine's).
    pub opcodes: &'a [&'a [u8]],
    /// `io_uring_register` operations.
    pub register_ops: &'a [u8],
    /// Submission-entry flags (`IOSQE_*`).
    pub sqe_flags: u8,
}

/// Restricts the ring of `submitter`, created with `setup_r_disabled`, to `allow`, and enables
/// it.
pub fn restrict_and_enable(submitter: &Submitter<'_>, allow: &RingAllowlist) -> io::Result<()> {
    let mut restrictions: Vec<Restriction> = allow
        .opcodes
        .iter()
        .flat_map(|group| group.iter())
        .map(|&op| Restriction::sqe_op(op))
        .chain(
            allow
                .register_ops
                .iter()
                .map(|&op| Restriction::register_op(op)),
        )
        .chain(std::iter::once(Restriction::sqe_flags_allowed(
            allow.sqe_flags,
        )))
        .collect();
    submitter.register_restrictions(&mut restrictions)?;
    submitter.register_enable_rings()
}

/// Whether this kernel restricts rings (Linux 5.10 and later): restricts a small ring.
pub(super) fn probe() -> io::Result<()> {
    let ring: IoUring = IoUring::builder().setup_r_disabled().build(2)?;
    restrict_and_enable(
        &ring.submitter(),
        &RingAllowlist {
            opcodes: &[&[opcode::Nop::CODE]],
            register_ops: &[],
            sqe_flags: 0,
        },
    )
}
