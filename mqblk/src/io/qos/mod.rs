//! QoS on the request path, for exports with limits only: QEMU's throttling, between parsing a
//! request and staging it for the engine.
//!
//! - [`buckets`]: the leaky buckets' arithmetic (QEMU's `util/throttle.c`), a pure type on a
//!   clock the caller passes in;
//! - [`throttle`]: [`Throttle`], one export's (or one throttle group's) buckets behind the
//!   short mutex its I/O threads share;
//! - `admit`: the admission stage of the I/O thread: a request the buckets hold back waits in
//!   its queue's FIFO until the thread's QoS timer ends.
//!
//! The settings are `config::qos`; which buckets an export uses, and the throttle groups, are
//! the daemon's (`daemon::qos`).

mod admit;
pub(super) mod buckets;
pub(super) mod throttle;

pub use throttle::Throttle;
