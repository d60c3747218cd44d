// Package e2e is a Kubernetes end-to-end test binary that carries only the
// network tests: k8s.io/kubernetes/test/e2e/network, and, through
// test/e2e itself (whose suite setup and RunE2ETests it uses),
// test/e2e/common with common/network. These packages hold the 47
// [sig-network] Conformance tests of k8s.io/kubernetes' conformance.yaml.
// Upstream's e2e.test imports every test package (storage, apps, ...); the
// tests here are the same code, selected with --ginkgo.focus as upstream's.
//
// Built by tests/k8s/build.sh e2e (`go test -c`) into e2e.test; run as
//
//	e2e.test --provider=skeleton --kubeconfig=... \
//	    --ginkgo.focus='\[sig-network\].*\[Conformance\]'
package e2e

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"k8s.io/component-base/version"
	conformancetestdata "k8s.io/kubernetes/test/conformance/testdata"
	k8se2e "k8s.io/kubernetes/test/e2e"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"
	testfixtures "k8s.io/kubernetes/test/fixtures"

	// The feature and environment names, frozen once registered.
	_ "k8s.io/kubernetes/test/e2e/feature"

	// The tests.
	_ "k8s.io/kubernetes/test/e2e/common/network"
	_ "k8s.io/kubernetes/test/e2e/network"

	// The framework's extensions upstream's e2e.test loads: dumps of the
	// cluster's state on a failure, metrics gathering, and the check that
	// every node is still Ready after each test.
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/metrics/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
)

func TestMain(m *testing.M) {
	showVersion := flag.Bool("version", false, "print the Kubernetes version the tests come from and exit")
	// The framework's flags (--provider, --kubeconfig, ...) and the
	// --viper-config settings, then the command line.
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	if *showVersion {
		fmt.Println(version.Get())
		os.Exit(0)
	}
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "e2e.test: unexpected arguments: %v\n", flag.Args())
		os.Exit(2)
	}
	// Manifests and fixtures some tests read, from the files embedded in
	// the binary (there is no Kubernetes source tree beside it).
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	testfiles.AddFileSource(testfixtures.GetTestFixturesFS())
	testfiles.AddFileSource(conformancetestdata.GetConformanceTestdataFS())
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

func TestE2E(t *testing.T) {
	k8se2e.RunE2ETests(t)
}
