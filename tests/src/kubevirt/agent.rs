//! A KubeVirt VM's guest as a [`GuestShell`], so that the connection
//! paths of [`crate::paths`] run in it: its commands go through the guest
//! agent (`guest-exec`, by `virsh qemu-agent-command` in the launcher's
//! `compute` container, on the launcher's own libvirt), its serial console
//! is read from the launcher's `guest-console-log` container. Both follow
//! the VM to the node it runs on.
//!
//! The guest is the test guest with the agent's overlay
//! ([`super::guest_disk`]): qemu-guest-agent on the virtio-serial channel
//! KubeVirt gives every domain (`org.qemu.guest_agent.0`).

use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};

use super::scenario::{console, launcher_pod};
use crate::kube_cluster::KubeCluster;
use crate::paths::GuestShell;

/// How long a command may run in the guest.
const COMMAND_LIMIT: Duration = Duration::from_secs(30);
/// How often the console and a command's status are looked at.
const POLL: Duration = Duration::from_millis(250);

/// The guest of VMI `default/<vmi>` (see the module doc).
pub struct AgentShell<'a> {
    cluster: &'a KubeCluster,
    vmi: String,
}

impl<'a> AgentShell<'a> {
    /// The guest of VMI `vmi` in `default`.
    pub fn new(cluster: &'a KubeCluster, vmi: &str) -> AgentShell<'a> {
        AgentShell {
            cluster,
            vmi: vmi.to_string(),
        }
    }

    /// The running launcher pod on the node the VMI's status names.
    fn launcher(&self) -> String {
        let vmi = self
            .cluster
            .api
            .get(&["-n", "default", "vmi", &self.vmi])
            .unwrap_or(Value::Null);
        let node = vmi["status"]["nodeName"].as_str().unwrap_or_default();
        launcher_pod(self.cluster, &self.vmi, node)
            .unwrap_or_else(|| panic!("no running launcher pod of {} on {node}", self.vmi))
    }

    /// Sends `command` (a QMP-style JSON command) to the guest agent
    /// through the launcher's libvirt; its answer's `return`.
    pub fn agent(&self, command: &Value) -> Result<Value, String> {
        let pod = self.launcher();
        let out = crate::kubevirt::virsh(
            self.cluster,
            &pod,
            &[
                "qemu-agent-command",
                &format!("default_{}", self.vmi),
                &command.to_string(),
            ],
        );
        if !out.status.success() {
            return Err(format!(
                "virsh qemu-agent-command {command} in {pod}: {}",
                crate::output_text(&out)
            ));
        }
        let answer: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
            format!(
                "the agent's answer to {command} is not JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })?;
        Ok(answer["return"].clone())
    }

    /// Runs `command` with the guest's `/bin/sh` (`guest-exec`) and waits
    /// up to `limit` for it to end: its exit code and its output (stdout,
    /// then stderr).
    pub fn exec(&self, command: &str, limit: Duration) -> Result<(i64, String), String> {
        let started = self.agent(&json!({
            "execute": "guest-exec",
            "arguments": {"path": "/bin/sh", "arg": ["-c", command], "capture-output": true},
        }))?;
        let pid = started["pid"]
            .as_i64()
            .ok_or_else(|| format!("guest-exec of {command:?} gave no pid: {started}"))?;
        let deadline = Instant::now() + limit;
        loop {
            let status = self.agent(&json!({
                "execute": "guest-exec-status", "arguments": {"pid": pid},
            }))?;
            if status["exited"] == true {
                let text = |key: &str| {
                    status[key]
                        .as_str()
                        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .unwrap_or_default()
                };
                let code = status["exitcode"].as_i64().unwrap_or(-1);
                return Ok((code, format!("{}{}", text("out-data"), text("err-data"))));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{command:?} still running in the guest after {limit:?}"
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    /// The console's lines so far, of the launcher the VM runs in now.
    fn lines(&self) -> Vec<String> {
        console(self.cluster, &self.launcher())
            .lines()
            .map(|l| l.trim_end_matches('\r').to_string())
            .collect()
    }
}

impl GuestShell for AgentShell<'_> {
    fn run_ok(&self, command: &str) -> String {
        match self.exec(command, COMMAND_LIMIT) {
            Ok((0, out)) => out,
            Ok((code, out)) => panic!("{command:?} in {} exited {code}: {out}", self.vmi),
            Err(e) => panic!("{command:?} in {}: {e}", self.vmi),
        }
    }

    /// Lines of the current launcher's console: a mark is good while the
    /// VM stays on its node.
    fn mark(&self) -> usize {
        self.lines().len()
    }

    fn wait_line_after(&self, prefix: &str, mark: usize, limit: Duration) -> (usize, String) {
        let deadline = Instant::now() + limit;
        loop {
            let lines = self.lines();
            if let Some(found) = crate::qemu::line_after(&lines, prefix, mark) {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "no console line {prefix:?} of {} within {limit:?}; console:\n{}",
                self.vmi,
                lines.join("\n")
            );
            std::thread::sleep(POLL);
        }
    }

    fn console_text(&self) -> String {
        self.lines().join("\n")
    }
}
