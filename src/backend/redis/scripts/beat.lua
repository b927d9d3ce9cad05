-- Redis 3.2 to 6 replicate a script whole unless told to replicate its
-- effects, and refuse writes after TIME or INFO; Redis 7 always does.
if redis.replicate_commands then
  redis.replicate_commands()
end

-- Refreshes the caller's candidate record in the hash
-- leaderrun:{KEY}:candidates (field: instance; value: "<expires ms> <seen
-- ms> <leading 0|1> <since ms> <pid> <host> <owner>", server time).
-- Returns 1 if the record was not there.
local function beat(candidates, instance, ttl_ms, leading, record)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  return redis.call('HSET', candidates, instance,
    string.format('%d %d %d %s', now + tonumber(ttl_ms), now, leading, record))
end

-- A lease value: "<token> <instance>/<attempt> <owner>". Tokens are written
-- with %d: Lua's own number formatting turns 10^14 into "1e+14".
local function parse_lease(value)
  return string.match(value, '^(%d+) (%x+)/(%d+) (.*)$')
end

-- The replication id of this server's history: a promoted replica, or a
-- primary restarted without persistence, has a new one.
local function replid()
  return string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)') or ''
end
