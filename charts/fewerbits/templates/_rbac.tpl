{{/*
The operator's RBAC rules, written once and used by both scopes. Every rule says why it exists and
cites the code that needs it (operator/fewerbits_operator/base/kube.py is the one module that talks to
the API server; its reads go through kopf indexes (indexes.py), and kopf (handlers.py) lists and watches). No
wildcards; Secrets are never listed or watched. tests/unit/test_chart.py checks both, and
e2e/tests/test_chart_install.py asks the API server for every grant.
*/}}

{{/* Rules on namespaced resources: a Role per watched namespace, or the cluster-wide ClusterRole. */}}
{{- define "fewerbits.rbac.namespacedRules" -}}
# QuantizedModels: a watched cache lists and watches them (kopf: handlers.py; its events and each
# list enqueue reconciles, runner.py), serving Kube.list_models and Kube.get_model; get reads one
# by name while the cache is behind the operator's own last write (Kube.get_model, also for the
# autoscaler's Kube.patch_serving_status). No create, update, patch or delete: the operator never
# writes a model's spec or metadata.
- apiGroups: ["fewerbits.io"]
  resources: ["quantizedmodels"]
  verbs: ["get", "list", "watch"]
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
# Quantization Jobs: list and watch those labelled app.kubernetes.io/managed-by=fewerbits (the
# watched cache behind Kube.get_job; their events enqueue the owning models, runner.py), get one
# while the cache is behind (Kube.get_job), create one per artifact key (Kube.create), patch to add
# a second owner that shares the artifact (Kube.add_owner), delete a serving canary's evaluation Job
# once its verdict is read (Kube.delete_job, canary.py).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Pods: a Job pod's termination message carries the Job's result (Kube.job_pods, a list); the
# models' pods (labelled fewerbits.io/model) are listed and watched by a cache (kopf: handlers.py
# INDEXED) from which the autoscaler, the metrics probe and the activator path read each variant's
# ready pods (Kube.list_pods) instead of a list per pass. Never written.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# vLLM Deployments, one per variant: list and watch those labelled
# app.kubernetes.io/managed-by=fewerbits (the watched cache behind Kube.list_deployments, which the
# autoscaler reads too; their events enqueue the owning models, runner.py), list by model label
# while the cache is behind, create, update when the rendered spec changes
# (Kube.replace_deployment), delete a variant whose pool is gone (Kube.delete_deployment). No get:
# nothing reads one Deployment by name.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "watch", "create", "update", "delete"]
# The scale subresource: the autoscaler changes replicas only through it (Kube.read_scale,
# Kube.patch_scale), never the Deployment's spec, so its writes cannot collide with the
# operator's. (The wake from zero is the activator's, under its own ServiceAccount.)
- apiGroups: ["apps"]
  resources: ["deployments/scale"]
  verbs: ["get", "patch"]
# Multi-node variants are LeaderWorkerSets (operator/fewerbits_operator/serving/lws.py): list and watch those
# labelled app.kubernetes.io/managed-by=fewerbits (the watched cache behind Kube.list_lws, started only
# where the API is served; their events enqueue the owning models), create, update when the rendered
# spec changes (Kube.replace_deployment), delete one whose variant no longer spans nodes
# (Kube.delete_lws). Harmless where LeaderWorkerSet is not installed.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["list", "watch", "create", "update", "delete"]
# Their scale subresource: the autoscaler sets a multi-node variant's groups through it only
# (Kube.read_lws_scale, Kube.patch_lws_scale).
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets/scale"]
  verbs: ["get", "patch"]
# One Service per model: get, create, patch its selector and ports back when they drift
# (Kube.get_service, Kube.create, Kube.patch_service); list and watch: a cache of the Services the
# operator labels as its own (kopf: handlers.py INDEXED, label-selected) serves the read each
# resync makes. A Service not in it is read by name.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch"]
# One InferencePool per model that sets spec.serving.routing: inferencePool (routing.py): get it by
# the model's name (Kube.get_inference_pool), create it, patch its spec back when it drifts
# (Kube.create_inference_pool, Kube.patch_inference_pool). Whether the CRD is served at all is a
# discovery GET every authenticated client may make (system:discovery).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch"]
# spec.serving.gateway (serving/gatewayroute.py): the model's HTTPRoute, read by name (observe, to
# report a missing CRD or a route it does not own; the activator-path loop, runtime/atzero.py),
# created, and replaced at the resourceVersion read when its backend switches (Service at zero,
# InferencePool once two pods are ready). No list, watch or delete: it is read by name, and goes
# with its model (owner reference).
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "create", "update"]
# The node cache's referenced-keys ConfigMap (operator/fewerbits_operator/core/nodecache.py), one per
# namespace with artifactCache: Node models: created under the picker's ConfigMap grant below
# (create cannot be limited to a name); replaced and deleted by that one name only
# (Kube.apply_configmap, Kube.delete_configmap). No list or watch of ConfigMaps.
- apiGroups: [""]
  resources: ["configmaps"]
  resourceNames: ["fewerbits-node-cache-references"]
  verbs: ["get", "update", "delete"]
# The endpoint picker of a model with spec.serving.routing: inferencePool (picker.py): its
# ServiceAccount (get by name, create), its RoleBinding and its ConfigMap (get by name, create, patch
# back when the rendered form changes: Kube.get_picker_object, Kube.create, Kube.patch_picker_object).
# Its Deployment and Service use the grants above.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create"]
# The picker's ConfigMap: its EndpointPickerConfig (scoring, or an even spread while pods lack metrics).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# The picker's RoleBinding to the ClusterRole below, for its ServiceAccount in the model's namespace.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["get", "create", "patch"]
# Binding a ClusterRole needs its permissions or `bind` on it: `bind` on the picker's ClusterRole
# only (resourceNames), so the operator can grant the picker what that role holds and nothing else
# (no escalate, no other role).
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["clusterroles"]
  verbs: ["bind"]
  resourceNames: [{{ printf "%s-epp" (include "fewerbits.fullname" .) | quote }}]
# Events on real transitions and scalings (Kube.post_event creates core/v1 Events, for reconcile
# and the autoscaler). Create only: nothing here patches or aggregates Events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# EndpointSlices labelled endpointslice.kubernetes.io/managed-by=activator.fewerbits.io: one per
# model that may reach zero, adding the activator's endpoints to the model's Service while it has at
# most one ready pod (atzero.py: Kube.list_endpoint_slices, create_endpoint_slice,
# replace_endpoint_slice, delete_endpoint_slice); list and watch: a cache of those (kopf:
# handlers.py INDEXED, label-selected) serves the reads. The EndpointSlice controller's own slices
# are never written.
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list", "watch", "create", "update", "delete"]
{{- end }}

{{/* Reads of cluster-scoped resources: needed in both scopes. */}}
{{- define "fewerbits.rbac.clusterRules" -}}
# QuantizationPolicies are cluster-scoped: a watched cache serves reconcile the one that applies
# (Kube.list_policies, a kopf index) and re-reconciles every model when one changes. No get:
# nothing reads one policy by name.
- apiGroups: ["fewerbits.io"]
  resources: ["quantizationpolicies"]
  verbs: ["list", "watch"]
# Their status subresource: each policy's Valid condition and its conflicts with other policies
# (runner._write_policy_status, Kube.patch_policy_status). Patch only, only where it changed.
- apiGroups: ["fewerbits.io"]
  resources: ["quantizationpolicies/status"]
  verbs: ["patch"]
# GPU inventory: a watched cache of Nodes gives the planner their GPU Feature Discovery labels and
# allocatable GPUs (Kube.list_nodes, a kopf index); list and watch instead of a list per reconcile.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
# A model's namespace labels, matched against each policy's namespaceSelector, read by name
# (Kube.namespace_labels). No list or watch: the operator is told its namespaces by name
# (FEWERBITS_NAMESPACES) and watches each on its own, or the whole cluster.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get"]
{{- end }}


{{/* The activator's rules (activator.py, its own ServiceAccount): a Role per watched namespace, or
a ClusterRole with rbac.scope=cluster. Least privilege: what one request needs, read from watches of
its own (activator_cache.py) so that a request at steady state makes no API call. */}}
{{- define "fewerbits.rbac.activatorRules" -}}
# QuantizedModels: the model a request names exists, whether autoscaling may wake it, and its plan's
# variant order (Activator.model). list and watch: the namespace's models cache; get: read through
# while the cache has not listed yet or its watch is broken (Kube.get_model).
- apiGroups: ["fewerbits.io"]
  resources: ["quantizedmodels"]
  verbs: ["get", "list", "watch"]
# Pods, list and watch by label (fewerbits.io/model, component=server): a ready serving pod to forward
# to (Activator.pods, ready_pod), and the change a held request waits on. Never a pod by name.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Deployments, list and watch by label (fewerbits.io/model): the variant to wake (Activator.wake,
# variant_to_wake). Never written: the wake goes through the scale subresource below.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "watch"]
# The wake: read the scale and replace it 0 -> 1 at the resourceVersion read, only from 0
# (Kube.wake_scale), so two replicas waking one model write once. No patch: never another count.
- apiGroups: ["apps"]
  resources: ["deployments/scale"]
  verbs: ["get", "update"]
# The ScaledFromZero Event on the model (Kube.post_event). Create only.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# HTTPRoutes, get by name only: a request naming a model by X-Fewerbits-Model is served only when its
# value is what the model's own route sets, token included (Activator.route_is_proof,
# Kube.get_http_route). No list or watch: the route the request names is read, at most once per
# model every few seconds.
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get"]
{{- end }}
