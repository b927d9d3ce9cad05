//! `leaderrun status` (SPEC §9): who holds a lease, its token, the time left
//! and the counter. Exit 0 when held, 3 when free, 69 when the backend
//! cannot be asked.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context as _;

use crate::backend::{Holder, Observation, StoreError, unix_ms};
use crate::cli::StatusArgs;
use crate::error::Exit;
use crate::log;
use crate::run::Failure;
use crate::shard::shard_key;
use crate::spec::{parse_backend, parse_key};

/// How long `status` waits for the backend.
const STATUS_TIMEOUT: Duration = Duration::from_secs(2);

pub fn run(args: StatusArgs) -> Result<Exit, Failure> {
    let key = parse_key(args.lease.key.as_deref().unwrap_or_default())?;
    let backend = parse_backend(&args.lease)?;
    log::init(&args.lease.log, vec![("key", key.clone())])?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(async {
        let failed = |error: StoreError| match error {
            StoreError::Unreachable(error) => {
                eprintln!("leaderrun: error: backend {backend} unreachable: {error:#}");
                Ok(Exit::Unreachable)
            }
            StoreError::Fatal(fatal) => Err(Failure::from(fatal)),
        };
        let observation = match backend.observer(&key, STATUS_TIMEOUT)?.observe().await {
            Ok(observation) => observation,
            Err(error) => return failed(error),
        };
        let (text, held) = match shard_count(&observation) {
            // Shard mode: each shard's holder too.
            Some(n) => {
                let stores = (0..n)
                    .map(|shard| backend.observer(&shard_key(&key, shard), STATUS_TIMEOUT))
                    .collect::<Result<Vec<_>, _>>()?;
                let shards: Vec<Option<Holder>> =
                    match futures_util::future::try_join_all(stores.iter().map(|s| s.observe()))
                        .await
                    {
                        Ok(seen) => seen.into_iter().map(|o| o.holder).collect(),
                        Err(error) => return failed(error),
                    };
                let text = if args.json {
                    shards_json(&key, &shards, &observation)
                } else {
                    shards_text(&key, &shards, &observation)
                };
                (text, shards.iter().all(Option::is_some))
            }
            None => {
                let text = if args.json {
                    json(&key, &observation)
                } else {
                    text(&key, &observation)
                };
                (text, observation.holder.is_some())
            }
        };
        print!("{text}");
        Ok(if held { Exit::Child(0) } else { Exit::Free })
    })
}

/// Shard mode: the shard count of the key's oldest replica that runs in
/// shard mode, if any does.
fn shard_count(observation: &Observation) -> Option<u32> {
    observation.candidates.iter().find_map(|c| c.shards)
}

fn left(holder: &Holder) -> String {
    holder
        .expires_in
        .map_or("unknown".into(), |d| format!("{:.3}s", d.as_secs_f64()))
}

fn shards_text(key: &str, shards: &[Option<Holder>], observation: &Observation) -> String {
    let held = shards.iter().flatten().count();
    let mut out = format!(
        "key:        {key}\nshards:     {} ({held} held)\n",
        shards.len()
    );
    for (shard, holder) in shards.iter().enumerate() {
        let _ = match holder {
            Some(h) => writeln!(
                out,
                "  shard {shard}: {}, token {}, expires in {}",
                h.owner,
                h.token,
                left(h)
            ),
            None => writeln!(out, "  shard {shard}: free"),
        };
    }
    out + &candidates_text(observation)
}

fn shards_json(key: &str, shards: &[Option<Holder>], observation: &Observation) -> String {
    let quote = log::json_string;
    let each: Vec<String> = shards
        .iter()
        .enumerate()
        .map(|(shard, holder)| match holder {
            Some(h) => format!(
                "{{\"shard\":{shard},\"held\":true,\"holder\":{},\"token\":{},\"expires_in_ms\":{}}}",
                quote(&h.owner),
                h.token,
                h.expires_in
                    .map_or("null".into(), |d| d.as_millis().to_string())
            ),
            None => format!(
                "{{\"shard\":{shard},\"held\":false,\"holder\":null,\"token\":null,\"expires_in_ms\":null}}"
            ),
        })
        .collect();
    format!(
        "{{\"key\":{},\"shards\":{},\"held\":{},\"by_shard\":[{}],\"candidates\":[{}]}}\n",
        quote(key),
        shards.len(),
        shards.iter().flatten().count(),
        each.join(","),
        candidates_json(observation)
    )
}

fn text(key: &str, observation: &Observation) -> String {
    let mut out = format!("key:        {key}\n");
    match &observation.holder {
        Some(holder) => {
            let _ = write!(
                out,
                "holder:     {}\ntoken:      {}\nexpires:    in {}\n",
                holder.owner,
                holder.token,
                left(holder)
            );
        }
        None => out.push_str("holder:     none (the lease is free)\n"),
    }
    let _ = writeln!(out, "counter:    {}", observation.counter);
    out + &candidates_text(observation)
}

fn candidates_text(observation: &Observation) -> String {
    let mut out = format!("candidates: {}\n", observation.candidates.len());
    let now = unix_ms();
    let seconds = |ms: u64| format!("{:.1}s", now.saturating_sub(ms) as f64 / 1000.0);
    for c in &observation.candidates {
        let _ = writeln!(
            out,
            "  {}  host {}, pid {}, {}, up {}, seen {} ago",
            c.owner,
            c.host,
            c.pid,
            if c.leading { "leading" } else { "following" },
            seconds(c.since_ms),
            seconds(c.last_seen_ms),
        );
    }
    out
}

fn candidates_json(observation: &Observation) -> String {
    let quote = log::json_string;
    let candidates: Vec<String> = observation
        .candidates
        .iter()
        .map(|c| {
            format!(
                "{{\"owner\":{},\"host\":{},\"pid\":{},\"since_ms\":{},\"last_seen_ms\":{},\"leading\":{},\"shards\":{}}}",
                quote(&c.owner),
                quote(&c.host),
                c.pid,
                c.since_ms,
                c.last_seen_ms,
                c.leading,
                c.shards.map_or("null".into(), |n| n.to_string()),
            )
        })
        .collect();
    candidates.join(",")
}

/// One JSON object; the field names are documented in the README and stable.
fn json(key: &str, observation: &Observation) -> String {
    let quote = log::json_string;
    let holder = match &observation.holder {
        Some(holder) => format!(
            "\"held\":true,\"holder\":{},\"token\":{},\"expires_in_ms\":{}",
            quote(&holder.owner),
            holder.token,
            holder
                .expires_in
                .map_or("null".into(), |d| d.as_millis().to_string()),
        ),
        None => "\"held\":false,\"holder\":null,\"token\":null,\"expires_in_ms\":null".into(),
    };
    format!(
        "{{\"key\":{},{holder},\"counter\":{},\"candidates\":[{}]}}\n",
        quote(key),
        observation.counter,
        candidates_json(observation)
    )
}
