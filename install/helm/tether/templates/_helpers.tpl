{{/* The name of every object: the release's name if it holds "tether", else <release>-tether. */}}
{{- define "tether.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The labels the DaemonSet selects its pods by (immutable once installed). */}}
{{- define "tether.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Every object's labels. */}}
{{- define "tether.labels" -}}
{{ include "tether.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The image, tag defaulting to the appVersion. */}}
{{- define "tether.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if eq (toString $tag) "latest" -}}
{{- fail "image.tag: never \"latest\" (the kubelet pulls it Always, so an image imported by hand is ignored); name a version" -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* tetherd's socket on the node (and, mounted at the same path, in the pod). */}}
{{- define "tether.socket" -}}
{{- printf "%s/tether.sock" (trimSuffix "/" .Values.hostPaths.runDir) -}}
{{- end -}}

{{/* Fails on a mode the chart does not know, or values a mode needs and lacks. */}}
{{- define "tether.checkValues" -}}
{{- $mode := .Values.mode -}}
{{- if eq $mode "kubernetes" -}}
{{- if not .Values.cluster.cidrs -}}
{{- fail "mode kubernetes needs cluster.cidrs (one CIDR per family)" -}}
{{- end -}}
{{- else if eq $mode "singleNode" -}}
{{- if not .Values.podCidrs -}}
{{- fail "mode singleNode needs podCidrs (one CIDR per family)" -}}
{{- end -}}
{{- else if eq $mode "etcd" -}}
{{- if not .Values.etcd.endpoints -}}
{{- fail "mode etcd needs etcd.endpoints" -}}
{{- end -}}
{{- if not .Values.cluster.cidrs -}}
{{- fail "mode etcd needs cluster.cidrs (one CIDR per family)" -}}
{{- end -}}
{{- else if ne $mode "nodeCidrs" -}}
{{- fail (printf "mode must be kubernetes, singleNode, nodeCidrs or etcd, not %q" (toString $mode)) -}}
{{- end -}}
{{- if not (has .Values.overlay (list "none" "vxlan")) -}}
{{- fail (printf "overlay must be none or vxlan, not %q" (toString .Values.overlay)) -}}
{{- end -}}
{{- if .Values.migrationNetwork.enabled -}}
{{- $found := false -}}
{{- range .Values.pools -}}
{{- if eq .name $.Values.migrationNetwork.pool -}}{{- $found = true -}}{{- end -}}
{{- end -}}
{{- if not $found -}}
{{- fail (printf "migrationNetwork.pool %q is not one of pools' names: define it in pools" .Values.migrationNetwork.pool) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The conflist the init container writes (install/install.sh), from
`netconf`: install/10-tether.conflist with the chart's socket when the
values are the defaults (the install suite compares them). One line of
JSON. */}}
{{- define "tether.conflist" -}}
{{- $n := .Values.netconf -}}
{{- $tether := dict "type" "tether" "socket" (include "tether.socket" .) "vmAddressPolicy" $n.vmAddressPolicy -}}
{{- if not (kindIs "invalid" $n.mtu) -}}
{{- $_ := set $tether "mtu" $n.mtu -}}
{{- end -}}
{{- with $n.dns -}}
{{- $_ := set $tether "dns" . -}}
{{- end -}}
{{- with $n.kubevirt -}}
{{- $_ := set $tether "kubevirt" . -}}
{{- end -}}
{{- $_ := set $tether "capabilities" (dict "io.kubernetes.cri.pod-annotations" true "ips" true "mac" true) -}}
{{- $plugins := list $tether -}}
{{- if $n.portmap -}}
{{- $plugins = append $plugins (dict "type" "portmap" "snat" true "capabilities" (dict "portMappings" true)) -}}
{{- end -}}
{{- dict "cniVersion" "1.0.0" "cniVersions" (list "1.0.0" "1.1.0") "name" $n.name "plugins" $plugins | toJson -}}
{{- end -}}
