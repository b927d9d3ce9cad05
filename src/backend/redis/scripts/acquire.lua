-- One acquisition attempt.
-- KEYS: lease, counter, candidates, released, history, heldoff.
-- ARGV: instance, attempt, owner, ttl_ms, highest token the caller has seen,
-- run id the caller knows ("" if none), ttl in whole seconds, candidate
-- record, token of a holder whose known expiry has not passed ("" if none),
-- largest token.
-- Returns {code, token, text, ms}: 1 acquired (text: run id or ""), 0 held
-- (text: owner, ms: PTTL), 2 server too young (ms: wait), 3 run id changed,
-- 4 lease vanished before its known expiry, 5 counter exhausted, 6 this
-- server's history is not the one the lease was last written on (ms: wait).
local current = redis.call('GET', KEYS[1])
local mine = false
if current then
  local token, instance, attempt, owner = parse_lease(current)
  if instance == ARGV[1] then
    if attempt == ARGV[2] then
      -- A repeat of an attempt whose reply was lost.
      redis.call('PEXPIRE', KEYS[1], ARGV[4])
      beat(KEYS[3], ARGV[1], ARGV[4], 1, ARGV[8])
      return {1, tonumber(token), '', tonumber(ARGV[4])}
    end
    -- An earlier term of this replica, over now: a new term, a new token.
    mine = true
  else
    beat(KEYS[3], ARGV[1], ARGV[4], 0, ARGV[8])
    if not token then
      -- Not a lease of ours (an operator's SET): held, by nobody we know.
      return {0, 0, current, redis.call('PTTL', KEYS[1])}
    end
    return {0, tonumber(token), owner, redis.call('PTTL', KEYS[1])}
  end
end
beat(KEYS[3], ARGV[1], ARGV[4], 0, ARGV[8])
local run_id = ''
if not mine then
  -- Free: only now does the server's history matter.
  local info = redis.call('INFO', 'server')
  run_id = string.match(info, 'run_id:(%w+)')
  if ARGV[6] ~= '' and ARGV[6] ~= run_id then
    return {3, 0, run_id, 0}
  end
  local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
  if uptime < tonumber(ARGV[7]) then
    return {2, 0, run_id, (tonumber(ARGV[7]) - uptime) * 1000}
  end
  -- The lease's keys remember the history they were last written on; on
  -- another one (a promoted replica that may have missed writes, whoever
  -- asks) nothing is handed out for one ttl.
  local held = redis.call('PTTL', KEYS[6])
  if held > 0 then
    return {6, 0, run_id, held}
  end
  local known = redis.call('GET', KEYS[5])
  local now_replid = replid()
  if known and known ~= now_replid then
    redis.call('SET', KEYS[5], now_replid)
    redis.call('SET', KEYS[6], '1', 'PX', ARGV[4])
    return {6, 0, run_id, tonumber(ARGV[4])}
  end
  if ARGV[9] ~= '' then
    -- The caller saw a holder whose lease has not expired yet: if that
    -- lease is gone without a release, the data was lost.
    local released = tonumber(redis.call('GET', KEYS[4]) or '0')
    if released < tonumber(ARGV[9]) then
      return {4, 0, run_id, 0}
    end
  end
end
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
if counter < tonumber(ARGV[5]) then
  counter = tonumber(ARGV[5])
end
if counter >= tonumber(ARGV[10]) then
  return {5, counter, run_id, 0}
end
local token = string.format('%d', counter + 1)
redis.call('SET', KEYS[2], token)
redis.call('SET', KEYS[1], token .. ' ' .. ARGV[1] .. '/' .. ARGV[2] .. ' ' .. ARGV[3], 'PX', ARGV[4])
redis.call('SET', KEYS[5], replid())
beat(KEYS[3], ARGV[1], ARGV[4], 1, ARGV[8])
return {1, counter + 1, run_id, tonumber(ARGV[4])}
