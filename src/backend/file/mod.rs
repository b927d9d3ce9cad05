//! The embedded backend: leases in a private directory, for replicas on one
//! host, with no server.
//!
//! - `state_dir.rs`: where the directory is, its safety checks, file names;
//! - `record.rs`: the lease and candidate records and their encoding;
//! - `lock.rs`: the OFD locks on single bytes of the lease file;
//! - `lease.rs`: every read-modify-write of the lease, under the mutex byte;
//! - `candidates.rs`: the replicas' heartbeat files;
//! - `line.rs` and `watch.rs`: the followers' line and the head's watch;
//! - `clock.rs`: CLOCK_BOOTTIME and the boot id.

mod candidates;
mod clock;
mod lease;
mod line;
mod lock;
mod record;
mod state_dir;
mod watch;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;

use self::lease::{Me, Shared};
use self::line::Line;
use self::watch::{HeadWatch, Hub, Watch};
use super::{
    Attempt, Backend, BackendOptions, Bounded, Call, Capabilities, Fatal, LeaseConfig, LeaseStore,
    Observation, RenewError, StoreError,
};
use crate::error::ConfigError;

/// The largest token the file backend issues.
pub const MAX_TOKEN: u64 = lock::MAX_TOKEN;

/// `file:///abs/dir` or `file:/abs/dir`: a state directory on this host.
pub struct FileBackend {
    dir: PathBuf,
    /// The inotify descriptor its stores' watches share.
    hub: Arc<Hub>,
}

/// `file://` with no path, or no `--backend` at all: the default directory.
pub fn default(options: &BackendOptions) -> Result<Arc<dyn Backend>, ConfigError> {
    refuse_options("file://", options)?;
    Ok(Arc::new(FileBackend {
        dir: state_dir::default_dir()?,
        hub: Arc::default(),
    }))
}

/// Parses `file:DIR` (DIR absolute), `file:///abs/dir` or `file://` (the
/// default directory).
pub fn parse(url: &str, options: &BackendOptions) -> Result<Arc<dyn Backend>, ConfigError> {
    let refused = |why: String| ConfigError::BackendUrl {
        url: url.to_owned(),
        why,
    };
    refuse_options(url, options)?;
    let rest = &url["file:".len()..];
    let path = match rest.strip_prefix("//") {
        Some("") => return default(options),
        Some(path) if path.starts_with('/') => path,
        Some(_) => {
            return Err(refused(
                "a file:// URL names no host: use file:///abs/dir (three slashes)".into(),
            ));
        }
        None if rest.is_empty() => {
            return Err(refused("no directory given: use file:///abs/dir".into()));
        }
        None if !rest.starts_with('/') => {
            // Replicas started from different directories would each get a
            // lease of their own, and all lead.
            let absolute = std::env::current_dir()
                .map(|cwd| format!(" (from here: file://{})", cwd.join(rest).display()))
                .unwrap_or_default();
            return Err(refused(format!(
                "the directory {rest:?} is relative, so replicas started from different directories would use different leases; give an absolute path{absolute}"
            )));
        }
        None => rest,
    };
    let dir = url::Url::parse(&format!("file://{path}"))
        .ok()
        .and_then(|u| u.to_file_path().ok())
        .ok_or_else(|| refused("not a valid directory path".into()))?;
    Ok(Arc::new(FileBackend {
        dir,
        hub: Arc::default(),
    }))
}

fn refuse_options(url: &str, options: &BackendOptions) -> Result<(), ConfigError> {
    if options.tls_ca_file.is_some() {
        return Err(ConfigError::BackendUrl {
            url: url.to_owned(),
            why: "--tls-ca-file applies to TLS backends (rediss://) only".into(),
        });
    }
    Ok(())
}

impl fmt::Display for FileBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file://{}", self.dir.display())
    }
}

impl Backend for FileBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            tokens: true,
            fence_advance: true,
            durable_tokens: true,
            server_clock: true,
            max_token: MAX_TOKEN,
        }
    }

    fn lease(&self, lease: LeaseConfig) -> Result<Arc<dyn LeaseStore>, ConfigError> {
        let call_timeout = lease.call_timeout;
        let store = FileStore::open(&self.dir, lease, self.hub.clone())?;
        Ok(Bounded::wrap(Arc::new(store), call_timeout))
    }

    fn observer(
        &self,
        key: &str,
        call_timeout: Duration,
    ) -> Result<Arc<dyn LeaseStore>, ConfigError> {
        let store = FileStore {
            shared: Arc::new(Shared {
                dir: state_dir::open(&self.dir, false)?,
                dir_path: self.dir.clone(),
                name: state_dir::file_name(key),
                key: key.to_owned(),
                me: None,
                boot_id: clock::boot_id(),
                watch: Watch::new(self.hub.clone()),
                file: Mutex::new(None),
            }),
            line: Arc::default(),
            pending_write: Mutex::default(),
            withdrawn: AtomicBool::new(false),
        };
        Ok(Bounded::wrap(Arc::new(store), call_timeout))
    }
}

/// One replica's lease on one key.
pub struct FileStore {
    shared: Arc<Shared>,
    line: Arc<Line>,
    /// The candidate record's write after an acquisition or a release (or
    /// its removal after the last release), off the way to the command or
    /// to the next leader's; the next call waits for it, so records never
    /// go back.
    pending_write: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The last release removed the candidate record (or its removal is
    /// pending): `withdraw` has nothing left to do but wait for it.
    withdrawn: AtomicBool,
}

impl FileStore {
    /// Keeps `write` (a candidate record's write or removal, started off
    /// the caller's way) for the next call to wait for.
    fn write_later(&self, write: tokio::task::JoinHandle<()>) {
        *self.pending_write.lock().unwrap() = Some(write);
    }

    /// Waits for a candidate record still being written, so that records
    /// are written in the order of the calls.
    async fn settle(&self) {
        let pending = self.pending_write.lock().unwrap().take();
        if let Some(write) = pending {
            let _ = write.await;
        }
    }

    fn open(dir: &Path, lease: LeaseConfig, hub: Arc<Hub>) -> Result<FileStore, ConfigError> {
        let dir_fd = state_dir::open(dir, true)?.expect("created");
        let shared = Shared {
            dir: Some(dir_fd),
            dir_path: dir.to_owned(),
            name: state_dir::file_name(&lease.key),
            key: lease.key,
            me: Some(Me {
                id: lease.me,
                ttl: lease.ttl,
                patience: lease.call_timeout,
                // The first pruning is a ttl after the start: a replica that
                // lives for a moment leaves the directory alone.
                pruned_at: Mutex::new(Some(std::time::Instant::now())),
            }),
            boot_id: clock::boot_id(),
            watch: Watch::new(hub),
            file: Mutex::new(None),
        };
        let file = shared
            .open_lease_file()
            .map_err(|source| ConfigError::StateDir {
                path: dir.display().to_string(),
                source,
            })?;
        *shared.file.lock().unwrap() = Some(file);
        Ok(FileStore {
            shared: Arc::new(shared),
            line: Arc::default(),
            pending_write: Mutex::default(),
            withdrawn: AtomicBool::new(false),
        })
    }

    /// The release, on this thread when the mutex is free (a handover's
    /// critical path: no hop to the blocking pool), else on the pool.
    async fn release_here(&self, token: u64) -> Result<bool, StoreError> {
        self.settle().await;
        match self.shared.release_now(token) {
            Some(released) => released,
            None => self.blocking(move |shared| shared.release(token)).await,
        }
    }

    /// Runs a file operation on the blocking pool, so a slow disk can delay
    /// the call (which the caller bounds) but never the supervisor's timers.
    async fn blocking<T: Send + 'static, E: From<StoreError> + Send + 'static>(
        &self,
        op: impl FnOnce(&Shared) -> Result<T, E> + Send + 'static,
    ) -> Result<T, E> {
        self.settle().await;
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || op(&shared))
            .await
            .unwrap_or_else(|e| {
                Err(
                    StoreError::from(Fatal::Internal(format!("a file backend call failed: {e}")))
                        .into(),
                )
            })
    }
}

// Every call that a replica makes as it campaigns or leads also refreshes
// its candidate record, so status lists it without a call of its own.
impl LeaseStore for FileStore {
    fn acquire(&self, attempt: u64) -> Call<'_, Attempt> {
        Box::pin(async move {
            self.settle().await;
            self.withdrawn.store(false, Ordering::SeqCst);
            // On this thread when the mutex is free (a handover's critical
            // path: no hop to the blocking pool), else on the pool.
            let (answer, answered_inline) = match self.shared.acquire_now(attempt) {
                Some(answer) => (answer?, true),
                None => (
                    self.blocking(move |shared| shared.acquire(attempt)).await?,
                    false,
                ),
            };
            let leading = matches!(answer, Attempt::Acquired { .. });
            // The candidate record after the answer, off the way to the
            // command. When the acquisition ran on this thread, the record
            // is written on it too (a small write costs the start less than
            // the blocking pool's thread does, 0.07 ms a cycle, measured),
            // in a task: it runs at the runtime's next turn, after the
            // command's spawn.
            let shared = self.shared.clone();
            let beat = if answered_inline {
                tokio::spawn(async move { shared.beat(leading) })
            } else {
                tokio::task::spawn_blocking(move || shared.beat(leading))
            };
            self.write_later(beat);
            Ok(answer)
        })
    }

    fn renew(&self, token: u64) -> BoxFuture<'_, Result<(), RenewError>> {
        Box::pin(self.blocking(move |shared| {
            let renewed = shared.renew(token);
            shared.beat(renewed.is_ok());
            renewed
        }))
    }

    fn release(&self, token: u64) -> Call<'_, bool> {
        Box::pin(async move {
            let released = self.release_here(token).await?;
            // The candidate record after the release, off the way to the
            // next leader's command.
            let shared = self.shared.clone();
            let beat = tokio::task::spawn_blocking(move || shared.beat(false));
            self.write_later(beat);
            Ok(released)
        })
    }

    /// The release and the candidate record's removal, on this thread when
    /// the mutex is free: the run is over, nothing of it can be delayed, and
    /// a hop to the blocking pool for the removal cost every run that ends
    /// with its command 0.2 ms (measured). The removal is a task, run at the
    /// runtime's next turn: after the caller has given up the CPU to the
    /// next leader, which the release woke. `withdraw` waits for it.
    fn release_last(&self, token: u64) -> Call<'_, bool> {
        Box::pin(async move {
            let released = self.release_here(token).await?;
            let shared = self.shared.clone();
            let removal = tokio::spawn(async move { shared.withdraw() });
            self.write_later(removal);
            self.withdrawn.store(true, Ordering::SeqCst);
            Ok(released)
        })
    }

    fn advance_fence(&self, floor: u64) -> Call<'_, u64> {
        Box::pin(self.blocking(move |shared| shared.advance_fence(floor)))
    }

    fn heartbeat(&self) -> Call<'_, ()> {
        Box::pin(self.blocking(|shared| {
            shared.beat(false);
            Ok(())
        }))
    }

    fn withdraw(&self) -> Call<'_, ()> {
        if self.withdrawn.load(Ordering::SeqCst) {
            return Box::pin(async {
                self.settle().await;
                Ok(())
            });
        }
        Box::pin(self.blocking(|shared| {
            shared.withdraw();
            Ok(())
        }))
    }

    fn observe(&self) -> Call<'_, Observation> {
        Box::pin(self.blocking(|shared| {
            let mut observation = shared.observe_lease()?;
            observation.candidates = shared.candidates();
            Ok(observation)
        }))
    }

    /// Behind the head of the line: waits until this replica becomes the
    /// head (then at once, since a release may have come before its watch).
    /// At the head: until the lease file is written (a release), closed by a
    /// writer (a holder that exited or died) or replaced.
    fn notice(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if !self.line.follow(&self.shared) {
                self.line.head.notified().await;
                // The new head attempts at once, watching or not.
                self.shared.watch.head(&self.shared.path());
                return;
            }
            match self.shared.watch.head(&self.shared.path()) {
                HeadWatch::Wait(events) => watch::changed(&events).await,
                HeadWatch::Started => {}
                HeadWatch::Poll => std::future::pending().await,
            }
        })
    }

    fn leading(&self) {
        self.line.leave();
        self.shared.watch.stop();
    }

    fn release_wakes_one(&self) -> bool {
        true
    }

    fn wakes_on_release(&self) -> bool {
        self.line.waiting() && self.shared.watch.available()
    }

    fn keep_fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        let file = self.shared.file.lock().unwrap();
        self.shared
            .dir
            .iter()
            .map(AsRawFd::as_raw_fd)
            .chain(file.iter().map(AsRawFd::as_raw_fd))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::lease::RESERVE;
    use super::record::{HolderRecord, Record};
    use super::*;
    use crate::backend::Identity;
    use std::os::unix::fs::FileExt;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("leaderrun-unit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn open(dir: &Path, owner: &str) -> Arc<Shared> {
        let lease = LeaseConfig {
            key: "k".into(),
            me: Identity::new(owner),
            ttl: Duration::from_secs(6),
            call_timeout: Duration::from_secs(2),
            hand_over: false,
        };
        FileStore::open(dir, lease, Arc::default()).unwrap().shared
    }

    #[test]
    fn a_record_from_another_boot_is_free_and_resumes_above_its_reserve() {
        let dir = temp_dir("boot");
        let a = open(&dir, "a");
        assert_eq!(a.acquire(1).unwrap(), Attempt::Acquired { token: 1 });
        // What a crash could leave: the last synced record of an earlier
        // boot, its holder's expiry far ahead on that boot's clock, and
        // tokens up to its reserved mark possibly handed out unsynced.
        let stale = Record {
            seq: 100,
            counter: 5,
            reserved: 5 + RESERVE,
            boot: "an-earlier-boot".into(),
            key: "k".into(),
            holder: Some(HolderRecord {
                owner: "host:42".into(),
                instance: "00ff".into(),
                attempt: 1,
                token: 5,
                boot: "an-earlier-boot".into(),
                expires: u64::MAX / 2,
            }),
        };
        a.file
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .write_all_at(&stale.encode(), 0)
            .unwrap();
        let b = open(&dir, "b");
        assert_eq!(
            b.acquire(1).unwrap(),
            Attempt::Acquired {
                token: 5 + RESERVE + 1
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_reserved_mark_moves_a_block_at_a_time() {
        let dir = temp_dir("reserve");
        let a = open(&dir, "a");
        let reserved = |shared: &Shared| shared.locked(|lease| lease.read()).unwrap().reserved;
        for token in 1..=3 {
            assert_eq!(a.acquire(token).unwrap(), Attempt::Acquired { token });
            assert!(a.release(token).unwrap());
            assert_eq!(reserved(&a), 1 + RESERVE, "one sync for the whole block");
        }
        assert_eq!(a.advance_fence(5000).unwrap(), 5000);
        assert_eq!(reserved(&a), 5000 + RESERVE);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn relative_and_hosted_urls_are_refused() {
        let options = BackendOptions::default();
        let message = parse("file:relative", &options).unwrap_err().to_string();
        assert!(message.contains("relative"), "{message}");
        assert!(message.contains("file:///"), "{message}");
        assert!(parse("file://host/path", &options).is_err());
        assert!(parse("file:", &options).is_err());
        let shown = |url| parse(url, &options).unwrap().to_string();
        assert_eq!(shown("file:///var/lib/x"), "file:///var/lib/x");
        assert_eq!(shown("file:/abs"), "file:///abs");
        assert_eq!(shown("file:///my%20dir"), "file:///my dir");
    }
}
