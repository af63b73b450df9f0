//! `--backend spdk`: SPDK's `vhost` target, built by `scripts/spdk-build.sh` (SPDK has no
//! Debian package), serving a null bdev (`--engine null`) or an aio bdev on the image
//! (`--engine uring`; the build leaves SPDK's io_uring bdev out) as a vhost-user-blk
//! controller. Here: where the build is ([`SpdkBuild`]), the target's command line and the RPC
//! calls that create the bdev and the controller, as pure functions the tests check; running
//! `rpc.py`, and making the target ready for SIGTERM. `run/` starts the process and makes the
//! setup calls.
//!
//! The target runs without hugepages or vfio (`--no-huge -u`), on one reactor pinned to one CPU
//! (`--spdk-cpu`, default 0: `-m 0x1`) that busy-polls: its CPU time from /proc is a whole core
//! for the length of a point whatever the load, which the report shows as it is.
//!
//! Stopping: SPDK v26.05 stops a disconnected frontend's session on its reactor while DPDK's
//! vhost thread waits, and a SIGTERM in that window left the target hung ("Timeout waiting
//! for event: stop session", then no exit; 2 runs in 6 of tests/spdk_vhost.rs); a SIGTERM with
//! the controller still registered crashed it at exit about one time in three (SIGSEGV in
//! DPDK's `fdset_event_dispatch` thread, with a 64 MB core in its working directory).
//! [`SpdkBuild::prepare_stop`] waits until the controller has no session and deletes it; after
//! that, SIGTERM gave 20 clean exits in 20.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::EngineKind;

/// The environment variable `--spdk-dir` defaults to.
pub const SPDK_DIR_ENV: &str = "MQBLK_SPDK_DIR";

/// Memory (MiB) the target allocates for its buffers: without hugepages it is ordinary
/// anonymous memory, touched only as used.
const MEMORY_MIB: u64 = 1024;

/// The bdev's logical block size: 512, as mqblk's and QSD's exports have, so that every
/// workload the bench accepts (multiples of 512 bytes) runs on all three.
const BLOCK_SIZE: u64 = 512;

/// The name of the bdev the controller serves.
const BDEV: &str = "bench0";

/// A build made by `scripts/spdk-build.sh SRC DIR`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpdkBuild {
    /// DIR/bin/vhost.
    pub vhost: PathBuf,
    /// DIR/scripts/rpc.py (it imports its package from DIR/python).
    pub rpc_py: PathBuf,
}

impl SpdkBuild {
    /// The build in `dir` (`--spdk-dir`, else `$MQBLK_SPDK_DIR`); the error is the one line
    /// `--backend spdk` is refused with.
    pub fn find(dir: Option<&Path>) -> Result<SpdkBuild, String> {
        let how = "build SPDK's vhost target with `scripts/spdk-build.sh SPDK_SRC DIR` and pass \
                   --spdk-dir DIR (or set MQBLK_SPDK_DIR)";
        let dir = dir.ok_or_else(|| format!("--backend spdk needs an SPDK build: {how}"))?;
        // Absolute: the target is started in the run's directory, where a relative path
        // would name nothing.
        let dir =
            std::path::absolute(dir).map_err(|e| format!("--spdk-dir {}: {e}", dir.display()))?;
        let build = SpdkBuild {
            vhost: dir.join("bin/vhost"),
            rpc_py: dir.join("scripts/rpc.py"),
        };
        for f in [&build.vhost, &build.rpc_py] {
            if !f.is_file() {
                return Err(format!(
                    "--spdk-dir {}: no {}; {how}",
                    dir.display(),
                    f.display()
                ));
            }
        }
        Ok(build)
    }

    /// The target's command line: vhost-user sockets in `sock_dir`, RPC on `rpc_sock`. Without
    /// the core lock files SPDK otherwise keeps in /var/tmp: they make a second target (another
    /// test, another bench) fail to start on CPU 0 ("Cannot create lock on core 0, probably
    /// process N has claimed it") and outlive a target that is killed.
    pub fn vhost_argv(&self, sock_dir: &Path, rpc_sock: &Path, cpu: usize) -> Vec<OsString> {
        let mem = MEMORY_MIB.to_string();
        let mask = cpu_mask(cpu);
        let flags = [
            "-m",
            &mask,
            "--no-huge",
            "-s",
            &mem,
            "-u",
            "--disable-cpumask-locks",
        ];
        let mut argv: Vec<OsString> = vec![self.vhost.clone().into()];
        argv.extend(flags.iter().map(OsString::from));
        argv.extend(["-S".into(), sock_dir.into(), "-r".into(), rpc_sock.into()]);
        argv
    }

    /// `rpc.py`'s command line for one call (`call` as [`rpc_calls`] gives it).
    pub fn rpc_argv(&self, rpc_sock: &Path, call: &[String]) -> Vec<OsString> {
        let mut argv: Vec<OsString> = vec![
            "python3".into(),
            self.rpc_py.clone().into(),
            "-s".into(),
            rpc_sock.into(),
        ];
        argv.extend(call.iter().map(OsString::from));
        argv
    }
}

impl SpdkBuild {
    /// Runs one RPC call (`call` as [`rpc_calls`] or [`sessions_call`] give it); its output.
    pub fn rpc(&self, rpc_sock: &Path, call: &[String]) -> Result<String, String> {
        let argv = self.rpc_argv(rpc_sock, call);
        let out = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("running {}: {e}", self.rpc_py.display()))?;
        if !out.status.success() {
            return Err(format!(
                "rpc.py {}: {}: {}",
                call.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Makes the target ready for SIGTERM (see the module's note on stopping): waits up to
    /// `timeout` until the controller `ctrlr` has no session left, then deletes it.
    pub fn prepare_stop(
        &self,
        rpc_sock: &Path,
        ctrlr: &str,
        timeout: Duration,
    ) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            let n = session_count(&self.rpc(rpc_sock, &sessions_call(ctrlr))?)?;
            if n == 0 {
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "SPDK's controller {ctrlr} still has {n} session(s) {timeout:?} after the \
                     client disconnected"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.rpc(rpc_sock, &delete_call(ctrlr)).map(drop)
    }
}

/// The RPC call that deletes the controller `ctrlr` (its socket goes away with it).
pub fn delete_call(ctrlr: &str) -> Vec<String> {
    vec!["vhost_delete_controller".into(), ctrlr.into()]
}

/// The RPC call that lists the controller `ctrlr` with its sessions (connected frontends).
pub fn sessions_call(ctrlr: &str) -> Vec<String> {
    vec!["vhost_get_controllers".into(), "-n".into(), ctrlr.into()]
}

/// The number of sessions in `vhost_get_controllers`'s answer, over all its controllers.
pub fn session_count(answer: &str) -> Result<usize, String> {
    let v: serde_json::Value =
        serde_json::from_str(answer).map_err(|e| format!("vhost_get_controllers's answer: {e}"))?;
    let ctrlrs = v
        .as_array()
        .ok_or("vhost_get_controllers's answer is not a list")?;
    ctrlrs
        .iter()
        .map(|c| c["sessions"].as_array().map(Vec::len))
        .sum::<Option<usize>>()
        .ok_or_else(|| "a controller without \"sessions\" in vhost_get_controllers's answer".into())
}

/// The RPC calls, in order, that make the target serve the controller `ctrlr` (its socket is
/// the target's socket directory joined with `ctrlr`): a null bdev of `size` bytes (a whole
/// number of MiB, which `bdev_null_create` takes) for the null engine, an aio bdev on `image`
/// (O_DIRECT, as the other backends open it) for the uring engine; then the controller, on the
/// target's one reactor, on CPU `cpu`.
pub fn rpc_calls(
    engine: EngineKind,
    size: u64,
    image: Option<&Path>,
    ctrlr: &str,
    cpu: usize,
) -> Vec<Vec<String>> {
    let bdev = match (engine, image) {
        (EngineKind::Uring, Some(img)) => vec![
            "bdev_aio_create".into(),
            img.display().to_string(),
            BDEV.into(),
            BLOCK_SIZE.to_string(),
        ],
        _ => vec![
            "bdev_null_create".into(),
            BDEV.into(),
            (size >> 20).to_string(),
            BLOCK_SIZE.to_string(),
        ],
    };
    let controller = vec![
        "vhost_create_blk_controller".into(),
        "--cpumask".into(),
        cpu_mask(cpu),
        ctrlr.into(),
        BDEV.into(),
    ];
    vec![bdev, controller]
}

/// SPDK's mask of the one CPU `cpu`, in hex: as long as the CPU number needs, so that no
/// integer width bounds it.
fn cpu_mask(cpu: usize) -> String {
    format!("0x{}{}", 1 << (cpu % 4), "0".repeat(cpu / 4))
}

/// A directory laid out as an SPDK build (empty `bin/vhost` and `scripts/rpc.py`): enough for
/// [`SpdkBuild::find`], for tests of the bench's options and reports.
#[cfg(test)]
pub(crate) fn fake_build() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["bin/vhost", "scripts/rpc.py"] {
        let path = dir.path().join(f);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "").unwrap();
    }
    dir
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[OsString]) -> Vec<String> {
        v.iter().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn the_target_runs_without_hugepages_on_one_reactor() {
        let b = SpdkBuild {
            vhost: "/spdk/bin/vhost".into(),
            rpc_py: "/spdk/scripts/rpc.py".into(),
        };
        assert_eq!(
            strings(&b.vhost_argv(Path::new("/run/b"), Path::new("/run/b/s1.rpc"), 0)),
            [
                "/spdk/bin/vhost",
                "-m",
                "0x1",
                "--no-huge",
                "-s",
                "1024",
                "-u",
                "--disable-cpumask-locks",
                "-S",
                "/run/b",
                "-r",
                "/run/b/s1.rpc"
            ]
        );
        let call = rpc_calls(EngineKind::Null, 1 << 30, None, "s1.sock", 0);
        assert_eq!(
            call,
            [
                vec!["bdev_null_create", "bench0", "1024", "512"],
                vec![
                    "vhost_create_blk_controller",
                    "--cpumask",
                    "0x1",
                    "s1.sock",
                    "bench0"
                ]
            ]
        );
        assert_eq!(
            strings(&b.rpc_argv(Path::new("/r.rpc"), &call[0])),
            [
                "python3",
                "/spdk/scripts/rpc.py",
                "-s",
                "/r.rpc",
                "bdev_null_create",
                "bench0",
                "1024",
                "512"
            ]
        );
        let call = rpc_calls(
            EngineKind::Uring,
            1 << 30,
            Some(Path::new("/img/disk.img")),
            "s2.sock",
            0,
        );
        assert_eq!(
            call[0],
            ["bdev_aio_create", "/img/disk.img", "bench0", "512"]
        );
        assert_eq!(call[1][3], "s2.sock");
    }

    /// `--spdk-cpu N` puts the reactor, and the controller on it, on CPU N alone.
    #[test]
    fn the_reactor_runs_on_the_cpu_asked_for() {
        let b = SpdkBuild {
            vhost: "/spdk/bin/vhost".into(),
            rpc_py: "/spdk/scripts/rpc.py".into(),
        };
        let argv = strings(&b.vhost_argv(Path::new("/run/b"), Path::new("/r.rpc"), 1));
        assert_eq!(argv[1..3], ["-m", "0x2"]);
        let call = rpc_calls(EngineKind::Null, 1 << 30, None, "s1.sock", 5);
        assert_eq!(call[1][1..3], ["--cpumask", "0x20"]);
        assert_eq!(cpu_mask(0), "0x1");
        assert_eq!(cpu_mask(131), format!("0x8{}", "0".repeat(32)));
    }

    #[test]
    fn sessions_are_counted_from_vhost_get_controllers() {
        assert_eq!(
            sessions_call("s1.sock"),
            ["vhost_get_controllers", "-n", "s1.sock"]
        );
        let idle = r#"[{"ctrlr": "s1.sock", "cpumask": "0x1", "sessions": [],
            "backend_specific": {"block": {"bdev": "bench0"}}}]"#;
        assert_eq!(session_count(idle), Ok(0));
        let busy = r#"[{"ctrlr": "s1.sock", "sessions": [{"vid": 0, "id": 0,
            "name": "s1.socks0", "started": true, "max_queues": 2, "inflight_task_cnt": 0}]}]"#;
        assert_eq!(session_count(busy), Ok(1));
        assert!(session_count("[{}]").is_err());
        assert!(session_count("Null0").is_err());
    }

    #[test]
    fn a_missing_build_is_refused_with_how_to_make_one() {
        let e = SpdkBuild::find(None).unwrap_err();
        assert!(
            e.contains("scripts/spdk-build.sh") && !e.contains('\n'),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let e = SpdkBuild::find(Some(dir.path())).unwrap_err();
        assert!(
            e.contains("bin/vhost") && e.contains("scripts/spdk-build.sh"),
            "{e}"
        );
        std::fs::create_dir_all(dir.path().join("bin")).unwrap();
        std::fs::create_dir_all(dir.path().join("scripts")).unwrap();
        std::fs::write(dir.path().join("bin/vhost"), "").unwrap();
        std::fs::write(dir.path().join("scripts/rpc.py"), "").unwrap();
        let b = SpdkBuild::find(Some(dir.path())).unwrap();
        assert_eq!(b.vhost, dir.path().join("bin/vhost"));
    }

    #[test]
    fn a_relative_build_directory_is_made_absolute() {
        // The target runs in the run's directory: a relative path would not find it there.
        let dir = fake_build();
        let cwd = std::env::current_dir().unwrap();
        let rel = pathdiff(dir.path(), &cwd);
        let b = SpdkBuild::find(Some(&rel)).unwrap();
        assert!(b.vhost.is_absolute() && b.rpc_py.is_absolute(), "{b:?}");
        assert!(b.vhost.is_file(), "{b:?}");
    }

    /// `path` relative to `base` (both absolute), through `..` as needed.
    fn pathdiff(path: &Path, base: &Path) -> PathBuf {
        let up = base.components().count() - 1;
        let mut rel: PathBuf = std::iter::repeat_n("..", up).collect();
        rel.extend(path.components().skip(1));
        rel
    }
}
