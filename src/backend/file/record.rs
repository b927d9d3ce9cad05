//! The records the file backend stores, and their encoding: one line of
//! `name=value` fields (keys and owners have no whitespace) sealed with a
//! checksum, in a fixed-size slot.
//!
//! The lease file holds two slots, written alternately with a sequence
//! number, so a write torn by a crash leaves the previous record readable.

use super::state_dir::fnv1a;
use crate::backend::Candidate;

/// Bytes per record slot; a record is at most about 600 bytes.
pub const SLOT: usize = 1024;

const MAGIC: &str = "leaderrun-lease/1";
const CANDIDATE: &str = "leaderrun-candidate/1";

/// One lease record, as stored in a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    /// The last token handed out (or the fence floor).
    pub counter: u64,
    /// Synced high-water mark: no token above it has been handed out.
    pub reserved: u64,
    /// The boot that wrote this record.
    pub boot: String,
    pub key: String,
    pub holder: Option<HolderRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderRecord {
    pub owner: String,
    pub instance: String,
    /// The acquisition attempt of that instance that drew the token: a
    /// repeat of the same attempt gets the same token, a later one a new one.
    pub attempt: u64,
    pub token: u64,
    pub boot: String,
    /// CLOCK_BOOTTIME nanoseconds of the boot named by `boot`.
    pub expires: u64,
}

impl Record {
    pub fn new(key: &str) -> Record {
        Record {
            seq: 0,
            counter: 0,
            reserved: 0,
            boot: String::new(),
            key: key.to_owned(),
            holder: None,
        }
    }

    /// The record in a slot: one sealed line, padded with zeros.
    pub fn encode(&self) -> Vec<u8> {
        let mut line = format!(
            "{MAGIC} seq={} counter={} reserved={} boot={} key={}",
            self.seq, self.counter, self.reserved, self.boot, self.key
        );
        if let Some(h) = &self.holder {
            line += &format!(
                " owner={} instance={} attempt={} token={} holder_boot={} expires={}",
                h.owner, h.instance, h.attempt, h.token, h.boot, h.expires
            );
        }
        pad(seal(line))
    }

    pub fn decode(slot: &[u8]) -> Option<Record> {
        let fields = Fields::parse(unseal(slot)?, MAGIC)?;
        let holder = match fields.get("owner") {
            None => None,
            Some(owner) => Some(HolderRecord {
                owner: owner.to_owned(),
                instance: fields.get("instance")?.to_owned(),
                // Records written before attempts were recorded: attempt 0,
                // which no replica of this version uses.
                attempt: fields.number("attempt").unwrap_or(0),
                token: fields.number("token")?,
                boot: fields.get("holder_boot")?.to_owned(),
                expires: fields.number("expires")?,
            }),
        };
        Some(Record {
            seq: fields.number("seq")?,
            counter: fields.number("counter")?,
            reserved: fields.number("reserved")?,
            boot: fields.get("boot")?.to_owned(),
            key: fields.get("key")?.to_owned(),
            holder,
        })
    }
}

/// A candidate record: who runs, and until when it counts as alive.
pub struct CandidateRecord<'a> {
    pub candidate: &'a Candidate,
    pub boot: &'a str,
    /// CLOCK_BOOTTIME nanoseconds after which the record is stale.
    pub expires: u64,
}

impl CandidateRecord<'_> {
    pub fn encode(&self) -> Vec<u8> {
        let c = self.candidate;
        let shards = c.shards.map_or(String::new(), |n| format!(" shards={n}"));
        pad(seal(format!(
            "{CANDIDATE} owner={} host={} pid={} since_ms={} seen_ms={} leading={} boot={} expires={}{shards}",
            c.owner,
            c.host,
            c.pid,
            c.since_ms,
            c.last_seen_ms,
            u8::from(c.leading),
            self.boot,
            self.expires,
        )))
    }
}

/// A live candidate record (same boot, not expired at `now`), or None.
pub fn live_candidate(bytes: &[u8], boot_id: &str, now: u64) -> Option<Candidate> {
    let fields = Fields::parse(unseal(bytes)?, CANDIDATE)?;
    if fields.get("boot")? != boot_id || fields.number("expires")? <= now {
        return None;
    }
    Some(Candidate {
        owner: fields.get("owner")?.to_owned(),
        host: fields.get("host")?.to_owned(),
        pid: u32::try_from(fields.number("pid")?).ok()?,
        since_ms: fields.number("since_ms")?,
        last_seen_ms: fields.number("seen_ms")?,
        leading: fields.get("leading")? == "1",
        shards: fields.number("shards").and_then(|n| u32::try_from(n).ok()),
    })
}

/// A record line: `body sum=<checksum of body>` and a newline.
fn seal(body: String) -> String {
    let sum = fnv1a(body.as_bytes());
    format!("{body} sum={sum:016x}\n")
}

fn pad(line: String) -> Vec<u8> {
    let mut slot = line.into_bytes();
    slot.resize(SLOT.max(slot.len()), 0);
    slot
}

/// The body of a sealed line at the start of `bytes`, if its checksum holds.
fn unseal(bytes: &[u8]) -> Option<&str> {
    let end = bytes.iter().position(|b| *b == b'\n')?;
    let line = std::str::from_utf8(&bytes[..end]).ok()?;
    let (body, sum) = line.rsplit_once(" sum=")?;
    (u64::from_str_radix(sum, 16).ok()? == fnv1a(body.as_bytes())).then_some(body)
}

/// The `name=value` fields of a body after its magic word.
struct Fields<'a>(Vec<(&'a str, &'a str)>);

impl<'a> Fields<'a> {
    fn parse(body: &'a str, magic: &str) -> Option<Fields<'a>> {
        let mut words = body.split(' ');
        if words.next()? != magic {
            return None;
        }
        words
            .map(|w| w.split_once('='))
            .collect::<Option<_>>()
            .map(Fields)
    }

    fn get(&self, name: &str) -> Option<&'a str> {
        self.0.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }

    fn number(&self, name: &str) -> Option<u64> {
        self.get(name)?.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub fn held(token: u64) -> Record {
        Record {
            seq: 7,
            counter: token,
            reserved: token + 1000,
            boot: "c0ffee".into(),
            key: "a=b/../ключ".into(),
            holder: Some(HolderRecord {
                owner: "host:42".into(),
                instance: "00ff".into(),
                attempt: 3,
                token,
                boot: "c0ffee".into(),
                expires: 123_456_789,
            }),
        }
    }

    #[test]
    fn records_round_trip() {
        for record in [held(5), Record::new("k")] {
            assert_eq!(Record::decode(&record.encode()), Some(record));
        }
    }

    #[test]
    fn a_torn_or_edited_record_is_rejected() {
        let slot = held(5).encode();
        let line = String::from_utf8(slot).unwrap();
        let line = line.trim_end_matches('\0');
        assert_eq!(Record::decode(&line.as_bytes()[..line.len() / 2]), None);
        let edited = line.replace("counter=5", "counter=1");
        assert_eq!(Record::decode(edited.as_bytes()), None);
    }

    #[test]
    fn a_record_without_an_attempt_reads_as_attempt_zero() {
        let line = seal(format!(
            "{MAGIC} seq=1 counter=4 reserved=1004 boot=b key=k owner=o instance=i token=4 holder_boot=b expires=9"
        ));
        let record = Record::decode(line.as_bytes()).unwrap();
        assert_eq!(record.holder.unwrap().attempt, 0);
    }

    #[test]
    fn candidates_round_trip_and_expire() {
        let candidate = Candidate {
            owner: "o:1".into(),
            host: "h".into(),
            pid: 42,
            since_ms: 1,
            last_seen_ms: 2,
            leading: true,
            shards: Some(8),
        };
        let bytes = CandidateRecord {
            candidate: &candidate,
            boot: "b",
            expires: 100,
        }
        .encode();
        assert_eq!(live_candidate(&bytes, "b", 99), Some(candidate));
        assert_eq!(live_candidate(&bytes, "b", 100), None);
        assert_eq!(live_candidate(&bytes, "other-boot", 1), None);
    }
}
