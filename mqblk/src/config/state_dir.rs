//! The daemon's state directory: what must outlive a process of mqblk and belongs to no image.
//! Today that is the qcow2 exports' metadata journals (`qcow2-journals/UID/`,
//! `engine::qcow2::mapping_journal`), which a daemon serving an image after a crash of mqblk
//! reads.
//!
//! `--state-dir` names it; without it, `$STATE_DIRECTORY` (what systemd's `StateDirectory=`
//! sets), else [`DEFAULT`]. Every process of mqblk on a host must see the same one, as a
//! restarted daemon must find its predecessor's journals: the default is what makes that so
//! without anyone having to say it. `mqblk serve` makes the journals' directory before its
//! sandbox closes the filesystem, and the sandbox grants it.
//!
//! Each user the daemon runs as (`--user`) has a journals' directory of its own, which only it
//! can write: a daemon that gave up its capabilities, root's included, can write only what its
//! user owns, and a directory other users could write would let them plant records that a
//! replay trusts.

use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The state directory where neither `--state-dir` nor `$STATE_DIRECTORY` names one.
pub const DEFAULT: &str = "/var/lib/mqblk";

/// The directory of the qcow2 metadata journals, under the state directory.
const QCOW2_JOURNALS: &str = "qcow2-journals";

static DIR: OnceLock<PathBuf> = OnceLock::new();

/// Sets the state directory (`--state-dir`); `None` takes `$STATE_DIRECTORY` or [`DEFAULT`].
/// Only the first call, made before any export opens, counts.
pub fn set(dir: Option<PathBuf>) {
    let _ = DIR.set(dir.unwrap_or_else(from_environment));
}

/// The state directory.
pub fn get() -> &'static Path {
    DIR.get_or_init(from_environment)
}

fn from_environment() -> PathBuf {
    std::env::var("STATE_DIRECTORY")
        .ok()
        .and_then(|v| first_of(&v))
        .unwrap_or_else(|| PathBuf::from(DEFAULT))
}

/// The first directory of `$STATE_DIRECTORY`: systemd sets a colon-separated list when a unit
/// names several.
fn first_of(list: &str) -> Option<PathBuf> {
    list.split(':')
        .next()
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

/// The directory of every user's qcow2 metadata journals.
pub fn qcow2_journals_root() -> PathBuf {
    get().join(QCOW2_JOURNALS)
}

/// Where this process keeps, and looks for, the qcow2 metadata journals: its user's directory.
pub fn qcow2_journals() -> PathBuf {
    qcow2_journals_of(rustix::process::geteuid().as_raw())
}

/// The qcow2 metadata journals' directory of the user `uid`.
pub fn qcow2_journals_of(uid: u32) -> PathBuf {
    qcow2_journals_root().join(uid.to_string())
}

/// Makes the directory of every user's journals if it is missing (open to all to pass
/// through), and the state directory above it; returns it.
pub fn make_qcow2_journals_root() -> io::Result<PathBuf> {
    let root = qcow2_journals_root();
    if !root.is_dir() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&root)?;
    }
    Ok(root)
}

/// Makes the journals' directory of the user `uid` (group `gid`) if it is missing: its own,
/// readable by it only (a journal says where a guest's data lies in its image). One that
/// another user owns (made by a root daemon of another build, say) is given to `uid`, which
/// only root can do. Returns it. Where it exists already and is `uid`'s, it makes no call
/// that the sandbox's seccomp filter forbids.
pub fn make_qcow2_journals(uid: u32, gid: u32) -> io::Result<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let dir = qcow2_journals_of(uid);
    let give = || {
        rustix::fs::chown(
            &dir,
            Some(rustix::process::Uid::from_raw(uid)),
            Some(rustix::process::Gid::from_raw(gid)),
        )
    };
    match std::fs::metadata(&dir) {
        Ok(m) if m.is_dir() && m.uid() == uid => return Ok(dir),
        Ok(m) if m.is_dir() => {
            give()?;
            return Ok(dir);
        }
        _ => {}
    }
    make_qcow2_journals_root()?;
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => give()?,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systemd_s_first_state_directory_is_taken() {
        assert_eq!(
            first_of("/var/lib/mqblk"),
            Some(PathBuf::from("/var/lib/mqblk"))
        );
        assert_eq!(
            first_of("/var/lib/a:/var/lib/b"),
            Some(PathBuf::from("/var/lib/a"))
        );
        assert_eq!(first_of(""), None);
    }

    #[test]
    fn each_user_has_a_journals_directory_of_its_own() {
        assert_ne!(qcow2_journals_of(0), qcow2_journals_of(65534));
        assert!(qcow2_journals_of(0).starts_with(qcow2_journals_root()));
        assert_eq!(
            qcow2_journals(),
            qcow2_journals_of(rustix::process::geteuid().as_raw())
        );
    }
}
