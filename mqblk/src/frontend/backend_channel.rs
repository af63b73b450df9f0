//! The backend's channel to the frontend (protocol feature BACKEND_REQ), used to tell it that
//! the configuration space changed (an online resize), so that it raises a config interrupt
//! and the guest reads the new capacity.
//!
//! The `vhost` crate (0.18) hands the handler this channel only as an opaque `Backend` whose
//! config-change message is not implemented. mqblk therefore takes its own duplicate of the
//! channel's descriptor: it peeks at each message before the crate reads it, and when the
//! message is SET_BACKEND_REQ_FD, the peek (which installs a duplicate of an attached
//! descriptor in this process) yields the channel. The message itself is 12 bytes.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::time::{Duration, Instant};

/// VHOST_USER_SET_BACKEND_REQ_FD.
const SET_BACKEND_REQ_FD: u32 = 21;
/// VHOST_USER_BACKEND_CONFIG_CHANGE_MSG.
const CONFIG_CHANGE_MSG: u32 = 2;
/// Header flags: protocol version 1, and "reply wanted".
const VERSION: u32 = 0x1;
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;
/// How long a frontend may take to acknowledge a config change.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);

/// Peeks at the next message on the frontend connection `conn`: when it is
/// SET_BACKEND_REQ_FD, returns a duplicate of the channel descriptor it carries. Reads nothing
/// off the connection.
pub fn peek_backend_channel(conn: RawFd) -> Option<File> {
    let mut hdr = [0u8; 12];
    // First the header alone, with no room for descriptors, so that peeking at messages that
    // carry them (memory tables, eventfds) installs nothing.
    let mut iov = libc::iovec {
        iov_base: hdr.as_mut_ptr().cast(),
        iov_len: hdr.len(),
    };
    // SAFETY: a zeroed msghdr is valid; it points at one live iovec over `hdr`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: recvmsg on a descriptor the caller owns, into buffers that outlive the call.
    let n = unsafe { libc::recvmsg(conn, &mut msg, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    if n != hdr.len() as isize
        || u32::from_le_bytes(hdr[0..4].try_into().ok()?) != SET_BACKEND_REQ_FD
    {
        return None;
    }
    // Now with room for exactly one descriptor (CMSG_LEN, not CMSG_SPACE, whose padding would
    // fit a second): the peek installs a duplicate of it and of nothing more, however many a
    // hostile frontend attached.
    let mut cbuf = [0u64; 4];
    msg.msg_control = cbuf.as_mut_ptr().cast();
    // SAFETY: CMSG_LEN is arithmetic on its argument.
    msg.msg_controllen = unsafe { libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: as above; the control buffer is live and its length is given.
    let n = unsafe {
        libc::recvmsg(
            conn,
            &mut msg,
            libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n <= 0 {
        return None;
    }
    // SAFETY: CMSG_FIRSTHDR/CMSG_DATA walk the control buffer the kernel filled, within
    // msg_controllen.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        {
            return None;
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const RawFd);
        // The kernel installed `fd` for us; nobody else owns it.
        let file = (fd >= 0).then(|| File::from_raw_fd(fd))?;
        // More than one descriptor came with it: the vhost crate refuses that message, and
        // the channel is not taken (`file` is closed here).
        (msg.msg_flags & libc::MSG_CTRUNC == 0).then_some(file)
    }
}

/// The channel on which mqblk sends the frontend backend requests.
pub struct BackendChannel {
    sock: File,
}

impl BackendChannel {
    /// The channel over `sock`, a duplicate of the SET_BACKEND_REQ_FD descriptor.
    pub fn new(sock: File) -> Self {
        BackendChannel { sock }
    }

    /// Another handle on the same channel, so that a caller can wait for the frontend's
    /// answer without holding the session: QEMU answers a config change only after it has
    /// read the new configuration with GET_CONFIG, which the session must be free to serve.
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(BackendChannel {
            sock: self.sock.try_clone()?,
        })
    }

    /// Tells the frontend that the configuration space changed. With `reply_ack` (the
    /// REPLY_ACK protocol feature), waits up to [`REPLY_TIMEOUT`] for its acknowledgement. No
    /// call blocks: a frontend that does not read its channel, or answers slowly or with half
    /// a message, costs the caller at most the timeout.
    pub fn config_changed(&mut self, reply_ack: bool) -> io::Result<()> {
        // A late answer to an earlier change that timed out must not pass for this one's.
        self.discard_pending();
        let flags = VERSION | if reply_ack { NEED_REPLY } else { 0 };
        let mut msg = [0u8; 12];
        msg[0..4].copy_from_slice(&CONFIG_CHANGE_MSG.to_le_bytes());
        msg[4..8].copy_from_slice(&flags.to_le_bytes());
        // SAFETY: send(2) of a live 12-byte buffer on a descriptor this channel owns.
        let sent = unsafe {
            libc::send(
                self.sock.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if sent != msg.len() as isize {
            return Err(if sent < 0 {
                io::Error::last_os_error()
            } else {
                io::Error::other("the frontend's channel took part of the message")
            });
        }
        if !reply_ack {
            return Ok(());
        }
        // The reply: a header (the request, REPLY, size 8) and a u64, 0 for success.
        let mut reply = [0u8; 20];
        self.recv_within(&mut reply, Instant::now() + REPLY_TIMEOUT)?;
        let word = |i: usize| u32::from_le_bytes(reply[i..i + 4].try_into().expect("4 bytes"));
        if word(0) != CONFIG_CHANGE_MSG || word(4) & REPLY == 0 || word(8) != 8 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the frontend answered the config change with request {}, flags {:#x}, size {}",
                    word(0),
                    word(4),
                    word(8)
                ),
            ));
        }
        let status = u64::from_le_bytes(reply[12..20].try_into().expect("8 bytes"));
        if status != 0 {
            return Err(io::Error::other(format!(
                "the frontend refused the config change ({status})"
            )));
        }
        Ok(())
    }

    /// Fills `buf` from the channel by `deadline`, never blocking past it.
    fn recv_within(&self, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one live pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the frontend did not acknowledge the config change",
                ));
            }
            // SAFETY: recv(2) into the live rest of `buf`, without blocking.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    buf[got..].as_mut_ptr().cast(),
                    buf.len() - got,
                    libc::MSG_DONTWAIT,
                )
            };
            match n {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n if n > 0 => got += n as usize,
                _ => {
                    let e = io::Error::last_os_error();
                    if !matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads and drops whatever the frontend sent that nobody waited for.
    fn discard_pending(&self) {
        let mut sink = [0u8; 256];
        loop {
            // SAFETY: recv(2) into a live buffer, without blocking.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    sink.as_mut_ptr().cast(),
                    sink.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                return;
            }
        }
    }
}
