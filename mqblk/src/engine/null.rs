//! `engine=null`: completes everything at once; reads give zeros, or with `read-zeroes=off`
//! leave the buffers alone. The null_blk analogue: it measures the backend itself.
//!
//! Zeroing is the default because it is what a disk of zeroes answers. It is also a 4 KiB
//! `memset` of guest memory per read, which at millions of reads a second is a sizeable part
//! of the I/O thread's time; QEMU's null-co with `read-zeroes=off` and SPDK's null bdev skip it,
//! so a comparison with those turns it off on both sides. Leaving the buffer alone returns the
//! guest its own bytes, nothing of the daemon's.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{op_bytes, Channel, Engine, Op, ResizeError, Started};

/// The null engine.
pub struct NullEngine {
    capacity: AtomicU64,
    read_zeroes: bool,
}

impl NullEngine {
    /// A null disk of `capacity` bytes whose reads zero their buffers if `read_zeroes`.
    pub fn new(capacity: u64, read_zeroes: bool) -> Self {
        NullEngine {
            capacity: AtomicU64::new(capacity),
            read_zeroes,
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
        Ok(Box::new(NullChannel {
            read_zeroes: self.read_zeroes,
        }))
    }
    fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError> {
        let size = size.ok_or(ResizeError::SizeNeeded("null"))?;
        self.capacity.store(size, Ordering::Relaxed);
        Ok(size)
    }
}

struct NullChannel {
    read_zeroes: bool,
}

impl Channel for NullChannel {
    unsafe fn start(&mut self, op: &Op, _token: u64) -> Started {
        match *op {
            Op::Read { iovs, iovcnt, .. } if self.read_zeroes => {
                // SAFETY: the contract of `Op::Read`: `iovcnt` iovecs, each describing writable
                // guest memory that stays mapped until the operation completes (now).
                let iovs = unsafe { std::slice::from_raw_parts(iovs, iovcnt as usize) };
                for iov in iovs {
                    // SAFETY: as above.
                    unsafe { std::ptr::write_bytes(iov.iov_base.cast::<u8>(), 0, iov.iov_len) };
                }
            }
            _ => {}
        }
        // SAFETY: reads and writes carry valid iovecs (the contract of `Op`).
        let bytes = unsafe { op_bytes(op) };
        Started::Done(bytes.min(i32::MAX as u64) as i32)
    }
}
