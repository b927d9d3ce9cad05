//! `leaderrun status` (SPEC §9): who holds a lease, its token, the time left
//! and the counter. Exit 0 when held, 3 when free, 69 when the backend
//! cannot be asked.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context as _;

use crate::backend::{Observation, StoreError, unix_ms};
use crate::cli::StatusArgs;
use crate::error::Exit;
use crate::log;
use crate::run::Failure;
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
        let store = backend.observer(&key, STATUS_TIMEOUT)?;
        match store.observe().await {
            Ok(observation) => {
                let text = if args.json {
                    json(&key, &observation)
                } else {
                    text(&key, &observation)
                };
                print!("{text}");
                Ok(if observation.holder.is_some() {
                    Exit::Child(0)
                } else {
                    Exit::Free
                })
            }
            Err(StoreError::Unreachable(error)) => {
                eprintln!("leaderrun: error: backend {backend} unreachable: {error:#}");
                Ok(Exit::Unreachable)
            }
            Err(StoreError::Fatal(fatal)) => Err(fatal.into()),
        }
    })
}

fn text(key: &str, observation: &Observation) -> String {
    let mut out = format!("key:        {key}\n");
    match &observation.holder {
        Some(holder) => {
            let left = holder
                .expires_in
                .map_or("unknown".into(), |d| format!("{:.3}s", d.as_secs_f64()));
            let _ = write!(
                out,
                "holder:     {}\ntoken:      {}\nexpires:    in {left}\n",
                holder.owner, holder.token
            );
        }
        None => out.push_str("holder:     none (the lease is free)\n"),
    }
    let _ = writeln!(out, "counter:    {}", observation.counter);
    let _ = writeln!(out, "candidates: {}", observation.candidates.len());
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
    let candidates: Vec<String> = observation
        .candidates
        .iter()
        .map(|c| {
            format!(
                "{{\"owner\":{},\"host\":{},\"pid\":{},\"since_ms\":{},\"last_seen_ms\":{},\"leading\":{}}}",
                quote(&c.owner),
                quote(&c.host),
                c.pid,
                c.since_ms,
                c.last_seen_ms,
                c.leading
            )
        })
        .collect();
    format!(
        "{{\"key\":{},{holder},\"counter\":{},\"candidates\":[{}]}}\n",
        quote(key),
        observation.counter,
        candidates.join(",")
    )
}
