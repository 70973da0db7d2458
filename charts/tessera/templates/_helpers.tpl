{{- define "tessera.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Cluster-scoped objects carry the release's namespace too: two releases of the same name in
two namespaces (one per team) must not fight over one ClusterRole or webhook configuration. */}}
{{- define "tessera.clusterScopedName" -}}
{{- printf "%s-%s" (include "tessera.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* A Service name is a DNS-1035 label (no dots, a letter first), stricter than a release name. */}}
{{- define "tessera.webhookServiceName" -}}
{{- $name := printf "%s-webhook" (include "tessera.fullname" .) | replace "." "-" -}}
{{- if regexMatch "^[^a-z]" $name -}}{{- $name = printf "svc-%s" $name -}}{{- end -}}
{{- $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tessera.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- define "tessera.labels" -}}
app.kubernetes.io/name: tessera-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: tessera-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tessera.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tessera.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- /* never the namespace's `default` account: every pod there would get the operator's rights */ -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The ValidatingWebhookConfiguration the operator keeps current (webhook.managed). */}}
{{- define "tessera.webhookConfigurationName" -}}
{{- include "tessera.clusterScopedName" . -}}.tessera.dev
{{- end -}}

{{- define "tessera.namespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- join "," .Values.watch.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* What the operator does: watch its resources, own pods and Services (adopting the pods an
orphaning delete left: patch), each cluster's group Secret and NetworkPolicies, report status
and Events, and set replicas through the scale subresource when a cluster autoscales (as the
HPA would). */}}
{{- define "tessera.rules" -}}
- apiGroups: ["tessera.dev"]
  resources: ["inferenceclusters"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["tessera.dev"]
  resources: ["inferenceclusters/status", "inferenceclusters/scale"]
  verbs: ["patch"]
- apiGroups: ["tessera.dev"]
  resources: ["inferenceclusters/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "update", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
# Each cluster's Secret of group secrets (rank traffic): read, created, given new groups' keys.
# No list or watch: the operator reads its own Secret by name and caches no Secret.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
# spec.networkPolicy: the cluster's two NetworkPolicies.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "create", "update", "delete"]
# spec.router: each cluster's router Deployment, its ServiceAccount, and the Role (list and watch
# pods, rights the operator holds itself: no escalate or bind) with its RoleBinding. Read by name;
# Deployments are watched too (by the cluster label), so the client Service moves to a router
# as soon as it is Ready.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "update", "delete"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "update", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "update", "delete"]
# spec.router.inferencePool: the cluster's InferencePool (Gateway API inference extension).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "update", "delete"]
# spec.scheduling volcano: a PodGroup per replica group, made before its pods, deleted with
# them. Listed by the cluster label (to find a departed group's); never watched.
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "list", "create", "update", "delete"]
# spec.model.cache: the cluster's model-cache PersistentVolumeClaim (read by name; an orphan of
# the cluster's is adopted with a patch; no update: a claim's spec is immutable once made).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "patch", "delete"]
{{- end -}}

{{/* The Lease the operator's replicas elect their leader on (leaderElection). */}}
{{- define "tessera.leaseName" -}}
{{- include "tessera.fullname" . -}}
{{- end -}}
