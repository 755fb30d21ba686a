-- wrk script for `bench/heartbeats.py --generator wrk`: closed-loop heartbeats, each
-- connection sending its next beat as soon as the last was answered, cycling over the
-- nodes. Readings move as bench/busy.py moves them (memory random walk with unplaced
-- processes coming and going, utilisation / temperature / power drawn fresh, a card's
-- corrected ECC count growing about one beat in 40), or stay as they are (steady).
--
--   wrk -t T -c C -d D --timeout 30s -s bench/heartbeats.lua URL -- TEMPLATE NODES SECRET PREFIX VARY TOTALS THREADS
--
-- TEMPLATE: a beat body with @tokens@ where values go (written by heartbeats.py from
-- busy.py's payload): @host@ @ip@, and for varying readings @Mi@ @Ui@ @Ti@ @Pi@ @Ci@
-- per card i and @CPU@ @MEM@ @GMEM@. VARY: 1 or 0; TOTALS: the cards' memory in MB,
-- comma-separated; THREADS: wrk's -t (thread k sends nodes k, k+T, k+2T…). done()
-- prints one line, `WRKRESULT {json}`.

local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

local template, nodes, secret, prefix, vary, totals, gpus
local next_node, stride
local memory, corrected = {}, {}
local values = {}
local HEALTH_EVERY = 40
statuses = {}

function init(args)
  local handle = assert(io.open(args[1], "r"))
  template = handle:read("*a")
  handle:close()
  nodes, secret, prefix, vary = tonumber(args[2]), args[3], args[4], args[5] == "1"
  totals = {}
  for total in string.gmatch(args[6] or "", "%d+") do
    table.insert(totals, tonumber(total))
  end
  gpus = #totals
  stride = tonumber(args[7])
  next_node = id
  math.randomseed(7919 * (id + 1))
  wrk.headers["X-API-Key"] = secret
  wrk.headers["Content-Type"] = "application/json"
end

local function ip(n)
  return string.format("10.%d.%d.%d", math.floor(n / 65536), math.floor(n / 256) % 256, n % 256)
end

local function move_readings(n)
  local cards = memory[n]
  if cards == nil then
    cards, corrected[n] = {}, {}
    for i = 1, gpus do
      cards[i] = math.random(1024, math.floor(totals[i] * 0.5))
      corrected[n][i] = 0
    end
    memory[n] = cards
  end
  local sum = 0
  for i = 1, gpus do
    local total = totals[i]
    local used = cards[i] + math.random(-4096, 4096)
    if math.random() < 0.1 then -- an unplaced process comes or goes
      used = used + (math.random(2) == 1 and -1 or 1) * math.floor(total / 3)
    end
    used = math.min(math.max(used, 1024), math.floor(total * 0.95))
    cards[i] = used
    sum = sum + used
    local k = i - 1
    values["M" .. k] = used
    values["U" .. k] = math.random(0, 100) .. ".0"
    values["T" .. k] = math.random(35, 85) .. ".0"
    values["P" .. k] = string.format("%.1f", 60 + math.random() * 640)
  end
  if math.random(HEALTH_EVERY) == 1 then
    local card = math.random(gpus)
    corrected[n][card] = corrected[n][card] + math.random(1, 20)
  end
  for i = 1, gpus do
    values["C" .. (i - 1)] = corrected[n][i]
  end
  values.CPU = string.format("%.1f", 1 + math.random() * 59)
  values.MEM = string.format("%.1f", 5 + math.random() * 65)
  values.GMEM = sum
end

function request()
  local n = next_node
  next_node = next_node + stride
  if next_node >= nodes then
    next_node = next_node % stride
  end
  local node_id = string.format("%s-%05d", prefix, n)
  values.host, values.ip = node_id, ip(n)
  if vary then
    move_readings(n)
  end
  local body = string.gsub(template, "@(%w+)@", values)
  return wrk.format("POST", "/api/v1/nodes/" .. node_id .. "/heartbeat", nil, body)
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local counts = {}
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses") or {}) do
      counts[status] = (counts[status] or 0) + count
    end
  end
  local parts = {}
  for status, count in pairs(counts) do
    table.insert(parts, string.format('"%d": %d', status, count))
  end
  local errors = summary.errors
  io.write(string.format(
    'WRKRESULT {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "max_us": %d, '
      .. '"connect": %d, "read": %d, "write": %d, "timeout": %d, "statuses": {%s}}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.max,
    errors.connect, errors.read, errors.write, errors.timeout, table.concat(parts, ", ")
  ))
end
