// Command cnitool drives a CNI network configuration list through Go's libcni,
// the library that containerd, CRI-O and podman use, so that tether's tests
// can see a conflist executed exactly as a real runtime executes it: plugins
// found on a path, runtimeConfig injected per declared capability, prevResult
// chained from plugin to plugin, the result cached on ADD and handed back as
// prevResult on CHECK and DEL.
//
// Usage:
//
//	cnitool [flags] add|check|del CONFLIST NETNS
//
// Flags: -id, -ifname, -args "K=V;K=V", -cap JSON (capability args, e.g.
// {"portMappings":[...]}), -cache DIR (libcni's result cache), -path DIRS
// (colon separated; defaults to $CNI_PATH).
//
// ADD prints the final result as JSON on stdout. Any failure prints the error
// on stderr and exits 1.
//
// Built offline from Debian's golang-github-appc-cni-dev:
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o cnitool .
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
)

func main() {
	id := flag.String("id", "cnitool", "CNI_CONTAINERID")
	ifName := flag.String("ifname", "eth0", "CNI_IFNAME")
	args := flag.String("args", "", "CNI_ARGS, K=V pairs separated by ';'")
	capArgs := flag.String("cap", "", "capability args as a JSON object")
	cacheDir := flag.String("cache", "", "libcni result cache directory (default: libcni's)")
	path := flag.String("path", os.Getenv("CNI_PATH"), "plugin directories, ':' separated")
	timeout := flag.Duration("timeout", 60*time.Second, "deadline for the whole operation")
	flag.Parse()

	if flag.NArg() != 3 {
		fail(fmt.Errorf("usage: cnitool [flags] add|check|del CONFLIST NETNS"))
	}
	verb, confPath, netns := flag.Arg(0), flag.Arg(1), flag.Arg(2)

	list, err := libcni.ConfListFromFile(confPath)
	if err != nil {
		fail(fmt.Errorf("loading %s: %w", confPath, err))
	}

	rt := &libcni.RuntimeConf{
		ContainerID: *id,
		NetNS:       netns,
		IfName:      *ifName,
	}
	if *args != "" {
		for _, pair := range strings.Split(*args, ";") {
			kv := strings.SplitN(pair, "=", 2)
			if len(kv) != 2 {
				fail(fmt.Errorf("bad -args pair %q", pair))
			}
			rt.Args = append(rt.Args, [2]string{kv[0], kv[1]})
		}
	}
	if *capArgs != "" {
		if err := json.Unmarshal([]byte(*capArgs), &rt.CapabilityArgs); err != nil {
			fail(fmt.Errorf("bad -cap JSON: %w", err))
		}
	}

	cni := libcni.NewCNIConfigWithCacheDir(splitDirs(*path), *cacheDir, nil)
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()

	switch verb {
	case "add":
		result, err := cni.AddNetworkList(ctx, list, rt)
		if err != nil {
			fail(err)
		}
		out, err := json.Marshal(result)
		if err != nil {
			fail(err)
		}
		fmt.Println(string(out))
	case "check":
		if err := cni.CheckNetworkList(ctx, list, rt); err != nil {
			fail(err)
		}
	case "del":
		if err := cni.DelNetworkList(ctx, list, rt); err != nil {
			fail(err)
		}
	default:
		fail(fmt.Errorf("unknown verb %q (add, check or del)", verb))
	}
}

// splitDirs splits a ':' separated list of directories, dropping empty parts.
func splitDirs(dirs string) []string {
	var out []string
	for _, d := range strings.Split(dirs, ":") {
		if d != "" {
			out = append(out, d)
		}
	}
	return out
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "cnitool:", err)
	os.Exit(1)
}
