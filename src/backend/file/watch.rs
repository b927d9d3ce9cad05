//! The head of the followers' line watches the lease file with inotify: the
//! holder's release writes it and the holder's death closes it, and either
//! wakes the head at once.
//!
//! Only the head watches (a watch left on would wake this process at every
//! write of the file), and the inotify descriptor is made the first time
//! this replica heads a line: closing one costs milliseconds in the
//! kernel's mark teardown, which a replica that never follows should not pay.
//!
//! The lease stores of one backend (a replica's shards) share one inotify
//! descriptor, its events handed to each watch by watch descriptor: a user
//! may have 128 descriptors (`fs.inotify.max_user_instances`), and with one
//! per store, four replicas of 64 file shards on a host ran out, and the
//! heads that could not watch fell back to polling.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Mutex};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tracing::{debug, warn};

/// The inotify descriptor of one backend's stores, made on the first watch.
#[derive(Default)]
pub struct Hub {
    events: Mutex<Option<Arc<Events>>>,
}

impl Hub {
    fn events(&self) -> io::Result<Arc<Events>> {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(events) = &*events {
            return Ok(events.clone());
        }
        let made = Arc::new(setup()?);
        *events = Some(made.clone());
        Ok(made)
    }
}

/// The watch of one replica on one lease file.
pub struct Watch {
    hub: Arc<Hub>,
    state: Mutex<State>,
    /// Told when an event for this watch's file was read (by any watch's
    /// wait); a permit is kept until this watch waits.
    changed: Arc<Notify>,
}

#[derive(Default)]
enum State {
    /// No inotify descriptor yet: this replica has not headed the line.
    #[default]
    Unstarted,
    /// inotify could not be set up: the head polls instead.
    Unavailable,
    /// Set up, but not watching: this replica leads, or waits behind the head.
    Idle(Arc<Events>),
    /// At the head of the line, watching the lease file.
    Watching(Arc<Events>, WatchDescriptor),
}

/// The shared inotify descriptor, readable in the runtime, and who waits
/// for which of its watch descriptors.
pub struct Events {
    fd: AsyncFd<Watcher>,
    waiting: Mutex<Waiting>,
}

type Waiting = HashMap<WatchDescriptor, Vec<Arc<Notify>>>;

impl Events {
    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tells each watch whose file changed. An overflow of the kernel's
    /// queue loses events: every watch is told.
    fn hand_out(&self, events: &[InotifyEvent]) {
        let waiting = self.waiting();
        for event in events {
            if event.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                waiting.values().flatten().for_each(|n| n.notify_one());
            } else if !event.mask.contains(AddWatchFlags::IN_IGNORED) {
                if let Some(told) = waiting.get(&event.wd) {
                    told.iter().for_each(|n| n.notify_one());
                }
            }
        }
    }

    /// Stops telling `changed` of `wd`'s events; true if no watch waits
    /// for them any more.
    fn forget(&self, wd: WatchDescriptor, changed: &Arc<Notify>) -> bool {
        let mut waiting = self.waiting();
        let Some(told) = waiting.get_mut(&wd) else {
            return true;
        };
        told.retain(|n| !Arc::ptr_eq(n, changed));
        let last = told.is_empty();
        if last {
            waiting.remove(&wd);
        }
        last
    }
}

/// What a head waits on: the shared descriptor, and its watch's notice.
pub struct Waiter {
    events: Arc<Events>,
    changed: Arc<Notify>,
}

/// The inotify instance, as a raw descriptor for `AsyncFd`.
pub struct Watcher(Inotify);

impl AsRawFd for Watcher {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// What a head should do now.
pub enum HeadWatch {
    /// Wait for its file's events.
    Wait(Waiter),
    /// The watch just started: a release may have come before it, so attempt.
    Started,
    /// No watch is possible: poll.
    Poll,
}

impl Watch {
    pub fn new(hub: Arc<Hub>) -> Watch {
        Watch {
            hub,
            state: Mutex::default(),
            changed: Arc::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The head's watch on the lease file at `path`: started if it is not
    /// yet (then `Started`).
    pub fn head(&self, path: &Path) -> HeadWatch {
        let mut state = self.state();
        let events = match &*state {
            State::Watching(events, _) => {
                return HeadWatch::Wait(Waiter {
                    events: events.clone(),
                    changed: self.changed.clone(),
                });
            }
            State::Unavailable => return HeadWatch::Poll,
            State::Idle(events) => events.clone(),
            State::Unstarted => match self.hub.events() {
                Ok(events) => events,
                Err(e) => {
                    warn!(error = %e, "cannot watch the lease file; followers fall back to polling");
                    *state = State::Unavailable;
                    return HeadWatch::Poll;
                }
            },
        };
        match self.add(&events, path) {
            Ok(wd) => {
                *state = State::Watching(events, wd);
                HeadWatch::Started
            }
            Err(e) => {
                debug!(error = %e, "cannot watch the lease file; polling");
                *state = State::Idle(events);
                HeadWatch::Poll
            }
        }
    }

    /// Whether the head can watch (inotify could be set up, or has not been
    /// tried yet).
    pub fn available(&self) -> bool {
        !matches!(*self.state(), State::Unavailable)
    }

    /// Stops watching (this replica leads, or left the head).
    pub fn stop(&self) {
        let mut state = self.state();
        if let State::Watching(events, wd) = &*state {
            if events.forget(*wd, &self.changed) {
                let _ = events.fd.get_ref().0.rm_watch(*wd);
            }
            *state = State::Idle(events.clone());
        }
    }

    /// Watches the lease file at `path` again after it was reopened (an
    /// operator replaced it): the old watch went with the old file.
    pub fn rewatch(&self, path: &Path) -> io::Result<()> {
        let mut state = self.state();
        if let State::Watching(events, old) = &*state {
            let events = events.clone();
            // The old watch went with the old file (its IN_IGNORED).
            events.forget(*old, &self.changed);
            let wd = self.add(&events, path)?;
            *state = State::Watching(events, wd);
        }
        Ok(())
    }

    fn add(&self, events: &Events, path: &Path) -> io::Result<WatchDescriptor> {
        let wd = events.fd.get_ref().0.add_watch(
            path,
            AddWatchFlags::IN_MODIFY
                | AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_ATTRIB
                | AddWatchFlags::IN_DELETE_SELF
                | AddWatchFlags::IN_MOVE_SELF,
        )?;
        events
            .waiting()
            .entry(wd)
            .or_default()
            .push(self.changed.clone());
        Ok(wd)
    }
}

fn setup() -> io::Result<Events> {
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
    // SAFETY: the Watcher owns the inotify descriptor for as long as the
    // AsyncFd lives, and always returns that same descriptor.
    let fd = unsafe {
        AsyncFd::register_with_interest(Watcher(inotify), tokio::io::Interest::READABLE)
    }?;
    Ok(Events {
        fd,
        waiting: Mutex::default(),
    })
}

/// Waits until the watched file changes (any event but the removal of a
/// watch), read here or by another watch's wait. Returns at once on an
/// error: the caller attempts.
pub async fn changed(waiter: &Waiter) {
    let notified = waiter.changed.notified();
    tokio::pin!(notified);
    loop {
        tokio::select! {
            biased;
            () = &mut notified => return,
            ready = waiter.events.fd.readable() => {
                let Ok(mut ready) = ready else {
                    return;
                };
                match ready.get_inner().0.read_events() {
                    Ok(events) => waiter.events.hand_out(&events),
                    Err(nix::errno::Errno::EAGAIN) => ready.clear_ready(),
                    Err(_) => return,
                }
            }
        }
    }
}
