{{/* Names ------------------------------------------------------------------------------- */}}

{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedserve.fullname" -}}
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

{{/* "<fullname>-<component>", fitting a DNS label. Call with (dict "root" $ "component" "x"). */}}
{{- define "pagedserve.componentName" -}}
{{- printf "%s-%s" (include "pagedserve.fullname" .root | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{/* The router's headless Service (the gateways' round-robin target). */}}
{{- define "pagedserve.routerHeadlessName" -}}
{{- printf "%s-headless" (include "pagedserve.componentName" (dict "root" . "component" "router")) }}
{{- end }}

{{- define "pagedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagedserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels: (dict "root" $ "component" "router") ------------------------------------------ */}}

{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pagedserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Images ------------------------------------------------------------------------------ */}}

{{/* (dict "image" <values image> "default" <tag>) -> repository@digest | repository:tag */}}
{{- define "pagedserve.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .default .image.tag) }}
{{- end }}
{{- end }}

{{- define "pagedserve.image" -}}
{{- include "pagedserve.imageRef" (dict "image" .Values.image "default" .Chart.AppVersion) }}
{{- end }}

{{/*
The image of a role: (dict "root" $ "component" x). Router and gateway run the torch-free image
(the Dockerfile's `slim` target: `<role>.image`, repository defaulting to image.repository and
tag to <appVersion>-slim); prefill and decode the full one (`image`).
*/}}
{{- define "pagedserve.roleImage" -}}
{{- $root := .root -}}
{{- if has .component (list "router" "gateway") }}
{{- $own := (index $root.Values .component).image -}}
{{- $image := dict "repository" (default $root.Values.image.repository $own.repository) "tag" $own.tag "digest" $own.digest -}}
{{- include "pagedserve.imageRef" (dict "image" $image "default" (printf "%s-slim" $root.Chart.AppVersion)) }}
{{- else }}
{{- include "pagedserve.image" $root }}
{{- end }}
{{- end }}

{{/* The pull policy of a role's image: (dict "root" $ "component" x). */}}
{{- define "pagedserve.rolePullPolicy" -}}
{{- if has .component (list "router" "gateway") }}
{{- (index .root.Values .component).image.pullPolicy }}
{{- else }}
{{- .root.Values.image.pullPolicy }}
{{- end }}
{{- end }}

{{/* Redis ------------------------------------------------------------------------------- */}}

{{/* The value of --redis-url: a literal, or $(PAGEDSERVE_REDIS_URL) filled from a Secret. */}}
{{- define "pagedserve.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/0" (include "pagedserve.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) }}
{{- else if .Values.redis.urlSecret.name }}
{{- "$(PAGEDSERVE_REDIS_URL)" }}
{{- else if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else }}
{{- fail "redis: set redis.enabled=true, redis.url or redis.urlSecret.name (the cluster needs a Redis for worker discovery)" }}
{{- end }}
{{- end }}

{{/* Pods -------------------------------------------------------------------------------- */}}

{{/* "true" when a role's values (.Values.prefill, ...) turn its KEDA ScaledObject on. */}}
{{- define "pagedserve.kedaEnabled" -}}
{{- if and (hasKey .autoscaling "keda") .autoscaling.keda.enabled }}true{{ end }}
{{- end }}

{{/* terminationGracePeriodSeconds: preStop sleep + drain timeout + a margin for the process exit. */}}
{{- define "pagedserve.gracePeriod" -}}
{{- add (int .root.Values.preStopSleepSeconds) (int .values.drainTimeoutSeconds) 15 }}
{{- end }}

{{/* Topology spread constraints of a role; a constraint without a labelSelector gets the role's. */}}
{{- define "pagedserve.topologySpread" -}}
{{- $selector := include "pagedserve.selectorLabels" . | fromYaml }}
{{- $out := list }}
{{- range .values.topologySpreadConstraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) }}
{{- end }}
{{- $out = append $out $c }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* Flags every role shares: model identity, bind/advertise, Redis, observability. */}}
{{- define "pagedserve.commonArgs" -}}
{{- $v := .root.Values -}}
{{- $args := list "--model" $v.model.mountPath "--block-size" (toString (int $v.model.blockSize)) -}}
{{- with $v.model.servedModelName }}{{ $args = concat $args (list "--served-model-name" .) }}{{ end -}}
{{- with $v.model.revision }}{{ $args = concat $args (list "--revision" .) }}{{ end -}}
{{- with $v.model.dtype }}{{ $args = concat $args (list "--dtype" .) }}{{ end -}}
{{- with $v.model.quantization }}{{ $args = concat $args (list "--quantization" . "--quantization-group-size" (toString (int $v.model.quantizationGroupSize))) }}{{ if $v.model.quantizeLmHead }}{{ $args = append $args "--quantize-lm-head" }}{{ end }}{{ end -}}
{{- $args = concat $args (list "--host" "0.0.0.0" "--port" (toString (int .values.port))) -}}
{{- if ne .component "router" }}
{{- $args = concat $args (list "--advertise-address" (printf "$(POD_IP):%d" (int .values.port)) "--worker-id" "$(POD_NAME)") -}}
{{- end }}
{{- $args = concat $args (list "--redis-url" (include "pagedserve.redisUrl" .root)) -}}
{{- $args = concat $args (list "--drain-timeout" (toString (int .values.drainTimeoutSeconds)) "--max-message-bytes" .values.maxMessageBytes) -}}
{{- if $v.tracing.enabled }}
{{- $args = concat $args (list "--otlp-traces-endpoint" (required "tracing.otlpEndpoint is required with tracing.enabled" $v.tracing.otlpEndpoint)) -}}
{{- if $v.tracing.includeText }}{{ $args = append $args "--trace-include-text" }}{{ end -}}
{{- end }}
{{- if $v.metrics.enabled }}
{{- $args = concat $args (list "--metrics-port" (toString (int $v.metrics.port))) -}}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/* Flags prefill and decode share: the engine. */}}
{{- define "pagedserve.engineArgs" -}}
{{- $v := .root.Values -}}
{{- /* NOTE: the default tag (appVersion) is the CPU build, which cannot run --device cuda */}}
{{- if and $v.gpu.enabled (not $v.image.tag) (not $v.image.digest) }}
{{- fail "gpu.enabled runs the workers with --device cuda, which needs a CUDA build of the image: set image.tag (e.g. 0.1.0-cu128, see values-gpu.yaml) or image.digest" }}
{{- end }}
{{- $args := list "--device" (ternary "cuda" "cpu" $v.gpu.enabled) -}}
{{- $args = concat $args (list "--max-num-batched-tokens" (toString (int .values.maxNumBatchedTokens)) "--max-num-seqs" (toString (int .values.maxNumSeqs))) -}}
{{- if kindIs "invalid" .values.kvCacheMemoryFraction }}
{{- $args = concat $args (list "--kv-cache-memory" .values.kvCacheMemory) -}}
{{- else }}
{{- $args = concat $args (list "--kv-cache-memory-fraction" (toString .values.kvCacheMemoryFraction)) -}}
{{- end }}
{{- with $v.model.maxModelLen }}{{ $args = concat $args (list "--max-model-len" (toString (int .))) }}{{ end -}}
{{- with $v.model.kvCacheDtype }}{{ $args = concat $args (list "--kv-cache-dtype" .) }}{{ end -}}
{{- $tp := int (default 1 .values.tensorParallelSize) -}}
{{- if gt $tp 1 }}{{ $args = concat $args (list "--tensor-parallel-size" (toString $tp)) }}{{ end -}}
{{- with .values.numGpuBlocksOverride }}{{ $args = concat $args (list "--num-gpu-blocks-override" (toString (int .))) }}{{ end -}}
{{- $args = append $args (ternary "--enable-prefix-caching" "--no-enable-prefix-caching" .values.enablePrefixCaching) -}}
{{- $args = concat $args (list "--eviction-policy" .values.evictionPolicy) -}}
{{- toYaml $args }}
{{- end }}

{{/*
A role's Deployment. Call with (dict "root" $ "component" "prefill" "values" .Values.prefill
"args" <list: subcommand and its role-only flags> "service" "pagedserve.internal.v1.PrefillWorker"
"worker" true).
*/}}
{{- define "pagedserve.deployment" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $ctx := dict "root" $root "component" .component "values" $v -}}
{{- $isWorker := .worker -}}
{{- $gpu := and $isWorker $root.Values.gpu.enabled -}}
{{- $args := concat .args (include "pagedserve.commonArgs" $ctx | fromYamlArray) -}}
{{- if $isWorker }}
{{- $args = concat $args (include "pagedserve.engineArgs" $ctx | fromYamlArray) -}}
{{- end }}
{{- $args = concat $args (include "pagedserve.tlsArgs" $ctx | fromYamlArray) -}}
{{- if $root.Values.tls.enabled }}
{{- /* NOTE: the probes' plaintext port (Health only); in no Service, open to no pod */}}
{{- $args = concat $args (list "--health-port" (toString (int $root.Values.tls.healthPort))) -}}
{{- end }}
{{- $args = concat $args (default list .extraArgs) $v.extraArgs -}}
{{- $tls := $root.Values.tls.enabled -}}
{{- $probe := dict "root" $root "component" .component "port" $v.port -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pagedserve.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pagedserve.labels" $ctx | nindent 4 }}
  {{- if and (not $root.Values.redis.enabled) $root.Values.redis.urlSecret.name }}
  annotations:
    # NOTE: the URL must reach --redis-url, and only env vars expand in args: see helm/README.md.
    checkov.io/skip1: CKV_K8S_35=the Redis URL Secret reaches --redis-url through an env var
  {{- end }}
spec:
  {{- if not (or $v.autoscaling.enabled (include "pagedserve.kedaEnabled" $v)) }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with $v.updateStrategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pagedserve.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pagedserve.labels" $ctx | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with (merge (dict) (default (dict) .annotations) $v.podAnnotations) }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "pagedserve.serviceAccountName" $root }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ include "pagedserve.gracePeriod" $ctx }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- if and $gpu $root.Values.gpu.runtimeClassName }}
      runtimeClassName: {{ $root.Values.gpu.runtimeClassName }}
      {{- end }}
      {{- $nodeSelector := merge (deepCopy $v.nodeSelector) (ternary $root.Values.gpu.nodeSelector dict $gpu) }}
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $tolerations := concat $v.tolerations (ternary $root.Values.gpu.tolerations list $gpu) }}
      {{- with $tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- include "pagedserve.topologySpread" $ctx | nindent 8 }}
      {{- end }}
      {{- if eq $root.Values.model.source "download" }}
      initContainers:
        {{- include "pagedserve.modelDownloadContainer" (dict "root" $root "tokenizerOnly" (eq .component "router")) | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "pagedserve.roleImage" $ctx }}
          imagePullPolicy: {{ include "pagedserve.rolePullPolicy" $ctx }}
          args:
            {{- range $args }}
            - {{ . | quote }}
            {{- end }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            {{- if ne .component "router" }}
            {{- /* torch threads = the CPU request (whole CPUs, rounded up), not the node's cores */}}
            - name: OMP_NUM_THREADS
              valueFrom:
                resourceFieldRef:
                  resource: requests.cpu
                  divisor: "1"
            {{- end }}
            {{- if and (not $root.Values.redis.enabled) $root.Values.redis.urlSecret.name }}
            - name: PAGEDSERVE_REDIS_URL
              valueFrom:
                secretKeyRef:
                  name: {{ $root.Values.redis.urlSecret.name }}
                  key: {{ $root.Values.redis.urlSecret.key }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            {{- if $root.Values.metrics.enabled }}
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
            {{- end }}
            {{- if $tls }}
            - name: health
              containerPort: {{ $root.Values.tls.healthPort }}
              protocol: TCP
            {{- end }}
          startupProbe:
            {{- include "pagedserve.grpcProbe" (merge (dict "service" "" "timing" $v.probes.startup) $probe) | nindent 12 }}
          readinessProbe:
            {{- include "pagedserve.grpcProbe" (merge (dict "service" .service "timing" $v.probes.readiness) $probe) | nindent 12 }}
          livenessProbe:
            {{- include "pagedserve.grpcProbe" (merge (dict "service" "" "timing" $v.probes.liveness) $probe) | nindent 12 }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ $root.Values.preStopSleepSeconds }}
          resources:
            {{- $resources := deepCopy $v.resources }}
            {{- if $gpu }}
            {{- /* NOTE: one GPU per tensor-parallel rank */}}
            {{- $tp := int (default 1 $v.tensorParallelSize) }}
            {{- $gpuCount := dict $root.Values.gpu.resourceName (ternary $tp (int $root.Values.gpu.count) (gt $tp 1)) }}
            {{- $_ := set $resources "limits" (merge (default (dict) $resources.limits) $gpuCount) }}
            {{- $_ := set $resources "requests" (merge (default (dict) $resources.requests) $gpuCount) }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- include "pagedserve.modelMount" $root | nindent 12 }}
            {{- if $isWorker }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            {{- if $tls }}
            - name: tls
              mountPath: {{ $root.Values.tls.mountPath }}
              readOnly: true
            {{- end }}
            {{- with .extraMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $root.Values.tmpSizeLimit }}
        {{- include "pagedserve.modelVolume" $root | nindent 8 }}
        {{- if $isWorker }}
        # NOTE: memory-backed /dev/shm: the container runtime's default is 64 MiB, too small for
        # PyTorch's shared memory and for the KV pool when the shm transport is on.
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSizeLimit }}
        {{- end }}
        {{- if $tls }}
        {{- include "pagedserve.tlsVolume" (dict "root" $root "paths" $args) | nindent 8 }}
        {{- end }}
        {{- with include "pagedserve.modelDownloadVolumes" $root }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with .extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}

{{/* A role's gRPC Service: (dict "root" $ "component" "router" "values" .Values.router "headless" false) */}}
{{- define "pagedserve.service" -}}
{{- $root := .root -}}
{{- $v := .values -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "pagedserve.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pagedserve.labels" . | nindent 4 }}
  {{- with .annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if .headless }}
  # NOTE: the router finds workers in the Redis registry (each advertises its pod IP); this
  # headless Service gives them DNS names and a scrape target.
  clusterIP: None
  publishNotReadyAddresses: false
  {{- else }}
  type: {{ .type }}
  {{- end }}
  selector:
    {{- include "pagedserve.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ .port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if $root.Values.metrics.enabled }}
    - name: metrics
      port: {{ $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- end }}
{{- end }}
