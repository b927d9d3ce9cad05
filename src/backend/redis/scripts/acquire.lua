-- One acquisition attempt.
-- KEYS: lease, counter, candidates, released, history, heldoff, line.
-- ARGV: instance, attempt, owner, ttl_ms, highest token the caller has seen,
-- run id the caller knows ("" if none), ttl in whole seconds, candidate
-- record, token of a holder whose known expiry has not passed ("" if none),
-- largest token, behind the line (1: sent behind the caller's BLPOP), known
-- server (1: the caller's connection is to the server whose run id it knows,
-- up for a ttl: no need to look at either).
-- Returns {code, token, text, ms}: 1 acquired (text: run id or ""), 0 held
-- (text: owner, ms: PTTL), 2 server too young (ms: wait), 3 run id changed,
-- 4 lease vanished before its known expiry, 5 counter exhausted, 6 this
-- server's history is not the one the lease was last written on (ms: wait),
-- 7 declined (behind the line only).
--
-- An attempt behind the line was sent before it runs, by a follower that
-- may have moved on since: it takes nothing of its own replica's (a lease
-- of another attempt: a term that began meanwhile), nor for a replica that
-- has left the candidates (it is exiting); a wake it took then goes on to
-- the next follower. The candidate record is written once on every path,
-- and the server's replication id read at most once: this script runs at
-- every handover, right after the release.
local behind = ARGV[11] == '1'
local DECLINED = {7, 0, '', 0}

-- Refreshes the caller's record; false if an attempt behind the line finds
-- that the caller had left the candidates (the record is not kept then).
local function refreshed(leading)
  local new = beat(KEYS[3], ARGV[1], ARGV[4], leading, ARGV[8]) == 1
  if new and behind then
    redis.call('HDEL', KEYS[3], ARGV[1])
    return false
  end
  return true
end

-- Declines, passing the wake on to the next follower (the lease is free).
local function pass_on()
  redis.call('DEL', KEYS[7])
  redis.call('RPUSH', KEYS[7], redis.call('GET', KEYS[4]) or '0')
  redis.call('PEXPIRE', KEYS[7], ARGV[4])
  return DECLINED
end

-- A follower's answer, with its record refreshed; declined if it had left.
local function follow(answer, free)
  if refreshed(0) then
    return answer
  end
  if free then
    return pass_on()
  end
  return DECLINED
end

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
    if behind then
      return DECLINED
    end
    -- An earlier term of this replica, over now: a new term, a new token.
    mine = true
  elseif not token then
    -- Not a lease of ours (an operator's SET): held, by nobody we know.
    return follow({0, 0, current, redis.call('PTTL', KEYS[1])}, false)
  else
    return follow({0, tonumber(token), owner, redis.call('PTTL', KEYS[1])}, false)
  end
end
local run_id = ''
local now_replid = nil
local known = nil
if not mine then
  -- Free: only now does the server's history matter.
  if ARGV[12] == '1' then
    run_id = ARGV[6]
  else
    local info = redis.call('INFO', 'server')
    run_id = string.match(info, 'run_id:(%w+)')
    if ARGV[6] ~= '' and ARGV[6] ~= run_id then
      return follow({3, 0, run_id, 0}, true)
    end
    local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
    if uptime < tonumber(ARGV[7]) then
      return follow({2, 0, run_id, (tonumber(ARGV[7]) - uptime) * 1000}, true)
    end
  end
  -- The lease's keys remember the history they were last written on; on
  -- another one (a promoted replica that may have missed writes, whoever
  -- asks) nothing is handed out for one ttl.
  local held = redis.call('PTTL', KEYS[6])
  if held > 0 then
    return follow({6, 0, run_id, held}, true)
  end
  known = redis.call('GET', KEYS[5])
  now_replid = replid()
  if known and known ~= now_replid then
    redis.call('SET', KEYS[5], now_replid)
    redis.call('SET', KEYS[6], '1', 'PX', ARGV[4])
    return follow({6, 0, run_id, tonumber(ARGV[4])}, true)
  end
  if ARGV[9] ~= '' then
    -- The caller saw a holder whose lease has not expired yet: if that
    -- lease is gone without a release, the data was lost.
    local released = tonumber(redis.call('GET', KEYS[4]) or '0')
    if released < tonumber(ARGV[9]) then
      return follow({4, 0, run_id, 0}, true)
    end
  end
end
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
if counter < tonumber(ARGV[5]) then
  counter = tonumber(ARGV[5])
end
if counter >= tonumber(ARGV[10]) then
  return follow({5, counter, run_id, 0}, not mine)
end
if not refreshed(1) then
  -- Only behind the line, so the lease is free.
  return pass_on()
end
local token = string.format('%d', counter + 1)
redis.call('SET', KEYS[2], token)
redis.call('SET', KEYS[1], token .. ' ' .. ARGV[1] .. '/' .. ARGV[2] .. ' ' .. ARGV[3], 'PX', ARGV[4])
-- The history the lease is written on: left as it is when it was found
-- equal (an earlier term of this replica's did not look).
if mine or not known then
  redis.call('SET', KEYS[5], now_replid or replid())
end
return {1, counter + 1, run_id, tonumber(ARGV[4])}
