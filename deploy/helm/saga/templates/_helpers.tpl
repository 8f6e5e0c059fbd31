{{/* Names, labels and the pieces every saga container shares. */}}

{{- define "saga.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "saga.fullname" -}}
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

{{- define "saga.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; the component's are added by the caller. */}}
{{- define "saga.labels" -}}
helm.sh/chart: {{ include "saga.chart" . }}
{{ include "saga.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: {{ .Values.serviceMonitor.jobName | default "saga" }}
{{- end -}}

{{- define "saga.selectorLabels" -}}
app.kubernetes.io/name: {{ include "saga.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "saga.image" -}}
{{- $image := .image | default dict -}}
{{- $repo := $image.repository | default .root.Values.image.repository -}}
{{- $tag := $image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- printf "%s:%s" $repo (toString $tag) -}}
{{- end -}}

{{- define "saga.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "saga.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Secret names: an existing Secret wins over the one the chart makes. */}}
{{- define "saga.kafkaSecretName" -}}
{{- .Values.kafka.sasl.existingSecret | default (printf "%s-kafka" (include "saga.fullname" .)) -}}
{{- end -}}

{{- define "saga.publicKeysSecretName" -}}
{{- .Values.signing.existingPublicSecret | default (printf "%s-public-keys" (include "saga.fullname" .)) -}}
{{- end -}}

{{- define "saga.privateKeysSecretName" -}}
{{- .Values.signing.existingPrivateSecret | default (printf "%s-private-keys" (include "saga.fullname" .)) -}}
{{- end -}}

{{/* dict root, p (a participant entry) */}}
{{- define "saga.participant.secretName" -}}
{{- $url := .p.storageUrl | default dict -}}
{{- $url.existingSecret | default (printf "%s-storage-%s" (include "saga.fullname" .root) (.p.name | lower)) -}}
{{- end -}}

{{- define "saga.participant.secretKey" -}}
{{- $url := .p.storageUrl | default dict -}}
{{- $url.key | default "url" -}}
{{- end -}}

{{- define "saga.participant.fullname" -}}
{{- printf "%s-participant-%s" (include "saga.fullname" .root) (.p.name | lower | replace "_" "-" | replace "." "-") | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "saga.console.dbSecretName" -}}
{{- .Values.console.db.existingSecret | default (printf "%s-console-db" (include "saga.fullname" .)) -}}
{{- end -}}

{{/*
The environment every saga process shares: Kafka address, prefix, log format, connect
timeout, librdkafka settings and, when asked, the SASL login from a Secret.
dict: root, kafkaSecret (a component's own Secret, may be empty), sasl (bool: add the login)
*/}}
{{- define "saga.env.kafka" -}}
{{- $root := .root -}}
{{- $kafka := $root.Values.kafka -}}
- name: SAGA_KAFKA_BOOTSTRAP
  value: {{ $kafka.bootstrap | quote }}
- name: SAGA_TOPIC_PREFIX
  value: {{ $kafka.topicPrefix | quote }}
- name: SAGA_CONNECT_TIMEOUT
  value: {{ $kafka.connectTimeout | quote }}
- name: SAGA_LOG_FORMAT
  value: {{ $root.Values.logFormat | quote }}
{{- range $name, $value := $kafka.config }}
- name: {{ printf "SAGA_KAFKA_%s" ($name | upper | replace "." "_" | replace "-" "_") }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- if and $kafka.sasl.enabled .sasl }}
- name: SAGA_KAFKA_SECURITY_PROTOCOL
  value: {{ $kafka.sasl.securityProtocol | quote }}
- name: SAGA_KAFKA_SASL_MECHANISM
  value: {{ $kafka.sasl.mechanism | quote }}
- name: SAGA_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ .kafkaSecret | default (include "saga.kafkaSecretName" $root) }}
      key: {{ $kafka.sasl.usernameKey }}
- name: SAGA_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .kafkaSecret | default (include "saga.kafkaSecretName" $root) }}
      key: {{ $kafka.sasl.passwordKey }}
{{- end }}
{{- if $kafka.tls.caSecret.name }}
- name: SAGA_KAFKA_SSL_CA_LOCATION
  value: {{ printf "/etc/saga/kafka-ca/%s" $kafka.tls.caSecret.key | quote }}
{{- end }}
{{- end -}}

{{/* SAGA_KEYS_DIR when signing is on. */}}
{{- define "saga.env.keys" -}}
{{- if .Values.signing.enabled }}
- name: SAGA_KEYS_DIR
  value: /etc/saga/keys
{{- end }}
{{- end -}}

{{/* Volume mounts of the shared volumes (tmp, Kafka CA, keys). dict: root, keys (bool) */}}
{{- define "saga.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .root.Values.kafka.tls.caSecret.name }}
- name: kafka-ca
  mountPath: /etc/saga/kafka-ca
  readOnly: true
{{- end }}
{{- if and .root.Values.signing.enabled .keys }}
- name: keys
  mountPath: /etc/saga/keys
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The shared volumes. The key folder is one projected volume: every public key, and the
private key of this pod's principal only (none for a verifier).
dict: root, principal (e.g. coordinator; empty: public keys only), optionalPrivate (bool)
*/}}
{{- define "saga.volumes" -}}
{{- $root := .root -}}
- name: tmp
  emptyDir: {}
{{- if $root.Values.kafka.tls.caSecret.name }}
- name: kafka-ca
  secret:
    secretName: {{ $root.Values.kafka.tls.caSecret.name }}
    defaultMode: 0444
{{- end }}
{{- if and $root.Values.signing.enabled (hasKey . "principal") }}
- name: keys
  projected:
    defaultMode: 0440
    sources:
      - secret:
          name: {{ include "saga.publicKeysSecretName" $root }}
      {{- if .principal }}
      - secret:
          name: {{ include "saga.privateKeysSecretName" $root }}
          optional: {{ .optionalPrivate | default false }}
          items:
            - key: {{ printf "%s.key" .principal }}
              path: {{ printf "%s.key" .principal }}
      {{- end }}
{{- end }}
{{- end -}}

{{/* Checksum of the Secrets the chart makes: pods restart when one changes. */}}
{{- define "saga.secretsChecksum" -}}
checksum/secrets: {{ include (print .Template.BasePath "/secrets.yaml") . | sha256sum }}
{{- end -}}

{{/* Pod metadata annotations and labels shared by every pod. dict: root, component */}}
{{- define "saga.podLabels" -}}
{{ include "saga.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- with .root.Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* HTTP probes on the metrics port. dict: probe (values), path, port */}}
{{- define "saga.probe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
{{- with .headers }}
  httpHeaders:
    {{- toYaml . | nindent 4 }}
{{- end }}
periodSeconds: {{ .probe.periodSeconds | default 10 }}
timeoutSeconds: {{ .probe.timeoutSeconds | default 5 }}
failureThreshold: {{ .probe.failureThreshold | default 3 }}
{{- end -}}
