-- Run once at startup: every command the other scripts run, on this key's
-- own keys and its probe key, so a missing permission is found (and named)
-- before any lease is taken, not in the middle of a term.
-- KEYS: lease, counter, candidates, released, probe.
-- Returns "ok", or "<COMMAND>: <the server's refusal>" for the first refused.
local checks = {
  {'INFO', 'server'},
  {'INFO', 'replication'},
  {'TIME'},
  {'GET', KEYS[1]},
  {'PTTL', KEYS[1]},
  {'GET', KEYS[2]},
  {'HGETALL', KEYS[3]},
  {'GET', KEYS[4]},
  {'SET', KEYS[5], '1', 'PX', 1000},
  {'PEXPIRE', KEYS[5], 1000},
  {'DEL', KEYS[5]},
  {'RPUSH', KEYS[5], '1'},
  {'DEL', KEYS[5]},
  {'HSET', KEYS[5], 'f', '1'},
  {'HDEL', KEYS[5], 'f'},
}
for _, check in ipairs(checks) do
  local answer = redis.pcall(unpack(check))
  if type(answer) == 'table' and answer.err then
    return check[1] .. ': ' .. answer.err
  end
end
return 'ok'
