-- The shutdown notice: removes the caller's candidate record, and gives up
-- a lease the caller holds (one that its line's attempt acquired and that
-- no term took: the run is over), waking the follower first in line.
-- KEYS: candidates, lease, line, released. ARGV: instance, ttl_ms.
redis.call('HDEL', KEYS[1], ARGV[1])
live(KEYS[1])
local current = redis.call('GET', KEYS[2])
if current then
  local token, instance = parse_lease(current)
  if instance == ARGV[1] then
    redis.call('DEL', KEYS[2], KEYS[3])
    redis.call('SET', KEYS[4], token, 'PX', ARGV[2])
    redis.call('RPUSH', KEYS[3], token)
    redis.call('PEXPIRE', KEYS[3], ARGV[2])
  end
end
return 1
