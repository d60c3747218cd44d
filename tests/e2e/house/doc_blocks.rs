//! The docs' command blocks marked runnable, run as they are written.
//!
//! A block is runnable when the line before its ` ```sh ` fence is
//! `<!-- runnable: NAME ... -->`, in the README or any page of the book
//! (docs/). Each runs in bash, traced, with `set -e`: it must succeed, and
//! its last steps must have removed the network namespaces and the
//! directory it made. What it prints is checked too where this file knows
//! the block: the quick start (`quickstart`: the CNI results, the pod's
//! address, MAC and route, the node's host routes, the ping, the admin
//! API's answers, the silent DELs). The quick start's build block
//! (`<!-- quickstart-build ... -->`) is not run, since it installs packages
//! and builds: its packages must be among those `make demo`'s set-up
//! installs (`tests/setup.sh demo`, which the fresh-machine run proves),
//! its cargo commands must be `make release`'s, and its grpcurl version
//! the one tests/setup.sh builds.
//!
//! What is changed, and only that, so that runs never meet each other or a
//! user's own: every network namespace a block adds (`ip netns add NAME`,
//! or a `for` loop's names) gets this run's prefix, and `/tmp/tether`
//! becomes a directory of this run's; a block that uses another path under
//! /tmp is refused. The block runs in a directory where `target/release`
//! is a link to the binaries under test ([`bin_dir`]: the debug build under
//! `make test`), with the grpcurl tests/setup.sh installs first on `PATH`.
//! Whatever happens, the block's processes (its tetherd) are killed by
//! their process group and its netns and directory removed.
//!
//! Run as root, after `tests/setup.sh`.

use std::collections::BTreeSet;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use tether_e2e::runtime::GRPCURL;
use tether_e2e::{
    bin_dir, doc_files, require_root, tether_bin, tetherd_bin, unique_name, wait_until,
    workspace_dir, TempDir,
};

/// What starts each traced command line in the block's output (bash's PS4).
const TRACE: &str = "+readme+ ";
/// A guard against a block that hangs (a daemon that never opens its
/// socket, say): every step of a block takes well under a second but a
/// 3-packet ping, so reaching this means something is stuck. Not a
/// measure of speed.
const HANG_GUARD: Duration = Duration::from_secs(300);
/// The blocks this file checks the output of, besides running them.
const KNOWN: [&str; 2] = ["quickstart", "vm-keeps-its-address"];

/// A marked block of a Markdown file.
#[derive(Debug)]
struct Block {
    /// The file, relative to the workspace.
    file: String,
    /// Its marker's name.
    name: String,
    /// Its text.
    body: String,
}

/// Every block marked `<!-- MARKER: NAME ... -->` in the docs.
fn marked_blocks(marker: &str) -> Vec<Block> {
    let tag = format!("<!-- {marker}");
    let mut blocks = Vec::new();
    for file in doc_files() {
        let text = std::fs::read_to_string(workspace_dir().join(&file)).expect("a doc file");
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in lines.iter().enumerate() {
            let Some(rest) = line.trim().strip_prefix(&tag) else {
                continue;
            };
            let name = rest
                .trim_start_matches(':')
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
            assert_eq!(
                lines.get(n + 1).map(|l| l.trim()),
                Some("```sh"),
                "{file}:{}: {tag} must be followed by a ```sh block",
                n + 1
            );
            let body: Vec<&str> = lines[n + 2..]
                .iter()
                .copied()
                .take_while(|l| l.trim() != "```")
                .collect();
            assert!(!body.is_empty(), "{file}:{}: the block is empty", n + 1);
            blocks.push(Block {
                file: file.clone(),
                name,
                body: body.join("\n") + "\n",
            });
        }
    }
    blocks
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn every_runnable_block_of_the_docs_runs_as_written_and_removes_what_it_made() {
    require_root();
    let blocks = marked_blocks("runnable");
    let names: Vec<&str> = blocks.iter().map(|b| b.name.as_str()).collect();
    let unique: BTreeSet<&str> = names.iter().copied().collect();
    assert_eq!(
        unique.len(),
        names.len(),
        "two runnable blocks share a name: {names:?}"
    );
    for known in KNOWN {
        assert!(
            unique.contains(known),
            "no runnable block `{known}` in the docs: {names:?}"
        );
    }
    for bin in [tether_bin(), tetherd_bin()] {
        assert!(bin.exists(), "{} is missing: build first", bin.display());
    }
    assert!(
        Path::new(GRPCURL).exists(),
        "{GRPCURL} is missing: run tests/setup.sh (as root) first"
    );
    for block in &blocks {
        eprintln!("running {} ({})", block.name, block.file);
        run_block(block);
    }
}

/// Runs `block` (see the module's doc) and checks what it did.
fn run_block(block: &Block) {
    let work = TempDir::new("doc");
    let names = Names::of(&block.body, work.path().join("tether"));
    let script = names.substitute(&block.body);
    let script_path = work.path().join("block.sh");
    std::fs::write(&script_path, &script).expect("writing block.sh");
    std::fs::create_dir(work.path().join("target")).expect("mkdir target");
    std::os::unix::fs::symlink(bin_dir(), work.path().join("target/release"))
        .expect("linking target/release to the binaries under test");

    let log = work.path().join("block.out");
    let mut run = Run::start(&script_path, &log, &names);
    let finished = wait_until(HANG_GUARD, || run.has_exited());
    let status = run.finish();
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let context = || {
        format!(
            "{} ({}):\n--- the block, as run ---\n{script}\n--- its trace and output ---\n{output}",
            block.name, block.file
        )
    };
    assert!(
        finished,
        "the block did not finish in {HANG_GUARD:?}: {}",
        context()
    );
    assert!(
        status.success(),
        "the block failed ({status}): {}",
        context()
    );

    match block.name.as_str() {
        "quickstart" => check_quickstart(&parse_trace(&output), &script, &names)
            .unwrap_or_else(|e| panic!("{e}\n{}", context())),
        "vm-keeps-its-address" => {
            assert!(
                output.lines().any(|l| l.starts_with("vm1 kept 10.244.0.")),
                "the VM's address was not kept: {}",
                context()
            );
        }
        _ => {}
    }
    for (_, ns) in &names.netns {
        assert!(
            !Path::new("/run/netns").join(ns).exists(),
            "the block's last steps left netns {ns}: {}",
            context()
        );
    }
    assert!(
        !names.dir.exists(),
        "the block's last steps left {}: {}",
        names.dir.display(),
        context()
    );
}

#[test]
fn the_quick_start_build_is_what_make_demo_installs_and_builds() {
    let blocks = marked_blocks("quickstart-build");
    assert_eq!(
        blocks.len(),
        1,
        "one quickstart-build block wanted: {blocks:?}"
    );
    let block = &blocks[0].body;
    let lines: Vec<&str> = block
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();

    let apt: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("apt-get install -y "))
        .flat_map(|l| l.split_whitespace())
        .collect();
    assert!(!apt.is_empty(), "no `apt-get install -y` line in:\n{block}");
    let setup = std::fs::read_to_string(workspace_dir().join("tests/setup.sh")).expect("setup.sh");
    let demo_packages = setup_packages(&setup, "demo");
    // The C toolchain is the one thing the set-up leaves to the machine
    // (the book's Requirements).
    let unknown: Vec<&&str> = apt
        .iter()
        .filter(|p| **p != "build-essential" && !demo_packages.contains(**p))
        .collect();
    assert!(
        unknown.is_empty(),
        "the quick start installs {unknown:?}, which tests/setup.sh does not mark \"demo\" \
         (the demo's set-up: {demo_packages:?})"
    );

    let cargo: Vec<String> = lines
        .iter()
        .filter(|l| l.starts_with("cargo "))
        .map(|l| without_comment(l))
        .collect();
    let makefile = std::fs::read_to_string(workspace_dir().join("Makefile")).expect("Makefile");
    assert_eq!(
        cargo,
        make_recipe(&makefile, "release"),
        "the quick start's build vs `make release`"
    );

    let go_mod = std::fs::read_to_string(workspace_dir().join("tests/k8s/grpcurl/go.mod"))
        .expect("tests/k8s/grpcurl/go.mod");
    let pinned = go_mod
        .lines()
        .find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("github.com/fullstorydev/grpcurl")).then(|| w.next())?
        })
        .expect("grpcurl's version in tests/k8s/grpcurl/go.mod");
    let install = format!("go install github.com/fullstorydev/grpcurl/cmd/grpcurl@{pinned}");
    assert!(
        block.contains(&install),
        "the quick start's grpcurl is not the one tests/setup.sh builds ({install})"
    );
}

/// The netns names and the directory a block uses, this run's own.
struct Names {
    /// (the block's name, this run's), in the order the block adds them.
    netns: Vec<(String, String)>,
    dir: PathBuf,
}

impl Names {
    /// Every netns `block` adds, each with a name of this run's, and
    /// `dir` for /tmp/tether.
    fn of(block: &str, dir: PathBuf) -> Names {
        let mut netns: Vec<(String, String)> = Vec::new();
        // `ip netns add $VAR` takes its names from a `for VAR in ...; do`
        // before it.
        let mut lists: Vec<(String, Vec<String>)> = Vec::new();
        for line in block.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let ["for", var, "in", items @ ..] = &words[..] {
                let items = items.iter().take_while(|w| **w != "do");
                let items = items.map(|w| w.trim_end_matches(';').to_string());
                lists.push((format!("${var}"), items.collect()));
            }
            for added in words
                .windows(4)
                .filter(|w| w[..3] == ["ip", "netns", "add"])
            {
                let added = match lists.iter().rev().find(|(var, _)| var == added[3]) {
                    Some((_, items)) => items.clone(),
                    None => vec![added[3].to_string()],
                };
                for name in added {
                    assert!(
                        !name.starts_with('$'),
                        "a block adds netns {name}, whose names this test cannot see: {line}"
                    );
                    if !netns.iter().any(|(fixed, _)| *fixed == name) {
                        let ours = unique_name(&format!("d{}", netns.len()));
                        netns.push((name, ours));
                    }
                }
            }
        }
        Names { netns, dir }
    }

    /// This run's name for the block's netns `fixed`.
    fn ours(&self, fixed: &str) -> &str {
        self.netns
            .iter()
            .find(|(f, _)| f == fixed)
            .map(|(_, o)| o.as_str())
            .unwrap_or_else(|| panic!("the block adds no netns {fixed}"))
    }

    /// The block with its fixed names replaced by this run's (whole words
    /// only), and nothing else changed. Panics unless each was there, and
    /// if the block uses a path under /tmp other than /tmp/tether.
    fn substitute(&self, block: &str) -> String {
        let dir = self.dir.to_str().expect("a UTF-8 temp dir");
        let mut script = block.to_string();
        let pairs = self
            .netns
            .iter()
            .map(|(f, o)| (f.as_str(), o.as_str()))
            .chain([("/tmp/tether", dir)]);
        for (fixed, ours) in pairs {
            let (replaced, n) = replace_word(&script, fixed, ours);
            assert!(n > 0, "the block no longer names {fixed}:\n{block}");
            script = replaced;
        }
        assert!(
            !script.replace(dir, "").contains("/tmp/"),
            "the block uses a path under /tmp other than /tmp/tether:\n{block}"
        );
        script
    }
}

/// `text` with every whole-word `word` (not inside a longer name or path
/// component) replaced by `with`, and how many there were.
fn replace_word(text: &str, word: &str, with: &str) -> (String, usize) {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    let (mut out, mut rest, mut n) = (String::new(), text, 0);
    while let Some(at) = rest.find(word) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + word.len()..].chars().next();
        let whole = !before.is_some_and(|c| is_name(c) || c == '/') && !after.is_some_and(is_name);
        out.push_str(&rest[..at]);
        out.push_str(if whole { with } else { word });
        n += usize::from(whole);
        rest = &rest[at + word.len()..];
    }
    out.push_str(rest);
    (out, n)
}

/// tests/setup.sh's packages marked `who` ("demo" or "test").
fn setup_packages(setup: &str, who: &str) -> BTreeSet<String> {
    let list = setup
        .split_once("PACKAGES=\"")
        .and_then(|(_, rest)| rest.split_once('"'))
        .map(|(list, _)| list)
        .expect("tests/setup.sh: PACKAGES=\"...\"");
    list.lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [pkg, mark] if mark == who => Some(pkg.to_string()),
            _ => None,
        })
        .collect()
}

/// The commands of the Makefile's `target`, with `$(CARGO)` as `cargo`.
fn make_recipe(makefile: &str, target: &str) -> Vec<String> {
    makefile
        .lines()
        .skip_while(|l| !l.starts_with(&format!("{target}:")))
        .skip(1)
        .take_while(|l| l.starts_with('\t'))
        .map(|l| l.trim().replace("$(CARGO)", "cargo"))
        .collect()
}

fn without_comment(line: &str) -> String {
    line.split(" #").next().unwrap_or(line).trim().to_string()
}

/// The block running in bash, in a process group of its own: the group is
/// how its background tetherd is found again, whatever the block did.
struct Run<'a> {
    child: Child,
    names: &'a Names,
    reaped: bool,
}

impl<'a> Run<'a> {
    fn start(script: &Path, log: &Path, names: &'a Names) -> Run<'a> {
        let out = std::fs::File::create(log).expect("creating the output file");
        let err = out.try_clone().expect("duplicating the output fd");
        let path = format!(
            "{}:{}",
            Path::new(GRPCURL)
                .parent()
                .expect("grpcurl's dir")
                .display(),
            std::env::var("PATH").unwrap_or_default()
        );
        // The block is sourced as it is; PS4 and `set -e -x` come from the
        // caller. Output goes to a file, not a pipe, so that a tetherd left
        // running cannot hold the read open.
        let child = Command::new("bash")
            .args([
                "-c",
                &format!("PS4='{TRACE}'; set -e -x; . \"$0\""),
                "./block.sh",
            ])
            .current_dir(script.parent().expect("the script's dir"))
            .env("PATH", path)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("spawning bash");
        Run {
            child,
            names,
            reaped: false,
        }
    }

    /// Whether bash has exited, leaving it unreaped: while it is a zombie,
    /// its pid, which is the group's id, cannot go to anyone else.
    fn has_exited(&self) -> bool {
        let pid = self.child.id() as libc::id_t;
        // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child, WNOWAIT leaves it unreaped.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // SAFETY: si_pid is set when waitid found an exited child.
        rc == 0 && unsafe { info.si_pid() } != 0
    }

    /// Kills whatever is left of the block's process group (its tetherd
    /// when the block stopped early, and bash itself when it hangs), then
    /// reaps bash and returns how it exited.
    fn finish(&mut self) -> std::process::ExitStatus {
        self.kill_group();
        self.reaped = true;
        self.child.wait().expect("waiting for bash")
    }

    fn kill_group(&self) {
        if !self.reaped {
            // SAFETY: kill has no memory preconditions; the group is ours
            // (bash, unreaped, leads it).
            unsafe { libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL) };
        }
    }
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        if !self.reaped {
            self.kill_group();
            let _ = self.child.wait();
        }
        for (_, ns) in &self.names.netns {
            if Path::new("/run/netns").join(ns).exists() {
                let _ = Command::new("ip").args(["netns", "del", ns]).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.names.dir);
    }
}

/// One traced command: the variables bash traced just before it (the
/// `VAR=value cmd` form traces them on lines of their own), the command
/// line, and what it printed.
#[derive(Debug)]
struct Traced {
    env: Vec<String>,
    command: String,
    output: String,
}

impl Traced {
    fn env(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
    }
}

/// The comment at the end of the block's line that runs `command`.
fn comment_of<'s>(script: &'s str, command: &str) -> Option<&'s str> {
    script.lines().find_map(|line| {
        let (code, comment) = line.split_once(" #")?;
        (code.trim() == command).then(|| comment.trim())
    })
}

/// The trace split at each [`TRACE`] mark (found anywhere, since a command
/// whose output has no final newline leaves the next mark mid-line). bash
/// repeats PS4's first character once more for the sourced file, so every
/// mark comes as `++readme+ `: the extra `+` ends each command's output, and
/// is dropped.
fn parse_trace(output: &str) -> Vec<Traced> {
    let is_assignment = |line: &str| {
        line.split_once('=').is_some_and(|(name, value)| {
            !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !value.contains(' ')
        })
    };
    let mut traced = Vec::new();
    let mut env = Vec::new();
    for part in output.split(TRACE).skip(1) {
        let (command, out) = part.split_once('\n').unwrap_or((part, ""));
        let out = out.trim_end_matches('+');
        if is_assignment(command) && out.is_empty() {
            env.push(command.to_string());
            continue;
        }
        traced.push(Traced {
            env: std::mem::take(&mut env),
            command: command.to_string(),
            output: out.to_string(),
        });
    }
    traced
}

/// Checks what the quick start printed against what it says it prints.
fn check_quickstart(traced: &[Traced], script: &str, names: &Names) -> Result<(), String> {
    let pods = [
        names.ours("pod1").to_string(),
        names.ours("pod2").to_string(),
    ];
    let find = |what: &str, pick: &dyn Fn(&Traced) -> bool| -> Result<Vec<&Traced>, String> {
        let found: Vec<&Traced> = traced.iter().filter(|t| pick(t)).collect();
        if found.is_empty() {
            Err(format!("no {what} in the trace"))
        } else {
            Ok(found)
        }
    };
    let plugin = |verb: &'static str| {
        move |t: &Traced| t.command == "target/release/tether" && t.env("CNI_COMMAND") == Some(verb)
    };

    // Step 4: each ADD's result, at the netconf's cniVersion.
    let adds = find("ADD", &plugin("ADD"))?;
    let ids: Vec<_> = adds.iter().map(|t| t.env("CNI_CONTAINERID")).collect();
    if ids != [Some(pods[0].as_str()), Some(pods[1].as_str())] {
        return Err(format!("ADDs for {ids:?}, not the two pods"));
    }
    let mut host_veths = Vec::new();
    for (n, (add, pod)) in adds.iter().zip(&pods).enumerate() {
        let r: Value = serde_json::from_str(add.output.trim())
            .map_err(|e| format!("ADD {pod}: not a CNI result ({e}): {:?}", add.output))?;
        let ip = format!("10.244.0.{}", n + 1);
        let mac = format!("0a:58:0a:f4:00:{:02x}", n + 1);
        let ips = r["ips"].as_array().map(Vec::as_slice).unwrap_or_default();
        let want_ok = r["cniVersion"] == "1.0.0"
            && ips.len() == 1
            && ips[0]["address"] == format!("{ip}/32").as_str()
            && ips[0]["gateway"] == "169.254.1.1"
            && r["routes"] == serde_json::json!([{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}]);
        let pod_if = ips
            .first()
            .and_then(|i| i["interface"].as_u64())
            .map(|i| &r["interfaces"][i as usize]);
        let pod_if_ok = pod_if.is_some_and(|i| {
            i["name"] == "eth0"
                && i["mac"] == mac.as_str()
                && i["sandbox"] == format!("/run/netns/{pod}").as_str()
        });
        let host_if = r["interfaces"]
            .as_array()
            .and_then(|all| all.iter().find(|i| i.get("sandbox").is_none()));
        let host_ok = host_if.is_some_and(|i| {
            i["name"].as_str().is_some_and(|n| n.starts_with("tth"))
                && i["mac"] == "0a:58:a9:fe:01:01"
        });
        if !(want_ok && pod_if_ok && host_ok) {
            return Err(format!(
                "ADD {pod}: wanted {ip}/32 on eth0 (MAC {mac}) in /run/netns/{pod}, gateway and \
                 default route 169.254.1.1, a tth… host veth with the anycast MAC 0a:58:a9:fe:01:01, \
                 at cniVersion 1.0.0; got {r}"
            ));
        }
        host_veths.push(
            host_if
                .and_then(|i| i["name"].as_str())
                .unwrap_or_default()
                .to_string(),
        );
    }

    // Step 5: what the comments say, and that they say it.
    let pod1 = &pods[0];
    let said = |command: String, want: &str| match comment_of(script, &command) {
        Some(comment) if comment == want => Ok(()),
        other => Err(format!(
            "the README's comment on `{command}` is {other:?}, not {want:?}"
        )),
    };
    said(
        format!("ip -n {pod1} addr show eth0"),
        "10.244.0.1/32, MAC 0a:58:0a:f4:00:01",
    )?;
    said(
        format!("ip -n {pod1} route"),
        "default via 169.254.1.1 dev eth0 proto 201 onlink",
    )?;
    let addr = &find("addr show", &|t| {
        t.command == format!("ip -n {pod1} addr show eth0")
    })?[0]
        .output;
    if !addr.contains("inet 10.244.0.1/32 ") || !addr.contains("link/ether 0a:58:0a:f4:00:01 ") {
        return Err(format!(
            "{pod1}'s eth0 lacks 10.244.0.1/32 or MAC 0a:58:0a:f4:00:01:\n{addr}"
        ));
    }
    let route = &find("pod route", &|t| t.command == format!("ip -n {pod1} route"))?[0].output;
    if route.trim() != "default via 169.254.1.1 dev eth0 proto 201 onlink" {
        return Err(format!("{pod1}'s routes:\n{route}"));
    }
    let node = names.ours("tether-node");
    let host = &find("host routes", &|t| {
        t.command == format!("ip -n {node} route show proto 201")
    })?[0]
        .output;
    let host_lines: Vec<&str> = host.lines().map(str::trim).collect();
    let want: Vec<String> = host_veths
        .iter()
        .enumerate()
        .map(|(n, veth)| format!("10.244.0.{} dev {veth} scope link", n + 1))
        .collect();
    if host_lines != want {
        return Err(format!(
            "the node's proto 201 routes: {host_lines:?}, wanted {want:?}"
        ));
    }
    let ping = &find("ping", &|t| {
        t.command == format!("ip netns exec {pod1} ping -c 3 10.244.0.2")
    })?[0]
        .output;
    if !ping.contains("3 packets transmitted, 3 received") {
        return Err(format!("the ping:\n{ping}"));
    }

    // Step 6: the admin API, as the text under the block says.
    let grpcurl = |call: &str| {
        format!(
            "grpcurl -plaintext -unix {}/tether.sock {call}",
            names.dir.display()
        )
    };
    let list = &find("list", &|t| t.command == grpcurl("list"))?[0].output;
    let services: BTreeSet<&str> = list.lines().map(str::trim).collect();
    let reflection = services.iter().any(|s| s.starts_with("grpc.reflection."));
    if ![
        "tether.cni.v1.Cni",
        "tether.admin.v1.Admin",
        "grpc.health.v1.Health",
    ]
    .iter()
    .all(|s| services.contains(s))
        || !reflection
    {
        return Err(format!("list: {services:?}"));
    }
    let get_node = &find("GetNode", &|t| {
        t.command == grpcurl("tether.admin.v1.Admin/GetNode")
    })?[0]
        .output;
    let node_info: Value =
        serde_json::from_str(get_node).map_err(|e| format!("GetNode ({e}): {get_node}"))?;
    let pools = node_info["pools"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if pools.len() != 1
        || pools[0]["cidr"] != "10.244.0.0/24"
        || pools[0]["used"] != "2"
        || node_info["storeBackend"] != "local"
        || node_info["pendingDelDir"].as_str().is_none()
    {
        return Err(format!(
            "GetNode: wanted the pool with 2 used, the local store and the DEL queue: {node_info}"
        ));
    }
    let list_att = &find("ListAttachments", &|t| {
        t.command == grpcurl("tether.admin.v1.Admin/ListAttachments")
    })?[0]
        .output;
    let attachments: Value =
        serde_json::from_str(list_att).map_err(|e| format!("ListAttachments ({e}): {list_att}"))?;
    let seen: Vec<(String, String, String)> = attachments["attachments"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|a| {
            (
                a["containerId"].as_str().unwrap_or_default().to_string(),
                a["ips"].to_string(),
                a["hostInterface"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let want: Vec<(String, String, String)> = pods
        .iter()
        .zip(&host_veths)
        .enumerate()
        .map(|(n, (pod, veth))| {
            (
                pod.clone(),
                format!("[\"10.244.0.{}/32\"]", n + 1),
                veth.clone(),
            )
        })
        .collect();
    if seen != want {
        return Err(format!("ListAttachments: {seen:?}, wanted {want:?}"));
    }

    // Step 7: DEL prints nothing, then the echo says ok.
    let dels = find("DEL", &plugin("DEL"))?;
    if dels.len() != 2 || dels.iter().any(|t| !t.output.is_empty()) {
        return Err(format!("DELs: {dels:?}"));
    }
    for pod in &pods {
        let said = format!("DEL {pod}: ok");
        find(&said, &|t| t.output.trim() == said)?;
    }
    Ok(())
}
