# tether: `make demo` and `make test` are the two commands that must work on a
# fresh machine, as root. Both install what they need first.

CARGO ?= cargo
RELEASE_DIR := target/release
# The unit tests that need root are compiled in only with these features
# (`make test`); `make check` leaves them out and runs as any user.
ROOT_TESTS := tether-kernel/root-tests,tether-node-server/root-tests,tether-e2e/root-tests,tether-e2e/tools-tests,tether-e2e/cluster-tests,tether-e2e/kubelet-tests
DEBUG_DIR := target/debug
# Test-name filters (substrings, as libtest matches them) of the tests that
# need a part the tools line of `make test` builds. KUBE_SUITES need only
# the Kubernetes binaries (`make k8s`: kube-apiserver, kube-proxy, the
# kubelet's) and helm (which renders the chart's RBAC and CRDs for every
# suite on the Kubernetes store); TOOL_SUITES need e2e.test or CoreDNS too.
# A test whose name matches both runs with TOOL_SUITES.
KUBE_SUITES := kube_api kube_client kubernetes network_policy node_routes routing::services vm_connections
TOOL_SUITES := kube:: conformance install:: house::

.PHONY: all setup setup-demo k8s helm e2e-bins mdbook conformance-images conformance netpol kubevirt bench-kubevirt manifests docs reference build release demo check test unit integration lint lint-text bench clean shim-size min-kernel

all: build

## setup: install the Debian packages and tools the tests need (all of
## tests/setup.sh's list; the demo's are among them).
setup:
	bash tests/setup.sh

## setup-demo: install only what `make demo` uses (the packages setup.sh
## marks "demo", grpcurl and the test guest).
setup-demo:
	bash tests/setup.sh demo

## k8s: kube-apiserver, kubectl, kube-controller-manager, kube-scheduler,
## kubelet and kube-proxy for the Kubernetes suites, built from the k8s.io/kubernetes
## Go module in one `go build` and cached in /var/tmp/tether-k8s
## (tests/k8s/build.sh). Like helm and e2e-bins, it needs only the
## machine's Go, no Debian package (`make test` builds them beside setup).
k8s:
	@dir=$$(sh tests/k8s/build.sh) && echo "k8s: $$($$dir/kube-apiserver --version) in $$dir"

## helm: helm, built from its Go module (helm.sh/helm/v4, pinned in
## tests/k8s/helm/go.mod) and cached in /var/tmp/tether-k8s
## (tests/k8s/helm/build.sh): the chart's tests, and `make manifests`.
helm:
	@dir=$$(sh tests/k8s/helm/build.sh) && echo "helm: $$($$dir/helm version --short) in $$dir"

## e2e-bins: what Kubernetes' sig-network Conformance tests run beside the
## cluster: e2e.test (the e2e tests of the network packages, from the
## k8s.io/kubernetes module of `make k8s`), agnhost, and CoreDNS with the
## plugins of kubeadm's Corefile, built from their Go modules and cached in
## /var/tmp/tether-k8s (tests/k8s/build.sh e2e and coredns).
e2e-bins:
	@dir=$$(sh tests/k8s/build.sh e2e) && echo "e2e: e2e.test $$($$dir/e2e.test --version), agnhost $$($$dir/agnhost --version | awk '{ print $$NF }') in $$dir"
	@dir=$$(sh tests/k8s/build.sh coredns) && echo "coredns: $$($$dir/coredns -version | head -n 1) in $$dir"

## conformance-images: the images those tests run (agnhost, glibc-dns-testing,
## nginx, pause, busybox, and CoreDNS's), under the names they ask for, as
## OCI archives for `ctr -n k8s.io images import`: Debian roots made with
## mmdebstrap (tests/k8s/images.sh) and packed with the e2e-bins on top
## (tests/src/conformance_images.rs), cached in /var/tmp/tether-k8s. Prints
## each name and archive. Root only.
conformance-images: setup e2e-bins
	$(CARGO) run -q -p tether-e2e --bin conformance_images

## manifests: install/manifests/, the plain manifests (one per mode), from
## the chart install/helm/tether (install/generate.sh); the install suite
## fails while a committed file differs from the chart's output.
manifests:
	sh install/generate.sh

## docs: the book (docs/, mdBook): mdBook itself, pinned, built once with
## `cargo install --locked` and cached in /var/tmp/tether-tools
## (docs/mdbook.sh); the book built into target/book; and every link and
## anchor of the built book checked (tests/book_links.py). `make test`
## runs it.
docs: mdbook
	@bin=$$(sh docs/mdbook.sh) && $$bin/mdbook build docs
	python3 tests/book_links.py target/book

## mdbook: mdBook alone, built once and cached (docs/mdbook.sh). `make
## test` builds it on its Rust line, through `docs`: its tools line starts
## with the Kubernetes binaries, on which the time of `make test` hangs.
mdbook:
	@bin=$$(sh docs/mdbook.sh) && echo "mdbook: $$($$bin/mdbook --version) in $$bin"

## reference: the book's reference pages generated from the code:
## docs/reference/tetherd-flags.md from `tetherd --help`, and
## docs/reference/chart-values.md from the chart's values.yaml
## (docs/reference.py); tests/e2e/house/doc_facts.rs fails while a committed
## page differs from what this writes.
reference:
	$(CARGO) build -p tether-node-server --bin tetherd
	python3 docs/reference.py $$($(CARGO) metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/debug/tetherd

## build: debug build of every crate (the integration tests use it), with
## the root unit tests compiled in, as `make test` runs them.
##
## With LINT_BUILD=1 (as `make test` builds) clippy lints the workspace's
## crates during the build, as `cargo clippy --features ... -- -D warnings`
## would: clippy-driver compiles them, set the way cargo-clippy sets it
## (RUSTC_WORKSPACE_WRAPPER, and CLIPPY_ARGS joined as cargo-clippy joins
## them), so a lint fails the build. The dependencies are then compiled
## once, not a second time in check mode for clippy: that second pass was
## 11 minutes of a fresh machine's `make test`. The `cargo test` that
## follows must see the same two variables, or it compiles the workspace
## again.
CLIPPY_BUILD = RUSTC_WORKSPACE_WRAPPER="$$(command -v clippy-driver || echo clippy-driver-not-found)" CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__
build:
	$(if $(LINT_BUILD),$(CLIPPY_BUILD)) $(CARGO) build --workspace --all-targets --features $(ROOT_TESTS)

## release: optimized binaries; the shim is built on its own (-p) so that it
## does not pick up the daemon's features.
release:
	$(CARGO) build --release -p tether-cni-shim
	$(CARGO) build --release -p tether-node-server

## shim-size: the release plugin binary must stay at or below 1 MiB. Only
## the shim is built for it: the daemon's release build (LTO) is not needed
## by the tests and would add minutes to `make test`.
shim-size:
	$(CARGO) build --release -p tether-cni-shim
	@size=$$(stat -c %s $(RELEASE_DIR)/tether); \
	  echo "tether (release, stripped): $$size bytes"; \
	  test $$size -le 1048576 || { echo "FAIL: tether is larger than 1 MiB"; exit 1; }

## demo: a node daemon in a node netns plus two pods wired through the real
## plugin binary; ping, CHECK, admin state, DEL, cleanup; a KubeVirt VM that
## keeps its address; a real QEMU guest on the tap binding leasing it.
demo: setup-demo release
	bash tests/demo.sh $(RELEASE_DIR) $(DEMO_FLAGS)

## lint: formatting and clippy (with and without the root tests compiled
## in), and the Markdown files' links and anchors (tests/doc_links.py). CI's
## `make test` checks the same, but clippy only with the root tests compiled
## in, within its build (LINT_BUILD).
lint: lint-text
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --workspace --all-targets --features $(ROOT_TESTS) -- -D warnings

## lint-text: the part of lint that compiles nothing: formatting and the
## links. `make test` runs it, and clippy within its build (LINT_BUILD).
lint-text:
	$(CARGO) fmt --all -- --check
	python3 tests/doc_links.py

## check: what a contributor runs before a commit, as any user, in minutes:
## formatting, clippy, and every test of the fast tier (the unit tests on
## the fake kernel, the suites' checks of docs, layers and harness; no
## root, no network namespaces, no packages beyond Rust's). The other
## tiers show as ignored, each with what it needs: plain `cargo test` is
## this too.
check:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) test --workspace

## test: the whole suite (unit, integration against real netns, real
## runtimes, chaining, concurrency, crash, bad input, security, real QEMU
## guests, a real kube-apiserver, the cluster suites on etcd and on the
## Kubernetes store (etcd:: and kubernetes:: tests), a one-node Kubernetes
## whose kubelet calls tether, two kubelet nodes with kube-proxy and CoreDNS
## judged by a slice of Kubernetes' network conformance tests), the book
## built and its links checked (docs), its runnable blocks run and its
## facts checked (doc_blocks, doc_facts). Root only.
##
## The suites run in three parts, each test in exactly one, each as soon
## as what it needs is built: those whose names contain none of
## KUBE_SUITES and TOOL_SUITES when the Rust line is done; those of
## KUBE_SUITES once the tools line has built the Kubernetes binaries and
## helm; those of TOOL_SUITES once it is done. Each part runs with TETHER_GO_PARTS
## naming the Go parts built so far (`pending`: none), under which a test
## that asks for another fails at once and says which list to add it to.
##
## Before the suites, two lines run side by side: the tools that need only
## the machine's Go (the Kubernetes binaries and helm, then e2e-bins), and
## setup then the Rust (lint-text, the build with clippy's lints in it
## (LINT_BUILD), shim-size, docs with mdBook; the build needs setup's
## protoc). Each leaves a core idle at times (downloads, links, a last
## crate); side by side they fill it. The Kubernetes binaries go first: the
## machine is busy from start to end, and part 2 waits for them. Once
## setup has installed mmdebstrap, a third line builds the Debian roots of
## the conformance images (tests/k8s/images.sh, mostly downloads and
## unpacking, at nice 15; target/roots.log), which part 3's first tests
## would otherwise build before its conformance slice can start. The tools line's
## output is kept in target/go-parts.log and printed after it; either line
## failing fails `make test` before any suite that needs it runs. The tools
## line runs at a lower priority (nice 15): it takes what the Rust line
## and then the suites leave idle, and does not starve the suites' daemons
## (whose leases in the cluster suites last 2 s).
TEST_RUN = $(CLIPPY_BUILD) TETHER_BIN_DIR=$(CURDIR)/$(DEBUG_DIR) \
	  $(CARGO) test --workspace --features $(ROOT_TESTS) --no-fail-fast -- --test-threads=2
test:
	@test "$$(id -u)" = 0 || { echo "make test must run as root (it creates network namespaces)"; exit 1; }
	@mkdir -p target; rm -f target/kube-helm.rc; \
	echo "== $$(date +%T) make test: setup and the Rust line, the tools line beside"; \
	( nice -n 15 $(MAKE) --no-print-directory k8s helm >target/go-parts.log 2>&1; rc=$$?; \
	  echo $$rc >target/kube-helm.rc; [ $$rc = 0 ] || exit $$rc; \
	  nice -n 15 $(MAKE) --no-print-directory e2e-bins >>target/go-parts.log 2>&1 ) & go=$$!; \
	roots=; \
	$(MAKE) --no-print-directory setup; rust=$$?; \
	if [ $$rust = 0 ]; then \
	  nice -n 15 sh tests/k8s/images.sh >target/roots.log 2>&1 & roots=$$!; \
	  $(MAKE) --no-print-directory lint-text build shim-size docs LINT_BUILD=1; rust=$$?; \
	fi; \
	if [ $$rust != 0 ]; then \
	  wait $$go $$roots; cat target/go-parts.log; \
	  echo "make test: setup or the Rust build failed (exit $$rust)"; exit 1; \
	fi; \
	echo "== $$(date +%T) make test: part 1, the suites that need no Go part, while the tools line may still build"; \
	TETHER_GO_PARTS=pending $(TEST_RUN) \
	  $(foreach f,$(KUBE_SUITES) $(TOOL_SUITES),--skip $(f)); first=$$?; \
	while [ ! -s target/kube-helm.rc ]; do sleep 2; done; \
	if [ "$$(cat target/kube-helm.rc)" = 0 ]; then \
	  echo "== $$(date +%T) make test: part 2, the suites that need only the Kubernetes binaries and helm ($(KUBE_SUITES))"; \
	  TETHER_GO_PARTS=kube,helm $(TEST_RUN) $(KUBE_SUITES) \
	    $(foreach f,$(TOOL_SUITES),--skip $(f)); second=$$?; \
	else second=1; fi; \
	wait $$go; gorc=$$?; \
	echo "== $$(date +%T) the Go parts, built beside setup, the Rust and the first parts (target/go-parts.log):"; \
	cat target/go-parts.log; \
	wait $$roots; rootsrc=$$?; \
	echo "== $$(date +%T) the images' Debian roots, built beside the Rust and the first parts (target/roots.log):"; \
	cat target/roots.log; \
	[ $$rootsrc = 0 ] || echo "make test: building the images' Debian roots failed (exit $$rootsrc); part 3's tests try again"; \
	if [ $$gorc != 0 ]; then \
	  [ $$first = 0 ] || echo "make test: FAILED: a suite that needs no Go part (exit $$first; its report is above)"; \
	  [ $$second = 0 ] || echo "make test: FAILED: a suite that needs the Kubernetes binaries and helm, or they did not build (exit $$second)"; \
	  echo "make test: building the Go parts failed (exit $$gorc)"; exit 1; \
	fi; \
	echo "== $$(date +%T) make test: part 3, the suites that need e2e.test or CoreDNS ($(TOOL_SUITES))"; \
	$(TEST_RUN) $(TOOL_SUITES); third=$$?; \
	[ $$first = 0 ] || echo "make test: FAILED: a suite that needs no Go part (exit $$first; its report is above)"; \
	[ $$second = 0 ] || echo "make test: FAILED: a suite that needs the Kubernetes binaries and helm (exit $$second; its report is above)"; \
	[ $$third = 0 ] || echo "make test: FAILED: a suite that needs e2e.test or CoreDNS (exit $$third; its report is above)"; \
	echo "== $$(date +%T) make test: done"; \
	[ $$first = 0 ] && [ $$second = 0 ] && [ $$third = 0 ]

## conformance: Kubernetes' own network conformance tests, the 47
## `[sig-network] ... [Conformance]` tests of e2e.test v1.37.2, on two
## kubelet nodes wired by tether (installed with its chart in its default
## mode, the Kubernetes store), with kube-proxy and CoreDNS
## (tests/src/kube_cluster.rs); while they run, one node's tetherd is killed and
## the other's kubelet restarted (--faults). STACK picks the cluster's IP
## families: v4 (the default), dual (IPv4 first, then IPv6; the run adds
## every non-SCTP `[Feature:IPv6DualStack]` test) or v6 (IPv6 alone).
## Writes the stack's section of CONFORMANCE.md and keeps the others.
## `make test` runs slices of them (tests/e2e/conformance/conformance_slice.rs).
## Root only.
STACK ?= v4
conformance: setup k8s helm e2e-bins build
	@test "$$(id -u)" = 0 || { echo "make conformance must run as root (it creates namespaces)"; exit 1; }
	TETHER_BIN_DIR=$(CURDIR)/$(DEBUG_DIR) $(CARGO) run -p tether-e2e --bin conformance -- --stack $(STACK) --faults --write CONFORMANCE.md

## netpol: Kubernetes' own NetworkPolicy tests, every `[sig-network] Netpol`
## test of e2e.test v1.37.2 (the `[Feature:NetworkPolicy]` tests and the two
## API tests) but the three that need SCTP in the kernel, on the cluster
## `make conformance` uses, tether installed by its chart (NetworkPolicy on,
## its default), with the same two faults; writes NETPOL.md, the SCTP tests
## listed there with their reason. Root only.
netpol: setup k8s helm e2e-bins build
	@test "$$(id -u)" = 0 || { echo "make netpol must run as root (it creates namespaces)"; exit 1; }
	TETHER_BIN_DIR=$(CURDIR)/$(DEBUG_DIR) $(CARGO) run -p tether-e2e --bin conformance -- --suite netpol --faults --write NETPOL.md

## kubevirt: KubeVirt itself on tether (tests/e2e/kube/kubevirt.rs):
## KubeVirt v1.7.0 built from its Go module (tests/k8s/kubevirt/build.sh,
## cached in /var/tmp/tether-k8s), its images assembled from Debian
## packages (tests/k8s/kubevirt/images.sh, tests/src/kubevirt.rs), deployed
## with its operator on two kubelet nodes wired by tether, and VMs booted
## and live-migrated through KubeVirt's API: the guest runs
## qemu-guest-agent (the VMI shows tether's IP from it, before and after
## each migration), and a stream on every path to or from the VM, through
## kube-proxy, is held through each migration; a VM migrated under a
## NetworkPolicy that denies it new connections keeps its own, and the
## denied ones never pass. Not part of `make test` (the
## KubeVirt build alone takes tens of minutes the first time). Root only.
kubevirt: setup k8s helm build
	@test "$$(id -u)" = 0 || { echo "make kubevirt must run as root (it creates namespaces)"; exit 1; }
	TETHER_BIN_DIR=$(CURDIR)/$(DEBUG_DIR) $(CARGO) test -p tether-e2e --test e2e -- kube::kubevirt:: --ignored --nocapture --test-threads=1

## bench-kubevirt: migrations of a VirtualMachine through KubeVirt's API
## (the `make kubevirt` cluster; 10 timed after 1 untimed), each with a
## stream on every path to or from the VM (per path: survived, stall
## against the guest's pause; probes lost against it), beside `tether-bench
## vm`'s QMP-driven QEMU migrations on the Kubernetes store run first in the
## same sitting; writes its section of BENCHMARKS.md. Apart from
## `make bench`: it needs the KubeVirt build. Root only.
bench-kubevirt: setup k8s helm release
	TETHER_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) $(CARGO) build --release -p tether-bench -p tether-e2e --bin tether-bench --bin node_init
	TETHER_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) $(RELEASE_DIR)/tether-bench kubevirt --no-build --write BENCHMARKS.md

## min-kernel: the netlink suites (tether-kernel's unit tests with the root
## tests, node-server's DHCP server against udhcpc) on Debian 12's stock
## 6.1 cloud kernel, in a QEMU guest (tests/guest/kernel-suite.sh); about a
## minute. `make test` runs it too (tests/e2e/kernel/min_kernel.rs). Root only.
min-kernel: setup
	$(CARGO) test -p tether-e2e --features tether-e2e/root-tests --test e2e -- kernel::min_kernel:: --nocapture

## bench: tether vs the reference ptp/bridge + host-local, side by side; then
## cluster mode (3 nodes on etcd) vs one node, block claims, claim to route;
## scripted migrations; real QEMU migrations and the tap binding's ADD;
## macvlan with tether as IPAM vs with host-local and whereabouts (on a
## real kube-apiserver), one node; tether on 3 nodes; pod-ready latency
## through a real kubelet and containerd, tether's DaemonSet beside ptp;
## 10, 30 and 100 nodes on each control store (claims, 100 simultaneous
## migrations, the store's load, a node's start-up with 1,000 VM records);
## pod to pod across two nodes (iperf3 throughput and sockperf round
## trips, tether host-gw (without and with 1,000 NetworkPolicies) and VXLAN
## beside two netns joined by a bare veth) and pod-ready latency on two
## kubelet nodes; NetworkPolicy's creation to enforcement and its ADD cost.
bench: setup k8s release
	$(CARGO) build --release -p tether-bench
	@set -e; for b in cni cluster migration vm ipam kubelet scale nodes policy; do \
	  echo "tether-bench $$b"; \
	  TETHER_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) $(RELEASE_DIR)/tether-bench $$b --write BENCHMARKS.md; \
	done

clean:
	$(CARGO) clean
