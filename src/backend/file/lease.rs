//! The lease file and every read-modify-write of it, under the mutex byte.
//!
//! One file per key holds the lease record: the token counter, and the
//! holder's owner, instance, attempt, token and expiry. The holder keeps a
//! *liveness* lock on its token's byte for its whole term; the kernel drops
//! it the moment the holder dies, so a dead holder frees the lease at once,
//! while one that is alive but stuck keeps its byte and loses the lease
//! when its expiry passes. A successor locks the byte of its own, newer
//! token, so a stuck holder's byte never gets in its way.
//!
//! Tokens only grow across `kill -9` and reboots, without an fsync on every
//! acquisition: the record keeps a *reserved* high-water mark, synced to disk
//! before any child sees a token below it, in blocks of `RESERVE` tokens.
//! Within one boot the page cache is coherent, so the counter read back is
//! exact even after every process was killed. Only a kernel crash or power
//! loss can lose unsynced writes, and both mean a new boot: a record written
//! in an earlier boot resumes above its reserved mark.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;

use super::clock;
use super::lock::{self, MAX_TOKEN, MUTEX_AT, liveness_at};
use super::record::{HolderRecord, Record, SLOT};
use super::watch::Watch;
use crate::backend::{
    Attempt, Fatal, Holder, Identity, Observation, RenewError, StoreError, Unreachable,
};

/// Tokens reserved per sync of the high-water mark.
pub const RESERVE: u64 = 1000;

/// What every call of one replica on one key shares.
pub struct Shared {
    /// None only for an observer of a directory that does not exist yet.
    pub dir: Option<OwnedFd>,
    pub dir_path: PathBuf,
    pub name: String,
    pub key: String,
    /// None for a read-only observer (`leaderrun status`).
    pub me: Option<Me>,
    pub boot_id: String,
    /// The head of the line's watch on the lease file, re-added when an
    /// operator replaces the file.
    pub watch: Watch,
    /// The open lease file, reopened if an operator replaces it. The mutex
    /// also keeps two calls of this process apart: OFD locks do not conflict
    /// within one open file description.
    pub file: Mutex<Option<File>>,
}

pub struct Me {
    pub id: Identity,
    pub ttl: Duration,
    /// How long a read-modify-write waits for another process's mutex: the
    /// call's own bound, so abandoned calls do not pile up behind a mutex.
    pub patience: Duration,
    /// When this replica last removed expired candidate records.
    pub pruned_at: Mutex<Option<Instant>>,
}

impl Shared {
    pub fn path(&self) -> PathBuf {
        self.dir_path.join(&self.name)
    }

    pub fn dir(&self) -> &OwnedFd {
        self.dir
            .as_ref()
            .expect("a mutating call on an observer of a missing directory")
    }

    pub fn me(&self) -> &Me {
        self.me
            .as_ref()
            .expect("a mutating call on a read-only observer")
    }

    pub fn acquire(&self, attempt: u64) -> Result<Attempt, StoreError> {
        self.locked(|lease| self.acquire_locked(lease, attempt, false))
            .map(|answer| answer.expect("a blocking acquisition always answers"))
    }

    /// The acquisition on the calling thread, if the mutex is free now and
    /// the token needs no sync to disk; None: go through the blocking pool.
    /// Nothing of this replica's runs while it acquires, so a slow disk can
    /// delay no deadline.
    pub fn acquire_now(&self, attempt: u64) -> Option<Result<Attempt, StoreError>> {
        self.locked_now(|lease| self.acquire_locked(lease, attempt, true))
    }

    /// `inline`: give up (None) rather than sync the record to disk.
    fn acquire_locked(
        &self,
        lease: &Locked<'_>,
        attempt: u64,
        inline: bool,
    ) -> Result<Option<Attempt>, StoreError> {
        let me = self.me();
        {
            let mut record = lease.read()?;
            let now = clock::now_ns();
            if let Some(holder) = &record.holder {
                let live = holder.boot == self.boot_id && now < holder.expires;
                let mine = holder.instance == me.id.instance;
                if mine && live && holder.attempt == attempt {
                    // A repeat of an attempt whose reply we never saw.
                    let token = holder.token;
                    lease.write_holder(&mut record, self, attempt, token, now)?;
                    return Ok(Some(Attempt::Acquired { token }));
                }
                if !mine && live && lease.liveness_held(holder.token)? {
                    return Ok(Some(Attempt::Held(Holder {
                        owner: holder.owner.clone(),
                        token: holder.token,
                        expires_in: Some(Duration::from_nanos(holder.expires - now)),
                    })));
                }
                if mine {
                    // An earlier term of ours, over now: a new term draws a
                    // new token.
                    lock::unlock(lease.file, liveness_at(holder.token));
                }
            }
            if record.counter >= MAX_TOKEN {
                return Err(Fatal::CounterExhausted {
                    counter: record.counter,
                    max: MAX_TOKEN,
                }
                .into());
            }
            let token = record.counter + 1;
            if inline && token > record.reserved {
                // The reserved mark moves: a sync, for the blocking pool.
                return Ok(None);
            }
            lease.lock_liveness(token)?;
            record.counter = token;
            if let Err(e) = lease.write_holder(&mut record, self, attempt, token, now) {
                lock::unlock(lease.file, liveness_at(token));
                return Err(e);
            }
            Ok(Some(Attempt::Acquired { token }))
        }
    }

    pub fn renew(&self, token: u64) -> Result<(), RenewError> {
        let me = self.me();
        let lost = self.locked::<_, RenewError>(|lease| {
            let mut record = lease.read()?;
            let now = clock::now_ns();
            match &record.holder {
                Some(h)
                    if h.instance == me.id.instance
                        && h.token == token
                        && h.boot == self.boot_id
                        && now < h.expires =>
                {
                    let attempt = h.attempt;
                    lease.write_holder(&mut record, self, attempt, token, now)?;
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
        match lost {
            None => Ok(()),
            Some(holder) => Err(RenewError::Lost(holder)),
        }
    }

    pub fn release(&self, token: u64) -> Result<bool, StoreError> {
        self.locked(|lease| self.release_locked(lease, token))
    }

    /// The release on the calling thread, if the mutex is free now (a
    /// release never syncs); None: go through the blocking pool. The term's
    /// processes are gone by then, so a slow disk can delay no deadline.
    pub fn release_now(&self, token: u64) -> Option<Result<bool, StoreError>> {
        self.locked_now(|lease| self.release_locked(lease, token).map(Some))
    }

    fn release_locked(&self, lease: &Locked<'_>, token: u64) -> Result<bool, StoreError> {
        let me = self.me();
        {
            let mut record = lease.read()?;
            let ours = record
                .holder
                .as_ref()
                .is_some_and(|h| h.instance == me.id.instance && h.token == token);
            if ours {
                record.holder = None;
                // The write is also what wakes the head of the line.
                lease.write(&mut record)?;
            }
            lock::unlock(lease.file, liveness_at(token));
            Ok(ours)
        }
    }

    pub fn advance_fence(&self, floor: u64) -> Result<u64, StoreError> {
        if floor > MAX_TOKEN {
            return Err(Fatal::FloorOutOfRange {
                floor,
                max: MAX_TOKEN,
            }
            .into());
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

    /// The holder and the counter, without taking the mutex or creating
    /// anything (the read of a slot is atomic enough: a torn slot is
    /// rejected by its checksum and the other one read).
    pub fn observe_lease(&self) -> Result<Observation, StoreError> {
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
            Err(e) => return Err(self.io("open", e.into()).into()),
        };
        let lease = Locked {
            file: &file,
            shared: self,
        };
        let record = lease.read()?;
        let now = clock::now_ns();
        let holder = match record.holder {
            Some(h)
                if h.boot == self.boot_id && now < h.expires && lease.liveness_held(h.token)? =>
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
            candidates: Vec::new(),
        })
    }

    /// Runs `op` on the lease file with the mutex byte held, after checking
    /// that the path still names the open file (an operator may have deleted
    /// or replaced it; writing to an unlinked file would split the lease).
    pub fn locked<T, E: From<Unreachable>>(
        &self,
        op: impl FnOnce(&Locked<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut slot = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let patience = Instant::now()
            + self
                .me
                .as_ref()
                .map_or(Duration::from_secs(2), |me| me.patience);
        loop {
            if slot.is_none() {
                *slot = Some(self.open_lease_file().map_err(|e| self.io("open", e))?);
                // The old watch went with the old file.
                self.watch
                    .rewatch(&self.path())
                    .map_err(|e| self.io("watch", e))?;
            }
            let file = slot.as_ref().expect("opened above");
            lock::lock_mutex(file, patience).map_err(|e| self.io("lock", e))?;
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
                lock::unlock(file, MUTEX_AT);
                return result;
            }
            // Closing the stale file also drops any liveness byte held in it:
            // the lease it described no longer exists.
            *slot = None;
        }
    }

    /// `locked`, but only if the lease file is open and its mutex byte free
    /// right now: no wait, for the calling thread. None if not, or if `op`
    /// gives up (Ok(None)).
    fn locked_now<T, E: From<Unreachable>>(
        &self,
        op: impl FnOnce(&Locked<'_>) -> Result<Option<T>, E>,
    ) -> Option<Result<T, E>> {
        let slot = self.file.try_lock().ok()?;
        let file = slot.as_ref()?;
        lock::try_lock(file, MUTEX_AT).ok()?;
        let same =
            nix::sys::stat::fstatat(self.dir(), self.name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
                .is_ok_and(|st| {
                    file.metadata()
                        .is_ok_and(|m| m.dev() == st.st_dev && m.ino() == st.st_ino)
                });
        let result = same.then(|| op(&Locked { file, shared: self }));
        lock::unlock(file, MUTEX_AT);
        match result? {
            Ok(Some(answer)) => Some(Ok(answer)),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }

    pub fn open_lease_file(&self) -> io::Result<File> {
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

    pub fn io(&self, what: &str, source: io::Error) -> Unreachable {
        Unreachable::Io {
            context: format!("{what} {}", self.path().display()),
            source,
        }
    }
}

/// The lease file with the mutex byte held.
pub struct Locked<'a> {
    pub file: &'a File,
    shared: &'a Shared,
}

impl Locked<'_> {
    pub fn read(&self) -> Result<Record, StoreError> {
        let mut buf = vec![0u8; 2 * SLOT];
        let mut filled = 0;
        while filled < buf.len() {
            match self.file.read_at(&mut buf[filled..], filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.shared.io("read", e).into()),
            }
        }
        let slots: Vec<&[u8]> = buf.chunks(SLOT).collect();
        let records: Vec<Record> = slots.iter().filter_map(|s| Record::decode(s)).collect();
        if records.is_empty() {
            if slots.iter().all(|s| s.iter().all(|b| *b == 0)) {
                return Ok(Record::new(&self.shared.key));
            }
            return Err(Fatal::Corrupt(format!(
                "{} has no readable record; move it aside only if no replica runs, as its counter is lost with it",
                self.shared.path().display()
            ))
            .into());
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
            return Err(Fatal::Corrupt(format!(
                "{} belongs to key {:?}, not {:?} (a file name collision): use another state directory for one of them",
                self.shared.path().display(),
                record.key,
                self.shared.key
            ))
            .into());
        }
        Ok(record)
    }

    /// Writes the record to the next slot; syncs it when the counter has
    /// passed the reserved mark, which then moves a block ahead.
    pub fn write(&self, record: &mut Record) -> Result<(), StoreError> {
        let sync = record.counter > record.reserved;
        if sync {
            record.reserved = record.counter.saturating_add(RESERVE);
        }
        record.boot = self.shared.boot_id.clone();
        record.seq += 1;
        let offset = (record.seq % 2) * SLOT as u64;
        self.file
            .write_all_at(&record.encode(), offset)
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
        attempt: u64,
        token: u64,
        now: u64,
    ) -> Result<(), StoreError> {
        let me = shared.me();
        record.holder = Some(HolderRecord {
            owner: me.id.owner.clone(),
            instance: me.id.instance.clone(),
            attempt,
            token,
            boot: shared.boot_id.clone(),
            // `now` was read after the caller's send instant, so this expiry is
            // never earlier than the one the supervisor computes.
            expires: clock::after(now, me.ttl),
        });
        self.write(record)
    }

    /// Whether another process holds the liveness byte of `token`.
    fn liveness_held(&self, token: u64) -> Result<bool, Unreachable> {
        lock::held_elsewhere(self.file, liveness_at(token))
            .map_err(|e| self.shared.io("probe lock on", e))
    }

    fn lock_liveness(&self, token: u64) -> Result<(), Fatal> {
        lock::try_lock(self.file, liveness_at(token)).map_err(|e| {
            Fatal::Corrupt(format!(
                "the liveness lock of token {token} in {} is held by another process ({e}): the counter went backwards",
                self.shared.path().display()
            ))
        })
    }
}
