//! The signals leaderrun handles, merged into one stream of domain events.

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};

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
    streams: Vec<(tokio::signal::unix::Signal, SignalEvent)>,
}

impl Signals {
    pub fn register() -> std::io::Result<Signals> {
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
        Ok(Signals { streams })
    }

    /// The next signal received. Cancel-safe: a signal that arrives while the
    /// caller is elsewhere is delivered on the next call.
    pub async fn next(&mut self) -> SignalEvent {
        std::future::poll_fn(|cx| {
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
