-- prefixroute for HAProxy (2.6+, built with Lua): ask the sidecar where an OpenAI request goes.
--
-- Loaded by haproxy.cfg ("lua-load"). The action reads the buffered request body (option http-buffer-request),
-- POSTs it to the sidecar's pick endpoint (the same path: /v1/completions or /v1/chat/completions) and stores the
-- answer in two variables: txn.prefixroute_upstream (host:port of the engine, mapped to a backend by
-- prefixroute.map) and txn.prefixroute_id (the decision id, written by the log line that releases it). Any failure
-- (sidecar down, slow, or refusing the body) leaves them unset: the request goes to the plain balancer.

local sidecar = os.getenv("PREFIXROUTE_SIDECAR") or "127.0.0.1:8100"
local timeout_ms = tonumber(os.getenv("PREFIXROUTE_TIMEOUT_MS") or "200")

core.register_action("prefixroute_pick", { "http-req" }, function(txn)
    local body = txn.sf:req_body()
    if body == nil or body == "" then
        return
    end
    local ok, res = pcall(function()
        return core.httpclient():post({
            url = "http://" .. sidecar .. txn.sf:path(),
            headers = { ["content-type"] = { "application/json" } },
            body = body,
            timeout = timeout_ms,
        })
    end)
    if not ok or res == nil or res.status ~= 200 or res.headers == nil then
        return
    end
    local upstream = res.headers["x-prefixroute-upstream"]
    local id = res.headers["x-prefixroute-id"]
    if upstream == nil or id == nil then
        return
    end
    txn:set_var("txn.prefixroute_upstream", upstream[0])
    txn:set_var("txn.prefixroute_id", id[0])
end)
