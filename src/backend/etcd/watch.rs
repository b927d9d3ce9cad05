//! The store's two watches: a follower's of the lease's folder (its
//! wake-ups, and what it last saw of the lease), and a holder's of the line
//! (who a release hands the lease to).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Notify;

use super::client::{Client, b64, int, unb64};
use super::ops::{counter_of, prefix_end, range_prefix};
use super::{Keys, LeaseRecord, Seen};

/// A follower's wake-ups, from its watch.
#[derive(Default)]
pub(super) struct Waiter {
    pub(super) notify: Notify,
    /// The watch runs and this replica has a place in line.
    pub(super) watching: AtomicBool,
    pub(super) task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// A lease record naming this replica, written by a release that
    /// handed it the lease.
    pub(super) handed: Mutex<Option<LeaseRecord>>,
}

/// The followers in line, as a holder's watch of the line sees them: the
/// first is who a release hands the lease to.
#[derive(Default)]
pub(super) struct Line {
    /// By place (the key's creation revision).
    pub(super) places: Mutex<BTreeMap<i64, Place>>,
    pub(super) task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// A follower's place in line: `line/INSTANCE`, its value `h OWNER` when
/// it takes a lease handed to it (`- OWNER` when not), on its etcd lease.
#[derive(Clone)]
pub(super) struct Place {
    pub(super) instance: String,
    pub(super) owner: String,
    pub(super) takes_handover: bool,
    pub(super) session: i64,
    pub(super) revision: i64,
}

impl Line {
    pub(super) fn stop(&self) {
        if let Some(task) = self.task.lock().unwrap().take() {
            task.abort();
        }
        self.places.lock().unwrap().clear();
    }

    /// Applies a key-value of the line (a range's or a watch event's).
    pub(super) fn put(&self, keys: &Keys, kv: &Value) {
        let key = String::from_utf8_lossy(&unb64(&kv["key"])).into_owned();
        let Some(instance) = key.strip_prefix(&keys.line) else {
            return;
        };
        let value = String::from_utf8_lossy(&unb64(&kv["value"])).into_owned();
        let (flag, owner) = value.split_once(' ').unwrap_or(("-", ""));
        let place = Place {
            instance: instance.to_owned(),
            owner: owner.to_owned(),
            takes_handover: flag == "h",
            session: int(&kv["lease"]),
            revision: int(&kv["mod_revision"]),
        };
        let mut places = self.places.lock().unwrap();
        places.retain(|_, p| p.instance != place.instance);
        places.insert(int(&kv["create_revision"]), place);
    }

    pub(super) fn delete(&self, keys: &Keys, kv: &Value) {
        let key = String::from_utf8_lossy(&unb64(&kv["key"])).into_owned();
        if let Some(instance) = key.strip_prefix(&keys.line) {
            self.places
                .lock()
                .unwrap()
                .retain(|_, p| p.instance != instance);
        }
    }

    /// The follower first in line (other than `me`).
    pub(super) fn first(&self, me: &str) -> Option<Place> {
        self.places
            .lock()
            .unwrap()
            .values()
            .find(|p| p.instance != me)
            .cloned()
    }
}

impl Waiter {
    /// Stops the watch (and so the wake-ups) of this replica.
    pub(super) fn stop(&self) {
        if let Some(task) = self.task.lock().unwrap().take() {
            task.abort();
        }
        self.watching.store(false, Ordering::SeqCst);
    }
}

/// Watches the lease's folder from revision `from`, and wakes this follower
/// when a release names it, or when the lease went without a release and
/// it is first in line. Re-opened after a break, from where it stopped.
pub(super) async fn watch(
    client: Arc<Client>,
    keys: Keys,
    instance: String,
    waiter: Arc<Waiter>,
    seen: Arc<Mutex<Option<Seen>>>,
    mut from: i64,
) {
    let create = |from: i64| {
        json!({
            "key": b64(keys.folder.as_bytes()),
            "range_end": b64(&prefix_end(keys.folder.as_bytes())),
            "start_revision": from.to_string(),
        })
    };
    loop {
        let mut stream = match client.watch(create(from)).await {
            Ok(stream) => stream,
            Err(_) => {
                waiter.watching.store(false, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        loop {
            let result = match stream.next().await {
                Ok(result) => result,
                Err(_) => break,
            };
            if result["created"].as_bool().unwrap_or(false) {
                waiter.watching.store(true, Ordering::SeqCst);
            }
            if result["canceled"].as_bool().unwrap_or(false) {
                // Compacted past `from`: start again from now, and look.
                from = 0;
                waiter.notify.notify_one();
                break;
            }
            let events = result["events"].as_array().cloned().unwrap_or_default();
            let mut named = false;
            let mut lease_gone = false;
            for event in &events {
                let key = String::from_utf8_lossy(&unb64(&event["kv"]["key"])).into_owned();
                let deleted = event["type"].as_str() == Some("DELETE");
                from = from.max(int(&event["kv"]["mod_revision"]) + 1);
                if key == keys.wake && !deleted {
                    named |= unb64(&event["kv"]["value"]) == instance.as_bytes();
                    lease_gone = false;
                } else if key == keys.lease {
                    // What an attempt starts from, kept current.
                    let record = (!deleted)
                        .then(|| LeaseRecord::parse(&event["kv"]).ok())
                        .flatten();
                    *waiter.handed.lock().unwrap() =
                        record.clone().filter(|r| r.instance == instance);
                    if let Some(seen) = seen.lock().unwrap().as_mut() {
                        seen.lease = record;
                    }
                    lease_gone = deleted
                        && !events
                            .iter()
                            .any(|e| unb64(&e["kv"]["key"]) == keys.wake.as_bytes());
                } else if key == keys.counter && !deleted {
                    if let (Some(seen), Ok((counter, revision))) = (
                        seen.lock().unwrap().as_mut(),
                        counter_of(Some(&event["kv"])),
                    ) {
                        seen.counter = counter;
                        seen.counter_revision = revision;
                    }
                }
            }
            if named || (lease_gone && first_in_line(&client, &keys, &instance).await) {
                waiter.notify.notify_one();
            }
        }
        waiter.watching.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A holder's watch of the line: keeps `line` current, from `initial` (the
/// line's keys and the revision they were read at) or a read of its own.
/// Re-opened after a break, from where it stopped.
pub(super) async fn watch_line(
    client: Arc<Client>,
    keys: Keys,
    line: Arc<Line>,
    initial: Option<(Vec<Value>, i64)>,
) {
    let read = || async {
        let reply = client
            .call("kv/range", &range_prefix(&keys.line, 0)["request_range"])
            .await
            .ok()?;
        let kvs = reply["kvs"].as_array().cloned().unwrap_or_default();
        Some((kvs, int(&reply["header"]["revision"])))
    };
    // A term that ends within this time releases to whom the acquisition
    // saw in line (the release reads the line too): a cycle of a command
    // that does nothing opens no watch.
    if initial.is_some() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut initial = initial;
    loop {
        let Some((places, revision)) = (match initial.take() {
            Some(initial) => Some(initial),
            None => read().await,
        }) else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        line.places.lock().unwrap().clear();
        for kv in &places {
            line.put(&keys, kv);
        }
        let create = json!({
            "key": b64(keys.line.as_bytes()),
            "range_end": b64(&prefix_end(keys.line.as_bytes())),
            "start_revision": (revision + 1).to_string(),
        });
        let Ok(mut stream) = client.watch(create).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        while let Ok(result) = stream.next().await {
            if result["canceled"].as_bool().unwrap_or(false) {
                break;
            }
            for event in result["events"].as_array().into_iter().flatten() {
                if event["type"].as_str() == Some("DELETE") {
                    line.delete(&keys, &event["kv"]);
                } else {
                    line.put(&keys, &event["kv"]);
                }
            }
        }
        // Read the line again: events may have been missed.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether this follower has waited longest.
async fn first_in_line(client: &Client, keys: &Keys, instance: &str) -> bool {
    let reply = client
        .call("kv/range", &range_prefix(&keys.line, 1)["request_range"])
        .await;
    match reply {
        Ok(reply) => reply["kvs"][0]["key"]
            .as_str()
            .map(|k| unb64(&json!(k)) == format!("{}{instance}", keys.line).as_bytes())
            // Nobody in line (a race): wake, the attempt tells.
            .unwrap_or(true),
        Err(_) => true,
    }
}
