//! tether's Helm chart (`install/helm/tether`) for the suites: helm itself,
//! built from its Go module by `tests/k8s/helm/build.sh` (cached across
//! runs), the chart rendered into objects (`helm template`), and helm run
//! against a real API server ([`Helm::against`]).
//!
//! helm keeps its cache, config and data under a temp dir of each [`Helm`]
//! (`HELM_CACHE_HOME`, ...), never under the user's home.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value;

use crate::kube::KubeApi;
use crate::{workspace_dir, TempDir};

/// The chart, relative to the workspace.
pub const CHART: &str = "install/helm/tether";
/// The release name the plain manifests and the suites use.
pub const RELEASE: &str = "tether";
/// The namespace tether is installed in.
pub const NAMESPACE: &str = "kube-system";
/// The modes the chart knows: (`mode` value, the plain manifest's file in
/// `install/manifests/`).
pub const MODES: [(&str, &str); 4] = [
    ("kubernetes", "tether-kubernetes.yaml"),
    ("singleNode", "tether-single-node.yaml"),
    ("nodeCidrs", "tether-node-cidrs.yaml"),
    ("etcd", "tether-etcd.yaml"),
];

/// The directory holding `helm` (built once per process by
/// tests/k8s/helm/build.sh, which caches across runs).
pub fn helm_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        crate::kube::go_part_wanted("helm");
        let script = workspace_dir().join("tests/k8s/helm/build.sh");
        let out = Command::new("sh")
            .arg(&script)
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        assert!(out.status.success(), "tests/k8s/helm/build.sh failed");
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
}

/// The `helm` binary.
pub fn helm_bin() -> PathBuf {
    helm_dir().join("helm")
}

/// helm with a home of its own, on this machine or against an API server.
#[derive(Debug)]
pub struct Helm {
    home: TempDir,
    /// The API server's netns and the admin's kubeconfig, if any.
    api: Option<(String, PathBuf)>,
}

impl Default for Helm {
    fn default() -> Self {
        Helm::new()
    }
}

impl Helm {
    /// helm without a cluster (`lint`, `template`).
    pub fn new() -> Helm {
        Helm {
            home: TempDir::new("helm"),
            api: None,
        }
    }

    /// helm against `api`, as its admin, run in the server's netns (where
    /// kubectl runs too).
    pub fn against(api: &KubeApi) -> Helm {
        Helm {
            home: TempDir::new("helm"),
            api: Some((api.netns().name().to_string(), api.admin_kubeconfig())),
        }
    }

    /// Runs `helm args...` from the workspace (so that [`CHART`] resolves).
    pub fn run(&self, args: &[&str]) -> Output {
        let mut cmd = match &self.api {
            Some((netns, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", netns]).arg(helm_bin());
                c
            }
            None => Command::new(helm_bin()),
        };
        if let Some((_, kubeconfig)) = &self.api {
            cmd.arg(format!("--kubeconfig={}", kubeconfig.display()));
        }
        let home = self.home.path();
        cmd.args(args)
            .current_dir(workspace_dir())
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"))
            .output()
            .unwrap_or_else(|e| panic!("running helm {args:?}: {e}"))
    }

    /// Like [`Helm::run`]; panics with helm's output unless it succeeds;
    /// its stdout.
    pub fn run_ok(&self, args: &[&str]) -> String {
        crate::stdout_ok(&self.run(args), format_args!("helm {args:?}"))
    }

    /// A values file in this helm's home, holding `values` (JSON is YAML).
    pub fn values_file(&self, name: &str, values: &Value) -> PathBuf {
        let path = self.home.path().join(format!("{name}.json"));
        std::fs::write(&path, values.to_string()).expect("writing a values file");
        path
    }
}

/// `helm template` of the chart (release [`RELEASE`] in [`NAMESPACE`]) with
/// `--set` of each of `sets`; panics unless helm renders it. Its YAML.
pub fn template(sets: &[&str]) -> String {
    let mut args = vec!["template", RELEASE, CHART, "--namespace", NAMESPACE];
    for s in sets {
        args.extend(["--set", s]);
    }
    Helm::new().run_ok(&args)
}

/// Every object of a multi-document YAML text (empty documents left out).
pub fn objects(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|doc| {
            <Value as serde::Deserialize>::deserialize(doc)
                .unwrap_or_else(|e| panic!("the chart's output is not YAML: {e}\n{yaml}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// The object of `kind` named `name` among `objects`; panics if absent.
pub fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            let have: Vec<String> = objects
                .iter()
                .map(|o| format!("{}/{}", o["kind"], o["metadata"]["name"]))
                .collect();
            panic!("no {kind} {name} in the chart's output: {have:?}")
        })
}

/// The DaemonSet's tetherd container args in `objects`.
pub fn tetherd_args(objects: &[Value]) -> Vec<String> {
    let ds = find(objects, "DaemonSet", RELEASE);
    let containers = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("the DaemonSet's containers");
    let tetherd = containers
        .iter()
        .find(|c| c["name"] == "tetherd")
        .expect("a tetherd container");
    tetherd["args"]
        .as_array()
        .expect("tetherd's args")
        .iter()
        .map(|a| a.as_str().expect("a string arg").to_string())
        .collect()
}
