-- Lists the live candidates and drops the expired ones.
local function live(candidates)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local all = redis.call('HGETALL', candidates)
  local found = {}
  for i = 1, #all, 2 do
    local expires = tonumber(string.match(all[i + 1], '^(%d+)'))
    if expires and expires > now then
      table.insert(found, all[i + 1])
    else
      redis.call('HDEL', candidates, all[i])
    end
  end
  return found
end
