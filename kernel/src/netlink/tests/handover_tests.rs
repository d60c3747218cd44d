//! The migration handover on the real kernel (`netlink::handover`):
//! flows created, read back and deleted in conntrack with the translations
//! the kernel makes of them, a flow the kernel masqueraded read as such,
//! the anchors' rules and tables, the handover's nftables sets, and a
//! link's counters read across namespaces.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;

use super::*;
use crate::handover::{
    anchor_mark, anchor_table, handover_script, Flow, FlowCreated, FlowEnds, Handover,
    ANCHOR_RULE_PRIORITY, TCP, TCP_ESTABLISHED, UDP,
};

/// `TCP_CONNTRACK_SYN_SENT`: a connection whose first packet went out.
const TCP_SYN_SENT: u8 = 1;
use crate::netlink::LinuxHandover;
use crate::ClusterRoute;

fn ends(src: &str, dst: &str) -> FlowEnds {
    FlowEnds {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
    }
}

fn flow(proto: u8, orig: FlowEnds, reply: FlowEnds, mark: u32) -> Flow {
    Flow {
        proto,
        orig,
        reply,
        mark,
        timeout_secs: 100,
        tcp_state: (proto == TCP).then_some(TCP_ESTABLISHED),
    }
}

/// A host outside the node (a netns of its own) on a veth of the node's:
/// `uplink` (10.77.0.21/24) in the node, `eth9` (10.77.0.200/24 and
/// `more` addresses) outside, both up.
fn host_outside(node: &str, more: &[&str]) -> Netns {
    let outside = new_netns();
    let path = outside.path.to_str().expect("path").to_owned();
    run_in(
        node,
        &[
            "ip", "link", "add", "uplink", "type", "veth", "peer", "name", "eth9", "netns", &path,
        ],
    );
    run_in(
        node,
        &["ip", "addr", "add", "10.77.0.21/24", "dev", "uplink"],
    );
    run_in(node, &["ip", "link", "set", "uplink", "up"]);
    for a in std::iter::once(&"10.77.0.200/24").chain(more) {
        run_in(&path, &["ip", "addr", "add", a, "dev", "eth9"]);
    }
    run_in(&path, &["ip", "link", "set", "eth9", "up"]);
    outside
}

fn handover() -> LinuxHandover {
    let dp = connect();
    LinuxHandover::new(dp.handle.clone(), dp.dumps.clone())
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn flows_go_into_conntrack_with_their_translation_and_come_back_out() {
    require_root!();
    in_node_netns(|| async {
        let h = handover();
        let vm = "10.244.0.5";
        let anchored = flow(
            TCP,
            ends("10.244.0.5:40000", "10.77.0.200:8000"),
            ends("10.77.0.200:8000", "10.244.0.5:40000"),
            anchor_mark(7),
        );
        let service = flow(
            TCP,
            ends("10.244.0.5:40001", "10.96.0.10:9100"),
            ends("10.244.1.9:9100", "10.244.0.5:40001"),
            0,
        );
        let datagrams = flow(
            UDP,
            ends("10.244.0.5:40002", "10.77.0.200:8001"),
            ends("10.77.0.200:8001", "10.244.0.5:40002"),
            anchor_mark(7),
        );
        let v6 = flow(
            TCP,
            ends("[fd00:10:244::5]:40000", "[fd00:77:ff::200]:8010"),
            ends("[fd00:77:ff::200]:8010", "[fd00:10:244::5]:40000"),
            anchor_mark(7),
        );
        for f in [&anchored, &service, &datagrams, &v6] {
            assert_eq!(
                h.create_flow(f, false).await.expect("create"),
                FlowCreated::Created,
                "{f:?}"
            );
        }
        let mut read = h.flows_of(vm.parse().unwrap()).await.expect("flows");
        read.sort_by_key(|f| f.orig.src.port());
        assert_eq!(read.len(), 3, "{read:#?}");
        // The kernel made the destination translation again: the answers
        // come from the backend.
        assert_eq!(read[1].orig, service.orig);
        assert_eq!(read[1].reply, service.reply);
        assert!(read[1].destination_translated() && !read[1].source_translated());
        assert_eq!(read[1].mark, 0);
        // The anchored flows are untranslated and keep their mark.
        assert_eq!(
            (read[0].reply, read[0].mark),
            (anchored.orig.inverse(), anchor_mark(7))
        );
        assert_eq!(read[0].tcp_state, Some(TCP_ESTABLISHED));
        assert_eq!((read[2].proto, read[2].mark), (UDP, anchor_mark(7)));
        assert!(
            read.iter()
                .all(|f| f.timeout_secs <= 100 && f.timeout_secs > 90),
            "{read:#?}"
        );
        let read6 = h
            .flows_of("fd00:10:244::5".parse().unwrap())
            .await
            .expect("v6 flows");
        assert_eq!(read6.len(), 1);
        assert_eq!(read6[0].orig, v6.orig);
        // One read for several addresses gives each the same flows, in
        // the order asked.
        let each = h
            .flows_of_each(&[
                "fd00:10:244::5".parse().unwrap(),
                "10.244.0.99".parse().unwrap(),
                vm.parse().unwrap(),
            ])
            .await
            .expect("flows of each");
        // (Their timeouts tick between the reads: not compared.)
        let ends_of = |flows: &[Flow]| {
            let mut e: Vec<_> = flows
                .iter()
                .map(|f| (f.proto, f.orig, f.reply, f.mark))
                .collect();
            e.sort_by_key(|x| x.1.src.port());
            e
        };
        assert_eq!(
            (
                each.len(),
                ends_of(&each[0]),
                each[1].len(),
                ends_of(&each[2])
            ),
            (3, ends_of(&read6), 0, ends_of(&read))
        );

        // Creating the same flow again sets its timeout anew, and brings an
        // opening TCP state forward: a connection sent while it was being
        // opened has opened since (left SYN_SENT here, its packets would
        // be invalid). An established one is never set back.
        let mut opening = anchored.clone();
        opening.orig.src.set_port(40002);
        opening.reply.dst.set_port(40002);
        opening.mark = anchor_mark(9);
        opening.tcp_state = Some(TCP_SYN_SENT);
        assert_eq!(
            h.create_flow(&opening, false).await.unwrap(),
            FlowCreated::Created
        );
        let state_of = |flows: &[Flow], orig: FlowEnds| {
            let f = flows.iter().find(|f| f.orig == orig).expect("the flow");
            (f.tcp_state, f.timeout_secs)
        };
        let read = h.flows_of(vm.parse().unwrap()).await.unwrap();
        assert_eq!(state_of(&read, opening.orig).0, Some(TCP_SYN_SENT));
        let mut stale = anchored.clone();
        stale.tcp_state = Some(TCP_SYN_SENT);
        assert_eq!(
            h.create_flow(&stale, false).await.unwrap(),
            FlowCreated::Refreshed
        );
        let read = h.flows_of(vm.parse().unwrap()).await.unwrap();
        assert_eq!(
            state_of(&read, anchored.orig).0,
            Some(TCP_ESTABLISHED),
            "an established flow is never set back"
        );
        for f in [&opening, &anchored] {
            let mut later = f.clone();
            later.tcp_state = Some(TCP_ESTABLISHED);
            later.timeout_secs = 400;
            assert_eq!(
                h.create_flow(&later, false).await.unwrap(),
                FlowCreated::Refreshed
            );
        }
        let refreshed = h.flows_of(vm.parse().unwrap()).await.unwrap();
        for orig in [anchored.orig, opening.orig] {
            let (state, t) = state_of(&refreshed, orig);
            assert_eq!(state, Some(TCP_ESTABLISHED), "state set anew");
            assert!(t > 300, "timeout set anew: {t}");
        }
        assert_eq!(h.delete_anchored(9).await.unwrap(), 1);

        // A flow this node tracked itself before (the VM ran here, left and
        // comes back): a real connection over this netns's loopback, its
        // window tracking strict. Sent again, it is made liberal, so that
        // the packets of a connection that went on elsewhere are not
        // invalid here.
        let node = node_ns_path();
        run_in(&node, &["ip", "link", "set", "lo", "up"]);
        // conntrack runs in a netns only once a rule there asks for it.
        nft("table inet ct_on {\n chain out {\n  type filter hook output priority 0;\n  ct state new accept\n }\n}\n");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let server = listener.local_addr().expect("address");
        let client = std::net::TcpStream::connect(server).expect("connect");
        let _accepted = listener.accept().expect("accept");
        let back = FlowEnds {
            src: client.local_addr().expect("address"),
            dst: server,
        };
        // IP_CT_TCP_FLAG_BE_LIBERAL.
        let liberal = 0x08;
        let strict = h.tcp_flags_of(back).await.unwrap().expect("the flow");
        assert_eq!(
            (strict.0 & liberal, strict.1 & liberal),
            (0, 0),
            "{strict:?}"
        );
        let mut returning = flow(TCP, back, back.inverse(), 0);
        returning.timeout_secs = 120;
        assert_eq!(
            h.create_flow(&returning, false).await.unwrap(),
            FlowCreated::Refreshed
        );
        let now = h.tcp_flags_of(back).await.unwrap().expect("the flow");
        assert_eq!(
            (now.0 & liberal, now.1 & liberal),
            (liberal, liberal),
            "{now:?}"
        );
        let mut other_mark = anchored.clone();
        other_mark.mark = anchor_mark(8);
        assert_eq!(
            h.create_flow(&other_mark, false).await.unwrap(),
            FlowCreated::Exists
        );
        assert_eq!(
            h.create_flow(&other_mark, true).await.unwrap(),
            FlowCreated::Replaced
        );
        // A flow one of whose directions another entry holds collides: the
        // backend's answers to the VM are the reply of the service flow.
        let backend_side = flow(
            TCP,
            ends("10.244.0.5:40001", "10.244.1.9:9100"),
            ends("10.244.1.9:9100", "10.244.0.5:40001"),
            0,
        );
        assert_eq!(
            h.create_flow(&backend_side, false).await.unwrap(),
            FlowCreated::Exists
        );
        // Asked to replace, it still keeps a translated entry: that is this
        // node's own translation of the flow.
        assert_eq!(
            h.create_flow(&backend_side, true).await.unwrap(),
            FlowCreated::Exists
        );

        assert_eq!(
            h.create_flow(&anchored, true).await.unwrap(),
            FlowCreated::Replaced
        );
        assert_eq!(h.count_anchored(7).await.unwrap(), 3);
        assert_eq!(h.count_anchored(8).await.unwrap(), 0);
        assert_eq!(h.delete_anchored(7).await.unwrap(), 3);
        assert_eq!(h.count_anchored(7).await.unwrap(), 0);
        let left = h.flows_of(vm.parse().unwrap()).await.unwrap();
        assert_eq!(left.len(), 1, "only the service flow: {left:#?}");

        // The other order: this node forwards the VM's connection to a
        // backend pod of its own, untranslated, when the VM's Service flow
        // arrives. It collides (the kernel would have made it with another
        // port for the answers), and replaces the forwarding when asked.
        let forwarded = flow(
            UDP,
            ends("10.244.0.5:40003", "10.244.1.9:9100"),
            ends("10.244.1.9:9100", "10.244.0.5:40003"),
            0,
        );
        let to_service = flow(
            UDP,
            ends("10.244.0.5:40003", "10.96.0.10:9100"),
            ends("10.244.1.9:9100", "10.244.0.5:40003"),
            0,
        );
        assert_eq!(
            h.create_flow(&forwarded, false).await.unwrap(),
            FlowCreated::Created
        );
        assert_eq!(
            h.create_flow(&to_service, false).await.unwrap(),
            FlowCreated::Exists
        );
        let held = h.flows_of(vm.parse().unwrap()).await.unwrap();
        assert!(
            held.iter().all(|f| f.orig != to_service.orig),
            "nothing made with another port: {held:#?}"
        );
        assert_eq!(
            h.create_flow(&to_service, true).await.unwrap(),
            FlowCreated::Replaced
        );
        let now = h.flows_of(vm.parse().unwrap()).await.unwrap();
        let made: Vec<&Flow> = now.iter().filter(|f| f.orig.src.port() == 40003).collect();
        assert_eq!(made.len(), 1, "{now:#?}");
        assert_eq!(
            (made[0].orig, made[0].reply),
            (to_service.orig, to_service.reply)
        );

        // Many at once, in one trip: each outcome in its flow's place.
        let again = flow(
            UDP,
            ends("10.244.0.5:40004", "10.77.0.200:8004"),
            ends("10.77.0.200:8004", "10.244.0.5:40004"),
            anchor_mark(7),
        );
        let made: Vec<FlowCreated> = h
            .create_flows(
                &[again.clone(), forwarded.clone(), to_service.clone()],
                true,
            )
            .await
            .into_iter()
            .map(|r| r.expect("create"))
            .collect();
        assert_eq!(
            made,
            [
                FlowCreated::Created,
                // Its reply direction is the Service flow's, translated.
                FlowCreated::Exists,
                FlowCreated::Refreshed
            ]
        );
        assert_eq!(h.count_anchored(7).await.unwrap(), 1);
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn a_watch_follows_flows_made_changed_and_ended_with_one_read() {
    require_root!();
    in_node_netns(|| async {
        let h = handover();
        let vm: std::net::IpAddr = "10.244.0.5".parse().unwrap();
        // Made before the feed opens: conntrack gives it no event record.
        let old = flow(
            TCP,
            ends("10.244.0.5:41000", "10.77.0.200:8000"),
            ends("10.77.0.200:8000", "10.244.0.5:41000"),
            anchor_mark(8),
        );
        h.create_flow(&old, false).await.expect("create");
        let mut w = crate::flow_watch::FlowWatch::open(&h).expect("the feed opens");
        // What the watch holds, and a read of the table, without the
        // timeouts (they count down between the two).
        let plain = |mut v: Vec<Flow>| {
            v.iter_mut().for_each(|f| f.timeout_secs = 0);
            v.sort_by_key(|f| (f.proto, f.orig.src, f.orig.dst));
            v
        };
        let got = w.flows_of_each(&h, &[vm]).await.expect("first read");
        assert_eq!(plain(got[0].clone()), plain(vec![old.clone()]));
        assert_eq!(w.reads(), 1);

        // Made: one of the VM's, one toward it, one opening (SYN sent),
        // one of another address; then the opening one established (an
        // update event with TCP's state), and the first one ended.
        let first = flow(
            TCP,
            ends("10.244.0.5:41002", "10.77.0.200:8002"),
            ends("10.77.0.200:8002", "10.244.0.5:41002"),
            anchor_mark(9),
        );
        let toward = flow(
            UDP,
            ends("10.77.0.200:5353", "10.244.0.5:6000"),
            ends("10.244.0.5:6000", "10.77.0.200:5353"),
            0,
        );
        let mut opening = flow(
            TCP,
            ends("10.244.0.5:41001", "10.77.0.200:8001"),
            ends("10.77.0.200:8001", "10.244.0.5:41001"),
            0,
        );
        opening.tcp_state = Some(TCP_SYN_SENT);
        let other = flow(
            UDP,
            ends("10.244.0.77:53", "10.77.0.200:53"),
            ends("10.77.0.200:53", "10.244.0.77:53"),
            0,
        );
        for f in [&first, &toward, &opening, &other] {
            h.create_flow(f, false).await.expect("create");
        }
        opening.tcp_state = Some(TCP_ESTABLISHED);
        assert_eq!(
            h.create_flow(&opening, false).await.expect("establish"),
            FlowCreated::Refreshed
        );
        assert_eq!(h.delete_anchored(9).await.expect("end the first"), 1);

        // The events reach the feed's thread on their own time: the watch
        // is asked until it agrees with a read, for at most 5 s.
        let want = plain(h.flows_of(vm).await.expect("read"));
        assert_eq!(want.len(), 3, "{want:#?}");
        let mut seen = Vec::new();
        for _ in 0..250 {
            seen = plain(w.flows_of_each(&h, &[vm]).await.expect("watch")[0].clone());
            if seen == want {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(seen, want, "the watch against a read");
        assert!(
            seen.iter()
                .any(|f| f.orig == opening.orig && f.tcp_state == Some(TCP_ESTABLISHED)),
            "{seen:#?}"
        );
        assert_eq!(w.reads(), 1, "followed, not read again");

        // The end of the flow made before the feed is read, when asked.
        assert_eq!(h.delete_anchored(8).await.expect("end the old one"), 1);
        w.read_again();
        let now = w.flows_of_each(&h, &[vm]).await.expect("read again");
        assert_eq!(plain(now[0].clone()), plain(h.flows_of(vm).await.unwrap()));
        assert_eq!((now[0].len(), w.reads()), (2, 2));

        // A new address is read once, with the others.
        let other_ip = "10.244.0.77".parse().unwrap();
        let both = w.flows_of_each(&h, &[vm, other_ip]).await.expect("both");
        assert_eq!((both[1].len(), w.reads()), (1, 3));
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn a_flow_the_kernel_masqueraded_reads_as_source_translated() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        enable_forwarding().expect("forwarding");
        let node = node_ns_path();
        let pod = TestPod::new("masq", &["10.244.0.5"]);
        dp.wire(&pod.wiring()).await.expect("wire");
        // A host outside, on a veth of the node's.
        let _outside = host_outside(&node, &[]);
        nft("table inet t {\n chain p {\n  type nat hook postrouting priority srcnat;\n  ip saddr 10.244.0.0/16 oifname \"uplink\" masquerade\n }\n}\n");
        // One datagram from the pod: conntrack holds its masqueraded flow.
        let pod_file = pod.ns.file.try_clone().expect("dup");
        std::thread::spawn(move || {
            nix::sched::setns(&pod_file, CloneFlags::CLONE_NEWNET).expect("setns");
            let s = UdpSocket::bind("10.244.0.5:40005").expect("bind");
            s.send_to(b"hello", "10.77.0.200:8001").expect("send");
        })
        .join()
        .expect("pod thread");
        let h = handover();
        let read = h
            .flows_of("10.244.0.5".parse().unwrap())
            .await
            .expect("flows");
        let f = read
            .iter()
            .find(|f| f.orig.dst == "10.77.0.200:8001".parse::<SocketAddr>().unwrap())
            .unwrap_or_else(|| panic!("no masqueraded flow: {read:#?}"));
        assert_eq!(f.proto, UDP);
        assert!(
            f.source_translated() && !f.destination_translated(),
            "{f:?}"
        );
        assert_eq!(f.reply.dst.ip(), "10.77.0.21".parse::<IpAddr>().unwrap());
        assert_eq!(
            f.landed("10.244.0.5".parse().unwrap(), 3).unwrap().reply,
            f.orig.inverse()
        );
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn anchors_are_rules_and_tables_and_the_guard_a_set_with_timeouts() {
    require_root!();
    in_node_netns(|| async {
        let node = node_ns_path();
        let outside = new_netns();
        let out_path = outside.path.to_str().expect("path").to_owned();
        run_in(
            &node,
            &[
                "ip", "link", "add", "uplink", "type", "veth", "peer", "name", "eth9", "netns",
                &out_path,
            ],
        );
        run_in(
            &node,
            &["ip", "addr", "add", "10.77.0.21/24", "dev", "uplink"],
        );
        run_in(
            &node,
            &[
                "ip",
                "-6",
                "addr",
                "add",
                "fd00:77:ff::21/64",
                "dev",
                "uplink",
                "nodad",
            ],
        );
        run_in(&node, &["ip", "link", "set", "uplink", "up"]);
        nft(&handover_script());
        let h = handover();

        let via = |ip: &str| ClusterRoute {
            dst: ip.parse::<IpAddr>().unwrap().into(),
            via: ip.parse().unwrap(),
            onlink_dev: None,
        };
        h.ensure_anchor(7, &[via("10.77.0.22"), via("fd00:77:ff::22")])
            .await
            .expect("anchor");
        h.ensure_anchor(7, &[via("10.77.0.22"), via("fd00:77:ff::22")])
            .await
            .expect("the same anchor again");
        let rules = run_in(&node, &["ip", "rule"]);
        let table = anchor_table(7).to_string();
        assert!(
            rules.contains(&format!("{ANCHOR_RULE_PRIORITY}:"))
                && rules.contains("fwmark 0x70000/0x7fff0000")
                && rules.contains(&table),
            "{rules}"
        );
        let routes = run_in(&node, &["ip", "route", "show", "table", &table]);
        assert!(routes.contains("default via 10.77.0.22"), "{routes}");
        let routes6 = run_in(&node, &["ip", "-6", "route", "show", "table", &table]);
        assert!(routes6.contains("default via fd00:77:ff::22"), "{routes6}");
        assert_eq!(h.anchors().await.unwrap(), vec![7]);
        h.remove_anchor(7).await.expect("remove");
        assert_eq!(h.anchors().await.unwrap(), Vec::<u16>::new());
        assert!(run_in(&node, &["ip", "route", "show", "table", &table])
            .trim()
            .is_empty());

        let vm: Vec<IpAddr> = vec![
            "10.244.0.9".parse().unwrap(),
            "fd00:10:244::9".parse().unwrap(),
        ];
        h.guard_moved(&vm, Duration::from_secs(60))
            .await
            .expect("guard");
        h.guard_moved(&vm, Duration::from_secs(60))
            .await
            .expect("guard again");
        let moved = run_in(
            &node,
            &["nft", "list", "set", "inet", "tether_vm", "moved_v4"],
        );
        assert!(
            moved.contains("10.244.0.9 timeout 1m") || moved.contains("10.244.0.9 timeout 60s"),
            "{moved}"
        );

        // A VM's own direction of a deferred Service flow, held back and
        // let go, in both families.
        let held = [
            (UDP, ends("10.244.0.9:33765", "10.96.0.20:9100")),
            (TCP, ends("[fd00:10:244::9]:47962", "[fd00:96::20]:9100")),
        ];
        let list = |set: &str| run_in(&node, &["nft", "list", "set", "inet", "tether_vm", set]);
        for _ in 0..2 {
            h.hold_back(&held, Some(Duration::from_secs(10)))
                .await
                .expect("hold back");
        }
        // nft 1.0.6 (Debian 12) prints a protocol in a concatenation as its
        // number, newer ones by name.
        let v4 = list("held_back_v4");
        assert!(
            ["udp", "17"].iter().any(|p| v4.contains(&format!(
                "10.244.0.9 . 10.96.0.20 . {p} . 33765 . 9100 timeout 10s"
            ))),
            "{v4}"
        );
        let v6 = list("held_back_v6");
        assert!(
            ["tcp", "6"].iter().any(|p| v6.contains(&format!(
                "fd00:10:244::9 . fd00:96::20 . {p} . 47962 . 9100 timeout 10s"
            ))),
            "{v6}"
        );
        h.hold_back(&held, None).await.expect("let go");
        h.hold_back(&held, None).await.expect("let go of nothing");
        assert!(!list("held_back_v4").contains("10.244.0.9"));
        assert!(!list("held_back_v6").contains("fd00:10:244::9"));
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn packets_sent_down_a_veth_are_held_counted_and_sent_again() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        enable_forwarding().expect("forwarding");
        let node = node_ns_path();
        nft(&handover_script());
        let pod = TestPod::new("count", &["10.244.0.12"]);
        dp.wire(&pod.wiring()).await.expect("wire");
        let other = TestPod::new("other", &["10.244.0.13"]);
        dp.wire(&other.wiring()).await.expect("wire");
        let h = handover();
        let held = h.capture(&pod.host).await.expect("capture");
        // The pod's own interface stands in for the tap: its transmit
        // counter is what it sent toward the node.
        let before = h
            .tap_counters(&pod.ns.path, "eth0", &pod.host)
            .await
            .expect("counters");
        assert!(pings(other.path(), "10.244.0.12"));
        let after = h
            .tap_counters(&pod.ns.path, "eth0", &pod.host)
            .await
            .expect("counters");
        assert!(
            after.sent > before.sent,
            "the node sent the echo request: {before:?} {after:?}"
        );
        assert!(
            after.read > before.read,
            "the pod answered: {before:?} {after:?}"
        );
        assert!(
            h.tap_counters(&pod.ns.path, "tap0", &pod.host)
                .await
                .is_err(),
            "no tap0 in the pod"
        );
        // The echo request, as the node sent it: IPv4, ICMP, to the pod.
        // The capture holds whatever else the node sent down the veth
        // too: its IPv6 multicast listener reports, which a slow machine
        // (the TCG guest of the min-kernel run) may send after the echo.
        let echo_to_pod = |p: &Vec<u8>| {
            p.len() >= 20 && (p[0] >> 4, p[9]) == (4, 1) && p[16..20] == [10, 244, 0, 12]
        };
        let echo = || held.last(usize::MAX).into_iter().rfind(echo_to_pod);
        let waited = Instant::now();
        while echo().is_none() && waited.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let last = vec![echo().unwrap_or_else(|| {
            panic!(
                "no echo request among the {} packets held: {:02x?}",
                held.seen(),
                held.last(usize::MAX)
            )
        })];
        assert!(h
            .routes_to_link("10.244.0.12".parse().unwrap(), &pod.host)
            .await
            .unwrap());
        assert!(!h
            .routes_to_link("10.244.0.13".parse().unwrap(), &pod.host)
            .await
            .unwrap());
        // Sent again, it reaches the pod once more, untracked. Counted by
        // the pod's own firewall: its link counters also see the node's
        // neighbour probes.
        let pod_ns = pod.ns.path.to_string_lossy().into_owned();
        for cmd in [
            "add table inet count",
            "add chain inet count input { type filter hook input priority 0; }",
            "add rule inet count input icmp type echo-request counter",
        ] {
            let argv: Vec<&str> = std::iter::once("nft").chain(cmd.split(' ')).collect();
            run_in(&pod_ns, &argv);
        }
        let requests = || {
            let out = run_in(&pod_ns, &["nft", "list", "chain", "inet", "count", "input"]);
            out.split_whitespace()
                .skip_while(|w| *w != "packets")
                .nth(1)
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no counter in {out}"))
        };
        let flows0 = run_in(&node, &["conntrack", "-C"]);
        let sent = h.replay(last).await.expect("replay");
        assert_eq!((sent.sent, sent.skipped), (1, 0));
        let waited = Instant::now();
        while requests() == 0 && waited.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(requests(), 1, "the pod got the echo request again, once");
        assert_eq!(
            run_in(&node, &["conntrack", "-C"]),
            flows0,
            "no flow for a packet sent again"
        );
        drop(held);
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn a_pinned_nodeport_flow_keeps_its_translation_when_the_vm_is_routed_elsewhere() {
    require_root!();
    for pin in [false, true] {
        let seen = std::thread::spawn(move || nodeport_source_after_a_move(pin))
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        let (first, second, third) = seen;
        if pin {
            assert_eq!(
                first, second,
                "pinned: the VM sees the same masqueraded source after the move"
            );
            assert_eq!(
                Some(first),
                third,
                "pinned: the source pod's veth deleted (its DEL), the flow holds"
            );
        } else {
            // Without pinning the kernel drops the masqueraded flow when its
            // packets leave through another device: a new one, another port.
            assert_ne!(first, second, "unpinned: the masquerade is made again");
        }
    }
}

/// A NodePort-like flow (DNAT to the VM's address, masqueraded toward it
/// with random ports, as kube-proxy masquerades) from an outside host,
/// then the VM's address routed to another pod (as a migration's source
/// does): the source the VM saw before and after; pinned, also after the
/// source pod's veth is deleted (its DEL: the kernel ends the masqueraded
/// flows of a device that goes).
fn nodeport_source_after_a_move(pin: bool) -> (SocketAddr, SocketAddr, Option<SocketAddr>) {
    let out = Arc::new(std::sync::Mutex::new(None));
    let slot = out.clone();
    in_node_netns(move || async move {
        let dp = connect();
        enable_forwarding().expect("forwarding");
        let node = node_ns_path();
        nft(&handover_script());
        nft("table ip kp {
 chain pre {
  type nat hook prerouting priority dstnat;
  ip daddr 10.77.0.21 udp dport 31000 dnat to 10.244.0.5:7000
 }
 chain post {
  type nat hook postrouting priority srcnat;
  ip daddr 10.244.0.5 oifname \"tth*\" masquerade fully-random
 }
}
");
        let outside = host_outside(&node, &[]);
        let source = TestPod::new("src", &["10.244.0.5"]);
        dp.wire(&source.wiring()).await.expect("wire");
        // The same address in another pod, wired as a migration's target.
        let target = TestPod::new("dst", &["10.244.0.5"]);
        let mut w = target.wiring();
        w.routed = false;
        dp.wire(&w).await.expect("wire the target unrouted");
        let recv_in = |p: &TestPod| {
            let f = p.ns.file.try_clone().expect("dup");
            std::thread::spawn(move || {
                nix::sched::setns(&f, CloneFlags::CLONE_NEWNET).expect("setns");
                let s = UdpSocket::bind("0.0.0.0:7000").expect("bind 7000");
                s.set_read_timeout(Some(Duration::from_secs(3)))
                    .expect("timeout");
                let mut buf = [0u8; 16];
                s.recv_from(&mut buf)
                    .map(|(_, from)| from)
                    .expect("a datagram")
            })
        };
        let outside_file = outside.file.try_clone().expect("dup");
        let client = std::thread::spawn(move || {
            nix::sched::setns(&outside_file, CloneFlags::CLONE_NEWNET).expect("setns");
            UdpSocket::bind("10.77.0.200:50000").expect("bind")
        })
        .join()
        .expect("client");
        let first = recv_in(&source);
        std::thread::sleep(Duration::from_millis(50));
        client.send_to(b"one", "10.77.0.21:31000").expect("send");
        let first = first.join().expect("first");
        if pin {
            let n = handover()
                .pin_translations(&["10.244.0.5".parse().unwrap()])
                .await
                .expect("pin");
            assert_eq!(n, 1, "one masqueraded flow toward the VM");
        }
        // The migration's route change: the address now leads to the target.
        dp.ensure_host_routes(&target.host, &["10.244.0.5".parse().unwrap()])
            .await
            .expect("route");
        let second = recv_in(&target);
        std::thread::sleep(Duration::from_millis(50));
        // Unpinned, the kernel drops the first packet after the move with
        // its flow; the next one starts a new flow.
        for _ in 0..3 {
            client.send_to(b"two", "10.77.0.21:31000").expect("send");
            std::thread::sleep(Duration::from_millis(100));
        }
        let second = second.join().expect("second");
        let third = if pin {
            run_in(&node, &["ip", "link", "del", &source.host]);
            let third = recv_in(&target);
            std::thread::sleep(Duration::from_millis(50));
            client.send_to(b"three", "10.77.0.21:31000").expect("send");
            Some(third.join().expect("third"))
        } else {
            None
        };
        *slot.lock().unwrap() = Some((first, second, third));
    });
    let seen = out.lock().unwrap().take();
    seen.expect("the test ran")
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn a_capture_hands_back_only_an_unbroken_run_of_the_newest_packets() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        enable_forwarding().expect("forwarding");
        let pod = TestPod::new("burst", &["10.244.0.14"]);
        dp.wire(&pod.wiring()).await.expect("wire");
        let name = std::ffi::CString::new(pod.host.as_str()).expect("name");
        // SAFETY: a valid NUL-terminated name that outlives the call.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert_ne!(ifindex, 0, "no {}", pod.host);
        // The real buffer, and one small enough that a burst overflows it.
        for rcvbuf in [None, Some(4096)] {
            let held = match rcvbuf {
                None => crate::replay::Capture::start(ifindex),
                Some(b) => crate::replay::Capture::start_with_buffer(ifindex, b),
            }
            .expect("capture");
            // Whatever the socket drops, what the capture hands back must
            // be the newest packets with none missing between them, or an
            // older packet (one the guest read) would be sent again in
            // place of a dropped one.
            let sock = UdpSocket::bind("0.0.0.0:0").expect("bind");
            const BURST: u32 = 30_000;
            for seq in 0..BURST {
                // A full queue drops a send: a gap in what the pod gets,
                // never in what the capture hands back.
                let _ = sock.send_to(&seq.to_be_bytes(), "10.244.0.14:9");
            }
            // Then a trickle the capture keeps up with: after a drop, the
            // run counts again once the socket's queue was read empty.
            std::thread::sleep(Duration::from_millis(200));
            const TRICKLE: u32 = 100;
            for seq in BURST..BURST + TRICKLE {
                sock.send_to(&seq.to_be_bytes(), "10.244.0.14:9")
                    .expect("send");
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(100));
            let seqs: Vec<u32> = held
                .last(BURST as usize)
                .iter()
                .filter(|p| p.len() == 20 + 8 + 4 && p[9] == 17)
                .map(|p| u32::from_be_bytes([p[28], p[29], p[30], p[31]]))
                .collect();
            assert!(held.seen() > 0, "nothing captured");
            for w in seqs.windows(2) {
                assert_eq!(
                    w[1],
                    w[0] + 1,
                    "a gap in the run handed back: {} then {}",
                    w[0],
                    w[1]
                );
            }
            eprintln!(
                "buffer {rcvbuf:?}: captured {} of {BURST}; handed back an unbroken run of {}",
                held.seen(),
                seqs.len()
            );
            assert_eq!(
                seqs.last(),
                Some(&(BURST + TRICKLE - 1)),
                "the newest packet last"
            );
            assert!(
                seqs.len() >= (TRICKLE / 2) as usize,
                "the trickle after the burst is handed back: {}",
                seqs.len()
            );
        }
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn a_mirror_of_the_vms_service_flow_is_neither_sent_nor_pinned() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        enable_forwarding().expect("forwarding");
        let node = node_ns_path();
        nft(&handover_script());
        // kube-proxy's NAT hooks, with nothing of this flow in them: the
        // kernel gives every new flow through them a null binding.
        nft("table ip kp {
 chain pre { type nat hook prerouting priority dstnat; }
 chain post { type nat hook postrouting priority srcnat; }
}
");
        // Another node, holding the backend and, like the node a VM left,
        // sending the backend's answers on translated back (from the
        // ClusterIP).
        let other = host_outside(&node, &["10.96.0.20/32"]);
        let other_path = other.path.to_str().expect("path").to_owned();
        run_in(
            &other_path,
            &["ip", "route", "add", "10.244.0.0/16", "via", "10.77.0.21"],
        );
        let vm = TestPod::new("mirror", &["10.244.0.9"]);
        dp.wire(&vm.wiring()).await.expect("wire");
        let bind_in = |ns: &File, addr: &'static str| {
            let f = ns.try_clone().expect("dup");
            std::thread::spawn(move || {
                nix::sched::setns(&f, CloneFlags::CLONE_NEWNET).expect("setns");
                let s = UdpSocket::bind(addr).expect("bind");
                s.set_read_timeout(Some(Duration::from_secs(2)))
                    .expect("timeout");
                s
            })
            .join()
            .expect("bind thread")
        };
        let guest = bind_in(&vm.ns.file, "10.244.0.9:40000");
        let backend = bind_in(&other.file, "10.77.0.200:9100");
        let answers_back = bind_in(&other.file, "10.96.0.20:9100");

        // The VM's Service flow, as a target makes it.
        let h = handover();
        let own = flow(
            UDP,
            ends("10.244.0.9:40000", "10.96.0.20:9100"),
            ends("10.77.0.200:9100", "10.244.0.9:40000"),
            0,
        );
        assert_eq!(
            h.create_flow(&own, false).await.expect("create"),
            FlowCreated::Created
        );
        // An answer that comes translated back and passes tracked: the
        // kernel tracks it as a flow of its own, a port changed to clear
        // the VM's entry.
        answers_back
            .send_to(b"answer", "10.244.0.9:40000")
            .expect("send");
        let mut buf = [0u8; 16];
        let seen = guest.recv_from(&mut buf).map(|(_, from)| from);
        let mirror = run_in(
            &node,
            &["conntrack", "-L", "-p", "udp", "--orig-src", "10.96.0.20"],
        );
        assert!(
            mirror.contains("sport=9100 dport=40000"),
            "the kernel tracked no mirror (the guest saw {seen:?}):\n{mirror}"
        );

        // Pinning leaves it, and with it the VM's own flow (made again,
        // the mirror would take the place of the VM's flow), and it is not
        // sent to a target.
        let vm_ip: IpAddr = "10.244.0.9".parse().unwrap();
        assert_eq!(
            h.pin_translations(&[vm_ip]).await.expect("pin"),
            0,
            "conntrack:\n{mirror}"
        );
        let read = h.flows_of(vm_ip).await.expect("flows");
        assert_eq!(read.len(), 1, "{read:#?}");
        assert_eq!((read[0].orig, read[0].reply), (own.orig, own.reply));
        // And the VM's next datagram still goes to its backend.
        guest.send_to(b"next", "10.96.0.20:9100").expect("send");
        let (_, from) = backend.recv_from(&mut buf).expect("the backend hears");
        assert_eq!(from, own.orig.src);
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn many_translated_flows_are_pinned_each_and_none_left_frozen() {
    require_root!();
    in_node_netns(|| async {
        let node = node_ns_path();
        nft(&handover_script());
        let h = handover();
        // NodePort-like flows toward a VM (the address translated to the
        // VM's, the source to the node's, as kube-proxy masquerades): many
        // clients' ports to one NodePort, so that their first directions
        // share one element of the freeze sets, in both families.
        let mut made = Vec::new();
        for i in 0..200u16 {
            made.push(flow(
                UDP,
                ends(&format!("10.77.0.200:{}", 20000 + i), "10.77.0.21:31000"),
                ends("10.244.0.7:7000", &format!("10.77.0.21:{}", 40000 + i)),
                0,
            ));
        }
        for i in 0..50u16 {
            made.push(flow(
                TCP,
                ends(
                    &format!("[fd00:77:ff::200]:{}", 20000 + i),
                    "[fd00:77:ff::21]:31000",
                ),
                ends(
                    "[fd00:10:244::7]:7000",
                    &format!("[fd00:77:ff::21]:{}", 40000 + i),
                ),
                0,
            ));
        }
        for f in &made {
            assert_eq!(
                h.create_flow(f, false).await.expect("create"),
                FlowCreated::Created
            );
        }
        let vm: [IpAddr; 2] = [
            "10.244.0.7".parse().unwrap(),
            "fd00:10:244::7".parse().unwrap(),
        ];
        let took = Instant::now();
        let pinned = h.pin_translations(&vm).await.expect("pin");
        // Printed for the record (benchmarks measure; tests do not time).
        eprintln!("pinned {pinned} flows in {:?}", took.elapsed());
        assert_eq!(pinned as usize, made.len());
        // Each is there again with its translation, and nothing is held
        // off any more.
        let mut read = Vec::new();
        for ip in vm {
            read.extend(h.flows_of(ip).await.expect("flows"));
        }
        assert_eq!(read.len(), made.len(), "{read:#?}");
        for f in &made {
            assert!(
                read.iter().any(|r| r.orig == f.orig && r.reply == f.reply),
                "{f:?} not in conntrack as it was"
            );
        }
        for set in ["frozen_v4", "frozen_v6"] {
            let listed = run_in(
                &node,
                &[
                    "nft",
                    "list",
                    "set",
                    "inet",
                    crate::handover::HANDOVER_TABLE,
                    set,
                ],
            );
            assert!(!listed.contains("elements"), "{set} still holds:\n{listed}");
        }
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn more_translated_flows_than_one_batch_holds_are_pinned() {
    require_root!();
    in_node_netns(|| async {
        nft(&handover_script());
        let h = handover();
        // As thousands of NodePort tries toward a VM leave them: each its
        // own source port at the node, so each answer direction its own
        // element of the freeze set. In one batch, 1,500 overran the
        // socket's receive buffer with their acknowledgements (ENOBUFS),
        // and the socket was left with answers missing.
        let made: Vec<Flow> = (0..1500u16)
            .map(|i| {
                flow(
                    UDP,
                    ends(&format!("10.77.0.200:{}", 20000 + i), "10.77.0.21:31000"),
                    ends("10.244.0.7:7000", &format!("10.77.0.21:{}", 30000 + i)),
                    0,
                )
            })
            .collect();
        for f in &made {
            h.create_flow(f, false).await.expect("create");
        }
        let vm: [IpAddr; 1] = ["10.244.0.7".parse().unwrap()];
        let pinned = h.pin_translations(&vm).await.expect("pin");
        assert_eq!(pinned as usize, made.len());
        let read = h.flows_of(vm[0]).await.expect("the socket still answers");
        assert_eq!(read.len(), made.len());
        let listed = run_in(
            &node_ns_path(),
            &[
                "nft",
                "list",
                "set",
                "inet",
                crate::handover::HANDOVER_TABLE,
                "frozen_v4",
            ],
        );
        assert!(!listed.contains("elements"), "left frozen:\n{listed}");
    });
}
