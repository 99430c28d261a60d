{{/*
Names, labels and the shared pieces of the dlx-proxy container.

The sidecar templates ("dlx-proxy.sidecarContainer", "dlx-proxy.sidecarVolumes")
take this chart's root context. From a parent chart that depends on dlx-proxy,
pass the subchart's values:
  {{- $dlx := dict "Values" (index .Values "dlx-proxy") "Release" .Release "Chart" (dict "Name" "dlx-proxy" "Version" "0.1.0" "AppVersion" "0.1.0") }}
  initContainers:
    {{- include "dlx-proxy.sidecarContainer" $dlx | nindent 4 }}
*/}}

{{/* Chart name, truncated to the 63 characters Kubernetes allows in names. */}}
{{- define "dlx-proxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: "<release>-<chart>", or the release name when it already contains the chart name. */}}
{{- define "dlx-proxy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "dlx-proxy.chart" -}}
{{- printf "%s-%s" .Chart.Name (.Chart.Version | default "0.1.0") | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels selecting this release's standalone pods. */}}
{{- define "dlx-proxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dlx-proxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Selector labels of the application pods (app.enabled): not the standalone
selector labels, so the chart's Service never picks them.
*/}}
{{- define "dlx-proxy.appSelectorLabels" -}}
app.kubernetes.io/name: {{ include "dlx-proxy.name" . }}-app
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: app-with-sidecar
{{- end }}

{{/* Labels of the application Deployment and its pods. */}}
{{- define "dlx-proxy.appLabels" -}}
helm.sh/chart: {{ include "dlx-proxy.chart" . }}
{{ include "dlx-proxy.appSelectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service | default "Helm" }}
app.kubernetes.io/part-of: dlx-proxy
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "dlx-proxy.labels" -}}
helm.sh/chart: {{ include "dlx-proxy.chart" . }}
{{ include "dlx-proxy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | default "Helm" }}
app.kubernetes.io/part-of: dlx-proxy
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "dlx-proxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dlx-proxy.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image reference: repository@digest, or repository:tag (tag defaults to appVersion). */}}
{{- define "dlx-proxy.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* Name of the ConfigMap (or Secret) that holds config.toml. */}}
{{- define "dlx-proxy.configName" -}}
{{- if and .Values.existingConfigMap .Values.existingSecret }}
{{- fail "set only one of existingConfigMap and existingSecret" }}
{{- end }}
{{- if .Values.existingSecret }}
{{- .Values.existingSecret }}
{{- else if .Values.existingConfigMap }}
{{- .Values.existingConfigMap }}
{{- else }}
{{- include "dlx-proxy.fullname" . }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the admin API token (existing or generated). */}}
{{- define "dlx-proxy.adminTokenSecretName" -}}
{{- if .Values.adminToken.existingSecret }}
{{- .Values.adminToken.existingSecret }}
{{- else }}
{{- printf "%s-admin-token" (include "dlx-proxy.fullname" . | trunc 50 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{/* "true" when the application user (appUser) is rendered: enabled, in embedded mode. */}}
{{- define "dlx-proxy.appUserEnabled" -}}
{{- if and .Values.appUser.enabled (eq (toString .Values.config.mode) "embedded") }}
{{- "true" }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the application user's password (existing or generated). */}}
{{- define "dlx-proxy.appUserSecretName" -}}
{{- if .Values.appUser.existingSecret }}
{{- .Values.appUser.existingSecret }}
{{- else }}
{{- printf "%s-app-user" (include "dlx-proxy.fullname" . | trunc 50 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{/* Port number of a "host:port" listen address ("" when the listener is off). */}}
{{- define "dlx-proxy.portOf" -}}
{{- if . }}
{{- splitList ":" (toString .) | last }}
{{- end }}
{{- end }}

{{/* Effective amqps listen address: the configured one, or 0.0.0.0:5671 when tls.enabled leaves it empty. */}}
{{- define "dlx-proxy.amqpsListen" -}}
{{- if .Values.config.listen.amqps }}
{{- .Values.config.listen.amqps }}
{{- else if .Values.tls.enabled }}
{{- "0.0.0.0:5671" }}
{{- end }}
{{- end }}

{{/* checksum/config annotation value: the rendered ConfigMap, or the name of an existing one. */}}
{{- define "dlx-proxy.configChecksum" -}}
{{- if or .Values.existingConfigMap .Values.existingSecret }}
{{- include "dlx-proxy.configName" . | sha256sum }}
{{- else }}
{{- include "dlx-proxy.configToml" . | sha256sum }}
{{- end }}
{{- end }}

{{/*
A value as TOML: strings are JSON-quoted (a valid TOML basic string), numbers,
booleans and arrays of scalars are written as JSON, which TOML reads the same.
toJson also keeps large integers out of float notation.
*/}}
{{- define "dlx-proxy.tomlValue" -}}
{{- if kindIs "string" . }}
{{- toJson . }}
{{- else if kindIs "map" . }}
{{- fail "dlx-proxy: a nested table cannot be written as a TOML value here" }}
{{- else }}
{{- toJson . }}
{{- end }}
{{- end }}

{{/*
One TOML table: `[name]` and its scalar keys, sorted; null values are left out
so the binary's default applies. Argument: (list "name" $map).
*/}}
{{- define "dlx-proxy.tomlTable" -}}
{{- $name := index . 0 }}
{{- $table := index . 1 | default dict -}}
[{{ $name }}]
{{- range $key := keys $table | sortAlpha }}
{{- $value := get $table $key }}
{{- if not (kindIs "invalid" $value) }}
{{ $key }} = {{ include "dlx-proxy.tomlValue" $value }}
{{- end }}
{{- end }}
{{- end }}

{{/* The whole config.toml rendered from .Values.config plus the tls/upstreamTls switches. */}}
{{- define "dlx-proxy.configToml" -}}
{{- $config := .Values.config }}
{{- $listen := deepCopy (get $config "listen" | default dict) }}
{{- $amqps := include "dlx-proxy.amqpsListen" . }}
{{- if $amqps }}
{{- $_ := set $listen "amqps" $amqps }}
{{- end }}
{{- $tls := deepCopy (get $config "tls" | default dict) }}
{{- if .Values.tls.enabled }}
{{- $_ := set $tls "cert_file" (printf "%s/tls.crt" .Values.tls.mountPath) }}
{{- $_ := set $tls "key_file" (printf "%s/tls.key" .Values.tls.mountPath) }}
{{- if .Values.tls.verifyClients }}
{{- $_ := set $tls "client_ca_file" (printf "%s/ca.crt" .Values.tls.mountPath) }}
{{- $_ := set $tls "require_client_cert" .Values.tls.requireClientCert }}
{{- end }}
{{- end }}
{{- $storage := deepCopy (get $config "storage" | default dict) }}
{{- /* Helm drops null values: an unset dir is a missing key. */}}
{{- if or (not (hasKey $storage "dir")) (kindIs "invalid" (index $storage "dir")) }}
{{- $_ := set $storage "dir" .Values.persistence.mountPath }}
{{- end }}
{{- $upstream := deepCopy (get $config "upstream" | default dict) }}
{{- if get $upstream "urls" }}
{{- /* A node list replaces the single URL (the binary refuses both). */}}
{{- $_ := unset $upstream "url" }}
{{- end }}
{{- if .Values.upstreamTls.caSecretName }}
{{- $_ := set $upstream "tls_ca_file" (printf "%s/%s" .Values.upstreamTls.mountPath .Values.upstreamTls.caKey) }}
{{- end }}
{{- if .Values.serviceUser.name }}
{{- $_ := set $upstream "user" .Values.serviceUser.name }}
{{- if .Values.serviceUser.existingSecret }}
{{- $_ := set $upstream "password_file" (printf "%s/%s" .Values.serviceUser.mountPath .Values.serviceUser.key) }}
{{- end }}
{{- end -}}
# config.toml for dlx-proxy, rendered by the dlx-proxy Helm chart.
# Edit the chart values (config.*) rather than this file.
mode = {{ include "dlx-proxy.tomlValue" (get $config "mode" | default "embedded") }}
{{- if kindIs "slice" (get $config "vhosts") }}
vhosts = {{ include "dlx-proxy.tomlValue" (get $config "vhosts") }}
{{- end }}
{{- $appUser := include "dlx-proxy.appUserEnabled" . }}
{{- if and (kindIs "slice" (get $config "users")) (not (get $config "users")) (not $appUser) }}
users = []
{{- end }}

{{ include "dlx-proxy.tomlTable" (list "listen" $listen) }}

{{ include "dlx-proxy.tomlTable" (list "upstream" $upstream) }}
{{- range $section := list "limits" "dead_letter" }}
{{- if hasKey $config $section }}

{{ include "dlx-proxy.tomlTable" (list $section (get $config $section)) }}
{{- end }}
{{- end }}

{{ include "dlx-proxy.tomlTable" (list "storage" $storage) }}
{{- if hasKey $config "proxy" }}

{{ include "dlx-proxy.tomlTable" (list "proxy" (get $config "proxy")) }}
{{- end }}

{{ include "dlx-proxy.tomlTable" (list "tls" $tls) }}
{{- range $section := list "log" "metrics" "shutdown" "runtime" }}
{{- if hasKey $config $section }}

{{ include "dlx-proxy.tomlTable" (list $section (get $config $section)) }}
{{- end }}
{{- end }}
{{- if .Values.adminToken.enabled }}

{{ include "dlx-proxy.tomlTable" (list "admin" (dict "token_file" (printf "%s/%s" .Values.adminToken.mountPath .Values.adminToken.key))) }}
{{- end }}
{{- range $user := get $config "users" | default list }}

[[users]]
{{- range $key := keys $user | sortAlpha }}
{{- $value := get $user $key }}
{{- if and (ne $key "permissions") (not (kindIs "invalid" $value)) }}
{{ $key }} = {{ include "dlx-proxy.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $permission := get $user "permissions" | default list }}

[[users.permissions]]
{{- range $key := keys $permission | sortAlpha }}
{{- $value := get $permission $key }}
{{- if not (kindIs "invalid" $value) }}
{{ $key }} = {{ include "dlx-proxy.tomlValue" $value }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if $appUser }}
{{- $app := .Values.appUser }}
{{- range $user := get $config "users" | default list }}
{{- if eq (toString (get $user "name")) (toString $app.name) }}
{{- fail (printf "appUser.name %q is also in config.users; rename one of them" $app.name) }}
{{- end }}
{{- end }}

# The application's user (chart value appUser): its password is the mounted Secret
# {{ include "dlx-proxy.appUserSecretName" . }}, key {{ $app.key }}.
[[users]]
loopback_only = false
name = {{ include "dlx-proxy.tomlValue" (toString $app.name) }}
password = ""
password_file = {{ include "dlx-proxy.tomlValue" (printf "%s/%s" $app.mountPath $app.key) }}
{{- range $permission := $app.permissions }}

[[users.permissions]]
{{- range $key := keys $permission | sortAlpha }}
{{ $key }} = {{ include "dlx-proxy.tomlValue" (get $permission $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $policy := get $config "policies" | default list }}

[[policies]]
{{- range $key := keys $policy | sortAlpha }}
{{- $value := get $policy $key }}
{{- if and (ne $key "definition") (not (kindIs "invalid" $value)) }}
{{ $key }} = {{ include "dlx-proxy.tomlValue" $value }}
{{- end }}
{{- end }}
{{- $definition := get $policy "definition" | default dict }}
{{- $entries := list }}
{{- range $key := keys $definition | sortAlpha }}
{{- $value := get $definition $key }}
{{- if not (kindIs "invalid" $value) }}
{{- $entries = append $entries (printf "%s = %s" (toJson $key) (include "dlx-proxy.tomlValue" $value)) }}
{{- end }}
{{- end }}
definition = { {{ join ", " $entries }} }
{{- end }}
{{ end }}

{{/* Container ports from the listen addresses. Argument: (dict "amqp" addr "amqps" addr "admin" addr). */}}
{{- define "dlx-proxy.containerPorts" -}}
{{- with include "dlx-proxy.portOf" .amqp }}
- name: amqp
  containerPort: {{ . | int }}
  protocol: TCP
{{- end }}
{{- with include "dlx-proxy.portOf" .amqps }}
- name: amqps
  containerPort: {{ . | int }}
  protocol: TCP
{{- end }}
{{- with include "dlx-proxy.portOf" .admin }}
- name: admin
  containerPort: {{ . | int }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* liveness, readiness and startup probes on the admin port. */}}
{{- define "dlx-proxy.probes" -}}
{{- $probes := .Values.probes }}
{{- if $probes.liveness.enabled }}
livenessProbe:
  httpGet:
    path: /healthz
    port: admin
  {{- toYaml (omit $probes.liveness "enabled") | nindent 2 }}
{{- end }}
{{- if $probes.readiness.enabled }}
readinessProbe:
  httpGet:
    path: /readyz
    port: admin
  {{- toYaml (omit $probes.readiness "enabled") | nindent 2 }}
{{- end }}
{{- if $probes.startup.enabled }}
startupProbe:
  httpGet:
    path: /healthz
    port: admin
  {{- toYaml (omit $probes.startup "enabled") | nindent 2 }}
{{- end }}
{{- end }}

{{/* Volume mounts of the dlx-proxy container: the config directory (never subPath), the storage volume, TLS material, extras. */}}
{{- define "dlx-proxy.volumeMounts" -}}
- name: dlx-proxy-config
  mountPath: {{ .Values.configMountPath }}
  readOnly: true
- name: dlx-proxy-data
  mountPath: {{ .Values.persistence.mountPath }}
{{- if .Values.tls.enabled }}
- name: dlx-proxy-tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.upstreamTls.caSecretName }}
- name: dlx-proxy-upstream-ca
  mountPath: {{ .Values.upstreamTls.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.adminToken.enabled }}
- name: dlx-proxy-admin-token
  mountPath: {{ .Values.adminToken.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.serviceUser.existingSecret }}
- name: dlx-proxy-service-user
  mountPath: {{ .Values.serviceUser.mountPath }}
  readOnly: true
{{- end }}
{{- if include "dlx-proxy.appUserEnabled" . }}
- name: dlx-proxy-app-user
  mountPath: {{ .Values.appUser.mountPath }}
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Whether the standalone workload is a StatefulSet with a claim per pod ("true" or ""). */}}
{{- define "dlx-proxy.stateful" -}}
{{- if and .Values.persistence.enabled (eq (get .Values.config "mode" | default "embedded") "embedded") }}true{{ end }}
{{- end }}

{{/* The storage volume of a pod without a claim template: an emptyDir, or the sidecar's existing claim. */}}
{{- define "dlx-proxy.dataVolume" -}}
- name: dlx-proxy-data
  {{- if .Values.persistence.sidecarClaimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.persistence.sidecarClaimName }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}

{{/* Pod volumes dlx-proxy needs (without extraVolumes), its storage volume included. */}}
{{- define "dlx-proxy.sidecarVolumes" -}}
{{ include "dlx-proxy.podVolumes" . }}
{{ include "dlx-proxy.dataVolume" . }}
{{- end }}

{{/* Pod volumes dlx-proxy needs but its storage volume and extraVolumes. */}}
{{- define "dlx-proxy.podVolumes" -}}
- name: dlx-proxy-config
  {{- if .Values.existingSecret }}
  secret:
    secretName: {{ include "dlx-proxy.configName" . }}
  {{- else }}
  configMap:
    name: {{ include "dlx-proxy.configName" . }}
  {{- end }}
{{- if .Values.tls.enabled }}
{{- if not .Values.tls.secretName }}
{{- fail "tls.enabled needs tls.secretName" }}
{{- end }}
- name: dlx-proxy-tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- if .Values.upstreamTls.caSecretName }}
- name: dlx-proxy-upstream-ca
  secret:
    secretName: {{ .Values.upstreamTls.caSecretName }}
{{- end }}
{{- if .Values.adminToken.enabled }}
- name: dlx-proxy-admin-token
  secret:
    secretName: {{ include "dlx-proxy.adminTokenSecretName" . }}
    items:
      - key: {{ .Values.adminToken.key }}
        path: {{ .Values.adminToken.key }}
{{- end }}
{{- if .Values.serviceUser.existingSecret }}
{{- if not .Values.serviceUser.name }}
{{- fail "serviceUser.existingSecret needs serviceUser.name" }}
{{- end }}
- name: dlx-proxy-service-user
  secret:
    secretName: {{ .Values.serviceUser.existingSecret }}
    items:
      - key: {{ .Values.serviceUser.key }}
        path: {{ .Values.serviceUser.key }}
{{- end }}
{{- if include "dlx-proxy.appUserEnabled" . }}
- name: dlx-proxy-app-user
  secret:
    secretName: {{ include "dlx-proxy.appUserSecretName" . }}
    items:
      - key: {{ .Values.appUser.key }}
        path: {{ .Values.appUser.key }}
{{- end }}
{{- end }}

{{/* Everything of the dlx-proxy container but its name, ports, env and restartPolicy. */}}
{{- define "dlx-proxy.containerCommon" -}}
image: {{ include "dlx-proxy.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
command:
  - dlx-proxy
  - run
  - --config
  - {{ printf "%s/config.toml" .Values.configMountPath | quote }}
{{- with .Values.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "dlx-proxy.probes" . }}
{{- with .Values.resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  {{- include "dlx-proxy.volumeMounts" . | trim | nindent 2 }}
{{- end }}

{{/*
dlx-proxy as a NATIVE sidecar: an init container with restartPolicy Always
(Kubernetes >= 1.29). It starts before the application containers (they wait
for its startup probe) and is stopped after them, so the application can still
settle and dead-letter its in-flight messages while it shuts down. Render it
under `initContainers:` of your pod template, together with the volumes from
"dlx-proxy.sidecarVolumes".
*/}}
{{- define "dlx-proxy.sidecarContainer" -}}
- name: {{ .Values.sidecar.containerName }}
  restartPolicy: Always
  {{- include "dlx-proxy.containerCommon" . | nindent 2 }}
  ports:
    {{- include "dlx-proxy.containerPorts" (dict "amqp" .Values.sidecar.listenAmqp "amqps" (include "dlx-proxy.amqpsListen" .) "admin" .Values.config.listen.admin) | trim | nindent 4 }}
  env:
    - name: DLX_PROXY_LISTEN__AMQP
      value: {{ .Values.sidecar.listenAmqp | quote }}
    {{- with .Values.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* Pod annotations: config checksum (optional) and annotation-based scraping (optional). */}}
{{- define "dlx-proxy.podAnnotations" -}}
{{- if .Values.standalone.rollOnConfigChange }}
checksum/config: {{ include "dlx-proxy.configChecksum" . }}
{{- end }}
{{- if .Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ include "dlx-proxy.portOf" .Values.config.listen.admin | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .Values.standalone.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}
