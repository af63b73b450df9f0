//! An I/O thread panics (a fault injected through the debug builds' `debug_inject_fault`):
//! the panic ends its export's service and its frontend's connection, is reported (log,
//! `export_list`, the `mqblk_export_failed` metric), and touches nothing else: another export
//! verifies data throughout, the daemon stays up, and the failed export serves again once it is
//! removed and added back.
mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::api::Api;
use support::daemon::*;
use support::frontend::Session;
use support::hostile::Bystander;
use support::metrics::{http_get, metrics_addr};
use support::wait::wait_until;

const IMG_SIZE: u64 = 8 * MIB;

fn export_status(api: &mut Api, id: &str) -> Value {
    let list = api.ok("export_list", json!({}));
    list.as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == id)
        .unwrap_or_else(|| panic!("no export {id} in {list}"))
        .clone()
}

#[test]
fn a_panicking_io_thread_fails_only_its_export() {
    let dir = TestDir::new();
    let img = dir.image("a.img", IMG_SIZE, None);
    let other = dir.image("b.img", IMG_SIZE, None);
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let api_sock = dir.join("api.sock");
    let mut daemon = Daemon::start_args(
        &dir,
        &[
            Export::file(&a, &img).queues(2).set("queue-size", "64"),
            Export::file(&b, &other),
        ],
        &[
            "--api-socket",
            api_sock.to_str().unwrap(),
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let mut api = Api::connect(&api_sock);
    let metrics = metrics_addr(&daemon);

    // Another tenant verifies its data before, during and after.
    let bystander = Bystander::start(b.clone(), IMG_SIZE);
    bystander.wait_serving();

    let mut s = Session::open(&a, 64, None);
    s.good_write(0, 0, 0x5a);
    assert_eq!(export_status(&mut api, "a")["failure"], Value::Null);

    api.ok(
        "debug_inject_fault",
        json!({"id": "a", "thread": 1, "fault": "panic"}),
    );
    assert!(
        s.conn.closed_by_peer(Duration::from_secs(10)),
        "the frontend of an export whose I/O thread died stayed connected"
    );
    let mut failure = String::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            let st = export_status(&mut api, "a");
            st["failure"].as_str().map(|f| failure = f.into()).is_some()
        }),
        "export a never reported failed"
    );
    assert!(
        failure.contains("mqblk-io1-a") && failure.contains("injected fault"),
        "{failure}"
    );
    assert_eq!(export_status(&mut api, "b")["failure"], Value::Null);
    let log = daemon.log();
    assert!(log.contains("I/O thread panicked"), "{log}");
    let (_, _, text) = http_get(metrics, "/metrics");
    assert!(
        text.contains("mqblk_export_failed{export=\"a\"} 1")
            && text.contains("mqblk_export_failed{export=\"b\"} 0"),
        "{text}"
    );
    // A new frontend of the failed export is turned away: the socket still listens, and the
    // daemon closes what connects.
    assert!(is_listening(&a), "the failed export's socket is gone");
    let refused = Session::negotiate(&a);
    assert!(refused.is_err(), "a failed export accepted a frontend");
    assert!(
        daemon
            .log()
            .contains("a frontend connected to a failed export"),
        "{}",
        daemon.log()
    );

    bystander.wait_served_more(20);
    assert!(daemon.has_exited().is_none(), "{}", daemon.log());

    // Removed and added again, it serves.
    api.ok("export_del", json!({"id": "a"}));
    api.ok(
        "export_add",
        json!({"socket": a, "path": img, "queues": 2, "queue-size": 64}),
    );
    assert_eq!(export_status(&mut api, "a")["failure"], Value::Null);
    let mut w = verify_workload(&a, 2, 2, 200, 9);
    w.queue_size = Some(64);
    let r = mqblk_client::run(&w).expect("workload on a");
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    bystander.finish();
    daemon.stop();
}
