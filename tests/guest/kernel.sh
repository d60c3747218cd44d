# Sourced by tests/guest/build.sh and tests/guest/kernel-suite.sh: the
# Debian cloud kernel the test guests boot. Sets pkg (the versioned
# linux-image package linux-image-cloud-amd64 depends on) and kver (its
# version in apt), updating apt's lists once if it knows no such package;
# exits naming $who if there is none.

kernel_pkg() {
    apt-cache depends linux-image-cloud-amd64 2>/dev/null |
        awk '/Depends: linux-image-[0-9]/ { print $2; exit }'
}
pkg=$(kernel_pkg)
if [ -z "$pkg" ]; then
    apt-get update >&2
    pkg=$(kernel_pkg)
fi
[ -n "$pkg" ] || { echo "$who: no linux-image-cloud-amd64 in apt" >&2; exit 1; }
kver=$(apt-cache policy "$pkg" | awk '/Candidate:/ { print $2 }')
