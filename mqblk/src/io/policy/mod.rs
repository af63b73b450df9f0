//! The request path's policies: small pure types with unit tests, composed by the I/O thread's
//! loop. Each decides one thing from recent history and nothing else.

pub mod batch;
pub mod engine_wait;
pub mod merge;
pub mod notify;
pub mod poll;
pub mod submit;
pub mod tally;

pub use batch::BatchPolicy;
pub use engine_wait::EngineWait;
pub use merge::Shape;
pub use notify::EarlyNotify;
pub use poll::PollPolicy;
