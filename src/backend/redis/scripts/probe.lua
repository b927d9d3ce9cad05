-- Run once at startup: every command the other scripts run, on this key's
-- own probe keys, so a missing permission is found before any lease is
-- taken, not in the middle of a term.
-- KEYS: lease, counter, candidates, released, probe.
redis.call('INFO', 'server')
redis.call('TIME')
redis.call('GET', KEYS[1])
redis.call('PTTL', KEYS[1])
redis.call('GET', KEYS[2])
redis.call('HGETALL', KEYS[3])
redis.call('GET', KEYS[4])
redis.call('SET', KEYS[5], '1', 'PX', 1000)
redis.call('PEXPIRE', KEYS[5], 1000)
redis.call('DEL', KEYS[5])
redis.call('RPUSH', KEYS[5], '1')
redis.call('DEL', KEYS[5])
redis.call('HSET', KEYS[5], 'f', '1')
redis.call('HDEL', KEYS[5], 'f')
return 1
