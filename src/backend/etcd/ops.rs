//! What the store's requests are made of: the operations and conditions of
//! etcd transactions (JSON for the v3 gateway), and the reading of replies.

use serde_json::{Value, json};

use super::client::{b64, int, unb64};
use crate::backend::{Fatal, StoreError, Unreachable};

pub(super) fn put(key: &str, value: &str, lease: Option<i64>) -> Value {
    let mut put = json!({"key": b64(key.as_bytes()), "value": b64(value.as_bytes())});
    if let Some(lease) = lease {
        put["lease"] = json!(lease.to_string());
    }
    json!({ "request_put": put })
}

pub(super) fn range(key: &str) -> Value {
    json!({ "request_range": {"key": b64(key.as_bytes())} })
}

/// `range`, answered by the member asked from what it has applied, without
/// asking the etcd leader (a transaction of such reads only is): it may be
/// behind, so only for a guess that a transaction's conditions check.
pub(super) fn range_local(key: &str) -> Value {
    json!({ "request_range": {"key": b64(key.as_bytes()), "serializable": true} })
}

/// Every key that starts with `prefix`, oldest first.
pub(super) fn range_prefix(prefix: &str, limit: i64) -> Value {
    json!({ "request_range": {
        "key": b64(prefix.as_bytes()),
        "range_end": b64(&prefix_end(prefix.as_bytes())),
        "sort_order": "ASCEND",
        "sort_target": "CREATE",
        "limit": limit,
    }})
}

/// A transaction's condition: `key` last changed at `revision` (0: absent).
pub(super) fn same_revision(key: &str, revision: i64) -> Value {
    json!({"key": b64(key.as_bytes()), "target": "MOD", "result": "EQUAL", "mod_revision": revision.to_string()})
}

/// A transaction's condition: `key` does not exist.
pub(super) fn absent(key: &str) -> Value {
    json!({"key": b64(key.as_bytes()), "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
}

/// The counter key's value and revision (0 and 0 when absent).
pub(super) fn counter_of(kv: Option<&Value>) -> Result<(u64, i64), StoreError> {
    let Some(kv) = kv else {
        return Ok((0, 0));
    };
    let counter = String::from_utf8_lossy(&unb64(&kv["value"]))
        .parse()
        .map_err(|_| Fatal::Corrupt("the counter key is not a number".into()))?;
    Ok((counter, int(&kv["mod_revision"])))
}

pub(super) fn delete(key: &str) -> Value {
    json!({ "request_delete_range": {"key": b64(key.as_bytes())} })
}

/// The end of the range of keys that start with `prefix`.
pub(super) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Whether a call failed because the etcd lease it named is gone.
pub(super) fn lease_gone(error: &StoreError) -> bool {
    matches!(error, StoreError::Unreachable(Unreachable::Server(why)) if why.contains("requested lease not found"))
}

/// The key-values of the `n`th response of a transaction.
pub(super) fn kvs(reply: &Value, n: usize) -> Vec<Value> {
    reply["responses"][n]["response_range"]["kvs"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}
