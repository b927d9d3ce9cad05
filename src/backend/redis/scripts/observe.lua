-- KEYS: lease, counter, candidates.
local current = redis.call('GET', KEYS[1]) or ''
return {current, redis.call('PTTL', KEYS[1]), tonumber(redis.call('GET', KEYS[2]) or '0'), live(KEYS[3])}
