{{/* Names and labels. */}}
{{- define "rr.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rr.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rr.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rr.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rr.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rr.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: stage
{{- end -}}

{{- define "rr.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rr.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The container image: the CUDA build with gpu.enabled (the CPU image has no CUDA torch). */}}
{{- define "rr.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.gpu.enabled -}}
{{- $gpu := .Values.gpu.image | default dict -}}
{{- $cudaTag := printf "%s-cuda" (trimSuffix "-cuda" $tag) -}}
{{- printf "%s:%s" (default .Values.image.repository $gpu.repository) (default $cudaTag $gpu.tag) -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* A config value with the stage's default when the key is absent (0 is a value). */}}
{{- define "rr.configMs" -}}
{{- $cfg := index . 0 -}}{{- $key := index . 1 -}}{{- $default := index . 2 -}}
{{- if hasKey $cfg $key -}}{{- index $cfg $key | int64 -}}{{- else -}}{{- $default -}}{{- end -}}
{{- end -}}

{{/*
terminationGracePeriodSeconds: on SIGTERM the stage waits up to revoke_budget_ms for in-flight
groups, then commits one transaction bounded by transaction_timeout_ms, then leaves the group.
*/}}
{{- define "rr.terminationGrace" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- $revoke := include "rr.configMs" (list .Values.config "revoke_budget_ms" 10000) | int64 -}}
{{- $txn := include "rr.configMs" (list .Values.config "transaction_timeout_ms" 120000) | int64 -}}
{{- add (div (add $revoke $txn 999) 1000) .Values.terminationGraceExtraSeconds -}}
{{- else -}}
{{- .Values.terminationGracePeriodSeconds | int64 -}}
{{- end -}}
{{- end -}}

{{- define "rr.kedaMaxReplicas" -}}
{{- if kindIs "invalid" .Values.keda.maxReplicaCount -}}
{{- .Values.partitions | int64 -}}
{{- else -}}
{{- .Values.keda.maxReplicaCount | int64 -}}
{{- end -}}
{{- end -}}

{{/* The security.protocol the SASL/TLS settings imply ("" when neither is enabled). */}}
{{- define "rr.securityProtocol" -}}
{{- if and .Values.kafka.sasl.enabled .Values.kafka.tls.enabled -}}SASL_SSL
{{- else if .Values.kafka.sasl.enabled -}}SASL_PLAINTEXT
{{- else if .Values.kafka.tls.enabled -}}SSL
{{- end -}}
{{- end -}}

{{/* Cross-value rules the schema cannot express. */}}
{{- define "rr.validate" -}}
{{- $partitions := .Values.partitions | int64 -}}
{{- if and (not .Values.keda.enabled) (gt (.Values.replicaCount | int64) $partitions) -}}
{{- fail (printf "replicaCount (%d) must not exceed partitions (%d): extra members hold no partitions" (.Values.replicaCount | int64) $partitions) -}}
{{- end -}}
{{- if .Values.keda.enabled -}}
{{- $max := include "rr.kedaMaxReplicas" . | int64 -}}
{{- if gt $max $partitions -}}
{{- fail (printf "keda.maxReplicaCount (%d) must not exceed partitions (%d)" $max $partitions) -}}
{{- end -}}
{{- if gt (.Values.keda.minReplicaCount | int64) $max -}}
{{- fail (printf "keda.minReplicaCount (%d) must not exceed keda.maxReplicaCount (%d)" (.Values.keda.minReplicaCount | int64) $max) -}}
{{- end -}}
{{- end -}}
{{- if .Values.staticMembership.enabled -}}
{{- $session := .Values.staticMembership.sessionTimeoutMs | int64 -}}
{{- $poll := include "rr.configMs" (list .Values.config "max_poll_interval_ms" 600000) | int64 -}}
{{- if gt $session $poll -}}
{{- fail (printf "staticMembership.sessionTimeoutMs (%d) must not exceed config.max_poll_interval_ms (%d): librdkafka refuses the consumer" $session $poll) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.kafka.sasl.enabled (not .Values.kafka.sasl.existingSecret) -}}
{{- fail "kafka.sasl.enabled needs kafka.sasl.existingSecret (a Secret holding the SASL username and password)" -}}
{{- end -}}
{{- if and .Values.kafka.tls.enabled (not .Values.kafka.tls.existingSecret) -}}
{{- fail "kafka.tls.enabled needs kafka.tls.existingSecret (a Secret holding the CA certificate)" -}}
{{- end -}}
{{- if and .Values.schemaRegistry.basicAuth.enabled (not .Values.schemaRegistry.basicAuth.existingSecret) -}}
{{- fail "schemaRegistry.basicAuth.enabled needs schemaRegistry.basicAuth.existingSecret (a Secret holding the registry username and password)" -}}
{{- end -}}
{{- if and .Values.schemaRegistry.tls.enabled (not .Values.schemaRegistry.tls.existingSecret) -}}
{{- fail "schemaRegistry.tls.enabled needs schemaRegistry.tls.existingSecret (a Secret holding the registry's CA certificate)" -}}
{{- end -}}
{{- if and .Values.schemaRegistry.tls.keyKey (not .Values.schemaRegistry.tls.certKey) -}}
{{- fail "schemaRegistry.tls.keyKey needs schemaRegistry.tls.certKey (the client certificate the key belongs to)" -}}
{{- end -}}
{{- end -}}
