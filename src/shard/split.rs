//! The split: from the live replicas of a key, how many shards this one
//! holds. Every replica computes it from the same records, so they agree
//! without talking: the replicas with the key's shard count, oldest first
//! (start time, then host and pid); the first `N mod R` hold ⌈N/R⌉ and the
//! others ⌊N/R⌋. A replica that joins is the youngest, so it takes the
//! smaller share and the older ones hand surplus over to it.

use crate::backend::{Candidate, Identity};

/// This replica's share, as one look at the records gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// How many shards this replica holds.
    pub quota: usize,
    /// The replicas the shards are split among (this one included).
    pub replicas: usize,
    /// Why this replica takes no shard: the oldest replica of the key runs
    /// another shard count.
    pub refused: Option<String>,
    /// Replicas left out of the split: they run another shard count.
    pub ignored: Vec<String>,
}

/// Whether a record is this replica's own.
pub fn is_me(me: &Identity, c: &Candidate) -> bool {
    c.host == me.host && c.pid == me.pid && c.since_ms == me.since_ms
}

/// This replica's share of `n` shards among `candidates` (the key's live
/// records), counting only those `counted` accepts (a replica that just
/// appeared is counted once it has stayed a while: see the balancer).
pub fn share(
    n: u32,
    me: &Identity,
    candidates: &[Candidate],
    counted: impl Fn(&Candidate) -> bool,
) -> Share {
    let mut live: Vec<&Candidate> = candidates.iter().collect();
    live.sort_by(|a, b| order(a).cmp(&order(b)));
    let shown = |c: &Candidate| {
        let runs = c
            .shards
            .map_or("without --shards".to_owned(), |m| format!("--shards {m}"));
        format!("{} on {} (pid {}) runs {runs}", c.owner, c.host, c.pid)
    };
    if let Some(oldest) = live.first() {
        if oldest.shards != Some(n) && !is_me(me, oldest) {
            return Share {
                quota: 0,
                replicas: 0,
                refused: Some(format!(
                    "the key's oldest replica, {}, and this one --shards {n}: taking no shard until the replicas agree (give every replica the same --shards)",
                    shown(oldest)
                )),
                ignored: Vec::new(),
            };
        }
    }
    let ignored = live
        .iter()
        .filter(|c| c.shards != Some(n) && !is_me(me, c))
        .map(|c| shown(c))
        .collect();
    let mut members: Vec<(u64, &str, u32)> = live
        .iter()
        .filter(|c| c.shards == Some(n) && !is_me(me, c) && counted(c))
        .map(|c| order(c))
        .collect();
    // This replica counts, whether or not its own record was seen yet.
    let mine = (me.since_ms, me.host.as_str(), me.pid);
    members.push(mine);
    members.sort_unstable();
    members.dedup();
    let replicas = members.len();
    let rank = members.iter().position(|m| *m == mine).unwrap_or(0);
    let n = n as usize;
    let quota = n / replicas + usize::from(rank < n % replicas);
    Share {
        quota,
        replicas,
        refused: None,
        ignored,
    }
}

fn order(c: &Candidate) -> (u64, &str, u32) {
    (c.since_ms, c.host.as_str(), c.pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(since_ms: u64, pid: u32) -> Identity {
        Identity {
            owner: format!("r{pid}"),
            instance: format!("{pid:016x}"),
            host: "h".into(),
            pid,
            since_ms,
            shards: Some(8),
        }
    }

    fn record(id: &Identity, shards: Option<u32>) -> Candidate {
        Candidate {
            owner: id.owner.clone(),
            host: id.host.clone(),
            pid: id.pid,
            since_ms: id.since_ms,
            last_seen_ms: id.since_ms,
            leading: false,
            shards,
        }
    }

    #[test]
    fn eight_over_three_is_three_three_two_oldest_first() {
        let ids: Vec<Identity> = (1..=3).map(|i| identity(i * 10, i as u32)).collect();
        let records: Vec<Candidate> = ids.iter().map(|id| record(id, Some(8))).collect();
        let quotas: Vec<usize> = ids
            .iter()
            .map(|id| share(8, id, &records, |_| true).quota)
            .collect();
        assert_eq!(quotas, vec![3, 3, 2]);
        // A fourth, the youngest: two each.
        let fourth = identity(40, 4);
        let mut records = records;
        records.push(record(&fourth, Some(8)));
        let quotas: Vec<usize> = ids
            .iter()
            .chain([&fourth])
            .map(|id| share(8, id, &records, |_| true).quota)
            .collect();
        assert_eq!(quotas, vec![2, 2, 2, 2]);
        // Not counted yet (it just appeared): the others keep their share.
        let young = |c: &Candidate| c.pid != 4;
        assert_eq!(share(8, &ids[0], &records, young).quota, 3);
        // More replicas than shards: the youngest are spares.
        assert_eq!(share(2, &fourth, &records, |_| true).quota, 0);
    }

    #[test]
    fn a_replica_counts_itself_before_its_record_is_seen() {
        let me = identity(5, 9);
        let share = share(8, &me, &[], |_| true);
        assert_eq!((share.quota, share.replicas), (8, 1));
    }

    #[test]
    fn another_shard_count_is_refused_or_ignored_by_age() {
        let old = identity(1, 1);
        let me = identity(2, 2);
        let records = vec![record(&old, Some(16)), record(&me, Some(8))];
        let refused = share(8, &me, &records, |_| true);
        assert_eq!(refused.quota, 0);
        let why = refused.refused.unwrap();
        assert!(
            why.contains("--shards 16") && why.contains("--shards 8"),
            "{why}"
        );
        // The older one ignores the younger with another count.
        let mut old8 = old.clone();
        old8.shards = Some(16);
        let kept = share(16, &old8, &records, |_| true);
        assert_eq!((kept.quota, kept.replicas), (16, 1));
        assert_eq!(kept.ignored.len(), 1, "{:?}", kept.ignored);
        // A single-lease replica on the key is another count too.
        let records = vec![record(&old, None), record(&me, Some(8))];
        let why = share(8, &me, &records, |_| true).refused.unwrap();
        assert!(why.contains("without --shards"), "{why}");
    }
}
