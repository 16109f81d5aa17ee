{{- define "vcache.name" -}}{{ .Release.Name }}-vcache{{- end -}}
{{- define "vcache.vllm" -}}{{ .Release.Name }}-vllm{{- end -}}
{{- define "vcache.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}
{{/* The replicas as the gateway's remote_replicas: pod DNS names of the StatefulSet. */}}
{{- define "vcache.remoteReplicas" -}}
{{- $list := list -}}
{{- range $i := until (int .Values.vllm.replicas) -}}
{{- $host := printf "%s-%d.%s-headless" (include "vcache.vllm" $) $i (include "vcache.vllm" $) -}}
{{- $list = append $list (dict "url" (printf "http://%s:%d" $host (int $.Values.vllm.port)) "kv_events" (printf "tcp://%s:%d" $host (int $.Values.vllm.kvEventsPort)) "kv_events_replay" (printf "tcp://%s:%d" $host (int $.Values.vllm.kvReplayPort)) "served_model_name" $.Values.servedModelName) -}}
{{- end -}}
{{- toJson $list -}}
{{- end -}}
