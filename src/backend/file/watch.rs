//! The head of the followers' line watches the lease file with inotify: the
//! holder's release writes it and the holder's death closes it, and either
//! wakes the head at once.
//!
//! Only the head watches (a watch left on would wake this process at every
//! write of the file), and the inotify descriptor is made the first time
//! this replica heads the line: closing one costs milliseconds in the
//! kernel's mark teardown, which a replica that never follows should not pay.

use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Mutex};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tracing::{debug, warn};

/// The watch of one replica on one lease file.
#[derive(Default)]
pub struct Watch {
    state: Mutex<State>,
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

/// The inotify descriptor, readable in the runtime.
pub type Events = AsyncFd<Watcher>;

/// The inotify instance, as a raw descriptor for `AsyncFd`.
pub struct Watcher(Inotify);

impl AsRawFd for Watcher {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// What a head should do now.
pub enum HeadWatch {
    /// Wait for these events.
    Wait(Arc<Events>),
    /// The watch just started: a release may have come before it, so attempt.
    Started,
    /// No watch is possible: poll.
    Poll,
}

impl Watch {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The head's watch on the lease file at `path`: started if it is not
    /// yet (then `Started`).
    pub fn head(&self, path: &Path) -> HeadWatch {
        let mut state = self.state();
        let events = match &*state {
            State::Watching(events, _) => return HeadWatch::Wait(events.clone()),
            State::Unavailable => return HeadWatch::Poll,
            State::Idle(events) => events.clone(),
            State::Unstarted => match setup() {
                Ok(events) => Arc::new(events),
                Err(e) => {
                    warn!(error = %e, "cannot watch the lease file; followers fall back to polling");
                    *state = State::Unavailable;
                    return HeadWatch::Poll;
                }
            },
        };
        match add(&events, path) {
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
            let _ = events.get_ref().0.rm_watch(*wd);
            *state = State::Idle(events.clone());
        }
    }

    /// Watches the lease file at `path` again after it was reopened (an
    /// operator replaced it): the old watch went with the old file.
    pub fn rewatch(&self, path: &Path) -> io::Result<()> {
        let mut state = self.state();
        if let State::Watching(events, _) = &*state {
            let events = events.clone();
            let wd = add(&events, path)?;
            *state = State::Watching(events, wd);
        }
        Ok(())
    }
}

fn setup() -> io::Result<Events> {
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
    // SAFETY: the Watcher owns the inotify descriptor for as long as the
    // AsyncFd lives, and always returns that same descriptor.
    unsafe { AsyncFd::register_with_interest(Watcher(inotify), tokio::io::Interest::READABLE) }
        .map_err(|e| e.into())
}

fn add(events: &Events, path: &Path) -> io::Result<WatchDescriptor> {
    Ok(events.get_ref().0.add_watch(
        path,
        AddWatchFlags::IN_MODIFY
            | AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_ATTRIB
            | AddWatchFlags::IN_DELETE_SELF
            | AddWatchFlags::IN_MOVE_SELF,
    )?)
}

/// Waits until the watched file changes (any event but the removal of a
/// watch). Returns at once on an error: the caller attempts.
pub async fn changed(events: &Events) {
    loop {
        let Ok(mut ready) = events.readable().await else {
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
