-- Argo CD health check for leaderworkerset.x-k8s.io/LeaderWorkerSet, as fewerbits runs them for
-- variants whose replica spans nodes (argocd-cm:
-- resource.customizations.health.leaderworkerset.x-k8s.io_LeaderWorkerSet; see docs/argocd/).
--
-- Reads spec.replicas (groups), status.{replicas,readyReplicas,updatedReplicas} and the
-- Available / Progressing / UpdateInProgress conditions LeaderWorkerSet v0.7 writes. Lua 5.1.
--   1. no status yet                                                   -> Progressing
--   2. groups exist, none ready, and the controller no longer reports
--      progress (Available=False, Progressing=False): failed groups     -> Degraded
--   3. every group ready and updated, Available=True                    -> Healthy
--   4. 0 groups wanted                                                  -> Suspended
--   5. anything else (groups starting, rolling update)                  -> Progressing

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

hs = {}
local spec = obj.spec or {}
local wanted = spec.replicas
if wanted == nil then
  wanted = 1
end
local status = obj.status
if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the LeaderWorkerSet controller"
  return hs
end
local ready = status.readyReplicas or 0
local updated = status.updatedReplicas or 0
local groups = status.replicas or 0
local available = find(status.conditions, "Available")
local progressing = find(status.conditions, "Progressing")
local counts = tostring(ready) .. "/" .. tostring(wanted) .. " groups ready, " .. tostring(updated) .. " updated"

if wanted > 0 and groups > 0 and ready == 0 and available ~= nil and available.status == "False"
    and (progressing == nil or progressing.status == "False") then
  hs.status = "Degraded"
  hs.message = "No group is ready and none is progressing (" .. counts .. ")"
  if available.message ~= nil and available.message ~= "" then
    hs.message = hs.message .. ": " .. available.message
  end
  return hs
end
if wanted == 0 then
  hs.status = "Suspended"
  hs.message = "Scaled to 0 groups"
  return hs
end
if ready >= wanted and updated >= wanted and groups == wanted and available ~= nil and available.status == "True" then
  hs.status = "Healthy"
  hs.message = counts
  return hs
end
hs.status = "Progressing"
hs.message = counts
if progressing ~= nil and progressing.message ~= nil and progressing.message ~= "" then
  hs.message = hs.message .. ": " .. progressing.message
end
return hs
