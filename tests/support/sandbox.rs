//! What a running daemon's threads hold, as /proc shows it: their seccomp mode and filters,
//! no_new_privs and capabilities, to check that the sandbox confines every one of them.

use std::fs;

/// One thread's confinement, from /proc/PID/task/TID/status.
#[derive(Debug, Clone)]
pub struct ThreadStatus {
    pub tid: u32,
    /// The thread's name (`comm`).
    pub name: String,
    /// `Seccomp:` (2: filtered).
    pub seccomp: u32,
    /// `Seccomp_filters:`: how many filters are stacked on it.
    pub filters: u32,
    /// `NoNewPrivs:`.
    pub no_new_privs: u32,
    /// `CapEff:`, `CapPrm:`, `CapBnd:`, `CapAmb:`.
    pub cap_eff: u64,
    pub cap_prm: u64,
    pub cap_bnd: u64,
    pub cap_amb: u64,
}

impl ThreadStatus {
    /// Whether this is one of mqblk's I/O threads, or an io_uring worker one of them started
    /// (`iou-wrk-TID`, `iou-sqp-TID`: they inherit its credentials and filters; a qcow2
    /// metadata worker's ring starts them too). `all`: the process's threads.
    pub fn is_io_thread(&self, all: &[ThreadStatus]) -> bool {
        if self.name.starts_with("mqblk-io") {
            return true;
        }
        let starter = ["iou-wrk-", "iou-sqp-"]
            .iter()
            .find_map(|p| self.name.strip_prefix(p)?.parse::<u32>().ok());
        // A worker whose starter has ended is held to an I/O thread's (stricter) checks.
        starter.is_some_and(|tid| {
            all.iter()
                .find(|t| t.tid == tid)
                .is_none_or(|t| t.name.starts_with("mqblk-io"))
        })
    }
}

/// CAP_IPC_LOCK's bit: what control threads may keep permitted (never effective) where
/// RLIMIT_MEMLOCK could not be lifted, to create I/O threads' rings (see mqblk's
/// `sandbox::privileges`).
pub const CAP_IPC_LOCK: u64 = 1 << 14;

/// Every thread of process `pid`. Panics if /proc cannot be read: a check that cannot look
/// must not pass.
pub fn threads(pid: u32) -> Vec<ThreadStatus> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap_or_else(|e| panic!("cannot list the threads of {pid}: {e}"));
    let mut out = Vec::new();
    for task in tasks {
        let task = task.expect("a /proc task entry");
        let Ok(status) = fs::read_to_string(task.path().join("status")) else {
            continue; // the thread ended meanwhile
        };
        let field = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
                .map(str::trim)
                .unwrap_or_else(|| panic!("no {key} in {status}"))
                .to_string()
        };
        let hex = |key: &str| u64::from_str_radix(&field(key), 16).expect("a hex capability set");
        let num = |key: &str| field(key).parse::<u32>().expect("a number");
        out.push(ThreadStatus {
            tid: task.file_name().to_string_lossy().parse().expect("a tid"),
            name: field("Name"),
            seccomp: num("Seccomp"),
            filters: num("Seccomp_filters"),
            no_new_privs: num("NoNewPrivs"),
            cap_eff: hex("CapEff"),
            cap_prm: hex("CapPrm"),
            cap_bnd: hex("CapBnd"),
            cap_amb: hex("CapAmb"),
        });
    }
    assert!(!out.is_empty(), "process {pid} shows no thread");
    out
}

/// Asserts that every thread of `pid` is confined: seccomp filtering (mode 2), no_new_privs,
/// empty effective, ambient and bounding capability sets, nothing permitted but
/// [`CAP_IPC_LOCK`]; I/O threads with filters of their own on top of the control threads' and
/// no capability at all. Returns the threads (at least `min_io` of them I/O threads).
pub fn assert_confined(pid: u32, min_io: usize) -> Vec<ThreadStatus> {
    let all = threads(pid);
    let table = all
        .iter()
        .map(|t| format!("{t:?}"))
        .collect::<Vec<_>>()
        .join("\n  ");
    let control_filters = all
        .iter()
        .filter(|t| !t.is_io_thread(&all))
        .map(|t| t.filters)
        .max()
        .expect("a control thread (the main thread at least)");
    for t in &all {
        assert_eq!(t.seccomp, 2, "thread not filtered by seccomp:\n  {table}");
        assert_eq!(t.no_new_privs, 1, "thread without no_new_privs:\n  {table}");
        assert_eq!(
            t.cap_eff, 0,
            "thread with effective capabilities:\n  {table}"
        );
        assert_eq!(t.cap_amb, 0, "thread with ambient capabilities:\n  {table}");
        assert_eq!(t.cap_bnd, 0, "thread with a bounding set:\n  {table}");
        assert_eq!(
            t.cap_prm & !CAP_IPC_LOCK,
            0,
            "thread with permitted capabilities:\n  {table}"
        );
        if t.is_io_thread(&all) {
            assert_eq!(t.cap_prm, 0, "I/O thread with a capability:\n  {table}");
            assert!(
                t.filters > control_filters,
                "I/O thread without its own, narrower filters:\n  {table}"
            );
        }
    }
    let io = all.iter().filter(|t| t.is_io_thread(&all)).count();
    assert!(
        io >= min_io,
        "{io} I/O threads, expected {min_io}:\n  {table}"
    );
    all
}
