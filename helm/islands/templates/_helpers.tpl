{{/* Names and labels. */}}
{{- define "islands.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "islands.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "islands.selectorLabels" -}}
app.kubernetes.io/name: {{ include "islands.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "islands.labels" -}}
{{ include "islands.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "islands.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Secret holding the Ray token: auth.existingSecret, else the one KubeRay generates for the
     cluster, named after the RayCluster (a RayJob's cluster has a generated name: a shell
     expression that reads it). */}}
{{- define "islands.tokenSecret" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else if eq .Values.mode "cluster" -}}
{{- include "islands.fullname" . -}}
{{- else -}}
{{- printf "$(kubectl -n %s get rayjob %s -o jsonpath='{.status.rayClusterName}')" .Release.Namespace (include "islands.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The enabled regions, as a dict name -> region (for ranges that skip `disabled`). */}}
{{- define "islands.regions" -}}
{{- $out := dict -}}
{{- range $name, $region := .Values.regions -}}
{{- if and $region (not $region.disabled) -}}
{{- $_ := set $out $name $region -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The regions that get a worker group in this release, as a dict name -> region: in a region
     release (`link.region.enabled`) the one it joins as; otherwise every enabled region that is
     not `remote` (a remote region runs in its own cluster). */}}
{{- define "islands.workerRegions" -}}
{{- $out := dict -}}
{{- $all := include "islands.regions" . | fromJson -}}
{{- if .Values.link.region.enabled -}}
{{- $name := .Values.link.region.name -}}
{{- if hasKey $all $name -}}{{- $_ := set $out $name (get $all $name) -}}{{- end -}}
{{- else -}}
{{- range $name, $region := $all -}}
{{- if not $region.remote -}}{{- $_ := set $out $name $region -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Where the link's Secrets are mounted (head container only). */}}
{{- define "islands.linkTokenDir" -}}/etc/islands-link/token{{- end -}}
{{- define "islands.linkTlsDir" -}}/etc/islands-link/tls{{- end -}}

{{/* The link's side in this release: the `link.server` or `link.region` block, or {} without one. */}}
{{- define "islands.linkSide" -}}
{{- if .Values.link.region.enabled -}}
{{- toJson .Values.link.region -}}
{{- else if .Values.link.server.enabled -}}
{{- toJson .Values.link.server -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{/* The TLS Secret's keys this side mounts, as a list (server: cert, key, client CA; region: CA,
     client cert and key), skipping empty ones. */}}
{{- define "islands.linkTlsKeys" -}}
{{- $keys := list -}}
{{- $tls := dict -}}
{{- if .Values.link.region.enabled -}}
{{- $tls = .Values.link.region.tlsSecret -}}
{{- if $tls.name -}}{{- $keys = list $tls.caKey $tls.certKey $tls.keyKey -}}{{- end -}}
{{- else if .Values.link.server.enabled -}}
{{- $tls = .Values.link.server.tlsSecret -}}
{{- $keys = list $tls.certKey $tls.keyKey $tls.clientCaKey -}}
{{- end -}}
{{- $out := list -}}
{{- range $keys -}}{{- if . -}}{{- $out = append $out . -}}{{- end -}}{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The region agent's command (a region release): `islands region join` against the home. */}}
{{- define "islands.regionJoin" -}}
{{- $r := .Values.link.region -}}
{{- $args := list "islands" "region" "join" "--home" $r.home "--region" $r.name "--address" "auto" -}}
{{- $args = concat $args (list "--token-file" (printf "%s/%s" (include "islands.linkTokenDir" .) $r.tokenSecret.key)) -}}
{{- if $r.tlsSecret.name -}}
{{- $dir := include "islands.linkTlsDir" . -}}
{{- if $r.tlsSecret.caKey -}}{{- $args = concat $args (list "--ca-cert" (printf "%s/%s" $dir $r.tlsSecret.caKey)) -}}{{- end -}}
{{- if and $r.tlsSecret.certKey $r.tlsSecret.keyKey -}}
{{- $args = concat $args (list "--client-cert" (printf "%s/%s" $dir $r.tlsSecret.certKey) "--client-key" (printf "%s/%s" $dir $r.tlsSecret.keyKey)) -}}
{{- end -}}
{{- end -}}
{{- with $r.serverName -}}{{- $args = concat $args (list "--server-name" .) -}}{{- end -}}
{{- $args = concat $args (list "--run-dir" (printf "/var/lib/islands/runs/region-%s" $r.name)) -}}
{{- $args = concat $args (.Values.job.extraArgs | default list) -}}
{{- join " " $args -}}
{{- end -}}

{{/* Chips in a TPU topology ("2x2x1" -> 4). */}}
{{- define "islands.topologyChips" -}}
{{- $chips := 1 -}}
{{- range splitList "x" . -}}
{{- $chips = mul $chips (atoi .) -}}
{{- end -}}
{{- $chips -}}
{{- end -}}

{{/* GKE's TPU node pools by their `cloud.google.com/gke-tpu-accelerator` label: the JobConfig's
     tpu_type, the topology's dimensions, the chips of a multi-host slice's hosts, and the
     topologies that are one host of all their chips (the table of docs/accelerators.md). */}}
{{- define "islands.tpuTypes" -}}
{{- toJson (dict
  "tpu-v4-podslice" (dict "tpuType" "v4" "dims" 3 "chipsPerHost" 4 "singleHost" (list "2x2x1"))
  "tpu-v5-lite-podslice" (dict "tpuType" "v5e" "dims" 2 "chipsPerHost" 4 "singleHost" (list "1x1" "2x2" "2x4"))
  "tpu-v5p-slice" (dict "tpuType" "v5p" "dims" 3 "chipsPerHost" 4 "singleHost" (list "2x2x1"))
  "tpu-v6e-slice" (dict "tpuType" "v6e" "dims" 2 "chipsPerHost" 4 "singleHost" (list "1x1" "2x2" "2x4"))) -}}
{{- end -}}

{{/* A region's learner shape as JSON {hosts, chipsPerHost, tpuType}: hosts is `hostsPerLearner`
     (default 1) and must be a TPU topology's hosts. Fails naming the key that is wrong.
     Argument: (list name region). */}}
{{- define "islands.learnerShape" -}}
{{- $name := index . 0 -}}
{{- $region := index . 1 -}}
{{- $acc := $region.accelerator | default dict -}}
{{- $hosts := int (get $region "hostsPerLearner" | default 1) -}}
{{- $out := dict "hosts" $hosts -}}
{{- if eq ($acc.type | default "cpu") "tpu" -}}
{{- $types := include "islands.tpuTypes" . | fromJson -}}
{{- if not (hasKey $types $acc.tpuType) -}}
{{- fail (printf "regions.%s.accelerator.tpuType: %q is not a GKE TPU node label (cloud.google.com/gke-tpu-accelerator); use one of %s" $name $acc.tpuType (keys $types | sortAlpha | join ", ")) -}}
{{- end -}}
{{- $tpu := get $types $acc.tpuType -}}
{{- $chips := int (include "islands.topologyChips" $acc.topology) -}}
{{- if ne (len (splitList "x" $acc.topology)) (int $tpu.dims) -}}
{{- fail (printf "regions.%s.accelerator.topology: %s topologies are %s, got %s" $name $acc.tpuType (ternary "AxB" "AxBxC" (eq (int $tpu.dims) 2)) $acc.topology) -}}
{{- end -}}
{{- $perHost := int $tpu.chipsPerHost -}}
{{- if has $acc.topology $tpu.singleHost -}}{{- $perHost = $chips -}}{{- end -}}
{{- if mod $chips $perHost -}}
{{- fail (printf "regions.%s.accelerator.topology: %s has %d chips, not a whole number of %s hosts of %d chips" $name $acc.topology $chips $acc.tpuType $perHost) -}}
{{- end -}}
{{- $slice := div $chips $perHost -}}
{{- if ne $hosts (int $slice) -}}
{{- fail (printf "regions.%s.hostsPerLearner: %s %s is %d chips on %d host(s) of %d chips; set hostsPerLearner: %d (got %d)" $name $acc.tpuType $acc.topology $chips $slice $perHost $slice $hosts) -}}
{{- end -}}
{{- $_ := set $out "chipsPerHost" $perHost -}}
{{- $_ := set $out "tpuType" $tpu.tpuType -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The JobConfig: `jobConfig` plus the regions and the metrics endpoint the chart owns. */}}
{{- define "islands.jobConfig" -}}
{{- $cfg := deepCopy (.Values.jobConfig | default dict) -}}
{{- $regions := dict -}}
{{- $spares := dict -}}
{{- range $name, $region := include "islands.regions" . | fromJson -}}
{{- $r := dict "learners" (int $region.learners) "max_learners" (int (default $region.learners (get $region "maxLearners"))) -}}
{{- if hasKey $region "bandwidthGbps" -}}{{- $_ := set $r "bandwidth_gbps" $region.bandwidthGbps -}}{{- end -}}
{{- if hasKey $region "latencyMs" -}}{{- $_ := set $r "latency_ms" $region.latencyMs -}}{{- end -}}
{{- if $region.remote -}}{{- $_ := set $r "remote" true -}}{{- end -}}
{{- /* The learners' hardware, so each asks Ray for its devices (docs/accelerators.md). */ -}}
{{- with $region.accelerator -}}
{{- $shape := include "islands.learnerShape" (list $name $region) | fromJson -}}
{{- $_ := set $r "accelerator" .type -}}
{{- if eq .type "gpu" -}}{{- $_ := set $r "devices_per_host" (int .count) -}}{{- end -}}
{{- if eq .type "tpu" -}}
{{- $_ := set $r "tpu_type" $shape.tpuType -}}
{{- $_ := set $r "topology" .topology -}}
{{- else if gt (int $shape.hosts) 1 -}}
{{- /* Each learner is a unit of this many hosts (pods), one program over their devices. */ -}}
{{- $_ := set $r "hosts_per_learner" (int $shape.hosts) -}}
{{- end -}}
{{- end -}}
{{- /* A remote region's spares are its agent's to keep (its release's pods grow by them). */ -}}
{{- if gt (int (default 0 (get $region "spares"))) 0 -}}
{{- $_ := set $spares $name (int (get $region "spares")) -}}
{{- end -}}
{{- $_ := set $regions $name $r -}}
{{- end -}}
{{- $_ := set $cfg "regions" $regions -}}
{{- if $spares -}}
{{- $health := deepCopy (get $cfg "health" | default dict) -}}
{{- $_ := set $health "spares" $spares -}}
{{- $_ := set $cfg "health" $health -}}
{{- end -}}
{{- with .Values.link.server -}}
{{- if .enabled -}}
{{- $link := deepCopy (get $cfg "link" | default dict) -}}
{{- $_ := set $link "port" (int .port) -}}
{{- /* Every interface of the pod: the Service and far regions reach the pod address; TLS and the
       token protect the link, the NetworkPolicy limits who may try. */ -}}
{{- $_ := set $link "host" "0.0.0.0" -}}
{{- $_ := set $link "token_file" (printf "%s/%s" (include "islands.linkTokenDir" $) .tokenSecret.key) -}}
{{- $dir := include "islands.linkTlsDir" $ -}}
{{- $tls := dict "cert_file" (printf "%s/%s" $dir .tlsSecret.certKey) "key_file" (printf "%s/%s" $dir .tlsSecret.keyKey) -}}
{{- with .tlsSecret.clientCaKey -}}{{- $_ := set $tls "client_ca_file" (printf "%s/%s" $dir .) -}}{{- end -}}
{{- $_ := set $link "tls" $tls -}}
{{- $_ := set $cfg "link" $link -}}
{{- end -}}
{{- end -}}
{{- $metrics := deepCopy (get $cfg "metrics" | default dict) -}}
{{- $_ := set $metrics "port" (int .Values.metrics.port) -}}
{{- /* The pod's every interface: Prometheus scrapes the pod address; the NetworkPolicy limits who may. */ -}}
{{- $_ := set $metrics "host" "0.0.0.0" -}}
{{- $_ := set $cfg "metrics" $metrics -}}
{{- if not .Values.link.region.enabled -}}
{{- $console := deepCopy (get $cfg "console" | default dict) -}}
{{- $_ := set $console "enabled" .Values.console.enabled -}}
{{- $_ := set $console "port" (int .Values.console.port) -}}
{{- $_ := set $console "allow_chaos" .Values.console.allowChaos -}}
{{- /* The pod's every interface: the Service and port-forward reach the pod address. */ -}}
{{- $_ := set $console "host" "0.0.0.0" -}}
{{- with .Values.console.tokenSecret.name -}}
{{- $_ := set $console "token_file" (printf "/etc/islands-console/%s" $.Values.console.tokenSecret.key) -}}
{{- end -}}
{{- $_ := set $cfg "console" $console -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Environment of every Ray container. Each learner's JAX platform is its region's (set by the
     service: CPU regions on the CPU, GPU and TPU regions on the devices Ray assigns). */}}
{{- define "islands.env" -}}
- name: XLA_PYTHON_CLIENT_PREALLOCATE
  value: "false"
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* What every Ray pod of the release gets from `pod:` (service account, affinity, volumes). */}}
{{- define "islands.podExtras" -}}
{{- include "islands.podExtrasWith" (list . .Values.pod.affinity) }}
{{- end -}}

{{/* The same with the affinity given: (list $root $affinity); a region's own replaces pod.affinity. */}}
{{- define "islands.podExtrasWith" -}}
{{- $root := index . 0 }}
{{- with $root.Values.pod.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with index . 1 }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "islands.podVolumes" -}}
{{- with .Values.pod.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- with .Values.pod.shmSize }}
- name: dshm
  emptyDir: {medium: Memory, sizeLimit: {{ . }}}
{{- end }}
{{- end -}}

{{- define "islands.podVolumeMounts" -}}
{{- with .Values.pod.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- if .Values.pod.shmSize }}
- {name: dshm, mountPath: /dev/shm}
{{- end }}
{{- end -}}

{{/* The RayCluster spec, shared by the RayCluster and the RayJob. */}}
{{- define "islands.rayClusterSpec" -}}
{{- $root := . -}}
{{- $fullname := include "islands.fullname" . -}}
{{- $isRegion := .Values.link.region.enabled -}}
{{- $side := include "islands.linkSide" . | fromJson -}}
{{- $tlsKeys := include "islands.linkTlsKeys" . | fromJsonArray -}}
{{- $workers := include "islands.workerRegions" . | fromJson -}}
rayVersion: {{ .Values.rayVersion | quote }}
enableInTreeAutoscaling: {{ .Values.autoscaler.enabled }}
{{- if .Values.autoscaler.enabled }}
{{- $opts := deepCopy .Values.autoscaler.options }}
{{- if not (hasKey $opts "securityContext") }}
{{- $_ := set $opts "securityContext" .Values.securityContext }}
{{- end }}
autoscalerOptions:
  {{- toYaml $opts | nindent 2 }}
{{- end }}
{{- if .Values.auth.enabled }}
authOptions:
  mode: token
  {{- /* Without a Secret of the user's, KubeRay generates the token once per cluster: nothing
         random is rendered here, so GitOps renders (helm template) stay identical. */}}
  {{- with .Values.auth.existingSecret }}
  secretName: {{ . }}
  {{- end }}
{{- end }}
headGroupSpec:
  serviceType: {{ .Values.dashboard.serviceType }}
  rayStartParams:
    dashboard-host: "0.0.0.0"
    {{- range $k, $v := .Values.head.rayStartParams }}
    {{ $k }}: {{ $v | toString | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "islands.labels" . | nindent 8 }}
        app.kubernetes.io/component: head
      {{- with .Values.pod.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "islands.podExtras" . | nindent 6 }}
      {{- if and (eq .Values.mode "job") (eq .Values.job.submissionMode "SidecarMode") }}
      restartPolicy: Never
      {{- end }}
      securityContext:
        {{- toYaml .Values.podSecurityContext | nindent 8 }}
      {{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.head.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.head.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-head
          image: {{ include "islands.image" . }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          securityContext:
            {{- toYaml .Values.securityContext | nindent 12 }}
          resources:
            {{- toYaml .Values.head.resources | nindent 12 }}
          env:
            {{- include "islands.env" . | nindent 12 }}
          ports:
            - {containerPort: 6379, name: gcs}
            - {containerPort: 8265, name: dashboard}
            - {containerPort: 10001, name: client}
            - {containerPort: 8080, name: metrics}
            {{- if not $isRegion }}
            - {containerPort: {{ .Values.metrics.port }}, name: islands-metrics}
            {{- if .Values.console.enabled }}
            - {containerPort: {{ .Values.console.port }}, name: islands-console}
            {{- end }}
            {{- end }}
            {{- if .Values.link.server.enabled }}
            - {containerPort: {{ .Values.link.server.port }}, name: islands-link}
            {{- end }}
          volumeMounts:
            {{- if not $isRegion }}
            - {name: job-config, mountPath: /etc/islands, readOnly: true}
            {{- end }}
            - {name: islands-data, mountPath: /var/lib/islands}
            {{- if $side }}
            - {name: link-token, mountPath: {{ include "islands.linkTokenDir" . }}, readOnly: true}
            {{- end }}
            {{- if $tlsKeys }}
            - {name: link-tls, mountPath: {{ include "islands.linkTlsDir" . }}, readOnly: true}
            {{- end }}
            {{- if and (not $isRegion) .Values.console.tokenSecret.name }}
            - {name: console-token, mountPath: /etc/islands-console, readOnly: true}
            {{- end }}
            {{- include "islands.podVolumeMounts" . | nindent 12 }}
      volumes:
        {{- include "islands.podVolumes" . | nindent 8 }}
        {{- if not $isRegion }}
        - name: job-config
          configMap:
            name: {{ $fullname }}-job
        {{- end }}
        {{- if and (not $isRegion) .Values.console.tokenSecret.name }}
        # The console's action token, readable by the pod's group only (fsGroup).
        - name: console-token
          secret:
            secretName: {{ .Values.console.tokenSecret.name }}
            defaultMode: 288   # 0440
            items:
              - {key: {{ .Values.console.tokenSecret.key | quote }}, path: {{ .Values.console.tokenSecret.key | quote }}}
        {{- end }}
        {{- if $side }}
        # The link's bearer token, readable by the pod's group only (fsGroup).
        - name: link-token
          secret:
            secretName: {{ $side.tokenSecret.name }}
            defaultMode: 288   # 0440
            items:
              - {key: {{ $side.tokenSecret.key | quote }}, path: {{ $side.tokenSecret.key | quote }}}
        {{- end }}
        {{- if $tlsKeys }}
        - name: link-tls
          secret:
            secretName: {{ $side.tlsSecret.name }}
            defaultMode: 288   # 0440
            items:
              {{- range $tlsKeys }}
              - {key: {{ . | quote }}, path: {{ . | quote }}}
              {{- end }}
        {{- end }}
        - name: islands-data
          {{- if .Values.storage.existingClaim }}
          persistentVolumeClaim:
            claimName: {{ .Values.storage.existingClaim }}
          {{- else }}
          emptyDir: {}
          {{- end }}
{{- if not $workers }}
workerGroupSpecs: []
{{- else }}
workerGroupSpecs:
{{- end }}
{{- range $name, $region := $workers }}
{{- $acc := $region.accelerator }}
{{- $shape := include "islands.learnerShape" (list $name $region) | fromJson }}
{{- $hosts := int $shape.hosts }}
{{- $learners := int $region.learners }}
{{- $max := int (default $region.learners (get $region "maxLearners")) }}
{{- /* A warm spare is a learner process of its own: one more pod of the group, always up. */ -}}
{{- $spares := int (default 0 (get $region "spares")) }}
{{- /* null keys vanish when Helm merges values, so an unset minLearners is simply absent */ -}}
{{- $min := $learners }}
{{- if and (hasKey $region "minLearners") (not (kindIs "invalid" (get $region "minLearners"))) }}
{{- $min = int (get $region "minLearners") }}
{{- end }}
{{- $limits := deepCopy (dig "resources" "limits" dict $region) }}
{{- $requests := deepCopy (dig "resources" "requests" dict $region) }}
{{- $selector := deepCopy (dig "nodeSelector" dict $region) }}
{{- $tolerations := dig "tolerations" list $region }}
{{- if eq $acc.type "tpu" }}
{{- $_ := set $limits "google.com/tpu" (int $shape.chipsPerHost) }}
{{- $_ := set $requests "google.com/tpu" (int $shape.chipsPerHost) }}
{{- $_ := set $selector "cloud.google.com/gke-tpu-accelerator" $acc.tpuType }}
{{- $_ := set $selector "cloud.google.com/gke-tpu-topology" $acc.topology }}
{{- $tolerations = append $tolerations (dict "key" "google.com/tpu" "operator" "Exists" "effect" "NoSchedule") }}
{{- else if eq $acc.type "gpu" }}
{{- $_ := set $limits "nvidia.com/gpu" (int $acc.count) }}
{{- $_ := set $requests "nvidia.com/gpu" (int $acc.count) }}
{{- $tolerations = append $tolerations (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
{{- end }}
  - groupName: {{ $name }}
    replicas: {{ add $learners $spares }}
    minReplicas: {{ add $min $spares }}
    maxReplicas: {{ add $max $spares }}
    numOfHosts: {{ $hosts }}
    rayStartParams:
      # Each host (pod) takes one unit of region:<name>: a learner of N hosts takes N.
      resources: {{ dict (printf "region:%s" $name) 1 | toJson | quote | squote }}
    template:
      metadata:
        labels:
          {{- include "islands.labels" $root | nindent 10 }}
          app.kubernetes.io/component: worker
          islands/region: {{ $name }}
        {{- with $root.Values.pod.annotations }}
        annotations:
          {{- toYaml . | nindent 10 }}
        {{- end }}
      spec:
        {{- include "islands.podExtrasWith" (list $root ($region.affinity | default $root.Values.pod.affinity)) | nindent 8 }}
        securityContext:
          {{- toYaml $root.Values.podSecurityContext | nindent 10 }}
        {{- with $root.Values.imagePullSecrets }}
        imagePullSecrets:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $selector }}
        nodeSelector:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $tolerations }}
        tolerations:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        containers:
          - name: ray-worker
            image: {{ include "islands.image" $root }}
            imagePullPolicy: {{ $root.Values.image.pullPolicy }}
            securityContext:
              {{- toYaml $root.Values.securityContext | nindent 14 }}
            resources:
              requests:
                {{- toYaml $requests | nindent 16 }}
              limits:
                {{- toYaml $limits | nindent 16 }}
            env:
              {{- include "islands.env" $root | nindent 14 }}
            ports:
              - {containerPort: 8080, name: metrics}
            volumeMounts:
              - {name: islands-data, mountPath: /var/lib/islands}
              {{- include "islands.podVolumeMounts" $root | nindent 14 }}
        volumes:
          - name: islands-data
            emptyDir: {}
          {{- include "islands.podVolumes" $root | nindent 10 }}
{{- end }}
{{- end -}}
