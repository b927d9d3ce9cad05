-- Moves the counter up to a floor. KEYS: counter. ARGV: floor.
local counter = tonumber(redis.call('GET', KEYS[1]) or '0')
if counter < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return tonumber(ARGV[1])
end
return counter
