//! The `tap` binding on the real kernel: the tap as QEMU needs it, frames
//! passing between it and the node through the pod's veth, and CHECK's
//! codes for each way the pod can break. The test opens a tap queue itself,
//! as QEMU would, and plays the guest.

use std::io::{Read, Write};
use std::os::fd::AsFd;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::*;
use crate::netlink::tap;
use tether_base::guest::TapSpec;

/// The size of the virtio-net header the tap prefixes to each frame
/// (IFF_VNET_HDR, default size).
const VNET_HDR: usize = 10;
/// The guest's MAC in these tests: not the pod interface's, as when a
/// VMI sets its own `macAddress`.
const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

fn spec(queues: u16) -> TapSpec {
    TapSpec {
        name: "tap0".into(),
        queues,
        owner: 107,
        group: 107,
    }
}

/// Opens a queue of the pod's tap from inside its netns.
fn open_queue(pod: &TestPod, spec: &TapSpec) -> File {
    let ns = pod.ns.file.try_clone().expect("dup");
    let spec = spec.clone();
    std::thread::spawn(move || {
        nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET).expect("setns");
        tap::open_queue(&spec).expect("open a tap queue")
    })
    .join()
    .expect("tap thread")
}

/// The next frame the guest side reads, without its vnet header.
fn read_frame(tap: &mut File, within: Duration) -> Option<Vec<u8>> {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(tap.as_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, PollTimeout::from(ms)).expect("poll") == 0 {
            return None;
        }
        let mut buf = vec![0u8; 65536];
        let n = tap.read(&mut buf).expect("read tap");
        if n > VNET_HDR {
            return Some(buf[VNET_HDR..n].to_vec());
        }
    }
}

/// An ARP request for `target` in a frame, if it is one.
fn arp_request_for(frame: &[u8], target: [u8; 4]) -> bool {
    frame.len() >= 42
        && frame[12..14] == [0x08, 0x06]
        && frame[20..22] == [0, 1]
        && frame[38..42] == target
}

/// The guest's ARP reply to `asker`.
fn arp_reply(asker_mac: &[u8], asker_ip: &[u8], guest_ip: [u8; 4]) -> Vec<u8> {
    let mut f = Vec::with_capacity(VNET_HDR + 42);
    f.extend_from_slice(&[0u8; VNET_HDR]);
    f.extend_from_slice(asker_mac);
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 2]);
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&guest_ip);
    f.extend_from_slice(asker_mac);
    f.extend_from_slice(asker_ip);
    f
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn a_tap_binding_joins_the_guest_to_the_node_and_checks_every_part() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let node = node_ns_path();
        let pod = TestPod::new("tap", &["10.1.0.9"]);
        let tap_spec = spec(2);
        let mut w = pod.wiring();
        w.tap = Some(&tap_spec);
        dp.wire(&w).await.expect("wire with a tap");
        dp.check(&w).await.expect("check right after wiring");

        // The tap as QEMU needs it.
        let links = ip_json(pod.path(), &["-d", "link", "show", "tap0"]);
        let data = &links[0]["linkinfo"]["info_data"];
        assert_eq!(data["type"], "tap", "{data}");
        assert_eq!(data["multi_queue"], true, "{data}");
        assert_eq!(data["vnet_hdr"], true, "{data}");
        assert_eq!(data["persist"], true, "{data}");
        assert_eq!(links[0]["mtu"], pod.mtu, "{}", links[0]);
        assert_eq!(links[0]["ifalias"], format!("tether:{}", pod.host));
        // The pod interface keeps the VM's MAC and holds no address: the
        // addresses are the guest's.
        let eth = ip_json(pod.path(), &["addr", "show", "eth0"]);
        assert_eq!(eth[0]["address"], pod.mac.to_string());
        assert_eq!(eth[0]["addr_info"], Value::Array(vec![]), "{}", eth[0]);

        // The node resolves the VM's address: its ARP request crosses the
        // pod to the tap, and the guest's answer crosses back.
        // The node needs an address of its own to ask from.
        run_in(&node, &["ip", "addr", "add", "10.255.0.1/32", "dev", "lo"]);
        run_in(&node, &["ip", "link", "set", "lo", "up"]);
        let mut queue = open_queue(&pod, &tap_spec);
        let ping = Command::new("nsenter")
            .arg(format!("--net={node}"))
            .args(["busybox", "ping", "-c1", "-W2", "10.1.0.9"])
            .spawn()
            .expect("ping");
        let mut asked = None;
        let deadline = Instant::now() + Duration::from_secs(3);
        while asked.is_none() && Instant::now() < deadline {
            if let Some(f) = read_frame(&mut queue, Duration::from_millis(500)) {
                if arp_request_for(&f, [10, 1, 0, 9]) {
                    asked = Some(f);
                }
            }
        }
        if asked.is_none() {
            for args in [
                &["tc", "-s", "filter", "show", "dev", "eth0", "ingress"][..],
                &["tc", "-s", "qdisc", "show"][..],
                &["ip", "-s", "link"][..],
            ] {
                eprintln!("{args:?}:\n{}", run_in(pod.path(), args));
            }
            eprintln!("node: {}", run_in(&node, &["ip", "-s", "link"]));
            eprintln!("node: {}", run_in(&node, &["ip", "route"]));
        }
        let asked = asked.expect("the node's ARP request for the VM reaches the tap");
        let reply = arp_reply(&asked[22..28], &asked[28..32], [10, 1, 0, 9]);
        queue
            .write_all(&reply)
            .expect("write the guest's ARP reply");
        let mut ping = ping;
        let _ = ping.wait();
        let neigh = ip_json(&node, &["neigh", "show", "10.1.0.9"]);
        assert_eq!(
            neigh.first().map(|n| n["lladdr"].clone()),
            Some(Value::from("52:54:00:12:34:56")),
            "the node learned the guest's MAC through the pod: {neigh:?}"
        );
        drop(queue);

        // Each way the pod can break has its own code.
        run_in(
            pod.path(),
            &["tc", "filter", "del", "dev", "tap0", "ingress"],
        );
        let err = dp.check(&w).await.expect_err("a missing redirect");
        assert_eq!(err.code(), 118, "{err}");
        run_in(pod.path(), &["ip", "link", "del", "tap0"]);
        let err = dp.check(&w).await.expect_err("a missing tap");
        assert_eq!(err.code(), 117, "{err}");
        rewire(&dp, &w).await;

        // A tap that is not ours is never taken or deleted.
        dp.remove_tap(&pod.ns.pod, "tap0", &pod.host)
            .await
            .expect("remove our tap");
        // The deletion itself finishes after the answer.
        let gone = Instant::now() + Duration::from_secs(5);
        while ip_json(pod.path(), &["link"])
            .iter()
            .any(|l| l["ifname"] == "tap0")
        {
            assert!(Instant::now() < gone, "the tap is still there");
            std::thread::sleep(Duration::from_millis(10));
        }
        dp.remove_tap(&pod.ns.pod, "tap0", &pod.host)
            .await
            .expect("removing a tap that is gone is success");
        dp.delete_link(&pod.host).await.expect("delete veth");
        run_in(pod.path(), &["ip", "tuntap", "add", "tap0", "mode", "tap"]);
        let err = dp.wire(&w).await.expect_err("someone else's tap0");
        assert!(err.to_string().contains("tap0"), "{err}");
        assert!(
            ip_json(&node, &["link"])
                .iter()
                .all(|l| l["ifname"] != pod.host.as_str()),
            "a failed ADD leaves no veth"
        );
        let err = dp
            .remove_tap(&pod.ns.pod, "tap0", &pod.host)
            .await
            .expect_err("someone else's tap is not removed");
        assert!(err.to_string().contains("tap0"), "{err}");
        assert!(ip_json(pod.path(), &["link"])
            .iter()
            .any(|l| l["ifname"] == "tap0"));
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn a_single_queue_tap_is_not_multi_queue() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let pod = TestPod::new("tap1q", &["10.1.0.10", "2001:db8::10"]);
        let tap_spec = spec(1);
        let mut w = pod.wiring();
        w.tap = Some(&tap_spec);
        dp.wire(&w).await.expect("wire");
        dp.check(&w).await.expect("check");
        let links = ip_json(pod.path(), &["-d", "link", "show", "tap0"]);
        assert_eq!(
            links[0]["linkinfo"]["info_data"]["multi_queue"], false,
            "{}",
            links[0]
        );
        // The node side is wired as for any pod: routes and fe80::1.
        let mut wrong = tap_spec.clone();
        wrong.queues = 4;
        w.tap = Some(&wrong);
        let err = dp.check(&w).await.expect_err("multi-queue differs");
        assert_eq!(err.code(), 117, "{err}");
    });
}

/// What KubeVirt's virt-handler does to a `managedTap` pod after tether's
/// ADD (pkg/network/driver, read from KubeVirt's code): the veth is renamed
/// and enslaved to a bridge with the tap, and a dummy takes its name, MAC
/// and MTU. A test double of virt-handler: the commands, not its code. This
/// kernel has no dummy driver (CONFIG_DUMMY is off), so an empty bridge
/// stands in for the dummy; CHECK accepts any non-veth link there.
fn rewrite_like_virt_handler(pod: &TestPod) {
    let ns = pod.path();
    let mac = pod.mac.to_string();
    let mtu = pod.mtu.to_string();
    for cmd in [
        &["ip", "link", "set", "eth0", "down"][..],
        &["ip", "addr", "flush", "dev", "eth0"],
        &["ip", "link", "set", "eth0", "name", "eth0-nic"],
        &["ip", "link", "add", "k6t-eth0", "type", "bridge"],
        &["ip", "link", "set", "eth0-nic", "master", "k6t-eth0"],
        &[
            "ip", "tuntap", "add", "tap0", "mode", "tap", "user", "107", "group", "107",
        ],
        &["ip", "link", "set", "tap0", "master", "k6t-eth0"],
        &["ip", "link", "add", "eth0", "type", "bridge"],
        &["ip", "link", "set", "eth0", "address", &mac, "mtu", &mtu],
        &["ip", "link", "set", "eth0-nic", "up"],
        &["ip", "link", "set", "k6t-eth0", "up"],
        &["ip", "link", "set", "eth0", "up"],
    ] {
        run_in(ns, cmd);
    }
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn check_accepts_a_pod_that_managed_tap_rewrote_and_nothing_else() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let pod = TestPod::new("mtap", &["10.1.0.11"]);
        let mut w = pod.wiring();
        w.managed_tap = true;
        dp.wire(&w).await.expect("wire");
        dp.check(&w).await.expect("check before KubeVirt's rewrite");
        rewrite_like_virt_handler(&pod);
        dp.check(&w).await.expect("check after KubeVirt's rewrite");
        // The same rewrite is a broken pod for any other binding.
        w.managed_tap = false;
        let err = dp.check(&w).await.expect_err("not managedTap");
        assert!((111..=113).contains(&err.code()), "{err}");
        w.managed_tap = true;
        // Taken out of the bridge, the veth carries nothing to the guest.
        run_in(pod.path(), &["ip", "link", "set", "eth0-nic", "nomaster"]);
        let err = dp.check(&w).await.expect_err("veth out of the bridge");
        assert_eq!(err.code(), 111, "{err}");
        assert!(err.to_string().contains("not bridged"), "{err}");
        run_in(
            pod.path(),
            &["ip", "link", "set", "eth0-nic", "master", "k6t-eth0"],
        );
        run_in(
            pod.path(),
            &["ip", "link", "set", "eth0", "address", "52:54:00:00:00:01"],
        );
        let err = dp.check(&w).await.expect_err("dummy with another MAC");
        assert_eq!(err.code(), 111, "{err}");
    });
}
