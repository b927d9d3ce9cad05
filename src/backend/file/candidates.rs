//! Candidate records: one heartbeat file per running replica of a key,
//! `<lease name>.<instance>.candidate` next to the lease file.
//!
//! A replica refreshes its own on every attempt and renewal and removes it
//! on a graceful exit. A replica that dies leaves its file behind, expired
//! after ttl; every replica removes expired ones at most once per ttl, so
//! records of killed replicas do not pile up.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use nix::unistd::{UnlinkatFlags, unlinkat};

use super::clock;
use super::lease::Shared;
use super::record::{CandidateRecord, live_candidate};
use crate::backend::{Candidate, unix_ms};

impl Shared {
    fn candidate_name(&self, instance: &str) -> String {
        let stem = self.name.strip_suffix(".lease").unwrap_or(&self.name);
        format!("{stem}.{instance}.candidate")
    }

    /// Writes this replica's candidate record; best effort (a replica that
    /// cannot write it still leads and follows, it is just not listed).
    /// Removes expired records of other replicas at most once per ttl.
    pub fn beat(&self, leading: bool) {
        let Some(me) = &self.me else { return };
        let now = clock::now_ns();
        let candidate = Candidate {
            owner: me.id.owner.clone(),
            host: me.id.host.clone(),
            pid: me.id.pid,
            since_ms: me.id.since_ms,
            last_seen_ms: unix_ms(),
            leading,
            shards: me.id.shards,
        };
        let record = CandidateRecord {
            candidate: &candidate,
            boot: &self.boot_id,
            expires: clock::after(now, me.ttl),
        };
        let written = nix::fcntl::openat(
            self.dir(),
            self.candidate_name(&me.id.instance).as_str(),
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(io::Error::from)
        .and_then(|fd| File::from(fd).write_all_at(&record.encode(), 0));
        if let Err(error) = written {
            tracing::debug!(error = %error, "cannot write the candidate record");
        }
        let mut pruned_at = me.pruned_at.lock().unwrap_or_else(|e| e.into_inner());
        if pruned_at.is_some_and(|at| at.elapsed() >= me.ttl) {
            *pruned_at = Some(Instant::now());
            self.remove_expired_candidates();
        }
    }

    /// Removes this replica's candidate record (expired ones are pruned by
    /// the replicas that run on).
    pub fn withdraw(&self) {
        let Some(me) = &self.me else { return };
        let _ = unlinkat(
            self.dir(),
            self.candidate_name(&me.id.instance).as_str(),
            UnlinkatFlags::NoRemoveDir,
        );
    }

    fn remove_expired_candidates(&self) {
        for (name, _) in self
            .candidate_files()
            .into_iter()
            .filter(|(_, c)| c.is_none())
        {
            let _ = unlinkat(self.dir(), name.as_str(), UnlinkatFlags::NoRemoveDir);
        }
    }

    /// The live candidates of this key, oldest first.
    pub fn candidates(&self) -> Vec<Candidate> {
        let mut live: Vec<Candidate> = self
            .candidate_files()
            .into_iter()
            .filter_map(|(_, c)| c)
            .collect();
        live.sort_by_key(|c| (c.since_ms, c.pid));
        live
    }

    /// Every candidate file of this key, with its record if it is live.
    fn candidate_files(&self) -> Vec<(String, Option<Candidate>)> {
        let stem = self.name.strip_suffix(".lease").unwrap_or(&self.name);
        let prefix = format!("{stem}.");
        let Ok(entries) = std::fs::read_dir(&self.dir_path) else {
            return Vec::new();
        };
        let now = clock::now_ns();
        entries
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| name.starts_with(&prefix) && name.ends_with(".candidate"))
            .map(|name| {
                let record = std::fs::read(self.dir_path.join(&name))
                    .ok()
                    .and_then(|bytes| live_candidate(&bytes, &self.boot_id, now));
                (name, record)
            })
            .collect()
    }
}
