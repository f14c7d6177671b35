-- Argo CD health check for fewerbits.io/QuantizedModel
-- (argocd-cm: resource.customizations.health.fewerbits.io_QuantizedModel; see docs/argocd/).
--
-- Reads only status conditions (metav1.Condition shape, each with observedGeneration) and the
-- per-variant replica counts; condition types and reasons are fewerbits_api.conditions (Reason).
-- Written for Lua 5.1 (Argo CD runs gopher-lua) with only the base, table and package libraries:
-- without resource.customizations.useOpenLibs Argo CD opens no string, math or os library and
-- strings have no methods (docs/gitops.md), so nothing here searches or cuts a string.
-- Order of the checks:
--   1. no status yet, or a status about an older generation      -> Progressing
--   2. a condition that needs a person (bad spec, no GPU fits,
--      Job failed, storage down, quality gate failed,
--      serving pods failing: corrupted artifact, wrong GPU,
--      a serving canary failed or never became ready)             -> Degraded
--   3. autoscaling to zero and every variant at 0 replicas         -> Suspended
--      waking from zero (replicas asked, none ready yet)           -> Progressing
--   4. a serving canary being judged (the old variant may serve)   -> Progressing
--   5. Ready=True, but this generation's artifact is still being
--      made or rolled out (the previous one serves meanwhile)      -> Progressing
--   6. Ready=True for the current generation                       -> Healthy
--   7. anything else (Job running, rolling out, ...)               -> Progressing

-- Conditions that are Degraded when False, with the reasons that mean "a person must act" ("*": all).
local DEGRADED = {
  { type = "Accepted", reasons = "*" },
  { type = "Planned", reasons = { NoPoolFits = true, NoGPUPools = true, ModelConfigUnavailable = true,
                                  PoolGone = true } },
  { type = "Quantized", reasons = { JobFailed = true, StorageUnavailable = true, JobOOMKilled = true,
                                    JobEvicted = true, JobOutOfDisk = true, JobDeadlineExceeded = true,
                                    JobExceedsPolicy = true, DatasetUnreadable = true,
                                    CalibrationDataUnavailable = true } },
  { type = "QualityGatePassed", reasons = { GateFailed = true } },
  { type = "ServingQualityPassed", reasons = { CanaryFailed = true, CanaryNotReady = true, CanaryError = true } },
  { type = "Deployed", reasons = { ServiceConflict = true, LeaderWorkerSetMissing = true,
                                   RoutingUnavailable = true, InferencePoolConflict = true,
                                   HTTPRouteConflict = true } },
  { type = "Ready", reasons = { PodsFailing = true } },
  { type = "AdaptersServed", reasons = { AdapterInvalid = true, AdaptersNotPlanned = true } },
}
local ORDER = { "Accepted", "Planned", "Quantized", "QualityGatePassed", "ServingQualityPassed", "Deployed", "Ready" }

local function find(conditions, type)
  if conditions == nil then
    return nil
  end
  for _, c in ipairs(conditions) do
    if c.type == type then
      return c
    end
  end
  return nil
end

local function describe(c)
  local text = c.message
  if text == nil or text == "" then
    text = c.reason or ""
  end
  return c.type .. "=" .. tostring(c.status) .. " (" .. tostring(c.reason) .. "): " .. text
end

hs = {}
local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
local status = obj.status

-- 1. The operator has not written a status, or not for this generation of the spec.
if status == nil or status.conditions == nil or #status.conditions == 0 then
  hs.status = "Progressing"
  hs.message = "Waiting for the fewerbits operator to report status"
  return hs
end
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the fewerbits operator to observe generation " .. tostring(generation)
  if status.observedGeneration ~= nil then
    hs.message = hs.message .. " (status describes generation " .. tostring(status.observedGeneration) .. ")"
  end
  return hs
end

-- A condition computed from an older spec says nothing about this one.
local function current(c)
  return c.observedGeneration == nil or generation == nil or c.observedGeneration >= generation
end

-- 2. Failures that need a person.
for _, rule in ipairs(DEGRADED) do
  local c = find(status.conditions, rule.type)
  if c ~= nil and c.status == "False" and current(c) and (rule.reasons == "*" or rule.reasons[c.reason]) then
    hs.status = "Degraded"
    hs.message = describe(c)
    return hs
  end
end

-- 3. Scaled to zero on purpose. Autoscaling is on unless the spec turns it off (the operator's
-- default); minReplicas 0 must be in the spec itself (a policy default is not visible here).
local spec = obj.spec or {}
local autoscaling = spec.autoscaling
if autoscaling ~= nil and autoscaling.enabled ~= false and autoscaling.minReplicas == 0
    and status.serving ~= nil and #status.serving > 0 then
  local all_zero = true
  for _, v in ipairs(status.serving) do
    if (v.replicas or 0) ~= 0 then
      all_zero = false
    end
  end
  if all_zero then
    hs.status = "Suspended"
    hs.message = "Scaled to zero: every variant has 0 replicas (autoscaling.minReplicas is 0)"
    return hs
  end
  -- Waking: a request at zero replicas asked for one (the activator); none is ready yet.
  local none_ready = true
  for _, v in ipairs(status.serving) do
    if (v.readyReplicas or 0) > 0 then
      none_ready = false
    end
  end
  if none_ready then
    hs.status = "Progressing"
    hs.message = "Scaling from zero: waiting for a replica to become ready"
    return hs
  end
end

-- 4. A new variant's canary is being judged (docs/canary.md): not healthy yet, whatever serves meanwhile.
local canary = find(status.conditions, "ServingQualityPassed")
if canary ~= nil and canary.status == "False" and current(canary)
    and (canary.reason == "CanaryPending" or canary.reason == "CanaryEvaluating") then
  hs.status = "Progressing"
  hs.message = describe(canary)
  return hs
end

-- The first step of ORDER before Ready not done yet for this generation, skipping the "Blocked"
-- echoes of an earlier step (or the first such echo when there is nothing else); nil when all are done.
local function pending()
  local blocked = nil
  for _, type in ipairs(ORDER) do
    local c = find(status.conditions, type)
    if type ~= "Ready" and c ~= nil and c.status ~= "True" then
      if c.reason ~= "Blocked" then
        return c
      end
      if blocked == nil then
        blocked = c
      end
    end
  end
  return blocked
end

-- 5. Serving what an earlier spec asked for while this one's artifact is made or rolled out
-- (Ready=True: the previous artifact keeps serving): not done yet, as a Deployment mid-rollout.
local ready = find(status.conditions, "Ready")
local step = pending()
if ready ~= nil and ready.status == "True" and current(ready) and step ~= nil then
  hs.status = "Progressing"
  hs.message = describe(step) .. "; the previous rollout keeps serving"
  return hs
end

-- 6. Serving, for the spec as it is now, with the endpoint in the message. The operator's
-- AllVariantsReady message names status.endpoint already ("N variant(s) serving at URL",
-- fewerbits_operator.core.serving_steps.ready_condition); other Ready=True messages get it appended.
if ready ~= nil and ready.status == "True" and current(ready) then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  if status.endpoint ~= nil and ready.reason ~= "AllVariantsReady" then
    hs.message = hs.message .. " (" .. status.endpoint .. ")"
  end
  -- The base serves whatever its LoRA adapters' state (docs/adapters.md); say where they stand.
  local adapters = find(status.conditions, "AdaptersServed")
  if adapters ~= nil and current(adapters) then
    hs.message = hs.message .. "; " .. describe(adapters)
  end
  return hs
end

-- 7. On its way: report the first step not done yet, skipping the "Blocked" echoes of an earlier step.
hs.status = "Progressing"
hs.message = "Waiting for Ready"
if step ~= nil and step.reason ~= "Blocked" then
  hs.message = describe(step)
elseif ready ~= nil and ready.status ~= "True" and ready.reason ~= "Blocked" then
  hs.message = describe(ready)
elseif step ~= nil then
  hs.message = describe(step)
elseif ready ~= nil and ready.status ~= "True" then
  hs.message = describe(ready)
end
return hs
