-- prefixroute for HAProxy (2.6+, built with Lua): ask the sidecar where an OpenAI request goes.
--
-- Loaded by haproxy.cfg ("lua-load"). The action reads the buffered request body (option http-buffer-request),
-- POSTs it to the sidecar's pick endpoint (the same path: /v1/completions or /v1/chat/completions) and stores the
-- answer in two variables: txn.prefixroute_upstream (host:port of the engine, mapped to a backend by
-- prefixroute.map) and txn.prefixroute_id (the decision id, written by the log line that releases it). Any failure
-- (sidecar down, slow, or refusing the body) leaves them unset: the request goes to the plain balancer.
--
-- It speaks HTTP/1.1 over a Lua socket rather than core.httpclient: HAProxy 2.6's httpclient retries a refused
-- connection three times, a second apart, whatever its timeout, so a sidecar that just went down would hold each
-- request 3 s. A socket fails at once on a refused connection and gives up after PREFIXROUTE_TIMEOUT_MS otherwise;
-- haproxy.cfg skips the call entirely while its health check sees the sidecar down.

local host, port = (os.getenv("PREFIXROUTE_SIDECAR") or "127.0.0.1:8100"):match("^(.*):(%d+)$")
local timeout_s = tonumber(os.getenv("PREFIXROUTE_TIMEOUT_MS") or "200") / 1000

-- The answer's status and the two headers the proxy needs (nil on any failure).
local function ask(path, body)
    local socket = core.tcp()
    socket:settimeout(timeout_s)
    if not socket:connect(host, tonumber(port)) then
        socket:close()
        return nil
    end
    local request = "POST " .. path .. " HTTP/1.1\r\nhost: prefixroute\r\ncontent-type: application/json\r\n"
        .. "content-length: " .. #body .. "\r\nconnection: close\r\n\r\n" .. body
    if not socket:send(request) then
        socket:close()
        return nil
    end
    local status_line = socket:receive("*l")
    if status_line == nil or not status_line:match("^HTTP/1%.%d 200 ") then
        socket:close()
        return nil
    end
    local upstream, id
    while true do
        local line = socket:receive("*l")
        if line == nil then
            socket:close()
            return nil
        end
        if line == "" or line == "\r" then
            break
        end
        local name, value = line:match("^([^:]+):%s*(.-)%s*$")
        if name ~= nil then
            name = name:lower()
            if name == "x-prefixroute-upstream" then
                upstream = value
            elseif name == "x-prefixroute-id" then
                id = value
            end
        end
    end
    socket:close()
    return upstream, id
end

core.register_action("prefixroute_pick", { "http-req" }, function(txn)
    local body = txn.sf:req_body()
    if body == nil or body == "" then
        return
    end
    local ok, upstream, id = pcall(ask, txn.sf:path(), body)
    if not ok or upstream == nil or id == nil then
        return
    end
    txn:set_var("txn.prefixroute_upstream", upstream)
    txn:set_var("txn.prefixroute_id", id)
end)
