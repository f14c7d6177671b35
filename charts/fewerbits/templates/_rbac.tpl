{{/*
The operator's RBAC rules, written once and used by both scopes. Every rule says why it exists and
cites the code that needs it (operator/fewerbits_operator/kube.py is the one module that talks to
the API server; kopf's own needs are in kopf/_core/reactor/observation.py). No wildcards; Secrets
are never listed or watched. tests/unit/test_chart.py checks both.
*/}}

{{/* Rules on namespaced resources: a Role per watched namespace, or the cluster-wide ClusterRole. */}}
{{- define "fewerbits.rbac.namespacedRules" -}}
# QuantizedModels: kopf lists and watches them (resume/create/update handlers) and the resync loop
# and the autoscaler list them (Kube.list_models, KubeIO.list_models); reconcile and the
# autoscaler read one by name (Kube.get_model, Kube.patch_serving_status); kopf patches its
# bookkeeping annotations under fewerbits.io/ onto the object (runner.py). No create, update or
# delete: the operator never writes a model's spec.
- apiGroups: ["fewerbits.io"]
  resources: ["quantizedmodels"]
  verbs: ["get", "list", "watch", "patch"]
# The status subresource: reconcile and the autoscaler merge-patch conditions, plan, artifacts and
# per-variant serving figures (Kube.patch_model_status, autoscaler Kube.patch_serving_status).
# Patch only: both read the object through the main resource.
- apiGroups: ["fewerbits.io"]
  resources: ["quantizedmodels/status"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion on the Jobs, Deployments and Services the operator
# creates need update on the owner's finalizers subresource where the OwnerReferencesPermission-
# Enforcement admission plugin is on (OpenShift). The operator never writes finalizers itself.
- apiGroups: ["fewerbits.io"]
  resources: ["quantizedmodels/finalizers"]
  verbs: ["update"]
# Secrets, get by name only: checks that a model's credentialsSecret exists and reads storage and
# source credentials for the operator's own look-ups (manifest.json, config.json) (Kube.secret_data).
# Never list or watch: the operator reads only Secrets a model names.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# Quantization Jobs: get (Kube.get_job), create one per artifact key (Kube.create), patch to add a
# second owner that shares the artifact (Kube.add_owner); list and watch for kopf's event handler on
# Jobs labelled app.kubernetes.io/managed-by=fewerbits (handlers.child_changed).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Pods, list only: a Job pod's termination message carries the Job's result (Kube.job_pods); the
# autoscaler lists each variant's ready pods to read vLLM's /metrics (KubeIO.list_pods).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
# vLLM Deployments, one per variant: list by model label (Kube.list_deployments and the
# autoscaler's KubeIO.list_deployments), create, update when the rendered spec changes
# (Kube.replace_deployment), delete a variant whose pool is gone (Kube.delete_deployment); watch
# for kopf's event handler. No get: nothing reads one Deployment by name.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "watch", "create", "update", "delete"]
# The scale subresource: the autoscaler changes replicas only through it (KubeIO.read_scale,
# KubeIO.patch_scale), never the Deployment's spec, so its writes cannot collide with the
# operator's.
- apiGroups: ["apps"]
  resources: ["deployments/scale"]
  verbs: ["get", "patch"]
# One Service per model: get, create, patch its selector and ports back when they drift
# (Kube.get_service, Kube.create, Kube.patch_service).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# Events on real transitions and scalings (Kube.post_event, KubeIO.post_event create core/v1
# Events; kopf's own posting is off). Create only: nothing here patches or aggregates Events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* Reads of cluster-scoped resources: needed in both scopes. */}}
{{- define "fewerbits.rbac.clusterRules" -}}
# QuantizationPolicies are cluster-scoped: a watched cache serves reconcile the one that applies
# (Kube.list_policies, kube.WatchCache) and re-reconciles every model when one changes.
- apiGroups: ["fewerbits.io"]
  resources: ["quantizationpolicies"]
  verbs: ["get", "list", "watch"]
# Their status subresource: each policy's Valid condition and its conflicts with other policies
# (runner._write_policy_status, Kube.patch_policy_status). Patch only, only where it changed.
- apiGroups: ["fewerbits.io"]
  resources: ["quantizationpolicies/status"]
  verbs: ["patch"]
# GPU inventory: a watched cache of Nodes gives the planner their GPU Feature Discovery labels and
# allocatable GPUs (Kube.list_nodes, kube.WatchCache); list and watch instead of a list per reconcile.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
{{- if eq .Values.rbac.scope "cluster" }}
# A model's namespace labels, matched against each policy's namespaceSelector
# (Kube.namespace_labels).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get"]
{{- else }}
# A model's namespace labels, matched against each policy's namespaceSelector
# (Kube.namespace_labels); list and watch because kopf, given a list of namespaces, lists and
# watches Namespace objects to serve exactly those (observation.namespace_observer).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end }}
# kopf watches CRDs so that a CRD installed or changed after the operator started is served
# without a restart (observation.resource_observer); without it kopf logs a warning and serves only
# what existed at start-up (which breaks CRDs applied later, e.g. crds.enabled=false with GitOps).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}
