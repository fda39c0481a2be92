{{/* The model volume ------------------------------------------------------------------------ */}}

{{/* The model volume (mounted read-only by every server). */}}
{{- define "pagedserve.modelVolume" -}}
{{- $m := .Values.model -}}
- name: model
{{- if eq $m.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "image" }}
  image:
    reference: {{ required "model.image.reference is required with model.source=image" $m.image.reference }}
    pullPolicy: {{ $m.image.pullPolicy }}
{{- else if eq $m.source "download" }}
  # NOTE: writable for the init container; the server's mount is read-only
  persistentVolumeClaim:
    claimName: {{ include "pagedserve.modelCacheClaim" . }}
{{- end }}
{{- end }}

{{- define "pagedserve.modelMount" -}}
{{- $m := .Values.model -}}
{{- $subPath := $m.subPath -}}
{{- if eq $m.source "download" }}
{{- $subPath = trimSuffix "/" (printf "%s/%s" (include "pagedserve.modelDownloadDir" .) $m.subPath) -}}
{{- end -}}
- name: model
  mountPath: {{ $m.mountPath }}
  readOnly: true
{{- with $subPath }}
  subPath: {{ . }}
{{- end }}
{{- end }}

{{/* model.source=download ------------------------------------------------------------------- */}}

{{- define "pagedserve.modelCacheClaim" -}}
{{- default (include "pagedserve.componentName" (dict "root" . "component" "model-cache")) .Values.model.download.cache.existingClaim }}
{{- end }}

{{/* The model's directory in the cache volume. */}}
{{- define "pagedserve.modelDownloadDir" -}}
{{- $d := .Values.model.download -}}
{{- if $d.dir }}
{{- trimAll "/" $d.dir }}
{{- else if eq $d.method "huggingface" }}
{{- $repo := required "model.download.repo is required with model.download.method=huggingface" $d.repo }}
{{- printf "hf/%s/%s" (replace "/" "--" $repo) $d.hfRevision }}
{{- else }}
{{- printf "fetch-model/%s-%s" (base $d.fetchModel.source) $d.fetchModel.dtype }}
{{- end }}
{{- end }}

{{/*
The init container that fills the cache volume (mounted at /cache): `hf download` or
`pagedserve fetch-model`. Both skip what is already there, so only the first pod pays. Call with
(dict "root" $ "tokenizerOnly" <bool>): a router's `hf download` fetches only the tokenizer,
configs and chat template.
*/}}
{{- define "pagedserve.modelDownloadContainer" -}}
{{- $root := .root -}}
{{- $d := $root.Values.model.download -}}
{{- $out := printf "/cache/%s" (include "pagedserve.modelDownloadDir" $root) -}}
{{- $hf := eq $d.method "huggingface" -}}
{{- /* NOTE: a router's `hf download` runs on its own (slim) image; fetch-model needs torch */}}
{{- $role := dict "root" $root "component" (ternary "router" "prefill" (and $hf .tokenizerOnly)) -}}
- name: model-download
  image: {{ include "pagedserve.roleImage" $role }}
  imagePullPolicy: {{ include "pagedserve.rolePullPolicy" $role }}
  {{- if $hf }}
  {{- $args := list "download" $d.repo "--revision" $d.hfRevision "--local-dir" $out }}
  {{- /* NOTE: a router needs the tokenizer, config and chat template, never the weights */}}
  {{- $patterns := ternary (list "*.json" "*.jinja" "*.txt" "*.model" "tokenizer*") $d.include .tokenizerOnly }}
  {{- range $patterns }}{{ $args = concat $args (list "--include" .) }}{{ end }}
  command: ["hf"]
  args:
    {{- range $args }}
    - {{ . | quote }}
    {{- end }}
  {{- else }}
  args:
    {{- range (list "fetch-model" $d.fetchModel.source "--out" $out "--dtype" $d.fetchModel.dtype) }}
    - {{ . | quote }}
    {{- end }}
  {{- end }}
  env:
    {{- if $hf }}
    # NOTE: the image is offline (HF_HUB_OFFLINE=1) for the servers; only this container downloads
    - name: HF_HUB_OFFLINE
      value: "0"
    - name: TRANSFORMERS_OFFLINE
      value: "0"
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- if $d.hfTokenSecret.name }}
    - name: HF_TOKEN_PATH
      value: /etc/pagedserve/hf-token/token
    {{- end }}
    {{- with $d.hfEndpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- end }}
    - name: PYTHONUNBUFFERED
      value: "1"
    {{- with $d.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml $d.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: model
      mountPath: /cache
    {{- if and $hf $d.hfTokenSecret.name }}
    - name: hf-token
      mountPath: /etc/pagedserve/hf-token
      readOnly: true
    {{- end }}
{{- end }}

{{/* The pod volumes only the download needs (the Hugging Face token). */}}
{{- define "pagedserve.modelDownloadVolumes" -}}
{{- $d := .Values.model.download -}}
{{- if and (eq .Values.model.source "download") (eq $d.method "huggingface") $d.hfTokenSecret.name }}
- name: hf-token
  secret:
    secretName: {{ $d.hfTokenSecret.name }}
    defaultMode: 288 # 0440: owner root, group fsGroup
    items:
      - key: {{ $d.hfTokenSecret.key }}
        path: token
{{- end }}
{{- end }}
