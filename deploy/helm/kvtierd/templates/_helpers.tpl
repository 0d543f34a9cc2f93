{{/* The region's directory: hugetlbfs moves it to /dev/hugepages. */}}
{{- define "kvtierd.dir" -}}
{{- if .Values.hugepages.hugetlbfs -}}/dev/hugepages/kvtierd{{- else -}}{{ .Values.region.dir }}{{- end -}}
{{- end -}}

{{- define "kvtierd.socket" -}}
{{ include "kvtierd.dir" . }}/{{ .Values.region.name }}.sock
{{- end -}}

{{- define "kvtierd.labels" -}}
app.kubernetes.io/name: kvtierd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvtierd.selector" -}}
app.kubernetes.io/name: kvtierd
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvtierd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "kvtierd.probe" -}}
exec:
  command: ["kvtierctl", "--socket", {{ include "kvtierd.socket" . | quote }}, "--timeout", "3", "stats"]
{{- end -}}
