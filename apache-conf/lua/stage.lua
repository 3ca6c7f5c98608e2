-- Stage handler of the private Apache (apache-conf/, mapped at /stage<N> and /stage<N>/r<route>,
-- the multi-route workload of the learned classifier: the route only names the path).
--
-- GET /stage1?work=0.05 burns exactly 0.05 s of this worker thread's CPU time and answers
-- 200 "ok". The thread CPU clock comes from the C module tcpu (CLOCK_THREAD_CPUTIME_ID):
-- os.clock() is CPU of the whole process, i.e. of all concurrent requests under mpm_event.
-- Demand and stage go to request notes for the access log (%{stage_cpu_us}n, %{stage}n)
-- and to the X-Stage-CPU-us response header.
local ok_tcpu, tcpu = pcall(require, "tcpu")

local MAX_WORK_S = 60      -- one request must not hold a worker thread for minutes
local CHUNK = 500          -- ~6 us of arithmetic between clock reads: bounds the overshoot

local function reply(r, status, body)
    r.status = status
    r.content_type = "text/plain"
    r:puts(body, "\n")
    return apache2.OK
end

function handle(r)
    if not ok_tcpu then
        return reply(r, 500, "stage: thread CPU clock module tcpu not loaded (" .. tostring(tcpu)
            .. "); restart with `overtake apache start`, which compiles it")
    end
    local stage = r.uri:match("^/stage(%d+)$") or r.uri:match("^/stage(%d+)/r%d+$") or "?"
    local args = r:parseargs()
    local raw = args.work
    if raw == nil then
        return reply(r, 400, "work: required query parameter, seconds of CPU, e.g. /stage1?work=0.05")
    end
    local work = tonumber(raw)
    if work == nil or work ~= work or work < 0 or work > MAX_WORK_S then
        return reply(r, 400, "work: must be seconds of CPU in [0, " .. MAX_WORK_S .. "], got " .. raw)
    end

    -- ?trace=1: when the handler ran (wall clock, microseconds) and in which process, for tests of admission
    local begin_us = r:clock()
    local c0 = tcpu.now_ns()
    local target = c0 + math.floor(work * 1e9 + 0.5)
    local x = 0
    while tcpu.now_ns() < target do
        for i = 1, CHUNK do x = x + (i % 7) end
    end
    local cpu_us = (tcpu.now_ns() - c0) // 1000

    r.notes["stage"] = stage
    r.notes["stage_cpu_us"] = tostring(cpu_us)
    r.headers_out["X-Stage-CPU-us"] = tostring(cpu_us)
    if args.trace then
        r.headers_out["X-Handler-Span-us"] = string.format("%d %d", begin_us, r:clock())
        -- and which process ran it (tests of counts shared by several children)
        local f = io.open("/proc/self/stat")
        if f then
            r.headers_out["X-Handler-Pid"] = tostring(f:read("*n"))
            f:close()
        end
    end
    return reply(r, 200, "ok stage=" .. stage .. " cpu_us=" .. cpu_us)
end
