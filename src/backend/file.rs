//! The embedded backend: leases in a private directory, for replicas on one
//! host, with no server.
//!
//! One file per key holds the lease record: the token counter, and the
//! holder's owner, instance, token and expiry. Three kinds of open-file-
//! description (OFD) locks on that file do the rest:
//!
//! - a *mutex* byte, held for the microseconds of a read-modify-write;
//! - a *liveness* byte per token, held by the holder for its whole term. The
//!   kernel drops it the moment the holder dies, so a dead holder frees the
//!   lease at once; a holder that is alive but stuck keeps its byte, and loses
//!   the lease when its expiry passes. A successor locks the byte of its own,
//!   newer token, so a stuck holder's byte never gets in its way.
//!
//! Expiry is kept on CLOCK_BOOTTIME together with the boot id: the wall clock
//! may jump, and a record from an earlier boot is known to be stale.
//!
//! The record is written to alternating slots, each with a sequence number
//! and a checksum, so a write torn by a crash leaves the previous record
//! readable.
//!
//! Tokens only grow across `kill -9` and reboots, without an fsync on every
//! acquisition: the record keeps a *reserved* high-water mark, synced to disk
//! before any child sees a token below it, in blocks of `RESERVE` tokens.
//! Within one boot the page cache is coherent, so the counter read back is
//! exact even after every process was killed. Only a kernel crash or power
//! loss can lose unsynced writes, and both mean a new boot: a record written
//! in an earlier boot resumes above its reserved mark, never below a token
//! that may have been handed out.
//!
//! Followers wait in a line (see `Line`): the one at its head watches the
//! file with inotify (the holder's release writes it and the holder's death
//! closes it, and either wakes the head at once); the others wait in the
//! kernel for the head's place. A release wakes one process, not every
//! follower.
//!
//! Every descriptor is close-on-exec: an OFD lock lives as long as any
//! descriptor of its open file description, so a child that inherited one
//! would keep the lease alive after leaderrun died.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use nix::sys::stat::Mode;
use tokio::io::unix::AsyncFd;
use tracing::warn;

use super::{Attempt, Candidate, Holder, Identity, Observation, RenewError, Unreachable, unix_ms};
use crate::error::ConfigError;

/// Bytes per record slot; a record is at most about 600 bytes.
const SLOT: usize = 1024;
/// Lock offsets, far past the record: advisory locks need no data there.
const MUTEX_AT: i64 = 1 << 40;
/// The followers' line: held by the head, queued for by the others.
const LINE_AT: i64 = MUTEX_AT + 1;
const LIVENESS_BASE: i64 = 1 << 41;
/// Tokens stay below this so every liveness offset fits in an `off_t`.
pub const MAX_TOKEN: u64 = 1 << 60;
/// Tokens reserved per sync of the high-water mark.
const RESERVE: u64 = 1000;

#[derive(Clone)]
pub struct FileBackend {
    shared: Arc<Shared>,
    /// Created when this replica first heads the line, so one that never
    /// does never pays for closing an inotify descriptor (milliseconds, in
    /// the kernel's mark teardown). None inside: could not watch; poll.
    notices: Arc<OnceLock<Option<AsyncFd<Watcher>>>>,
    line: Arc<Line>,
}

struct Shared {
    /// None only for an observer of a directory that does not exist yet.
    dir: Option<OwnedFd>,
    dir_path: PathBuf,
    name: String,
    key: String,
    /// None for a read-only observer (`leaderrun status`).
    me: Option<Me>,
    boot_id: String,
    /// The head's watch, re-added when the file is replaced. Only the head
    /// of the line watches: a watch left on would wake this process at
    /// every write of the file.
    inotify: OnceLock<Arc<Inotify>>,
    watching: Mutex<Option<WatchDescriptor>>,
    /// The open lease file, reopened if an operator replaces it. The mutex
    /// also keeps two calls of this process apart: OFD locks do not conflict
    /// within one open file description.
    file: Mutex<Option<File>>,
}

struct Me {
    id: Identity,
    ttl: Duration,
    /// How long a read-modify-write waits for another process's mutex: the
    /// call's own bound, so abandoned calls do not pile up behind a mutex.
    patience: Duration,
}

impl FileBackend {
    pub fn open(
        dir: &Path,
        key: &str,
        id: Identity,
        ttl: Duration,
        patience: Duration,
    ) -> Result<FileBackend, ConfigError> {
        let dir_fd = open_state_dir(dir, true)?.expect("created");
        let io_error = |source| ConfigError::StateDir {
            path: dir.display().to_string(),
            source,
        };
        let shared = Shared {
            dir: Some(dir_fd),
            dir_path: dir.to_owned(),
            name: file_name(key),
            key: key.to_owned(),
            me: Some(Me { id, ttl, patience }),
            boot_id: boot_id(),
            inotify: OnceLock::new(),
            watching: Mutex::new(None),
            file: Mutex::new(None),
        };
        let file = shared.open_lease_file().map_err(io_error)?;
        *shared.file.lock().unwrap() = Some(file);
        Ok(FileBackend {
            shared: Arc::new(shared),
            notices: Arc::default(),
            line: Arc::default(),
        })
    }

    /// A read-only view for `status`: creates nothing.
    pub fn observer(dir: &Path, key: &str) -> Result<FileBackend, ConfigError> {
        Ok(FileBackend {
            shared: Arc::new(Shared {
                dir: open_state_dir(dir, false)?,
                dir_path: dir.to_owned(),
                name: file_name(key),
                key: key.to_owned(),
                me: None,
                boot_id: boot_id(),
                inotify: OnceLock::new(),
                watching: Mutex::new(None),
                file: Mutex::new(None),
            }),
            notices: Arc::default(),
            line: Arc::default(),
        })
    }

    // Every call that a replica makes as it campaigns or leads also
    // refreshes its candidate record, so status lists it without a call of
    // its own.

    pub async fn acquire(&self) -> Result<Attempt, Unreachable> {
        let attempt = self
            .blocking(|shared| {
                let attempt = shared.acquire()?;
                shared.beat(matches!(attempt, Attempt::Acquired { .. }));
                Ok(attempt)
            })
            .await?;
        Ok(attempt)
    }

    pub async fn renew(&self, token: u64) -> Result<(), RenewError> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || {
            let renewed = shared.renew(token);
            shared.beat(renewed.is_ok());
            renewed
        })
        .await
        .unwrap_or_else(|e| Err(Unreachable::Corrupt(e.to_string()).into()))
    }

    pub async fn release(&self, token: u64) -> Result<bool, Unreachable> {
        self.blocking(move |shared| {
            let released = shared.release(token)?;
            shared.beat(false);
            Ok(released)
        })
        .await
    }

    pub async fn heartbeat(&self) -> Result<(), Unreachable> {
        self.blocking(|shared| {
            shared.beat(false);
            Ok(())
        })
        .await
    }

    pub async fn withdraw(&self) -> Result<(), Unreachable> {
        self.blocking(Shared::withdraw).await
    }
    pub async fn advance_fence(&self, floor: u64) -> Result<u64, Unreachable> {
        self.blocking(move |shared| shared.advance_fence(floor))
            .await
    }

    pub async fn observe(&self) -> Result<Observation, Unreachable> {
        self.blocking(Shared::observe).await
    }

    /// Waits for a turn to attempt. Behind the head of the line: until this
    /// replica becomes the head (then at once, since a release may have
    /// come before the watch). At the head: until the lease file is written
    /// (a release), closed by a writer (a holder that exited or died) or
    /// replaced.
    pub async fn notice(&self) {
        if !self.line.follow(&self.shared) {
            self.line.head.notified().await;
            // The new head attempts at once, watching or not.
            self.head_watch();
            return;
        }
        let watching = self
            .shared
            .watching
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        let notices = match self.notices.get() {
            // Could not watch: poll.
            Some(None) => return std::future::pending().await,
            Some(Some(notices)) if watching => notices,
            // At the head but not watching (yet, or again after leading):
            // start, and attempt once, since a release may have come first.
            _ => {
                if self.head_watch() {
                    return;
                }
                return std::future::pending().await;
            }
        };
        loop {
            let Ok(mut ready) = notices.readable().await else {
                return;
            };
            match ready.get_inner().0.read_events() {
                Ok(events)
                    if events
                        .iter()
                        .any(|e| !e.mask.contains(AddWatchFlags::IN_IGNORED)) =>
                {
                    return;
                }
                Err(nix::errno::Errno::EAGAIN) | Ok(_) => ready.clear_ready(),
                Err(_) => return,
            }
        }
    }

    /// Gives this replica's place in line to the next follower (it leads).
    pub fn leave_line(&self) {
        self.line.leave();
        self.shared.stop_watching();
    }

    /// Starts the head's watch (the inotify descriptor on first use).
    /// Returns whether it is watching; if not, the head polls.
    fn head_watch(&self) -> bool {
        let notices = self.notices.get_or_init(|| {
            self.watch()
                .inspect_err(|e| warn!(error = %e, "cannot watch the lease file; followers fall back to polling"))
                .ok()
        });
        if notices.is_none() {
            return false;
        }
        self.shared
            .start_watching()
            .inspect_err(|e| tracing::debug!(error = %e, "cannot watch the lease file; polling"))
            .is_ok()
    }

    fn watch(&self) -> io::Result<AsyncFd<Watcher>> {
        let inotify = Arc::new(Inotify::init(
            InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC,
        )?);
        let _ = self.shared.inotify.set(inotify.clone());
        register(Watcher(inotify))
    }

    /// Runs a file operation on the blocking pool, so a slow disk can delay
    /// the call (which the caller bounds) but never the supervisor's timers.
    async fn blocking<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Shared) -> Result<T, Unreachable> + Send + 'static,
    ) -> Result<T, Unreachable> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || op(&shared))
            .await
            .unwrap_or_else(|e| Err(Unreachable::Corrupt(e.to_string())))
    }
}

impl Shared {
    fn start_watching(&self) -> io::Result<()> {
        let Some(inotify) = self.inotify.get() else {
            return Ok(());
        };
        let mut watching = self.watching.lock().unwrap_or_else(|e| e.into_inner());
        *watching = Some(watch(inotify, &self.path())?);
        Ok(())
    }

    fn stop_watching(&self) {
        let mut watching = self.watching.lock().unwrap_or_else(|e| e.into_inner());
        if let (Some(inotify), Some(wd)) = (self.inotify.get(), watching.take()) {
            let _ = inotify.rm_watch(wd);
        }
    }

    fn path(&self) -> PathBuf {
        self.dir_path.join(&self.name)
    }

    fn dir(&self) -> &OwnedFd {
        self.dir
            .as_ref()
            .expect("a mutating call on an observer of a missing directory")
    }

    fn me(&self) -> &Me {
        self.me
            .as_ref()
            .expect("a mutating call on a read-only observer")
    }

    fn acquire(&self) -> Result<Attempt, Unreachable> {
        let me = self.me();
        self.locked(|lease| {
            let mut record = lease.read()?;
            let now = boottime_ns();
            if let Some(holder) = &record.holder {
                let live = holder.boot == self.boot_id && now < holder.expires;
                if holder.instance == me.id.instance && live {
                    // A repeat of an attempt whose reply we never saw.
                    let token = holder.token;
                    lease.write_holder(&mut record, self, token, now)?;
                    return Ok(Attempt::Acquired { token });
                }
                if holder.instance != me.id.instance
                    && live
                    && lease.holds_liveness(holder.token)?
                {
                    return Ok(Attempt::Held(Holder {
                        owner: holder.owner.clone(),
                        token: holder.token,
                        expires_in: Some(Duration::from_nanos(holder.expires - now)),
                    }));
                }
                if holder.instance == me.id.instance {
                    lease.unlock_liveness(holder.token);
                }
            }
            let token = record.counter + 1;
            if token >= MAX_TOKEN {
                return Err(Unreachable::Corrupt(format!(
                    "token counter exhausted at {}",
                    record.counter
                )));
            }
            lease.lock_liveness(token)?;
            record.counter = token;
            if let Err(e) = lease.write_holder(&mut record, self, token, now) {
                lease.unlock_liveness(token);
                return Err(e);
            }
            Ok(Attempt::Acquired { token })
        })
    }

    fn renew(&self, token: u64) -> Result<(), RenewError> {
        let me = self.me();
        let result = self.locked(|lease| {
            let mut record = lease.read()?;
            let now = boottime_ns();
            match &record.holder {
                Some(h)
                    if h.instance == me.id.instance
                        && h.token == token
                        && h.boot == self.boot_id
                        && now < h.expires =>
                {
                    lease.write_holder(&mut record, self, token, now)?;
                    Ok(None)
                }
                // Expired, released by an operator, or taken by someone else.
                other => Ok(Some(
                    other
                        .clone()
                        .filter(|h| h.instance != me.id.instance)
                        .map(|h| Holder {
                            owner: h.owner,
                            token: h.token,
                            expires_in: None,
                        }),
                )),
            }
        })?;
        match result {
            None => Ok(()),
            Some(holder) => Err(RenewError::Lost(holder)),
        }
    }

    fn release(&self, token: u64) -> Result<bool, Unreachable> {
        let me = self.me();
        self.locked(|lease| {
            let mut record = lease.read()?;
            let ours = record
                .holder
                .as_ref()
                .is_some_and(|h| h.instance == me.id.instance && h.token == token);
            if ours {
                record.holder = None;
                // The write is also what wakes the followers.
                lease.write(&mut record)?;
            }
            lease.unlock_liveness(token);
            Ok(ours)
        })
    }

    fn advance_fence(&self, floor: u64) -> Result<u64, Unreachable> {
        if floor >= MAX_TOKEN {
            return Err(Unreachable::Corrupt(format!(
                "fence floor {floor} is above the largest token {MAX_TOKEN}"
            )));
        }
        self.locked(|lease| {
            let mut record = lease.read()?;
            if record.counter < floor {
                record.counter = floor;
                lease.write(&mut record)?;
            }
            Ok(record.counter)
        })
    }

    fn observe(&self) -> Result<Observation, Unreachable> {
        let free = Observation {
            holder: None,
            counter: 0,
            candidates: Vec::new(),
        };
        let Some(dir) = &self.dir else {
            return Ok(free);
        };
        let file = match nix::fcntl::openat(
            dir,
            self.name.as_str(),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
            Mode::empty(),
        ) {
            Ok(fd) => File::from(fd),
            Err(nix::errno::Errno::ENOENT) => return Ok(free),
            Err(e) => return Err(self.io("open", e.into())),
        };
        let lease = Locked {
            file: &file,
            shared: self,
        };
        let record = lease.read()?;
        let now = boottime_ns();
        let holder = match record.holder {
            Some(h)
                if h.boot == self.boot_id
                    && now < h.expires
                    && lease.holds_liveness(h.token)? =>
            {
                Some(Holder {
                    owner: h.owner,
                    token: h.token,
                    expires_in: Some(Duration::from_nanos(h.expires - now)),
                })
            }
            _ => None,
        };
        Ok(Observation {
            holder,
            counter: record.counter,
            candidates: self.candidates(),
        })
    }

    /// `<lease name>.<instance>.candidate`: one heartbeat file per replica.
    fn candidate_name(&self, instance: &str) -> String {
        let stem = self.name.strip_suffix(".lease").unwrap_or(&self.name);
        format!("{stem}.{instance}.candidate")
    }

    /// Writes this replica's candidate record; best effort (a replica that
    /// cannot write it still leads and follows, it is just not listed).
    fn beat(&self, leading: bool) {
        let Some(me) = &self.me else { return };
        let now = boottime_ns();
        let line = seal(format!(
            "{CANDIDATE} owner={} host={} pid={} since_ms={} seen_ms={} leading={} boot={} expires={}",
            me.id.owner,
            me.id.host,
            me.id.pid,
            me.id.since_ms,
            unix_ms(),
            u8::from(leading),
            self.boot_id,
            now + me.ttl.as_nanos() as u64,
        ));
        let written = nix::fcntl::openat(
            self.dir(),
            self.candidate_name(&me.id.instance).as_str(),
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(io::Error::from)
        .and_then(|fd| {
            let mut slot = line.into_bytes();
            slot.resize(SLOT, 0);
            File::from(fd).write_all_at(&slot, 0)
        });
        if let Err(error) = written {
            tracing::debug!(error = %error, "cannot write the candidate record");
        }
    }

    /// Removes this replica's candidate record, and any that expired.
    fn withdraw(&self) -> Result<(), Unreachable> {
        let Some(me) = &self.me else { return Ok(()) };
        let mut names: Vec<String> = self
            .candidate_files()
            .into_iter()
            .filter(|(_, c)| c.is_none())
            .map(|(name, _)| name)
            .collect();
        names.push(self.candidate_name(&me.id.instance));
        for name in names {
            let _ = nix::unistd::unlinkat(
                self.dir(),
                name.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
        Ok(())
    }

    /// The live candidates of this key.
    fn candidates(&self) -> Vec<Candidate> {
        let mut live: Vec<Candidate> = self
            .candidate_files()
            .into_iter()
            .filter_map(|(_, c)| c)
            .collect();
        live.sort_by(|a, b| a.since_ms.cmp(&b.since_ms).then(a.pid.cmp(&b.pid)));
        live
    }

    /// Every candidate file of this key, with its record if it is live.
    fn candidate_files(&self) -> Vec<(String, Option<Candidate>)> {
        let stem = self.name.strip_suffix(".lease").unwrap_or(&self.name);
        let Ok(entries) = std::fs::read_dir(&self.dir_path) else {
            return Vec::new();
        };
        let now = boottime_ns();
        entries
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| name.starts_with(&format!("{stem}.")) && name.ends_with(".candidate"))
            .map(|name| {
                let record = std::fs::read(self.dir_path.join(&name))
                    .ok()
                    .and_then(|bytes| parse_candidate(&bytes, &self.boot_id, now));
                (name, record)
            })
            .collect()
    }

    /// Runs `op` on the lease file with the mutex byte held, after checking
    /// that the path still names the open file (an operator may have deleted
    /// or replaced it; writing to an unlinked file would split the lease).
    fn locked<T>(
        &self,
        op: impl FnOnce(&Locked<'_>) -> Result<T, Unreachable>,
    ) -> Result<T, Unreachable> {
        let mut slot = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let patience = Instant::now()
            + self
                .me
                .as_ref()
                .map_or(Duration::from_secs(2), |me| me.patience);
        loop {
            if slot.is_none() {
                *slot = Some(self.open_lease_file().map_err(|e| self.io("open", e))?);
                if self
                    .watching
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_some()
                {
                    // The old watch went with the old file.
                    self.start_watching().map_err(|e| self.io("watch", e))?;
                }
            }
            let file = slot.as_ref().expect("opened above");
            lock_mutex(file, patience).map_err(|e| self.io("lock", e))?;
            let same = nix::sys::stat::fstatat(
                self.dir(),
                self.name.as_str(),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .is_ok_and(|st| {
                file.metadata()
                    .is_ok_and(|m| m.dev() == st.st_dev && m.ino() == st.st_ino)
            });
            if same {
                let result = op(&Locked { file, shared: self });
                let _ = set_lock(file, libc::F_OFD_SETLK, libc::F_UNLCK, MUTEX_AT);
                return result;
            }
            // Closing the stale file also drops any liveness byte held in it:
            // the lease it described no longer exists.
            *slot = None;
        }
    }

    fn open_lease_file(&self) -> io::Result<File> {
        let flags = OFlag::O_RDWR | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        let mode = Mode::from_bits_truncate(0o600);
        let (fd, created) = match nix::fcntl::openat(
            self.dir(),
            self.name.as_str(),
            flags | OFlag::O_CREAT | OFlag::O_EXCL,
            mode,
        ) {
            Ok(fd) => (fd, true),
            Err(nix::errno::Errno::EEXIST) => (
                nix::fcntl::openat(self.dir(), self.name.as_str(), flags, mode)?,
                false,
            ),
            Err(e) => return Err(e.into()),
        };
        let file = File::from(fd);
        if created {
            // The new name must be durable too, or a crash could lose the
            // file and its counter with it.
            nix::unistd::fsync(self.dir())?;
        }
        let meta = file.metadata()?;
        if meta.uid() != nix::unistd::geteuid().as_raw() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} is owned by uid {}, not this user",
                    self.path().display(),
                    meta.uid()
                ),
            ));
        }
        Ok(file)
    }

    fn io(&self, what: &str, source: io::Error) -> Unreachable {
        Unreachable::Io {
            context: format!("{what} {}", self.path().display()),
            source,
        }
    }
}

/// The lease file with the mutex byte held.
struct Locked<'a> {
    file: &'a File,
    shared: &'a Shared,
}

impl Locked<'_> {
    fn read(&self) -> Result<Record, Unreachable> {
        let mut buf = vec![0u8; 2 * SLOT];
        let mut filled = 0;
        while filled < buf.len() {
            match self.file.read_at(&mut buf[filled..], filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.shared.io("read", e)),
            }
        }
        let slots: Vec<&[u8]> = buf.chunks(SLOT).collect();
        let records: Vec<Record> = slots.iter().filter_map(|s| Record::decode(s)).collect();
        if records.is_empty() {
            if slots.iter().all(|s| s.iter().all(|b| *b == 0)) {
                return Ok(Record::new(&self.shared.key));
            }
            return Err(Unreachable::Corrupt(format!(
                "{} has no readable record; move it aside only if no replica runs, as its counter is lost with it",
                self.shared.path().display()
            )));
        }
        let mut record = records
            .into_iter()
            .max_by_key(|r| r.seq)
            .expect("not empty");
        if record.boot != self.shared.boot_id {
            // Written in an earlier boot: writes after the last sync may have
            // been lost with the page cache, so any token up to the reserved
            // mark may have been handed out.
            record.counter = record.counter.max(record.reserved);
        }
        if record.key != self.shared.key {
            return Err(Unreachable::Corrupt(format!(
                "{} belongs to key {:?}, not {:?} (a file name collision): use another state directory for one of them",
                self.shared.path().display(),
                record.key,
                self.shared.key
            )));
        }
        Ok(record)
    }

    /// Writes the record to the next slot; syncs it when the counter has
    /// passed the reserved mark, which then moves a block ahead.
    fn write(&self, record: &mut Record) -> Result<(), Unreachable> {
        let sync = record.counter > record.reserved;
        if sync {
            record.reserved = record.counter + RESERVE;
        }
        record.boot = self.shared.boot_id.clone();
        record.seq += 1;
        let mut slot = record.encode().into_bytes();
        slot.resize(SLOT, 0);
        let offset = (record.seq % 2) * SLOT as u64;
        self.file
            .write_all_at(&slot, offset)
            .map_err(|e| self.shared.io("write", e))?;
        if sync {
            self.file
                .sync_data()
                .map_err(|e| self.shared.io("sync", e))?;
        }
        Ok(())
    }

    fn write_holder(
        &self,
        record: &mut Record,
        shared: &Shared,
        token: u64,
        now: u64,
    ) -> Result<(), Unreachable> {
        let me = shared.me();
        record.holder = Some(HolderRecord {
            owner: me.id.owner.clone(),
            instance: me.id.instance.clone(),
            token,
            boot: shared.boot_id.clone(),
            // `now` was read after the caller's send instant, so this expiry is
            // never earlier than the one the supervisor computes.
            expires: now + me.ttl.as_nanos() as u64,
        });
        self.write(record)
    }

    /// Whether another process holds the liveness byte of `token`.
    fn holds_liveness(&self, token: u64) -> Result<bool, Unreachable> {
        let mut probe = flock(libc::F_WRLCK, liveness_at(token));
        // SAFETY: F_OFD_GETLK fills in the flock struct we own.
        let rc = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_GETLK, &mut probe) };
        if rc != 0 {
            return Err(self.shared.io("probe lock on", io::Error::last_os_error()));
        }
        Ok(probe.l_type != libc::F_UNLCK as libc::c_short)
    }

    fn lock_liveness(&self, token: u64) -> Result<(), Unreachable> {
        set_lock(self.file, libc::F_OFD_SETLK, libc::F_WRLCK, liveness_at(token)).map_err(|e| {
            Unreachable::Corrupt(format!("the liveness lock of token {token} is held by another process ({e}): the counter went backwards"))
        })
    }

    fn unlock_liveness(&self, token: u64) {
        let _ = set_lock(
            self.file,
            libc::F_OFD_SETLK,
            libc::F_UNLCK,
            liveness_at(token),
        );
    }
}

fn liveness_at(token: u64) -> i64 {
    LIVENESS_BASE + token as i64
}

fn flock(kind: libc::c_int, start: i64) -> libc::flock {
    // SAFETY: flock is plain old data; zero is a valid value for every field.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = start;
    lock.l_len = 1;
    lock
}

fn set_lock(file: &File, cmd: libc::c_int, kind: libc::c_int, start: i64) -> io::Result<()> {
    let lock = flock(kind, start);
    // SAFETY: the fd is open for the duration of the call; lock is ours.
    if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &lock) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Takes the mutex byte, retrying until `patience` runs out. Not a blocking
/// lock: a process stopped while holding it must not hang this one beyond
/// the call's bound.
fn lock_mutex(file: &File, patience: Instant) -> io::Result<()> {
    let mut pause = Duration::from_micros(20);
    loop {
        match set_lock(file, libc::F_OFD_SETLK, libc::F_WRLCK, MUTEX_AT) {
            Ok(()) => return Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                if Instant::now() >= patience {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "lease file mutex held by another process",
                    ));
                }
                std::thread::sleep(pause);
                // Held for microseconds: never sleep long past its release.
                pause = (pause * 2).min(Duration::from_millis(1));
            }
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
}

/// The inotify instance, shared with the blocking calls that re-add the watch.
struct Watcher(Arc<Inotify>);

impl AsRawFd for Watcher {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

fn register(watcher: Watcher) -> io::Result<AsyncFd<Watcher>> {
    // SAFETY: the Watcher owns (through the Arc) the inotify descriptor for
    // as long as the AsyncFd lives, and always returns the same descriptor.
    unsafe { AsyncFd::register_with_interest(watcher, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into())
}

fn watch(inotify: &Inotify, path: &Path) -> io::Result<WatchDescriptor> {
    Ok(inotify.add_watch(
        path,
        AddWatchFlags::IN_MODIFY
            | AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_ATTRIB
            | AddWatchFlags::IN_DELETE_SELF
            | AddWatchFlags::IN_MOVE_SELF,
    )?)
}

/// The followers' line. Of the replicas waiting for a lease, one at a time,
/// the head, watches the lease file and attempts when it changes; each of
/// the others has a thread blocked in the kernel on the line byte, which the
/// kernel grants to one of them when the head leaves it (it acquired the
/// lease, or exited, or died). A release thus wakes one process: with 100
/// followers, the herd that answered every release was what delayed the
/// winner's child. Followers still poll at campaign_every and at a lease's
/// known expiry, so a stuck head slows handover to that, never stops it.
#[derive(Default)]
struct Line {
    state: Mutex<LineState>,
    changed: Condvar,
    /// Signalled when this replica becomes the head.
    head: tokio::sync::Notify,
}

#[derive(Default)]
struct LineState {
    following: bool,
    head: bool,
    queuing: bool,
}

impl Line {
    /// Joins the line (once per campaign: the thread queues while
    /// following). Returns whether this replica is the head.
    fn follow(self: &Arc<Self>, shared: &Arc<Shared>) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !state.following {
            state.following = true;
            self.changed.notify_all();
        }
        if !state.queuing {
            state.queuing = true;
            let (line, shared) = (self.clone(), shared.clone());
            let spawned = std::thread::Builder::new()
                .name("leaderrun-line".into())
                .spawn(move || line.queue(&shared));
            if let Err(e) = spawned {
                // Without a place in line, watch like a head: more wake-ups,
                // nothing missed.
                warn!(error = %e, "cannot queue for the lease; watching it directly");
                state.head = true;
            }
        }
        state.head
    }

    /// Leaves the line (this replica leads now): the thread lets the next
    /// follower have the head's place.
    fn leave(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.following = false;
        self.changed.notify_all();
    }

    /// The line thread: waits for the line byte while following, holds it as
    /// head until this replica stops following, and queues again.
    fn queue(&self, shared: &Shared) {
        loop {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            while !state.following {
                state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            drop(state);
            // Opened for each turn, so a replaced lease file is queued on as
            // it is now; close-on-exec like every descriptor here.
            let place = shared.open_lease_file().and_then(|file| {
                loop {
                    match set_lock(&file, libc::F_OFD_SETLKW, libc::F_WRLCK, LINE_AT) {
                        Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                        done => return done.map(|()| file),
                    }
                }
            });
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let Ok(_place) = place.inspect_err(|e| {
                warn!(error = %e, "cannot queue for the lease; watching it directly");
            }) else {
                state.head = true;
                self.head.notify_one();
                return;
            };
            if state.following {
                state.head = true;
                self.head.notify_one();
                while state.following {
                    state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                state.head = false;
            }
            // Dropping `_place` closes it and gives the byte to the next.
        }
    }
}

/// Opens (and with `create`, makes) the state directory, refusing one that
/// another user owns or that group or others may write: anyone who can
/// write there can take or forge a lease.
/// Without `create`, a directory that does not exist is `None`.
fn open_state_dir(dir: &Path, create: bool) -> Result<Option<OwnedFd>, ConfigError> {
    let shown = || dir.display().to_string();
    let io_error = |source| ConfigError::StateDir {
        path: shown(),
        source,
    };
    if create {
        match std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_error(e)),
        }
    }
    let fd = match nix::fcntl::open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(nix::errno::Errno::ENOENT) if !create => return Ok(None),
        Err(e) => return Err(io_error(e.into())),
    };
    let stat = nix::sys::stat::fstat(&fd).map_err(|e| io_error(e.into()))?;
    let me = nix::unistd::geteuid().as_raw();
    if stat.st_uid != me {
        return Err(ConfigError::UnsafeStateDir {
            path: shown(),
            why: format!(
                "owned by uid {}, not by this user (uid {me}); chown it, or point --backend at a directory of your own",
                stat.st_uid
            ),
        });
    }
    if stat.st_mode & 0o022 != 0 {
        return Err(ConfigError::UnsafeStateDir {
            path: shown(),
            why: format!(
                "mode {:04o} lets group or others write; run chmod 700 {}",
                stat.st_mode & 0o7777,
                shown()
            ),
        });
    }
    Ok(Some(fd))
}

/// A safe file name for any key: a hash for uniqueness, and a readable
/// (sanitized, truncated) copy of the key for operators. `/`, `..` and
/// unicode cannot escape the directory or make hidden files.
fn file_name(key: &str) -> String {
    let readable: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    format!("{:016x}-{readable}.lease", fnv1a(key.as_bytes()))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| {
        (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn boottime_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .expect("CLOCK_BOOTTIME is always available on Linux");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_owned())
        .unwrap_or_default()
}

/// One lease record, as stored in a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    seq: u64,
    /// The last token handed out (or the fence floor).
    counter: u64,
    /// Synced high-water mark: no token above it has been handed out.
    reserved: u64,
    /// The boot that wrote this record.
    boot: String,
    key: String,
    holder: Option<HolderRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct HolderRecord {
    owner: String,
    instance: String,
    token: u64,
    boot: String,
    /// CLOCK_BOOTTIME nanoseconds of the boot named by `boot`.
    expires: u64,
}

const MAGIC: &str = "leaderrun-lease/1";
const CANDIDATE: &str = "leaderrun-candidate/1";

/// A record line: `body sum=<checksum of body>` and a newline.
fn seal(body: String) -> String {
    let sum = fnv1a(body.as_bytes());
    format!("{body} sum={sum:016x}\n")
}

/// The body of a sealed line at the start of `bytes`, if its checksum holds.
fn unseal(bytes: &[u8]) -> Option<&str> {
    let end = bytes.iter().position(|b| *b == b'\n')?;
    let line = std::str::from_utf8(&bytes[..end]).ok()?;
    let (body, sum) = line.rsplit_once(" sum=")?;
    (u64::from_str_radix(sum, 16).ok()? == fnv1a(body.as_bytes())).then_some(body)
}

/// The `name=value` fields of a body after its magic word.
fn fields<'a>(body: &'a str, magic: &str) -> Option<Vec<(&'a str, &'a str)>> {
    let mut words = body.split(' ');
    if words.next()? != magic {
        return None;
    }
    words.map(|w| w.split_once('=')).collect()
}

/// A live candidate record (same boot, not expired), or None.
fn parse_candidate(bytes: &[u8], boot_id: &str, now: u64) -> Option<Candidate> {
    let fields = fields(unseal(bytes)?, CANDIDATE)?;
    let get = |name: &str| fields.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
    let number = |name: &str| get(name)?.parse::<u64>().ok();
    if get("boot")? != boot_id || number("expires")? <= now {
        return None;
    }
    Some(Candidate {
        owner: get("owner")?.to_owned(),
        host: get("host")?.to_owned(),
        pid: number("pid")? as u32,
        since_ms: number("since_ms")?,
        last_seen_ms: number("seen_ms")?,
        leading: get("leading")? == "1",
    })
}

impl Record {
    fn new(key: &str) -> Record {
        Record {
            seq: 0,
            counter: 0,
            reserved: 0,
            boot: String::new(),
            key: key.to_owned(),
            holder: None,
        }
    }

    /// One line of `name=value` fields (keys and owners have no whitespace),
    /// ending in a checksum of everything before it.
    fn encode(&self) -> String {
        let mut line = format!(
            "{MAGIC} seq={} counter={} reserved={} boot={} key={}",
            self.seq, self.counter, self.reserved, self.boot, self.key
        );
        if let Some(h) = &self.holder {
            line += &format!(
                " owner={} instance={} token={} holder_boot={} expires={}",
                h.owner, h.instance, h.token, h.boot, h.expires
            );
        }
        seal(line)
    }

    fn decode(slot: &[u8]) -> Option<Record> {
        let fields = fields(unseal(slot)?, MAGIC)?;
        let get = |name: &str| fields.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        let number = |name: &str| get(name)?.parse::<u64>().ok();
        let holder = match get("owner") {
            None => None,
            Some(owner) => Some(HolderRecord {
                owner: owner.to_owned(),
                instance: get("instance")?.to_owned(),
                token: number("token")?,
                boot: get("holder_boot")?.to_owned(),
                expires: number("expires")?,
            }),
        };
        Some(Record {
            seq: number("seq")?,
            counter: number("counter")?,
            reserved: number("reserved")?,
            boot: get("boot")?.to_owned(),
            key: get("key")?.to_owned(),
            holder,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(token: u64) -> Record {
        Record {
            seq: 7,
            counter: token,
            reserved: token + RESERVE,
            boot: "c0ffee".into(),
            key: "a=b/../ключ".into(),
            holder: Some(HolderRecord {
                owner: "host:42".into(),
                instance: "00ff".into(),
                token,
                boot: "c0ffee".into(),
                expires: 123_456_789,
            }),
        }
    }

    #[test]
    fn records_round_trip() {
        for record in [held(5), Record::new("k")] {
            let mut slot = record.encode().into_bytes();
            slot.resize(SLOT, 0);
            assert_eq!(Record::decode(&slot), Some(record));
        }
    }

    #[test]
    fn a_torn_or_edited_record_is_rejected() {
        let line = held(5).encode();
        assert_eq!(Record::decode(&line.as_bytes()[..line.len() / 2]), None);
        let edited = line.replace("counter=5", "counter=1");
        assert_eq!(Record::decode(edited.as_bytes()), None);
    }

    #[test]
    fn file_names_are_safe_and_distinct() {
        for key in [
            "..",
            "a/b",
            "../../etc/passwd",
            ".hidden",
            "ключ",
            &"x".repeat(200),
        ] {
            let name = file_name(key);
            assert!(!name.contains('/') && !name.starts_with('.'), "{name}");
            assert!(name.len() < 100, "{name}");
            assert!(name.is_ascii(), "{name}");
        }
        assert_ne!(file_name("a/b"), file_name("a_b"));
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("leaderrun-unit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_record_from_another_boot_is_free_and_resumes_above_its_reserve() {
        let dir = temp_dir("boot");
        let a = FileBackend::open_blocking(&dir, "k", "a");
        assert_eq!(a.acquire().unwrap(), Attempt::Acquired { token: 1 });
        // What a crash could leave: the last synced record of an earlier
        // boot, its holder's expiry far ahead on that boot's clock, and
        // tokens up to its reserved mark possibly handed out unsynced.
        let mut stale = held(5);
        stale.key = "k".into();
        stale.seq = 100;
        stale.boot = "an-earlier-boot".into();
        let holder = stale.holder.as_mut().unwrap();
        holder.boot = "an-earlier-boot".into();
        holder.expires = u64::MAX / 2;
        let mut slot = stale.encode().into_bytes();
        slot.resize(SLOT, 0);
        a.file
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .write_all_at(&slot, 0)
            .unwrap();

        let b = FileBackend::open_blocking(&dir, "k", "b");
        assert_eq!(
            b.acquire().unwrap(),
            Attempt::Acquired {
                token: 5 + RESERVE + 1
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_reserved_mark_moves_a_block_at_a_time() {
        let dir = temp_dir("reserve");
        let a = FileBackend::open_blocking(&dir, "k", "a");
        let reserved = |shared: &Shared| shared.locked(|lease| lease.read()).unwrap().reserved;
        for token in 1..=3 {
            assert_eq!(a.acquire().unwrap(), Attempt::Acquired { token });
            assert!(a.release(token).unwrap());
            assert_eq!(reserved(&a), 1 + RESERVE, "one sync for the whole block");
        }
        assert_eq!(a.advance_fence(5000).unwrap(), 5000);
        assert_eq!(reserved(&a), 5000 + RESERVE);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_holder_is_seen_until_it_releases() {
        let dir = temp_dir("hold");
        let a = FileBackend::open_blocking(&dir, "k", "a");
        let b = FileBackend::open_blocking(&dir, "k", "b");
        assert_eq!(a.acquire().unwrap(), Attempt::Acquired { token: 1 });
        // Acquire is idempotent for the holder.
        assert_eq!(a.acquire().unwrap(), Attempt::Acquired { token: 1 });
        let Attempt::Held(holder) = b.acquire().unwrap() else {
            panic!("b acquired a held lease")
        };
        assert_eq!((holder.owner.as_str(), holder.token), ("a", 1));
        assert!(holder.expires_in.unwrap() <= Duration::from_secs(6));
        a.renew(1).unwrap();
        assert!(matches!(b.renew(1), Err(RenewError::Lost(Some(_)))));
        assert!(a.release(1).unwrap());
        assert!(!a.release(1).unwrap(), "a second release finds nothing");
        assert!(matches!(a.renew(1), Err(RenewError::Lost(None))));
        assert_eq!(b.acquire().unwrap(), Attempt::Acquired { token: 2 });
        assert_eq!(b.advance_fence(50).unwrap(), 50);
        assert_eq!(b.advance_fence(10).unwrap(), 50);
        assert!(b.release(2).unwrap());
        assert_eq!(a.acquire().unwrap(), Attempt::Acquired { token: 51 });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unsafe_directories_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("mode");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = open_state_dir(&dir, true).unwrap_err().to_string();
        assert!(error.contains("chmod 700"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    impl FileBackend {
        fn open_blocking(dir: &Path, key: &str, owner: &str) -> Arc<Shared> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
                .unwrap();
            let _entered = runtime.enter();
            FileBackend::open(
                dir,
                key,
                Identity::new(owner),
                Duration::from_secs(6),
                Duration::from_secs(2),
            )
            .unwrap()
            .shared
        }
    }
}
