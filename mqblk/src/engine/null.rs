//! `engine=null`: completes everything at once; reads give zeros. The null_blk analogue: it
//! measures the backend itself.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{op_bytes, Channel, Engine, Op, ResizeError, Started};

/// The null engine.
pub struct NullEngine {
    capacity: AtomicU64,
}

impl NullEngine {
    /// A null disk of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        NullEngine {
            capacity: AtomicU64::new(capacity),
        }
    }
}

impl Engine for NullEngine {
    fn name(&self) -> &'static str {
        "null"
    }
    fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Relaxed)
    }
    fn block_size(&self) -> u32 {
        512
    }
    fn channel(&self) -> io::Result<Box<dyn Channel>> {
        Ok(Box::new(NullChannel))
    }
    fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError> {
        let size = size.ok_or(ResizeError::SizeNeeded("null"))?;
        self.capacity.store(size, Ordering::Relaxed);
        Ok(size)
    }
}

struct NullChannel;

impl Channel for NullChannel {
    unsafe fn start(&mut self, op: &Op, _token: u64) -> Started {
        if let Op::Read { iovs, iovcnt, .. } = *op {
            // SAFETY: the contract of `Op::Read`: `iovcnt` iovecs, each describing writable
            // guest memory that stays mapped until the operation completes (now).
            let iovs = unsafe { std::slice::from_raw_parts(iovs, iovcnt as usize) };
            for iov in iovs {
                // SAFETY: as above.
                unsafe { std::ptr::write_bytes(iov.iov_base.cast::<u8>(), 0, iov.iov_len) };
            }
        }
        // SAFETY: reads and writes carry valid iovecs (the contract of `Op`).
        let bytes = unsafe { op_bytes(op) };
        Started::Done(bytes.min(i32::MAX as u64) as i32)
    }
}
