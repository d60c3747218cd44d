//! A real Kubernetes API server for the suites: `kube-apiserver` built
//! from the `k8s.io/kubernetes` Go module by `tests/k8s/build.sh` (cached),
//! on Debian's etcd 3.4, started as a cluster would start it:
//! - TLS, with a CA this harness makes (openssl) for the serving
//!   certificate and the admin's client certificate (`system:masters`);
//! - a service-account signing key, so that `kubectl create token` gives
//!   tetherd a real service-account token;
//! - RBAC authorisation, so that tetherd's token can do exactly what
//!   the chart's RBAC (`install/helm/tether/templates/rbac.yaml`) grants.
//!
//! It runs in a netns of its own on the test fabric (host [`API_HOST`]),
//! its etcd on that netns's loopback; node daemons reach it over the
//! fabric, and `kubectl` runs inside that netns. Nothing is bound in the
//! machine's own netns. Dropping it kills both processes (by their
//! handles) and removes the netns and the directory.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cluster::Fabric;
use crate::stack::{url_host, Stack};
use crate::{wait_until, workspace_dir, Netns, TempDir};

/// The API server's host number on the fabric (10.77.0.5).
pub const API_HOST: u8 = 5;
/// Its secure port.
pub const API_PORT: u16 = 6443;
/// The service account tetherd runs as (the chart's, release `tether`).
pub const TETHER_SA: (&str, &str) = ("kube-system", "tether");
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The directory holding kube-apiserver and kubectl (built once per
/// process by tests/k8s/build.sh, which caches across runs).
pub fn k8s_bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| go_build("kube"))
}

/// The directory holding whereabouts and its CRDs (`crds/`), for the
/// benchmark (tests/k8s/build.sh whereabouts, cached across runs).
pub fn whereabouts_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| go_build("whereabouts"))
}

pub(crate) fn go_build(what: &str) -> PathBuf {
    go_part_wanted(what);
    let script = workspace_dir().join("tests/k8s/build.sh");
    let out = Command::new("sh")
        .arg(&script)
        .arg(what)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(out.status.success(), "tests/k8s/build.sh {what} failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Fails the test at once if it runs in a part of `make test` that starts
/// before the tools line has built `what`: `TETHER_GO_PARTS` names the Go
/// parts built so far (comma-separated; `pending`: none; unset: outside
/// `make test`, where a part is built on demand). There the test would
/// start a second build of `what` beside the one under way, or race it. The
/// test belongs in the Makefile's KUBE_SUITES (it needs only `kube` and
/// `helm`) or TOOL_SUITES, which run once their parts are built.
pub(crate) fn go_part_wanted(what: &str) {
    if let Some(built) = std::env::var_os("TETHER_GO_PARTS") {
        let built = built.to_string_lossy();
        if !built.split(',').any(|part| part == what) {
            panic!(
                "this test needs {what}, built by make test's tools line, but runs before it is \
                 built (TETHER_GO_PARTS={built}): add a part of its name to KUBE_SUITES (if it \
                 needs only the Kubernetes binaries and helm) or TOOL_SUITES in the Makefile"
            );
        }
    }
}

/// A Service the tests write by hand, with its endpoints (no selector,
/// no controller): [`KubeApi::service_with_endpoints`].
#[derive(Debug, Clone, Copy)]
pub struct ServiceSpec<'a> {
    /// Its name, in namespace `default`.
    pub name: &'a str,
    /// Its type: `ClusterIP` or `NodePort`.
    pub kind: &'a str,
    /// One entry per port: name, protocol, port, target port.
    pub ports: &'a [(&'a str, &'a str, u16, u16)],
    /// Its endpoints (IPv4 addresses).
    pub endpoints: &'a [IpAddr],
}

/// A running API server (see the module doc).
#[derive(Debug)]
pub struct KubeApi {
    etcd: Option<Child>,
    apiserver: Option<Child>,
    /// Its addresses on the fabric, one per family of the cluster, the
    /// one it serves on first.
    addresses: Vec<IpAddr>,
    /// The cluster's families: the Service ranges.
    stack: Stack,
    /// Whether the server serves aggregated APIs (see
    /// [`KubeApi::start_aggregating`]).
    aggregating: bool,
    /// Flags kube-apiserver gets beyond the harness's own (see
    /// [`KubeApi::restart_apiserver_with`]).
    extra_args: Vec<String>,
    // Dropped after the processes: the netns, then the dir.
    netns: Netns,
    dir: TempDir,
}

/// Every key this harness makes is ECDSA P-256, which kube-apiserver takes
/// for serving, client and service-account keys alike: an RSA-2048 key
/// costs openssl about half a second of CPU on the 2-core machine, and a
/// cluster start makes five or more of them; a P-256 key costs about a
/// hundredth of that.
const EC_CURVE: &str = "ec_paramgen_curve:P-256";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The API server's audit policy: every request at the Metadata level,
/// once, when its response is complete.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
";

impl KubeApi {
    /// Starts etcd and kube-apiserver on `fabric`, and waits until the
    /// server is ready and its default namespaces exist.
    pub fn start(fabric: &Fabric) -> KubeApi {
        KubeApi::start_with(fabric, false, Stack::V4)
    }

    /// [`KubeApi::start`] for a server that also fronts aggregated APIs
    /// and calls webhooks served by pods (KubeVirt's virt-api): it proxies
    /// with a front-proxy client certificate (the request-header
    /// authentication a kubeadm cluster sets up, its CA this harness's
    /// CA, the only name allowed `front-proxy-client`), and reaches the
    /// APIs' and webhooks' Services at their endpoints, pod IPs
    /// (`--enable-aggregator-routing=true`): the server runs no
    /// kube-proxy, so ClusterIPs lead nowhere from it.
    pub fn start_aggregating(fabric: &Fabric) -> KubeApi {
        KubeApi::start_with(fabric, true, Stack::V4)
    }

    /// [`KubeApi::start`] (or, if `aggregating`,
    /// [`KubeApi::start_aggregating`]) for a cluster of `stack`'s
    /// families: the server's address is its first family's, and it has a
    /// Service range per family.
    pub fn start_with(fabric: &Fabric, aggregating: bool, stack: Stack) -> KubeApi {
        // Build (or find) the binaries before anything is set up.
        k8s_bin_dir();
        let netns = Netns::new("kapi");
        let underlay = fabric.attach_host(&netns, API_HOST.into());
        let dir = TempDir::new("kapi");
        let d = dir.path();
        let addresses = stack.addresses(&underlay);
        let ip = addresses[0];
        // The CA, the serving certificate, the admin's client certificate
        // and the service-account key pair.
        openssl(
            d,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                EC_CURVE,
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "2",
                "-subj",
                "/CN=tether-test-ca",
            ],
        );
        let sign = |name: &str, subj: &str, ext: &str| sign_cert(d, name, subj, ext);
        sign(
            "apiserver",
            "/CN=kube-apiserver",
            &format!(
                "subjectAltName={},DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n",
                addresses
                    .iter()
                    .map(ToString::to_string)
                    .chain(stack.api_service_ips().iter().map(|s| s.to_string()))
                    .map(|ip| format!("IP:{ip}"))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        );
        sign(
            "admin",
            "/O=system:masters/CN=tether-test-admin",
            "extendedKeyUsage=clientAuth\n",
        );
        if aggregating {
            sign(
                "front-proxy-client",
                "/CN=front-proxy-client",
                "extendedKeyUsage=clientAuth\n",
            );
        }
        openssl(
            d,
            &[
                "genpkey",
                "-algorithm",
                "ec",
                "-pkeyopt",
                EC_CURVE,
                "-out",
                "sa.key",
            ],
        );
        openssl(d, &["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"]);
        let server = format!("https://{}:{API_PORT}", url_host(ip));
        std::fs::write(
            d.join("admin.kubeconfig"),
            kubeconfig(
                &server,
                &d.join("ca.crt"),
                &format!(
                    "client-certificate: {}\n    client-key: {}",
                    d.join("admin.crt").display(),
                    d.join("admin.key").display()
                ),
            ),
        )
        .expect("writing the admin kubeconfig");
        let mut api = KubeApi {
            etcd: None,
            apiserver: None,
            addresses,
            stack,
            aggregating,
            extra_args: Vec::new(),
            netns,
            dir,
        };
        api.etcd = Some(api.spawn(
            "etcd",
            Path::new(crate::cluster::ETCD_BIN),
            &[
                "--data-dir",
                &api.path("etcd").display().to_string(),
                "--listen-client-urls",
                "http://127.0.0.1:2379",
                "--advertise-client-urls",
                "http://127.0.0.1:2379",
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
            ],
        ));
        api.start_apiserver();
        api
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Starts `program` in the server's netns, logging to `<name>.log` in
    /// its directory (a control-plane component such as
    /// kube-controller-manager). The caller owns the child.
    pub fn spawn(&self, name: &str, program: &Path, args: &[&str]) -> Child {
        let (log, err) = crate::log_outputs(&self.path(&format!("{name}.log")));
        Command::new("ip")
            .args(["netns", "exec", self.netns.name()])
            .arg(program)
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {}: {e}", program.display()))
    }

    /// (Re)starts kube-apiserver and waits until it is ready.
    pub fn start_apiserver(&mut self) {
        assert!(self.apiserver.is_none(), "kube-apiserver already runs");
        let ip = self.address().to_string();
        // Every request's metadata (who, from which agent, what) in
        // audit.log, as a cluster's audit trail would have it.
        std::fs::write(self.path("audit-policy.yaml"), AUDIT_POLICY)
            .expect("writing the audit policy");
        let (bind, advertise, port) = (
            format!("--bind-address={ip}"),
            format!("--advertise-address={ip}"),
            format!("--secure-port={API_PORT}"),
        );
        let ranges = format!(
            "--service-cluster-ip-range={}",
            Stack::joined(&self.stack.service_cidrs())
        );
        let mut args = vec![
            "--etcd-servers=http://127.0.0.1:2379",
            &bind,
            &advertise,
            &port,
            "--tls-cert-file=apiserver.crt",
            "--tls-private-key-file=apiserver.key",
            "--client-ca-file=ca.crt",
            "--service-account-key-file=sa.pub",
            "--service-account-signing-key-file=sa.key",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--authorization-mode=Node,RBAC",
            &ranges,
            "--allow-privileged=true",
            // Nodes are reached (exec, logs) at their InternalIP: their
            // host names resolve nowhere here.
            "--kubelet-preferred-address-types=InternalIP",
            // Watch caches are on, as in a real cluster; a short
            // event TTL keeps etcd small.
            "--event-ttl=10m",
            "--audit-policy-file=audit-policy.yaml",
            "--audit-log-path=audit.log",
        ];
        if self.aggregating {
            args.extend([
                "--requestheader-client-ca-file=ca.crt",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                "--proxy-client-cert-file=front-proxy-client.crt",
                "--proxy-client-key-file=front-proxy-client.key",
                "--enable-aggregator-routing=true",
            ]);
        }
        args.extend(self.extra_args.iter().map(String::as_str));
        let child = self.spawn("apiserver", &k8s_bin_dir().join("kube-apiserver"), &args);
        self.apiserver = Some(child);
        let started = Instant::now();
        let ready = wait_until(READY_TIMEOUT, || {
            if let Some(c) = self.apiserver.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    panic!("kube-apiserver exited ({status})\n{}", self.log_tail());
                }
            }
            self.kubectl(&["get", "--raw", "/readyz"]).status.success()
                && self
                    .kubectl(&["get", "namespace", "kube-system"])
                    .status
                    .success()
        });
        assert!(
            ready,
            "kube-apiserver not ready in {READY_TIMEOUT:?}\n{}",
            self.log_tail()
        );
        eprintln!("harness: kube-apiserver ready in {:?}", started.elapsed());
    }

    /// The audit log's events so far (`audit.k8s.io/v1` Event objects, at
    /// the Metadata level: user, user agent, verb, object, response code).
    pub fn audit_events(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(self.path("audit.log")).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Compacts the API server's etcd up to now, after one write of a key
    /// of the test's own, so that every resource version the API server
    /// handed out before is gone: a watch that resumes from one gets 410
    /// Gone. Run while the API server is stopped, so that its watch cache
    /// starts after the compaction.
    pub fn compact_etcd(&self) {
        let etcdctl = |args: &[&str]| {
            let mut argv = vec!["etcdctl", "--endpoints=http://127.0.0.1:2379"];
            argv.extend_from_slice(args);
            self.netns.exec_ok(&argv)
        };
        etcdctl(&["put", "/tether-test/compaction", "now"]);
        let status: Value = serde_json::from_str(&etcdctl(&["endpoint", "status", "-w", "json"]))
            .expect("etcdctl printed JSON");
        let revision = status[0]["Status"]["header"]["revision"]
            .as_i64()
            .unwrap_or_else(|| panic!("no revision in {status}"));
        etcdctl(&["compact", &revision.to_string()]);
        eprintln!("harness: the API server's etcd compacted at revision {revision}");
    }

    /// Stops kube-apiserver (SIGKILL; etcd keeps the data), as an outage.
    pub fn stop_apiserver(&mut self) {
        if let Some(mut c) = self.apiserver.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The server's URL, as the nodes reach it.
    pub fn server(&self) -> String {
        format!("https://{}:{API_PORT}", url_host(self.address()))
    }

    /// Stops kube-apiserver and starts it again with `extra` flags beyond
    /// the harness's own (a later flag wins), and waits until it is ready.
    pub fn restart_apiserver_with(&mut self, extra: &[&str]) {
        self.stop_apiserver();
        self.extra_args = extra.iter().map(|s| s.to_string()).collect();
        self.start_apiserver();
    }

    /// Stops (`SIGSTOP`) or resumes (`SIGCONT`) the API server's etcd: a
    /// store that holds its connections and answers nothing.
    pub fn freeze_etcd(&self, frozen: bool) {
        let pid = self
            .etcd
            .as_ref()
            .map(Child::id)
            .expect("the API server's etcd runs");
        let signal = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill has no memory preconditions; the PID is our child's,
        // not reaped (it cannot have been reused).
        unsafe {
            libc::kill(pid as i32, signal);
        }
    }

    /// The PIDs of the API server's etcd and of kube-apiserver, while they
    /// run (our children, not reaped).
    pub fn pids(&self) -> (Option<u32>, Option<u32>) {
        (
            self.etcd.as_ref().map(Child::id),
            self.apiserver.as_ref().map(Child::id),
        )
    }

    /// The server's address on the fabric (its netns's).
    pub fn address(&self) -> IpAddr {
        self.addresses[0]
    }

    /// Its addresses on the fabric, one per family of the cluster,
    /// [`KubeApi::address`] first.
    pub fn addresses(&self) -> &[IpAddr] {
        &self.addresses
    }

    /// The netns the server runs in.
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        crate::log_tail(&self.path("apiserver.log"), 40)
    }

    /// The admin's kubeconfig (a client certificate of `system:masters`);
    /// usable from any netns on the fabric.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.path("admin.kubeconfig")
    }

    /// kubectl as the admin, inside the server's netns.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_as(&self.admin_kubeconfig(), args)
    }

    /// kubectl with another kubeconfig (e.g. tetherd's).
    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", self.netns.name()])
            .arg(k8s_bin_dir().join("kubectl"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(["--request-timeout=10s"])
            .args(args)
            .output()
            .expect("running kubectl")
    }

    /// kubectl as the admin; panics unless it succeeds; its stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        crate::stdout_ok(&self.kubectl(args), format_args!("kubectl {args:?}"))
    }

    /// [`KubeApi::service_with_endpoints`], then waits until kube-proxy
    /// on each of `proxies` (a node's name and netns) has the Service's
    /// ClusterIP and every endpoint in its nat table; `log(i)` is the
    /// kube-proxy log of `proxies[i]`, for a failure's message. The
    /// Service.
    pub fn expose_through(
        &self,
        spec: &ServiceSpec<'_>,
        proxies: &[(&str, &Netns)],
        log: &dyn Fn(usize) -> String,
    ) -> Value {
        let svc = self.service_with_endpoints(spec);
        let ip = svc["spec"]["clusterIP"].as_str().unwrap_or_default();
        let (name, endpoints) = (spec.name, spec.endpoints);
        for (i, (node, netns)) in proxies.iter().enumerate() {
            let programmed = wait_until(Duration::from_secs(60), || {
                let out = netns.exec(&["iptables-save", "-t", "nat"]);
                let rules = String::from_utf8_lossy(&out.stdout);
                !ip.is_empty()
                    && rules.contains(ip)
                    && endpoints.iter().all(|e| rules.contains(&format!("{e}:")))
            });
            assert!(
                programmed,
                "kube-proxy on {node} never programmed {name} ({ip} → {endpoints:?})\n{}",
                log(i)
            );
        }
        svc
    }

    /// The Service of `spec` in `default`, with no selector, and its
    /// endpoints written as an EndpointSlice by hand, as a controller
    /// would; the Service as the server answers it (its ClusterIP, its
    /// NodePorts). Nothing waits for kube-proxy here.
    pub fn service_with_endpoints(&self, spec: &ServiceSpec<'_>) -> Value {
        let ServiceSpec {
            name,
            kind,
            ports,
            endpoints,
        } = *spec;
        let service_ports: Vec<Value> = ports
            .iter()
            .map(|(n, proto, port, target)| {
                json!({"name": n, "protocol": proto, "port": port, "targetPort": target})
            })
            .collect();
        let slice_ports: Vec<Value> = ports
            .iter()
            .map(|(n, proto, _, target)| json!({"name": n, "protocol": proto, "port": target}))
            .collect();
        let addresses: Vec<Value> = endpoints
            .iter()
            .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}}))
            .collect();
        self.apply(
            &json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"type": kind, "ports": service_ports},
            })
            .to_string(),
        );
        self.apply(
            &json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("{name}-1"), "namespace": "default",
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4", "ports": slice_ports, "endpoints": addresses,
            })
            .to_string(),
        );
        self.get(&["-n", "default", "service", name])
            .unwrap_or_else(|| panic!("Service {name} is not there"))
    }

    /// `kubectl apply` of a manifest given as text.
    pub fn apply(&self, manifest: &str) {
        let file = self.path(&format!("m{}.yaml", crate::unique_name("")));
        std::fs::write(&file, manifest).expect("writing a manifest");
        self.kubectl_ok(&["apply", "-f", &file.display().to_string()]);
    }

    /// `kubectl apply -f` of a file of the repository (e.g.
    /// `install/manifests/ipamclaims-crd.yaml`).
    pub fn apply_file(&self, relative: &str) {
        let path = workspace_dir().join(relative);
        self.kubectl_ok(&["apply", "-f", &path.display().to_string()]);
    }

    /// An object as JSON (`kubectl get -o json`), `None` if not found.
    pub fn get(&self, args: &[&str]) -> Option<Value> {
        let mut a = vec!["get", "-o", "json"];
        a.extend_from_slice(args);
        let out = self.kubectl(&a);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains("NotFound") || err.contains("not found"),
                "kubectl {a:?}: {err}"
            );
            return None;
        }
        Some(serde_json::from_slice(&out.stdout).expect("kubectl printed JSON"))
    }

    /// A kubeconfig file for a client certificate, signed by the cluster's
    /// CA, of subject `subj` (e.g. `/O=system:nodes/CN=system:node:n1`).
    pub fn cert_kubeconfig(&self, name: &str, subj: &str) -> PathBuf {
        let d = self.dir.path();
        sign_cert(d, name, subj, "extendedKeyUsage=clientAuth\n");
        self.write_kubeconfig(
            name,
            &format!(
                "client-certificate: {}\n    client-key: {}",
                d.join(format!("{name}.crt")).display(),
                d.join(format!("{name}.key")).display()
            ),
        )
    }

    /// Writes `<name>.kubeconfig` for this server with `user` (the
    /// user's credentials, as kubeconfig lines); its path.
    fn write_kubeconfig(&self, name: &str, user: &str) -> PathBuf {
        let path = self.path(&format!("{name}.kubeconfig"));
        std::fs::write(
            &path,
            kubeconfig(&self.server(), &self.path("ca.crt"), user),
        )
        .expect("writing a kubeconfig");
        path
    }

    /// The directory of the server's files (its logs among them).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The cluster CA's certificate.
    pub fn ca_cert(&self) -> PathBuf {
        self.path("ca.crt")
    }

    /// A kubeconfig file for a token of service account `ns/name` (made
    /// with the TokenRequest API, valid for an hour).
    pub fn token_kubeconfig(&self, ns: &str, name: &str) -> PathBuf {
        let token = self.kubectl_ok(&["-n", ns, "create", "token", name, "--duration=1h"]);
        self.write_kubeconfig(name, &format!("token: {}", token.trim()))
    }

    /// Installs what tether's chart defines for the API: the IPAMClaim CRD
    /// and tether's own (mode kubernetes), and the service account with its
    /// RBAC as `helm template` renders them with the chart's defaults;
    /// waits for the CRDs.
    pub fn install_tether(&self) {
        self.apply_file("install/helm/tether/crds/ipamclaims.yaml");
        self.apply_file("install/helm/tether/crds/tether-store.yaml");
        let kinds = [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
        ];
        let items: Vec<Value> = crate::chart::objects(&crate::chart::template(&[]))
            .into_iter()
            .filter(|o| kinds.iter().any(|k| o["kind"] == *k))
            .collect();
        assert!(
            items.iter().any(|o| o["kind"] == "ServiceAccount"
                && o["metadata"]["name"] == TETHER_SA.1
                && o["metadata"]["namespace"] == TETHER_SA.0),
            "the chart's service account is not {TETHER_SA:?}"
        );
        self.apply(
            &serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string(),
        );
        self.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=30s",
            "crd/ipamclaims.k8s.cni.cncf.io",
            "crd/tethernodes.tether.dev",
            "crd/tethernodeids.tether.dev",
            "crd/addressblocks.tether.dev",
            "crd/poolblocks.tether.dev",
            "crd/vmaddresses.tether.dev",
            "crd/vmaddressowners.tether.dev",
        ]);
        // The authorizer follows RBAC objects through a watch: until it
        // has the chart's, a `can-i` (or tetherd's first request) is
        // refused. One rule of the ClusterRole and one of the Role.
        let sa = format!("--as=system:serviceaccount:{}:{}", TETHER_SA.0, TETHER_SA.1);
        let allowed = |args: &[&str]| {
            let out = self.kubectl(&[&["auth", "can-i", &sa][..], args].concat());
            String::from_utf8_lossy(&out.stdout).trim() == "yes"
        };
        let bound = crate::wait_until(Duration::from_secs(30), || {
            allowed(&["list", "-A", "ipamclaims.k8s.cni.cncf.io"])
                && allowed(&["create", "-n", TETHER_SA.0, "leases.coordination.k8s.io"])
        });
        assert!(bound, "the authorizer never had the chart's RBAC");
    }
}

/// Signs `<name>.crt` (key `<name>.key`) in `d` with the CA there, for
/// subject `subj`, with the openssl extensions `ext`.
fn sign_cert(d: &Path, name: &str, subj: &str, ext: &str) {
    std::fs::write(d.join(format!("{name}.ext")), ext).expect("writing an openssl ext file");
    openssl(
        d,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            EC_CURVE,
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            subj,
        ],
    );
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

fn kubeconfig(server: &str, ca: &Path, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {}\nusers:\n- name: user\n  user:\n    {user}\ncontexts:\n- name: test\n  context: {{cluster: test, user: user}}\ncurrent-context: test\n",
        ca.display()
    )
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("harness: kube-apiserver:\n{}", self.log_tail());
        }
        for child in [self.apiserver.take(), self.etcd.take()]
            .into_iter()
            .flatten()
        {
            let mut c = child;
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The sum of every sample of metric `name` in a Prometheus text page.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    metric_sum_with(text, name, "")
}

/// [`metric_sum`] of the samples whose labels contain `label`.
pub fn metric_sum_with(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.contains(label))
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
