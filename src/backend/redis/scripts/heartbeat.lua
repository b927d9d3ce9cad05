-- KEYS: candidates. ARGV: instance, ttl_ms, candidate record.
beat(KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3])
return 1
