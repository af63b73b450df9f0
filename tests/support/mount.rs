//! A filesystem mounted for one test (a small tmpfs for a full disk, a read-only one, a ramfs
//! without O_DIRECT), unmounted when dropped.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::daemon::TestDir;
use super::skip::skip_unless_allowed;

/// A filesystem mounted for one test; unmounted when dropped.
pub struct Mount {
    path: PathBuf,
}

impl Mount {
    /// Mounts `fstype` with `opts` on a new directory in `dir`; `None` where mounting is not
    /// allowed and skipping is (see [`skip_unless_allowed`]).
    pub fn new(dir: &TestDir, name: &str, fstype: &str, opts: &str) -> Option<Mount> {
        let path = dir.join(name);
        std::fs::create_dir_all(&path).unwrap();
        let mut cmd = Command::new("mount");
        cmd.args(["-t", fstype]);
        if !opts.is_empty() {
            cmd.args(["-o", opts]);
        }
        cmd.arg(fstype).arg(&path);
        let why = match cmd.output() {
            Ok(o) if o.status.success() => return Some(Mount { path }),
            Ok(o) => format!(
                "cannot mount {fstype} (mounting needs root): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => format!("cannot run mount for {fstype}: {e}"),
        };
        skip_unless_allowed("MQBLK_TEST_ALLOW_NO_MOUNT", &why);
        None
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn remount_ro(&self) {
        let st = Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(&self.path)
            .status()
            .unwrap();
        assert!(st.success(), "remount read-only");
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}
