//! One I/O thread's way to the namespace: each operation becomes one NVMe command in a
//! 128-byte io_uring entry (`IORING_OP_URING_CMD` with `NVME_URING_CMD_IO` or `_IO_VEC`), on
//! the thread's own ring; its completion carries the command's NVMe status.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use io_uring::{opcode, types};

use super::command::{self, lba_range, DsmRange, Status, MAX_BLOCKS_PER_COMMAND};
use crate::engine::{op_bytes, Channel, Op, Started};
use crate::log_limit::LogLimiter;

/// Builds the commands of one I/O thread.
pub(super) struct NvmeChannel {
    file: Arc<File>,
    nsid: u32,
    lba_shift: u32,
    /// Flushes go to the device only if it has a volatile write cache; without one, every
    /// completed write is already durable.
    volatile_write_cache: bool,
    /// A write-zeroes with `unmap` may deallocate.
    zeroes_may_deallocate: bool,
    /// The range of each Dataset Management in flight, by the token it was started with: a
    /// token names one operation at a time, so its range is reused by the next one. Grows to
    /// the number of tokens that ever discarded, then allocates no more.
    ranges: HashMap<u64, Box<DsmRange>>,
    /// Failed commands' statuses, rate-limited: a guest can make many requests fail.
    log: LogLimiter,
}

impl NvmeChannel {
    pub(super) fn new(
        file: Arc<File>,
        nsid: u32,
        lba_shift: u32,
        volatile_write_cache: bool,
        zeroes_may_deallocate: bool,
    ) -> Self {
        NvmeChannel {
            file,
            nsid,
            lba_shift,
            volatile_write_cache,
            zeroes_may_deallocate,
            ranges: HashMap::new(),
            log: LogLimiter::new(),
        }
    }

    /// A passthrough entry carrying `cmd`.
    fn entry(&self, cmd_op: u32, cmd: &command::UringCmd, buf_index: Option<u16>) -> Started {
        let entry = opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), cmd_op)
            .cmd(cmd.to_bytes())
            .buf_index(buf_index)
            .build();
        Started::WideRing(entry)
    }

    /// A read or write: one command for the whole iovec array (the I/O thread has split what
    /// exceeds the device's limits). Other operations are not for here.
    ///
    /// # Safety
    /// The iovecs of `op` are valid (the contract of [`Channel::start`]).
    unsafe fn read_write(&self, op: &Op) -> Started {
        let (nvme_opcode, offset, iovs, iovcnt, fua, buf_index) = match *op {
            Op::Read {
                offset,
                iovs,
                iovcnt,
                buf_index,
            } => (
                command::opcode::READ,
                offset,
                iovs,
                iovcnt,
                false,
                buf_index,
            ),
            Op::Write {
                offset,
                iovs,
                iovcnt,
                sync,
                buf_index,
            } => (
                command::opcode::WRITE,
                offset,
                iovs,
                iovcnt,
                sync,
                buf_index,
            ),
            _ => return Started::Done(-libc::EINVAL),
        };
        // SAFETY: the caller's contract.
        let bytes = unsafe { op_bytes(op) };
        let Ok((slba, blocks)) = lba_range(offset, bytes, self.lba_shift, MAX_BLOCKS_PER_COMMAND)
        else {
            return Started::Done(-libc::EINVAL);
        };
        let (cmd_op, addr, data_len, buf_index) = if iovcnt == 1 {
            // SAFETY: one valid iovec (the caller's contract).
            let iov = unsafe { *iovs };
            (
                command::URING_CMD_IO,
                iov.iov_base as u64,
                iov.iov_len as u32,
                buf_index,
            )
        } else {
            // The driver reads the iovec array when the entry is submitted; the slot keeps it
            // until completion anyway.
            (command::URING_CMD_IO_VEC, iovs as u64, iovcnt, None)
        };
        let cmd = command::read_write(nvme_opcode, self.nsid, slba, blocks, addr, data_len, fua);
        self.entry(cmd_op, &cmd, buf_index)
    }
}

impl Channel for NvmeChannel {
    unsafe fn start(&mut self, op: &Op, token: u64) -> Started {
        match *op {
            // SAFETY: the caller's contract.
            Op::Read { .. } | Op::Write { .. } => unsafe { self.read_write(op) },
            Op::Flush if !self.volatile_write_cache => Started::Done(0),
            Op::Flush => self.entry(command::URING_CMD_IO, &command::flush(self.nsid), None),
            Op::WriteZeroes { offset, len, unmap } => {
                let Ok((slba, blocks)) =
                    lba_range(offset, len, self.lba_shift, MAX_BLOCKS_PER_COMMAND)
                else {
                    return Started::Done(-libc::EINVAL);
                };
                let deallocate = unmap && self.zeroes_may_deallocate;
                let cmd = command::write_zeroes(self.nsid, slba, blocks, deallocate);
                self.entry(command::URING_CMD_IO, &cmd, None)
            }
            Op::Discard { offset, len } => {
                let Ok((slba, blocks)) = lba_range(offset, len, self.lba_shift, u32::MAX as u64)
                else {
                    return Started::Done(-libc::EINVAL);
                };
                let range = self
                    .ranges
                    .entry(token)
                    .or_insert_with(|| Box::new(DsmRange::default()));
                **range = DsmRange::new(slba, blocks as u32);
                let cmd = command::deallocate(self.nsid, &**range);
                self.entry(command::URING_CMD_IO, &cmd, None)
            }
        }
    }

    fn file_fd(&self) -> Option<RawFd> {
        Some(self.file.as_raw_fd())
    }

    fn wide_result(&mut self, res: i32) -> i32 {
        if res <= 0 {
            return res;
        }
        let status = Status(res as u16);
        if let Some(dropped) = self.log.allow() {
            tracing::warn!(
                status = format_args!("{:#06x}", status.0),
                code_type = status.code_type(),
                code = format_args!("{:#04x}", status.code()),
                meaning = status.meaning(),
                dropped_logs = dropped,
                "NVMe command failed"
            );
        }
        -status.errno()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel() -> NvmeChannel {
        let file = Arc::new(tempfile::tempfile().unwrap());
        NvmeChannel::new(file, 1, 12, true, true)
    }

    /// The command area of a started wide entry.
    fn cmd_of(s: Started) -> Vec<u8> {
        let Started::WideRing(e) = s else {
            panic!("not a wide entry: {s:?}")
        };
        // SAFETY: Entry128 is two plain-data halves: the 64-byte entry and 64 more bytes.
        let raw: [u8; 128] = unsafe { std::mem::transmute(e) };
        // The command area starts at byte 48 of the entry (struct io_uring_sqe's cmd[]).
        raw[48..128].to_vec()
    }

    #[test]
    fn operations_become_the_right_commands() {
        let mut ch = channel();
        let mut buf = vec![0u8; 16384];
        let iovs = [
            libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: 8192,
            },
            libc::iovec {
                iov_base: buf[8192..].as_mut_ptr().cast(),
                iov_len: 8192,
            },
        ];
        let read = Op::Read {
            offset: 1 << 20,
            iovs: iovs.as_ptr(),
            iovcnt: 2,
            buf_index: None,
        };
        // SAFETY: two iovecs over `buf`; nothing is submitted.
        let c = cmd_of(unsafe { ch.start(&read, 3) });
        assert_eq!(c[0], command::opcode::READ);
        assert_eq!(
            &c[36..40],
            &[2, 0, 0, 0],
            "vectored: data_len is the iovec count"
        );
        assert_eq!(
            &c[40..44],
            &256u32.to_le_bytes(),
            "1 MiB is LBA 256 of 4 KiB"
        );
        assert_eq!(&c[48..52], &3u32.to_le_bytes(), "4 blocks");

        // Not whole 4 KiB blocks: refused before it reaches the device.
        let bad = Op::Write {
            offset: 512,
            iovs: iovs.as_ptr(),
            iovcnt: 1,
            sync: false,
            buf_index: None,
        };
        assert!(matches!(
            // SAFETY: as above.
            unsafe { ch.start(&bad, 4) },
            Started::Done(r) if r == -libc::EINVAL
        ));

        // A discard's range lives in the channel, at the address the command names.
        let discard = Op::Discard {
            offset: 8192,
            len: 4096 * 3,
        };
        // SAFETY: a discard carries no memory.
        let c = cmd_of(unsafe { ch.start(&discard, 9) });
        let addr = u64::from_le_bytes(c[24..32].try_into().unwrap());
        assert_eq!(addr, &*ch.ranges[&9] as *const DsmRange as u64);
        assert_eq!(*ch.ranges[&9], DsmRange::new(2, 3));

        // Without a volatile write cache a flush is done at once.
        let mut no_cache =
            NvmeChannel::new(Arc::new(tempfile::tempfile().unwrap()), 1, 9, false, true);
        assert!(matches!(
            // SAFETY: a flush carries no memory.
            unsafe { no_cache.start(&Op::Flush, 1) },
            Started::Done(0)
        ));
        // SAFETY: as above.
        let flush = unsafe { ch.start(&Op::Flush, 1) };
        assert_eq!(cmd_of(flush)[0], command::opcode::FLUSH);
    }

    #[test]
    fn statuses_become_errnos() {
        let mut ch = channel();
        assert_eq!(ch.wide_result(0), 0);
        assert_eq!(ch.wide_result(-libc::EACCES), -libc::EACCES);
        assert_eq!(ch.wide_result(0x4080), -libc::EIO);
        assert_eq!(ch.wide_result(0x0002), -libc::EOPNOTSUPP);
    }
}
