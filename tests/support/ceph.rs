//! A single-node Ceph cluster for the rbd tests, started from Debian's packages (`ceph-mon`,
//! `ceph-osd`) in a temporary directory, the way the `micro-osd.sh` scripts of Ceph's client
//! libraries do it in their CI: one monitor on a free loopback port, one OSD, cephx on, a pool
//! `rbd` of size 1. No manager: nothing the tests do needs one.
//!
//! The OSD keeps its objects in memory (`memstore`): it starts in about two seconds where
//! bluestore on a file needs five and a RocksDB, and the tests' images are small. A memstore
//! OSD writes its objects to its directory when it stops cleanly (`osd_fast_shutdown = false`),
//! so [`Ceph::stop_osd`] (SIGTERM) and [`Ceph::start_osd`] keep the data, as a real OSD restart
//! does.
//!
//! The daemons are started by one long-lived thread with `PR_SET_PDEATHSIG`, so they die with
//! the test process however it ends, even for the cluster a `static` holds.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, set_parent_process_death_signal, Pid, Signal};

/// What to run when Ceph's daemons are missing.
pub const CEPH_HINT: &str = "the rbd tests need Debian's ceph-mon and ceph-osd (and ceph-common): \
     run .ci/setup, or apt-get install ceph-mon ceph-osd";

/// Longest wait for the cluster to come up or for an OSD to rejoin.
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// The tools the helper runs.
const TOOLS: &[&str] = &[
    "ceph-mon",
    "ceph-osd",
    "ceph-authtool",
    "monmaptool",
    "ceph",
    "rbd",
];

/// Fails the test with [`CEPH_HINT`] if a tool is missing.
pub fn require_ceph() {
    for t in TOOLS {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(t).is_file()))
            .unwrap_or(false);
        assert!(found, "{t} not found: {CEPH_HINT}");
    }
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns `cmd` from the keeper thread, which never exits: with `PR_SET_PDEATHSIG` tied to
/// it, the child gets SIGKILL when the test process ends.
fn spawn_kept(cmd: Command) -> std::io::Result<Child> {
    static KEEPER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let keeper = KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::spawn(move || {
            for (mut cmd, reply) in rx {
                // SAFETY: the closure runs in the child between fork and exec and makes only the
                // prctl(2) system call (rustix calls the kernel directly): async-signal-safe,
                // and it touches no memory of the parent.
                unsafe {
                    cmd.pre_exec(|| {
                        let _ = set_parent_process_death_signal(Some(Signal::KILL));
                        Ok(())
                    });
                }
                let _ = reply.send(cmd.spawn());
            }
        });
        Mutex::new(tx)
    });
    let (tx, rx) = mpsc::channel();
    keeper
        .lock()
        .unwrap()
        .send((cmd, tx))
        .expect("keeper thread");
    rx.recv().expect("keeper thread answers")
}

fn run_checked(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}; {CEPH_HINT}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {cmd:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A running single-node cluster. Dropping it stops its daemons; the directory goes with it.
pub struct Ceph {
    dir: tempfile::TempDir,
    /// The cluster's ceph.conf.
    pub conf: PathBuf,
    /// client.admin's keyring.
    pub keyring: PathBuf,
    /// The monitor's address.
    pub mon_port: u16,
    mon: Option<Child>,
    osd: Option<Child>,
    /// How long [`Ceph::start`] took.
    pub started_in: Duration,
}

impl Ceph {
    /// Creates and starts a cluster with a pool `rbd`; panics with a clear message if Ceph is
    /// not installed or does not come up in time.
    pub fn start() -> Ceph {
        require_ceph();
        let t0 = Instant::now();
        let dir = tempfile::Builder::new()
            .prefix("mqblk-ceph")
            .tempdir()
            .expect("temp dir");
        let d = dir.path().to_path_buf();
        micro(&d, "prepare");
        let conf = d.join("ceph.conf");
        let port = mon_port(&conf);
        let keyring = d.join("admin.keyring");
        let mut ceph = Ceph {
            dir,
            conf,
            keyring,
            mon_port: port,
            mon: None,
            osd: None,
            started_in: Duration::ZERO,
        };
        ceph.start_mon();
        micro(ceph.dir(), "osd-mkfs");
        ceph.start_osd();
        ceph.cli(&["osd", "pool", "create", "rbd", "8"]);
        ceph.rbd(&["pool", "init", "rbd"]);
        ceph.started_in = t0.elapsed();
        eprintln!(
            "ceph: cluster up in {:.1} s ({})",
            ceph.started_in.as_secs_f64(),
            ceph.dir.path().display()
        );
        ceph
    }

    /// The cluster's directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The `engine=rbd,...` keys of an export of `pool/image` on this cluster.
    pub fn export_keys(&self, pool: &str, image: &str) -> Vec<(String, String)> {
        vec![
            ("engine".into(), "rbd".into()),
            ("pool".into(), pool.into()),
            ("image".into(), image.into()),
            ("conf".into(), self.conf.display().to_string()),
            ("keyring".into(), self.keyring.display().to_string()),
        ]
    }

    /// Runs the `ceph` command against this cluster; panics if it fails.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = run_checked(
            Command::new("ceph")
                .arg("-c")
                .arg(&self.conf)
                .args(["--connect-timeout", "30"])
                .args(args),
            "ceph",
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs the `rbd` command against this cluster; panics if it fails.
    pub fn rbd(&self, args: &[&str]) -> String {
        let out = run_checked(
            Command::new("rbd").arg("-c").arg(&self.conf).args(args),
            "rbd",
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Creates `pool/image` of `size` bytes; `exclusive_lock` keeps librbd's default features,
    /// else only layering (what mqblk gives the images it creates).
    pub fn create_image(&self, pool: &str, image: &str, size: u64, exclusive_lock: bool) {
        let spec = format!("{pool}/{image}");
        let size = format!("{size}B");
        let mut args = vec!["create", "--size", &size, &spec];
        if !exclusive_lock {
            args.extend(["--image-feature", "layering"]);
        }
        self.rbd(&args);
    }

    /// The whole content of `pool/image`, read by the `rbd` tool (not through mqblk).
    pub fn read_image(&self, pool: &str, image: &str) -> Vec<u8> {
        let out = self.dir().join(format!("export-{image}"));
        let _ = std::fs::remove_file(&out);
        self.rbd(&[
            "export",
            &format!("{pool}/{image}"),
            &out.display().to_string(),
        ]);
        let data = std::fs::read(&out).expect("read the exported image");
        let _ = std::fs::remove_file(&out);
        data
    }

    /// The `features:` line of `rbd info pool/image`.
    pub fn features(&self, pool: &str, image: &str) -> String {
        self.rbd(&["info", &format!("{pool}/{image}")])
            .lines()
            .find(|l| l.trim_start().starts_with("features:"))
            .unwrap_or_default()
            .to_string()
    }

    fn spawn_daemon(&self, name: &str, args: &[&str]) -> Child {
        let log = std::fs::File::create(self.dir().join(format!("{name}.out"))).unwrap();
        let mut cmd = Command::new(name);
        cmd.arg("-f")
            .arg("-c")
            .arg(&self.conf)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        spawn_kept(cmd).unwrap_or_else(|e| panic!("cannot start {name}: {e}; {CEPH_HINT}"))
    }

    /// Starts the monitor (again).
    pub fn start_mon(&mut self) {
        assert!(self.mon.is_none(), "monitor already running");
        self.mon = Some(self.spawn_daemon("ceph-mon", &["-i", "a"]));
    }

    /// Stops the monitor (SIGTERM, then waits for it).
    pub fn stop_mon(&mut self) {
        if let Some(c) = self.mon.take() {
            stop(c, "ceph-mon");
        }
    }

    /// Starts the OSD (again) and waits until the monitor has it up.
    pub fn start_osd(&mut self) {
        assert!(self.osd.is_none(), "OSD already running");
        self.osd = Some(self.spawn_daemon("ceph-osd", &["-i", "0"]));
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let stat = self.cli(&["osd", "stat", "-f", "json"]);
            if stat.contains("\"num_up_osds\":1") {
                return;
            }
            if let Some(Some(status)) = self.osd.as_mut().map(|c| c.try_wait().ok().flatten()) {
                panic!(
                    "ceph-osd exited ({status}); its log is in {}",
                    self.dir().display()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the OSD is not up after {START_TIMEOUT:?}: {stat}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops the OSD cleanly (SIGTERM: a memstore OSD saves its objects), then waits for it.
    pub fn stop_osd(&mut self) {
        if let Some(c) = self.osd.take() {
            stop(c, "ceph-osd");
        }
    }
}

/// SIGTERM, and up to 30 s for the daemon to exit (then SIGKILL).
fn stop(mut c: Child, name: &str) {
    // Our own child, not yet reaped.
    let _ = kill_process(Pid::from_child(&c), Signal::TERM);
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.try_wait().ok().flatten().is_none() {
        if Instant::now() > deadline {
            eprintln!("{name} did not stop after SIGTERM: killing it");
            let _ = c.kill();
            let _ = c.wait();
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Ceph {
    /// Kills the daemons (SIGKILL) and removes the directory, through a shared reference: for
    /// a cluster held in a `static`, from an exit handler.
    pub fn kill_now(&self) {
        for c in [&self.osd, &self.mon].into_iter().flatten() {
            // Our own child (at worst already exited, never reaped by anyone else while this
            // `Ceph` lives).
            let _ = kill_process(Pid::from_child(c), Signal::KILL);
        }
        let _ = std::fs::remove_dir_all(self.dir.path());
    }
}

impl Drop for Ceph {
    fn drop(&mut self) {
        for c in [self.osd.take(), self.mon.take()].into_iter().flatten() {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `scripts/ceph-micro.sh STEP DIR`, the one definition of the micro cluster (everything
/// under `d`, loopback only, one replica, a memstore OSD that keeps its objects across a clean
/// restart); the tests' images are small, so its store is 2 GiB.
fn micro(d: &Path, step: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/ceph-micro.sh");
    run_checked(
        Command::new("bash")
            .arg(&script)
            .arg(step)
            .arg(d)
            .env("MEMSTORE_BYTES", (2u64 << 30).to_string()),
        &format!("ceph-micro.sh {step}"),
    );
}

/// The monitor's port, from the `mon_host = v2:127.0.0.1:PORT` line of `conf`.
fn mon_port(conf: &Path) -> u16 {
    let text = std::fs::read_to_string(conf).expect("read ceph.conf");
    text.lines()
        .find_map(|l| l.trim().strip_prefix("mon_host = v2:127.0.0.1:"))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no mon_host port in {}:\n{text}", conf.display()))
}
