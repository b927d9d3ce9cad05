-- Gives up the caller's lease and wakes the follower first in line.
-- KEYS: lease, candidates, line, released. ARGV: instance, token, ttl_ms,
-- candidate record, last (1: the run is over, the candidate record goes
-- too). Returns 1 released, 2 released before with this token (a release
-- whose answer was skipped or lost), 0 not held.
if ARGV[5] == '1' then
  redis.call('HDEL', KEYS[2], ARGV[1])
else
  beat(KEYS[2], ARGV[1], ARGV[3], 0, ARGV[4])
end
local current = redis.call('GET', KEYS[1])
if current then
  local token, instance = parse_lease(current)
  if instance == ARGV[1] and token == ARGV[2] then
    -- The lease, and any wake left in line: one wake, for the follower
    -- first in line, never more than one.
    redis.call('DEL', KEYS[1], KEYS[3])
    -- A lease gone with this mark was released, not lost: followers that
    -- knew its expiry need not wait for it.
    redis.call('SET', KEYS[4], token, 'PX', ARGV[3])
    redis.call('RPUSH', KEYS[3], token)
    redis.call('PEXPIRE', KEYS[3], ARGV[3])
    return 1
  end
end
if redis.call('GET', KEYS[4]) == ARGV[2] then
  return 2
end
return 0
