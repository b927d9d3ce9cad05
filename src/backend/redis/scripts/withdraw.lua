-- KEYS: candidates. ARGV: instance.
redis.call('HDEL', KEYS[1], ARGV[1])
live(KEYS[1])
return 1
