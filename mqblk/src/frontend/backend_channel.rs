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
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsFd, RawFd};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::{Errno, IoSliceMut};
use rustix::net::{
    recv, recvmsg, send, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendFlags,
};

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

/// Room for a control message that carries exactly one descriptor: CMSG_LEN(sizeof(int)),
/// which on Linux is the (already aligned) header and the descriptor; aligned as a `cmsghdr`.
/// Not CMSG_SPACE, whose padding would fit a second descriptor.
#[repr(C, align(8))]
struct OneFdControl([MaybeUninit<u8>; size_of::<libc::cmsghdr>() + size_of::<RawFd>()]);

/// Peeks at the next message on the frontend connection `conn`: when it is
/// SET_BACKEND_REQ_FD, returns a duplicate of the channel descriptor it carries. Reads nothing
/// off the connection.
pub fn peek_backend_channel(conn: impl AsFd) -> Option<File> {
    let mut hdr = [0u8; 12];
    // First the header alone, with no room for descriptors, so that peeking at messages that
    // carry them (memory tables, eventfds) installs nothing.
    let (n, _) = recv(&conn, &mut hdr, RecvFlags::PEEK | RecvFlags::DONTWAIT).ok()?;
    if n != hdr.len() || u32::from_le_bytes(hdr[0..4].try_into().ok()?) != SET_BACKEND_REQ_FD {
        return None;
    }
    // Now with room for exactly one descriptor: the peek installs a duplicate of it and of
    // nothing more, however many a hostile frontend attached.
    let mut space = OneFdControl([MaybeUninit::uninit(); _]);
    let mut control = RecvAncillaryBuffer::new(&mut space.0);
    let msg = recvmsg(
        &conn,
        &mut [IoSliceMut::new(&mut hdr)],
        &mut control,
        RecvFlags::PEEK | RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
    )
    .ok()?;
    if msg.bytes == 0 {
        return None;
    }
    // The descriptor the kernel installed for us, owned here.
    let fd = control.drain().find_map(|m| match m {
        RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
        _ => None,
    })?;
    // More than one descriptor came with it: the vhost crate refuses that message, and the
    // channel is not taken (`fd` is closed here).
    (!msg.flags.contains(ReturnFlags::CTRUNC)).then(|| File::from(fd))
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
        let sent = send(&self.sock, &msg, SendFlags::DONTWAIT | SendFlags::NOSIGNAL)?;
        if sent != msg.len() {
            return Err(io::Error::other(
                "the frontend's channel took part of the message",
            ));
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
            let timeout = Timespec::try_from(left).map_err(io::Error::other)?;
            let mut pfd = [PollFd::new(&self.sock, PollFlags::IN)];
            match poll(&mut pfd, Some(&timeout)) {
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the frontend did not acknowledge the config change",
                    ))
                }
                Ok(_) => {}
            }
            match recv(&self.sock, &mut buf[got..], RecvFlags::DONTWAIT) {
                Ok((0, _)) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok((n, _)) => got += n,
                Err(Errno::WOULDBLOCK | Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Reads and drops whatever the frontend sent that nobody waited for.
    fn discard_pending(&self) {
        let mut sink = [0u8; 256];
        while let Ok((1.., _)) = recv(&self.sock, &mut sink, RecvFlags::DONTWAIT) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage};
    use std::os::fd::BorrowedFd;
    use std::os::unix::net::UnixStream;

    /// The backend's end of a connection on which the frontend sent a message with request
    /// `request` and `fds` attached.
    fn sent(request: u32, fds: &[BorrowedFd<'_>]) -> UnixStream {
        let (frontend, backend) = UnixStream::pair().unwrap();
        let mut msg = [0u8; 12];
        msg[0..4].copy_from_slice(&request.to_le_bytes());
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
        }
        let n = sendmsg(
            &frontend,
            &[io::IoSlice::new(&msg)],
            &mut control,
            SendFlags::empty(),
        )
        .unwrap();
        assert_eq!(n, msg.len());
        backend
    }

    fn same_file(a: impl AsFd, b: impl AsFd) -> bool {
        let (a, b) = (rustix::fs::fstat(a).unwrap(), rustix::fs::fstat(b).unwrap());
        (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    }

    #[test]
    fn the_channel_of_a_set_backend_req_fd_is_taken_and_the_message_left() {
        let (channel, _) = UnixStream::pair().unwrap();
        let conn = sent(SET_BACKEND_REQ_FD, &[channel.as_fd()]);
        let taken = peek_backend_channel(&conn).expect("the channel");
        assert!(same_file(&taken, &channel));
        // The message is still there for the vhost crate to read.
        let mut hdr = [0u8; 12];
        let (n, _) = recv(&conn, &mut hdr, RecvFlags::DONTWAIT).unwrap();
        assert_eq!(n, 12);
        assert_eq!(hdr[0..4], SET_BACKEND_REQ_FD.to_le_bytes());
    }

    #[test]
    fn a_set_backend_req_fd_with_two_descriptors_yields_no_channel() {
        let (a, b) = UnixStream::pair().unwrap();
        let conn = sent(SET_BACKEND_REQ_FD, &[a.as_fd(), b.as_fd()]);
        assert!(peek_backend_channel(&conn).is_none());
    }

    #[test]
    fn other_messages_yield_no_channel() {
        let (channel, _) = UnixStream::pair().unwrap();
        // SET_MEM_TABLE, which carries descriptors too.
        assert!(peek_backend_channel(sent(5, &[channel.as_fd()])).is_none());
        assert!(peek_backend_channel(sent(SET_BACKEND_REQ_FD, &[])).is_none());
        let (frontend, backend) = UnixStream::pair().unwrap();
        // Half a header.
        send(
            &frontend,
            &SET_BACKEND_REQ_FD.to_le_bytes(),
            SendFlags::empty(),
        )
        .unwrap();
        assert!(peek_backend_channel(&backend).is_none());
        // Nothing at all.
        let (_frontend, backend) = UnixStream::pair().unwrap();
        assert!(peek_backend_channel(&backend).is_none());
    }
}
