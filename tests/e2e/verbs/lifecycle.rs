//! Attachment lifecycle edges that ordinary ADD/DEL tests do not reach:
//! a DEL immediately followed by an ADD of the same attachment (the DEL's
//! background veth deletion must not take the new veth with it), an ADD
//! whose plugin the runtime kills in the middle, and the release of a
//! previous boot's attachments at startup.

use std::time::Duration;

use serde_json::Value;
use tether_e2e::{
    add, check, cni_with_timeout, del, require_root, tether_bin, with_prev, CniEnv, Daemon,
    DaemonOpts, Netns,
};

fn pod_ipv4(result: &Value) -> String {
    result["ips"]
        .as_array()
        .and_then(|ips| {
            ips.iter()
                .find(|ip| !ip["address"].as_str().unwrap_or("").contains(':'))
        })
        .and_then(|ip| ip["address"].as_str())
        .and_then(|a| a.split('/').next())
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no IPv4 address in {result}"))
}

/// `tetherd_with_delays` on `cidr`, holding one kind of its steps back
/// (`hold`, one of its `--hold-*-ms` flags) `ms` milliseconds.
fn held_daemon(cidr: &str, hold: &str, ms: u32) -> Daemon {
    Daemon::start(DaemonOpts {
        pod_cidrs: vec![cidr.into()],
        bin: Some(env!("CARGO_BIN_EXE_tetherd_with_delays").into()),
        extra_args: vec![hold.into(), ms.to_string()],
        ..DaemonOpts::default()
    })
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn del_then_immediate_add_keeps_the_new_veth() {
    require_root();
    // tetherd_with_delays holds each background deletion back 300 ms, so
    // the ADD below always arrives while it is pending.
    let d = held_daemon("10.77.0.0/24", "--hold-deletions-ms", 300);
    let conf = d.netconf("1.1.0", "lifecycle");
    let pod = Netns::new("lcpod");
    let peer = Netns::new("lcpeer");
    let peer_ip = pod_ipv4(
        add(&tether_bin(), &conf, "lc-peer", &peer)
            .assert_success()
            .result(),
    );
    for round in 0..5 {
        let out = add(&tether_bin(), &conf, "lc-c1", &pod);
        out.assert_success();
        let result = out.result().clone();
        let host_if = result["interfaces"][0]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        del(&tether_bin(), &conf, "lc-c1", &pod).assert_success();
        // Straight back in, racing the background deletion of the old veth.
        let again = add(&tether_bin(), &conf, "lc-c1", &pod);
        again.assert_success();
        let result = again.result().clone();
        assert_eq!(
            result["interfaces"][0]["name"],
            host_if.as_str(),
            "same key, same host name"
        );
        // Let a late deletion strike if the ADD did not wait for it.
        std::thread::sleep(std::time::Duration::from_millis(400));
        assert!(
            d.node().link_names().contains(&host_if),
            "round {round}: the new veth {host_if} was deleted"
        );
        check(&tether_bin(), &with_prev(&conf, &result), "lc-c1", &pod).assert_success();
        pod.exec_ok(&["ping", "-c", "1", "-W", "2", &peer_ip]);
        del(&tether_bin(), &conf, "lc-c1", &pod).assert_success();
    }
}

/// A runtime that gives up on an ADD kills the plugin (containerd does,
/// when the kubelet's call is cancelled, as on a kubelet restart) and
/// then sends DEL. The daemon must not leave half an attachment behind:
/// the ADD it was in the middle of either finishes, and the DEL releases
/// it, or is undone. Before the verbs ran in tasks of their own, the
/// killed plugin's call was dropped at its next await, and its address
/// stayed taken with no attachment to release it: a /29's sixth pod then
/// found the pool exhausted.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn an_add_whose_plugin_is_killed_midway_leaves_nothing_after_its_del() {
    require_root();
    // Each wiring waits 1 s before the kernel is asked; the plugin is
    // killed 300 ms into its call, while the daemon waits there.
    let d = held_daemon("10.79.0.0/29", "--hold-wiring-ms", 1000);
    let conf = d.netconf("1.1.0", "lifecycle");
    let pod = Netns::new("lccut");
    let stdin = serde_json::to_vec(&conf).expect("JSON serializes");
    let cut = cni_with_timeout(
        &tether_bin(),
        &CniEnv::new("ADD", "lc-cut", &pod),
        &stdin,
        Duration::from_millis(300),
    );
    assert_eq!(
        cut.status, 137,
        "the plugin was killed in the middle: {cut}"
    );
    del(&tether_bin(), &conf, "lc-cut", &pod).assert_success();
    // Every address of the /29 is free again: six pods get one each.
    let pods: Vec<Netns> = (0..6).map(|i| Netns::new(&format!("lcc{i}"))).collect();
    for (i, p) in pods.iter().enumerate() {
        let out = add(&tether_bin(), &conf, &format!("lc-c{i}"), p);
        assert!(
            out.success(),
            "pod {i} of 6 in a /29 after the cut ADD's DEL: {out}\n{}",
            d.log()
        );
    }
    // And the cut ADD's veth went with its DEL.
    let host = tether_kernel::host_ifname("lifecycle", "lc-cut", "eth0");
    assert!(
        tether_e2e::wait_until(Duration::from_secs(5), || !d
            .node()
            .link_names()
            .contains(&host)),
        "{host} is still there"
    );
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn attachments_of_a_previous_boot_are_released_at_startup() {
    require_root();
    let mut d = Daemon::with_cidrs(&["10.78.0.0/29"], &[]);
    let conf = d.netconf("1.1.0", "lifecycle");
    let pod = Netns::new("lcboot");
    let first = add(&tether_bin(), &conf, "lc-boot", &pod);
    first.assert_success();
    let first = first.result().clone();

    // A restart on the same boot keeps the attachment.
    d.restart();
    check(&tether_bin(), &with_prev(&conf, &first), "lc-boot", &pod).assert_success();

    // Pretend the machine rebooted since: a different recorded boot id.
    d.stop();
    std::fs::write(
        d.state_dir().join("boot_id"),
        "00000000-0000-0000-0000-000000000000\n",
    )
    .expect("planting a boot id");
    d.restart();
    let out = check(&tether_bin(), &with_prev(&conf, &first), "lc-boot", &pod);
    assert_eq!(out.error_code(), Some(110), "released as unknown: {out}");
    assert!(
        d.log().contains("the node rebooted since the last run"),
        "{}",
        d.log()
    );
    // The released address is free: a /29 has 6, and next-fit hands out
    // all of them again without an exhaustion error.
    let pods: Vec<Netns> = (0..6).map(|i| Netns::new(&format!("lcb{i}"))).collect();
    for (i, p) in pods.iter().enumerate() {
        add(&tether_bin(), &conf, &format!("lc-b{i}"), p).assert_success();
    }
    // A DEL for the released attachment, as the runtime would send it, is a no-op.
    del(&tether_bin(), &conf, "lc-boot", &pod).assert_success();
}
