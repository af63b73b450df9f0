//! Unix socket paths the daemon listens on (the management API's, each export's): clearing
//! one left behind by an earlier run without taking over a live one or deleting anything that
//! is not a socket.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// Makes `path` free to bind: removes a socket there that nobody listens on.
///
/// Errors, whose messages leave the path to the caller: [`io::ErrorKind::AddrInUse`] if
/// something accepts a connection on it, [`io::ErrorKind::InvalidInput`] if it exists and is
/// not a socket (a typo must not delete a disk image), else the error from removing it. A path
/// that cannot be examined is left for `bind` to report.
pub fn remove_stale(path: &Path) -> io::Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if UnixStream::connect(path).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "another process is listening on it",
        ));
    }
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the path exists and is not a socket: choose another path",
        ));
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn only_stale_sockets_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();

        let none = dir.join("none.sock");
        remove_stale(&none).expect("nothing there: nothing to do");

        let stale = dir.join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());
        remove_stale(&stale).expect("a socket nobody listens on");
        assert!(!stale.exists());

        let live = dir.join("live.sock");
        let listener = UnixListener::bind(&live).unwrap();
        let e = remove_stale(&live).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        assert!(live.exists());
        drop(listener);

        let file = dir.join("disk.img");
        std::fs::write(&file, b"precious").unwrap();
        let e = remove_stale(&file).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains("is not a socket"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"precious");

        let link = dir.join("dangling.sock");
        std::os::unix::fs::symlink(dir.join("nowhere"), &link).unwrap();
        let e = remove_stale(&link).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        assert!(std::fs::symlink_metadata(&link).is_ok(), "the link is left");
    }
}
