{{/* TLS and API keys ----------------------------------------------------------------------- */}}

{{/* The Secret holding tls.crt, tls.key and ca.crt (existing, or written by cert-manager). */}}
{{- define "pagedserve.tlsSecretName" -}}
{{- $t := .Values.tls -}}
{{- if and $t.existingSecret $t.certManager.enabled }}
{{- fail "tls: set tls.existingSecret or tls.certManager.enabled, not both" }}
{{- else if $t.existingSecret }}
{{- $t.existingSecret }}
{{- else if $t.certManager.enabled }}
{{- include "pagedserve.componentName" (dict "root" . "component" "tls") }}
{{- else }}
{{- fail "tls.enabled needs tls.existingSecret or tls.certManager.enabled=true" }}
{{- end }}
{{- end }}

{{/* --tls-server-name: what the dialing roles check in the servers' certificate. */}}
{{- define "pagedserve.tlsServerName" -}}
{{- $router := include "pagedserve.componentName" (dict "root" . "component" "router") }}
{{- default (printf "%s.%s.svc" $router .Release.Namespace) .Values.tls.serverName }}
{{- end }}

{{/* A file of the mounted TLS Secret: (dict "root" $ "key" "tls.crt") */}}
{{- define "pagedserve.tlsFile" -}}
{{- printf "%s/%s" (trimSuffix "/" .root.Values.tls.mountPath) .key }}
{{- end }}

{{/* "true" when this role's server requires client certificates: (dict "root" $ "component" x) */}}
{{- define "pagedserve.tlsClientAuth" -}}
{{- $t := .root.Values.tls -}}
{{- if and $t.enabled $t.mtls (has .component (list "router" "prefill" "decode")) (or (ne .component "router") $t.routerClientAuth) }}true{{ end }}
{{- end }}

{{/*
The TLS flags of a role (a YAML list, empty without tls.enabled): (dict "root" $ "component" x).
Servers (router, prefill, decode) get their certificate; the roles that dial (router -> workers,
decode -> prefill, gateway -> router) get the CA, the server name and, under mTLS, a client
certificate; the gateway gets HTTPS with gateway.https.enabled.
*/}}
{{- define "pagedserve.tlsArgs" -}}
{{- $root := .root -}}
{{- $t := $root.Values.tls -}}
{{- $args := list -}}
{{- if and $t.routerClientAuth (not $t.mtls) }}
{{- fail "tls.routerClientAuth needs tls.mtls=true (the gateway must present a client certificate)" }}
{{- end }}
{{- if and (eq .component "gateway") $root.Values.gateway.https.enabled (not $t.enabled) }}
{{- fail "gateway.https.enabled needs tls.enabled=true (the certificate comes from the tls Secret)" }}
{{- end }}
{{- if $t.enabled }}
{{- $crt := include "pagedserve.tlsFile" (dict "root" $root "key" "tls.crt") -}}
{{- $key := include "pagedserve.tlsFile" (dict "root" $root "key" "tls.key") -}}
{{- $ca := include "pagedserve.tlsFile" (dict "root" $root "key" "ca.crt") -}}
{{- if has .component (list "router" "prefill" "decode") }}
{{- $args = concat $args (list "--tls-cert" $crt "--tls-key" $key) -}}
{{- if include "pagedserve.tlsClientAuth" . }}
{{- $args = concat $args (list "--tls-client-ca" $ca) -}}
{{- end }}
{{- end }}
{{- /* NOTE: prefill dials nobody (decode pulls KV from it), so it gets no client flags */}}
{{- if has .component (list "router" "decode" "gateway") }}
{{- $args = concat $args (list "--tls-ca" $ca "--tls-server-name" (include "pagedserve.tlsServerName" $root)) -}}
{{- if $t.mtls }}
{{- $args = concat $args (list "--tls-client-cert" $crt "--tls-client-key" $key) -}}
{{- end }}
{{- end }}
{{- if and (eq .component "gateway") $root.Values.gateway.https.enabled }}
{{- $args = concat $args (list "--https-cert" $crt "--https-key" $key) -}}
{{- end }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/*
A gRPC health probe: kubelet's native grpc probe, on the service port, or with tls.enabled on
the plaintext health-only port (`--health-port`: kubelet's grpc probes cannot speak TLS).
(dict "root" $ "component" x "port" P "service" S "timing" <values probe>)
*/}}
{{- define "pagedserve.grpcProbe" -}}
grpc:
  port: {{ ternary .root.Values.tls.healthPort .port .root.Values.tls.enabled }}
  service: {{ .service | quote }}
periodSeconds: {{ .timing.periodSeconds }}
failureThreshold: {{ .timing.failureThreshold }}
timeoutSeconds: 3
{{- end }}

{{/*
The TLS Secret volume with only the files a container names (its args):
(dict "root" $ "paths" <list of strings>). Empty when none.
*/}}
{{- define "pagedserve.tlsVolume" -}}
{{- $prefix := printf "%s/" (trimSuffix "/" .root.Values.tls.mountPath) -}}
{{- $keys := list -}}
{{- range .paths }}
{{- if hasPrefix $prefix . }}{{ $keys = append $keys (trimPrefix $prefix .) }}{{ end }}
{{- end }}
{{- if $keys }}
- name: tls
  secret:
    secretName: {{ include "pagedserve.tlsSecretName" .root }}
    defaultMode: 288 # 0440: owner root, group fsGroup
    items:
      {{- range $keys | uniq | sortAlpha }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}
{{- end }}

{{/* The Secret of the router's API keys; empty when there are none. */}}
{{- define "pagedserve.apiKeysSecretName" -}}
{{- $k := .Values.apiKeys -}}
{{- if and $k.existingSecret $k.create }}
{{- fail "apiKeys: set apiKeys.existingSecret or apiKeys.create, not both" }}
{{- else if $k.existingSecret }}
{{- $k.existingSecret }}
{{- else if $k.create }}
{{- if not $k.entries }}{{ fail "apiKeys.create needs at least one entry in apiKeys.entries" }}{{ end }}
{{- include "pagedserve.componentName" (dict "root" . "component" "api-keys") }}
{{- end }}
{{- end }}

{{/* The api-keys file: one tenant:key a line (router/auth.py). */}}
{{- define "pagedserve.apiKeysFile" -}}
{{- range .Values.apiKeys.entries }}
{{ .tenant }}:{{ .key }}
{{- end }}
{{- end }}
