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

{{- define "islands.tokenSecret" -}}
{{- default (printf "%s-ray-token" (include "islands.fullname" .)) .Values.auth.existingSecret -}}
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

{{/* Whether any region of this release's worker groups has an accelerator (then JAX picks its
     platform per process). */}}
{{- define "islands.anyAccelerator" -}}
{{- $any := false -}}
{{- range $name, $region := include "islands.workerRegions" . | fromJson -}}
{{- if ne $region.accelerator.type "cpu" -}}{{- $any = true -}}{{- end -}}
{{- end -}}
{{- $any -}}
{{- end -}}

{{/* The JobConfig: `jobConfig` plus the regions and the metrics endpoint the chart owns. */}}
{{- define "islands.jobConfig" -}}
{{- $cfg := deepCopy (.Values.jobConfig | default dict) -}}
{{- $regions := dict -}}
{{- range $name, $region := include "islands.regions" . | fromJson -}}
{{- $r := dict "learners" (int $region.learners) "max_learners" (int (default $region.learners (get $region "maxLearners"))) -}}
{{- if hasKey $region "bandwidthGbps" -}}{{- $_ := set $r "bandwidth_gbps" $region.bandwidthGbps -}}{{- end -}}
{{- if hasKey $region "latencyMs" -}}{{- $_ := set $r "latency_ms" $region.latencyMs -}}{{- end -}}
{{- if $region.remote -}}{{- $_ := set $r "remote" true -}}{{- end -}}
{{- $_ := set $regions $name $r -}}
{{- end -}}
{{- $_ := set $cfg "regions" $regions -}}
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
{{- toYaml $cfg -}}
{{- end -}}

{{/* Environment of every Ray container. */}}
{{- define "islands.env" -}}
- name: ISLANDS_JAX_PLATFORMS
  {{- /* Empty lets JAX choose per process (TPU/GPU on workers, CPU on the head). */}}
  value: {{ if eq (include "islands.anyAccelerator" .) "true" }}""{{ else }}"cpu"{{ end }}
- name: XLA_PYTHON_CLIENT_PREALLOCATE
  value: "false"
{{- with .Values.env }}
{{ toYaml . }}
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
{{- if .Values.auth.enabled }}
authOptions:
  mode: token
  secretName: {{ include "islands.tokenSecret" . }}
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
    spec:
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
      volumes:
        {{- if not $isRegion }}
        - name: job-config
          configMap:
            name: {{ $fullname }}-job
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
{{- $hosts := int (dig "hostsPerLearner" 1 $region) }}
{{- $learners := int $region.learners }}
{{- $max := int (default $region.learners (get $region "maxLearners")) }}
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
{{- $chips := int (include "islands.topologyChips" $acc.topology) }}
{{- if mod $chips $hosts }}
{{- fail (printf "regions.%s: topology %s has %d chips, not divisible by hostsPerLearner (%d)" $name $acc.topology $chips $hosts) }}
{{- end }}
{{- $_ := set $limits "google.com/tpu" (div $chips $hosts) }}
{{- $_ := set $requests "google.com/tpu" (div $chips $hosts) }}
{{- $_ := set $selector "cloud.google.com/gke-tpu-accelerator" $acc.tpuType }}
{{- $_ := set $selector "cloud.google.com/gke-tpu-topology" $acc.topology }}
{{- $tolerations = append $tolerations (dict "key" "google.com/tpu" "operator" "Exists" "effect" "NoSchedule") }}
{{- else if eq $acc.type "gpu" }}
{{- $_ := set $limits "nvidia.com/gpu" (int $acc.count) }}
{{- $_ := set $requests "nvidia.com/gpu" (int $acc.count) }}
{{- $tolerations = append $tolerations (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
{{- end }}
  - groupName: {{ $name }}
    replicas: {{ $learners }}
    minReplicas: {{ $min }}
    maxReplicas: {{ $max }}
    numOfHosts: {{ $hosts }}
    rayStartParams:
      # Each learner takes one unit of region:<name>, so the service's placement works unchanged.
      resources: {{ dict (printf "region:%s" $name) 1 | toJson | quote | squote }}
    template:
      metadata:
        labels:
          {{- include "islands.labels" $root | nindent 10 }}
          app.kubernetes.io/component: worker
          islands/region: {{ $name }}
      spec:
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
        volumes:
          - name: islands-data
            emptyDir: {}
{{- end }}
{{- end -}}
