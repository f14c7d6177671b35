{{/* Name of the chart, overridable. */}}
{{- define "fewerbits.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, prefixed with the chart name unless it already contains it. */}}
{{- define "fewerbits.fullname" -}}
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

{{- define "fewerbits.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "fewerbits.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fewerbits.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "fewerbits.labels" -}}
helm.sh/chart: {{ include "fewerbits.chart" . }}
{{ include "fewerbits.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: fewerbits
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "fewerbits.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "fewerbits.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference from {repository, tag, digest}: by digest when one is given, else by tag
     (default: the chart's appVersion). Call with (dict "image" .Values.image "root" .). */}}
{{- define "fewerbits.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end }}

{{/* The namespaces the operator watches, as a JSON list: [] (cluster-wide) for rbac.scope=cluster,
     else watchNamespaces or the release namespace. */}}
{{- define "fewerbits.watchNamespaces" -}}
{{- if eq .Values.rbac.scope "cluster" -}}
[]
{{- else -}}
{{- default (list .Release.Namespace) .Values.watchNamespaces | uniq | toJson -}}
{{- end -}}
{{- end }}

{{/* The activator's selector labels: its own component, so neither the operator's Deployment,
     Service nor PodDisruptionBudget selects its pods (and the other way round). */}}
{{- define "fewerbits.activatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "fewerbits.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: activator
{{- end }}

{{- define "fewerbits.activatorLabels" -}}
helm.sh/chart: {{ include "fewerbits.chart" . }}
{{ include "fewerbits.activatorSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: fewerbits
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}
