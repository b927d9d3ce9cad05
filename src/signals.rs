//! The signals leaderrun handles, merged into one stream of domain events.
//!
//! SIGCHLD is read from a signalfd: blocked in every thread from the start
//! of `main` (`block_child_signal`), it waits for the read, and a child's
//! exit wakes the runtime as a descriptor does, with no handler to run, no
//! pipe to write and read, and no system call cut short. That wake is the
//! first step of every handover, on the holder's side. Children get an
//! empty mask before they exec (spawn.rs, guard.rs). It is caught as well,
//! for a process some thread of which does not block it (a test binary
//! that uses the library): that thread runs the handler instead.

use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};

/// Blocks SIGCHLD in this thread, and so in every thread started from it
/// afterwards: call it first in `main`, before any thread starts (a thread
/// that did not block it would take the signal and drop it).
pub fn block_child_signal() -> nix::Result<()> {
    pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&child_signal()), None)
}

fn child_signal() -> SigSet {
    let mut set = SigSet::empty();
    set.add(Signal::SIGCHLD);
    set
}

/// What a received signal means to the supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalEvent {
    /// SIGTERM, SIGINT or SIGQUIT: end the term (or stop following) and exit.
    Stop(Signal),
    /// SIGHUP, SIGUSR1, SIGUSR2 or SIGWINCH: pass on to the child's group;
    /// the term goes on.
    Forward(Signal),
    /// SIGCHLD: some child (the command, or an orphan) changed state.
    ChildChanged,
}

/// The signal streams, registered once at startup so none is lost while the
/// supervisor is busy.
pub struct Signals {
    /// SIGCHLD, where every thread blocks it (`block_child_signal`).
    children: AsyncFd<SignalFd>,
    streams: Vec<(tokio::signal::unix::Signal, SignalEvent)>,
}

impl Signals {
    pub fn register() -> std::io::Result<Signals> {
        let children = SignalFd::with_flags(
            &child_signal(),
            SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC,
        )?;
        let events = [
            SignalEvent::ChildChanged,
            SignalEvent::Stop(Signal::SIGTERM),
            SignalEvent::Stop(Signal::SIGINT),
            SignalEvent::Stop(Signal::SIGQUIT),
            SignalEvent::Forward(Signal::SIGHUP),
            SignalEvent::Forward(Signal::SIGUSR1),
            SignalEvent::Forward(Signal::SIGUSR2),
            SignalEvent::Forward(Signal::SIGWINCH),
        ];
        let streams = events
            .into_iter()
            .map(|event| {
                let number = match event {
                    SignalEvent::ChildChanged => Signal::SIGCHLD,
                    SignalEvent::Stop(s) | SignalEvent::Forward(s) => s,
                };
                Ok((signal(SignalKind::from_raw(number as i32))?, event))
            })
            .collect::<std::io::Result<_>>()?;
        // SAFETY: the SignalFd owns its descriptor for as long as the
        // AsyncFd lives, and always returns that same descriptor.
        let children =
            unsafe { AsyncFd::register_with_interest(children, tokio::io::Interest::READABLE) }
                .map_err(std::io::Error::from)?;
        // Every handler is in place: the children know which to set back.
        crate::process::note_dispositions();
        Ok(Signals { children, streams })
    }

    /// The next signal received. Cancel-safe: a signal that arrives while the
    /// caller is elsewhere is delivered on the next call.
    pub async fn next(&mut self) -> SignalEvent {
        std::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(Ok(mut ready)) = self.children.poll_read_ready(cx) {
                // One read takes every SIGCHLD pending (they merge); the
                // reaper finds every child that ended.
                while let Ok(Some(_)) = ready.get_inner().read_signal() {}
                ready.clear_ready();
                return std::task::Poll::Ready(SignalEvent::ChildChanged);
            }
            for (stream, event) in &mut self.streams {
                if stream.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(*event);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}
