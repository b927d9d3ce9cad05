-- Extends the caller's lease.
-- KEYS: lease, candidates, history. ARGV: instance, token, ttl_ms, candidate record.
-- Returns {1, 0, ""} renewed, or {0, holder token or 0, holder owner or ""}.
local current = redis.call('GET', KEYS[1])
if current then
  local token, instance, attempt, owner = parse_lease(current)
  if instance == ARGV[1] and token == ARGV[2] then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    -- This server has the lease as the holder knows it: its history is the
    -- lease's now (a failover that kept the lease ends no term).
    redis.call('SET', KEYS[3], replid())
    beat(KEYS[2], ARGV[1], ARGV[3], 1, ARGV[4])
    return {1, 0, ''}
  end
  beat(KEYS[2], ARGV[1], ARGV[3], 0, ARGV[4])
  if token then
    return {0, tonumber(token), owner}
  end
  return {0, 0, ''}
end
beat(KEYS[2], ARGV[1], ARGV[3], 0, ARGV[4])
return {0, 0, ''}
