// CoreDNS with only the plugins a Kubernetes cluster's DNS uses: those of
// the Corefile kubeadm deploys (cmd/kubeadm/app/phases/addons/dns in
// k8s.io/kubernetes) and the two more the e2e DNS tests configure for
// their own server (hosts and log, test/e2e/network/dns_common.go), for
// the tests only. CoreDNS's own main links in every plugin it ships.
//
// Four more plugins come with these, since they import them and so
// register them too: debug, dnstap and metadata (forward, cache, log,
// kubernetes) and transfer (kubernetes).
//
// CoreDNS runs a query through the plugins of a server block in the order
// of dnsserver.Directives, which its build generates from plugin.cfg.
// Here that order is kept and only narrowed to the plugins linked in,
// which is what a plugin.cfg listing just them would generate.
package main

import (
	"strings"

	"github.com/coredns/caddy"
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	// kubeadm's Corefile.
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics" // the prometheus directive
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"

	// The e2e tests' own DNS server (agnhost's /coredns).
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/log"
)

func init() {
	// ListPlugins names a server type's plugins "<type>.<name>".
	linked := map[string]bool{}
	for _, name := range caddy.ListPlugins()["others"] {
		if d, ok := strings.CutPrefix(name, "dns."); ok {
			linked[d] = true
		}
	}
	var order []string
	for _, d := range dnsserver.Directives {
		if linked[d] {
			order = append(order, d)
		}
	}
	dnsserver.Directives = order
}

func main() {
	coremain.Run()
}
