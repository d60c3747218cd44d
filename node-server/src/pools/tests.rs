use super::*;
use std::collections::BTreeSet;
use tether_store::control::embedded::EmbeddedStore;

const ROOT: &str = "/tether/v1/";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn defs(text: &str) -> Vec<PoolDef> {
    def::parse(text).unwrap_or_else(|e| panic!("{e}"))
}

const MIGRATION: &str = r#"{"pools":[{"name":"mig","cidr":"10.200.0.0/26","rangeStart":"10.200.0.2",
    "exclude":["10.200.0.5","10.200.0.16/30"],"gateway":"10.200.0.1","blockSize":28}]}"#;

async fn open(
    store: &Arc<dyn ControlStore>,
    node: &str,
    text: &str,
    held: &[IpAddr],
) -> NamedPools {
    let (pools, rest) = NamedPools::open(node, store.clone(), ROOT, defs(text), held)
        .await
        .unwrap_or_else(|e| panic!("open: {e}"));
    assert!(rest.is_empty(), "{rest:?}");
    pools
}

fn control() -> (tempfile::TempDir, Arc<dyn ControlStore>) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = EmbeddedStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    (dir, Arc::new(store))
}

#[tokio::test]
async fn allocation_skips_exclusions_and_claims_blocks_as_needed() {
    let (_dir, store) = control();
    let p = open(&store, "n1", MIGRATION, &[]).await;
    let mut got = Vec::new();
    loop {
        match p.allocate("mig").await {
            Ok(a) => got.push(a),
            Err(e) => {
                assert_eq!(e.code(), 100, "{e}");
                assert!(e.to_string().contains("no free /28 block"), "{e}");
                break;
            }
        }
    }
    // 64 addresses less the network, broadcast and gateway (.0 and .1,
    // below the range too), .5 and .16-.19.
    assert_eq!(got.len(), 64 - 3 - 1 - 4);
    let set: BTreeSet<IpAddr> = got.iter().copied().collect();
    assert_eq!(set.len(), got.len(), "an address was given twice");
    for excluded in [
        "10.200.0.0",
        "10.200.0.1",
        "10.200.0.5",
        "10.200.0.17",
        "10.200.0.63",
    ] {
        assert!(!set.contains(&ip(excluded)), "{excluded} was given");
    }
    assert_eq!(p.claims().0, 4);
    let blocks = p.blocks("mig").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(blocks.len(), 4);
    let u = &p.usage()[0];
    assert_eq!(
        (u.used, u.free, u.size),
        (got.len() as u128, 0, got.len() as u128)
    );
}

#[tokio::test]
async fn requested_addresses_are_checked_against_the_definition_and_the_holder() {
    let (_dir, store) = control();
    let a = open(&store, "a", MIGRATION, &[]).await;
    let b = open(&store, "b", MIGRATION, &[]).await;
    for (addr, code, needle) in [
        ("10.200.0.5", 109, "excluded from pool mig by 10.200.0.5/32"),
        ("10.200.0.1", 109, "gateway"),
        ("10.200.0.18", 109, "10.200.0.16/30"),
        ("10.200.1.7", 106, "outside pool mig"),
    ] {
        let e = a.take("mig", ip(addr)).await.map(|_| ()).expect_err(addr);
        assert_eq!(e.code(), code, "{addr}: {e}");
        assert!(e.to_string().contains(needle), "{addr}: {e}");
    }
    assert_eq!(
        a.take("nope", ip("10.200.0.7")).await.map_err(|e| e.code()),
        Err(119)
    );
    a.take("mig", ip("10.200.0.7"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let e = a
        .take("mig", ip("10.200.0.7"))
        .await
        .map(|_| ())
        .expect_err("twice");
    assert_eq!(e.code(), 105);
    // Node b may not give an address of a's block.
    let e = b
        .take("mig", ip("10.200.0.8"))
        .await
        .map(|_| ())
        .expect_err("a's block");
    assert_eq!(e.code(), 106);
    assert!(e.to_string().contains("held by node a"), "{e}");
    // Its own allocation lands in another block.
    let got = b.allocate("mig").await.unwrap_or_else(|e| panic!("{e}"));
    assert!(!"10.200.0.0/28"
        .parse::<IpNet>()
        .is_ok_and(|n| n.contains(&got)));
}

#[tokio::test]
async fn two_nodes_on_one_control_plane_never_share_an_address() {
    let (_dir, store) = control();
    let a = Arc::new(open(&store, "a", MIGRATION, &[]).await);
    let b = Arc::new(open(&store, "b", MIGRATION, &[]).await);
    let mut tasks = Vec::new();
    for i in 0..60 {
        let p = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move { p.allocate("mig").await }));
    }
    let mut got = BTreeSet::new();
    let mut exhausted = 0;
    for t in tasks {
        match t.await.unwrap_or_else(|e| panic!("{e}")) {
            Ok(addr) => assert!(got.insert(addr), "{addr} given twice"),
            Err(e) if e.code() == 100 => exhausted += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(got.len() + exhausted, 60);
    assert!(got.len() >= 40, "only {} addresses given", got.len());
}

#[tokio::test]
async fn a_changed_definition_reports_held_addresses_and_never_takes_them() {
    let (_dir, store) = control();
    let p = open(&store, "n1", MIGRATION, &[]).await;
    let first = p.allocate("mig").await.unwrap_or_else(|e| panic!("{e}"));
    let text = MIGRATION.replace(
        r#""exclude":["10.200.0.5","10.200.0.16/30"]"#,
        &format!(r#""exclude":["10.200.0.5","10.200.0.16/30","{first}"]"#),
    );
    p.reload(defs(&text));
    let u = &p.usage()[0];
    assert_eq!(u.excluded_in_use, vec![first]);
    assert_eq!(u.used, 1);
    assert_eq!(p.pool_of(first).as_deref(), Some("mig"));
    // It is not given again, even once released.
    p.release(&[first]);
    for _ in 0..20 {
        assert_ne!(p.allocate("mig").await.ok(), Some(first));
    }
    // A pool removed from the file keeps serving the DELs of its addresses.
    let held = p.allocate("mig").await.unwrap_or_else(|e| panic!("{e}"));
    p.reload(Vec::new());
    assert_eq!(p.pool_of(held).as_deref(), Some("mig"));
    assert_eq!(p.allocate("mig").await.map_err(|e| e.code()), Err(119));
    p.release(&[held]);
}

#[tokio::test]
async fn reopening_restores_held_addresses_and_takes_their_blocks_back() {
    let (_dir, store) = control();
    let p = open(&store, "n1", MIGRATION, &[]).await;
    let a = p.allocate("mig").await.unwrap_or_else(|e| panic!("{e}"));
    drop(p);
    let held = vec![a];
    let p = open(&store, "n1", MIGRATION, &held).await;
    assert_eq!(p.usage()[0].used, 1);
    assert_ne!(p.allocate("mig").await.ok(), Some(a));
    // The block record was lost (say, reaped while the node was away):
    // it is claimed back at start.
    let (_dir2, empty) = control();
    let q = open(&empty, "n1", MIGRATION, &held).await;
    assert_eq!(q.usage()[0].used, 1);
    assert_eq!(q.blocks("mig").await.map(|b| b.len()).ok(), Some(1));
}
