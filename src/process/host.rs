//! The host: the one owner of processes in a leaderrun. It spawns units of
//! processes (a term's command, a hook), contains each (cgroup or keeper),
//! tells the guard about each, reaps every child of leaderrun's, and routes
//! each exit status to the unit that owns the pid.
//!
//! leaderrun never uses tokio's process support, so a blanket
//! `waitpid(-1)` steals nobody's status: a pid that belongs to no unit is an
//! orphan re-parented to leaderrun (a subreaper, or PID 1), reaped so it
//! does not linger as a zombie.
//!
//! A unit reports two events, in order: `Exited(code)` when its program
//! exits, and `Empty` when nothing it started is left. Its signals and its
//! kill reach its own processes and nothing else.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::OsString;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
use nix::unistd::Pid;
use tokio::sync::{Notify, oneshot};

use super::cgroup::UnitCgroup;
use super::keeper::{Frame, Link};
use super::spawn::{self, Command, Options};
use super::{ChildEnv, Containment, Guard, exit_code, lower_priority, terminal};

/// What to start as a unit.
pub struct Spawn<'a> {
    pub program: &'a Path,
    /// argv[0] first.
    pub argv: &'a [OsString],
    pub env: &'a ChildEnv,
    /// Where its stdout goes (a hook whose output is read), if not inherited.
    pub stdout: Option<&'a OwnedFd>,
    /// It may take the terminal's foreground (the command; never a hook).
    pub terminal: bool,
}

/// Who a signal reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The program's process group.
    Group,
    /// Every process of the unit, also those that left the group.
    All,
}

/// What a unit reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitEvent {
    /// Its program exited with this status (the code, or 128+N).
    Exited(u8),
    /// Nothing it started is left.
    Empty,
}

/// Processes as the term machine's driver uses them: the host, or a fake in
/// the driver's tests.
pub trait Processes {
    type Unit: ProcessUnit;
    fn spawn(&self, what: Spawn<'_>) -> impl Future<Output = io::Result<Self::Unit>>;
    /// Gets ready for the next spawn while nothing waits for it (a follower
    /// calls it as it starts to wait).
    fn prepare(&self) {}
    /// A term began with `token`, or (None) is over: if leaderrun dies in
    /// one, the guard releases its lease once its processes are gone.
    fn term(&self, _token: Option<u64>) {}
    /// The run is over and its lease released: the next leader may be
    /// starting its command on this host now, and what is left to do here
    /// (the exit) must not compete with it.
    fn retire(&self) {}
}

/// One unit of processes, as the driver uses it.
pub trait ProcessUnit {
    fn pid(&self) -> Pid;
    fn took_terminal(&self) -> bool;
    fn signal(&mut self, signal: Signal, scope: Scope);
    fn kill(&mut self);
    /// The next event; cancel-safe. Pends forever after `Empty`.
    fn next(&mut self) -> impl Future<Output = UnitEvent>;
}

pub struct Host {
    containment: Containment,
    guard: Option<Guard>,
    /// The units' programs (cgroup mode), by pid: where each status goes.
    waiting: RefCell<HashMap<Pid, oneshot::Sender<u8>>>,
    /// Units' programs whose status has gone to their unit, left zombies
    /// until their unit goes (or the next full pass): reaping one took
    /// 20-30 µs on the way to the release, which the next leader waited for.
    exited: RefCell<Vec<Pid>>,
    /// Notified after every pass of the reaper.
    reaped: Notify,
}

impl Host {
    pub fn new(containment: Containment, guard: Option<Guard>) -> Rc<Host> {
        Rc::new(Host {
            containment,
            guard,
            waiting: RefCell::default(),
            exited: RefCell::default(),
            reaped: Notify::new(),
        })
    }

    pub fn containment(&self) -> &Containment {
        &self.containment
    }

    /// On SIGCHLD: hands each unit's program status to its unit, from a
    /// look that leaves the program a zombie; when no program has exited,
    /// reaps every child that has ended (orphans, a keeper, earlier
    /// programs). A zombie holds its pid, so none is reused meanwhile.
    pub fn reap(&self) {
        let flags = WaitPidFlag::WEXITED
            | WaitPidFlag::WNOHANG
            | WaitPidFlag::WNOWAIT
            | WaitPidFlag::__WALL;
        let exited: Vec<(Pid, u8)> = self
            .waiting
            .borrow()
            .keys()
            .filter_map(|&pid| Some((pid, exit_code(waitid(Id::Pid(pid), flags).ok()?)?)))
            .collect();
        if exited.is_empty() {
            self.reap_all();
            return;
        }
        for (pid, code) in exited {
            if let Some(sender) = self.waiting.borrow_mut().remove(&pid) {
                let _ = sender.send(code);
            }
            self.exited.borrow_mut().push(pid);
        }
        self.reaped.notify_waiters();
    }

    fn reap_all(&self) {
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL)) {
                Ok(WaitStatus::StillAlive) => break,
                Ok(status) => {
                    let Some(pid) = status.pid() else { continue };
                    let Some(code) = exit_code(status) else {
                        continue;
                    };
                    if let Some(sender) = self.waiting.borrow_mut().remove(&pid) {
                        let _ = sender.send(code);
                    }
                }
                Err(Errno::EINTR) => {}
                Err(_) => break,
            }
        }
        self.exited.borrow_mut().clear();
        self.reaped.notify_waiters();
    }

    /// The unit of `pid` goes (after its term's release, if any): a program
    /// left a zombie is reaped now, with every child whose reaping waited.
    fn forget(&self, pid: Pid) {
        self.waiting.borrow_mut().remove(&pid);
        if self.exited.borrow().contains(&pid) {
            self.reap_all();
        }
    }
}

/// One lease's view of the host, in a leaderrun that runs several (shard
/// mode): its terms tell the guard their lease's number, and its commands
/// never take the terminal (several run at once).
#[derive(Clone)]
pub struct LeaseHost {
    pub host: Rc<Host>,
    pub lease: u32,
}

impl Processes for LeaseHost {
    type Unit = Unit;

    fn prepare(&self) {
        self.host.prepare();
    }

    fn term(&self, token: Option<u64>) {
        if let Some(guard) = &self.host.guard {
            guard.term(self.lease, token);
        }
    }

    async fn spawn(&self, what: Spawn<'_>) -> io::Result<Unit> {
        self.host
            .spawn(Spawn {
                terminal: false,
                ..what
            })
            .await
    }
}

impl Processes for Rc<Host> {
    type Unit = Unit;

    fn prepare(&self) {
        if let Containment::Cgroup(cgroups) = &self.containment {
            cgroups.prepare();
        }
        spawn::prepare();
    }

    fn term(&self, token: Option<u64>) {
        if let Some(guard) = &self.guard {
            guard.term(0, token);
        }
    }

    /// Lowers the priority of leaderrun and its guard to the least, and
    /// gives up the CPU: the release woke the next leader, on this CPU when
    /// it runs here (a virtual machine's idle CPU is passed over), and the
    /// next leader's start, its command's exec included, should not wait
    /// for this process's exit, nor the guard's (woken by that exit).
    fn retire(&self) {
        lower_priority();
        if let Some(guard) = &self.guard {
            guard.lower_priority();
        }
        // SAFETY: sched_yield has no arguments and cannot fail.
        unsafe { libc::sched_yield() };
    }

    async fn spawn(&self, what: Spawn<'_>) -> io::Result<Unit> {
        let take_terminal = what.terminal && what.stdout.is_none() && terminal::is_ours();
        let block = what.env.block();
        let env: Vec<&std::ffi::CStr> = block.entries().collect();
        let command = Command {
            path: what.program,
            argv: what.argv,
            env: &env,
        };
        let stdout = what.stdout.map(AsRawFd::as_raw_fd);
        let (pid, contained) = match &self.containment {
            Containment::Cgroup(cgroups) => {
                let cgroup = cgroups.unit()?;
                let pid = spawn::spawn(
                    &command,
                    Options {
                        stdout,
                        cgroup: Some(cgroup.fds()),
                        own_group: true,
                        death_signal: true,
                        take_terminal,
                        ..Options::default()
                    },
                )
                .inspect_err(|_| {
                    // Nothing ran in it (the exec failed before it joined,
                    // or it joined and exited): remove it.
                    let _ = std::fs::remove_dir(cgroup.path());
                })?;
                let (sender, exit) = oneshot::channel();
                self.waiting.borrow_mut().insert(pid, sender);
                (pid, Contained::Cgroup { cgroup, exit })
            }
            Containment::Keeper { exe } => {
                let link = Link::start(exe, &command, take_terminal, stdout).await?;
                if let Some(guard) = &self.guard {
                    guard.keeper(link.keeper, true);
                }
                (link.program, Contained::Keeper(link))
            }
        };
        if let Some(guard) = &self.guard {
            guard.watch(pid);
        }
        Ok(Unit {
            host: self.clone(),
            pid,
            took_terminal: take_terminal,
            contained,
            exited: false,
            empty: false,
        })
    }
}

/// A unit of processes: one program and everything it starts.
pub struct Unit {
    host: Rc<Host>,
    /// The program's pid, which is also its process group.
    pid: Pid,
    took_terminal: bool,
    contained: Contained,
    exited: bool,
    empty: bool,
}

enum Contained {
    Cgroup {
        cgroup: UnitCgroup,
        exit: oneshot::Receiver<u8>,
    },
    Keeper(Link),
}

impl ProcessUnit for Unit {
    fn pid(&self) -> Pid {
        self.pid
    }

    fn took_terminal(&self) -> bool {
        self.took_terminal
    }

    fn signal(&mut self, signal: Signal, scope: Scope) {
        match &mut self.contained {
            Contained::Cgroup { cgroup, .. } => {
                let _ = killpg(self.pid, signal);
                if scope == Scope::All {
                    cgroup.signal(signal);
                }
            }
            Contained::Keeper(link) => link.send(Frame::Signal {
                all: scope == Scope::All,
                signal: signal as i32,
            }),
        }
    }

    fn kill(&mut self) {
        match &mut self.contained {
            Contained::Cgroup { cgroup, .. } => {
                let _ = killpg(self.pid, Signal::SIGKILL);
                cgroup.kill();
            }
            Contained::Keeper(link) => link.send(Frame::Kill),
        }
    }

    async fn next(&mut self) -> UnitEvent {
        if self.empty {
            return std::future::pending().await;
        }
        match &mut self.contained {
            Contained::Cgroup { cgroup, exit } => {
                if !self.exited {
                    // A program whose status went elsewhere (it cannot, but
                    // never wait forever on it) counts as killed.
                    let code = exit.await.unwrap_or(128 + Signal::SIGKILL as u8);
                    self.exited = true;
                    return UnitEvent::Exited(code);
                }
                // The last process of a unit to die is always a child of
                // leaderrun's (a subreaper inherits every orphan), so each
                // change comes with a reaper pass; the timer is a safety net.
                loop {
                    let reaped = self.host.reaped.notified();
                    tokio::pin!(reaped);
                    reaped.as_mut().enable();
                    if !cgroup.populated() {
                        self.empty = true;
                        return UnitEvent::Empty;
                    }
                    let _ = tokio::time::timeout(Duration::from_millis(100), reaped).await;
                }
            }
            Contained::Keeper(link) => loop {
                match link.next().await {
                    Some(Frame::Exited(code)) if !self.exited => {
                        self.exited = true;
                        return UnitEvent::Exited(code);
                    }
                    Some(Frame::Empty) | None if !self.exited => {
                        // The keeper is gone without a word on the program:
                        // it was killed, and the program with it.
                        self.exited = true;
                        return UnitEvent::Exited(128 + Signal::SIGKILL as u8);
                    }
                    Some(Frame::Empty) | None => {
                        self.empty = true;
                        return UnitEvent::Empty;
                    }
                    Some(_) => {}
                }
            },
        }
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        if let Some(guard) = &self.host.guard {
            guard.unwatch(self.pid);
            if let Contained::Keeper(link) = &self.contained {
                guard.keeper(link.keeper, false);
            }
        }
        self.host.forget(self.pid);
        if let Contained::Cgroup { cgroup, .. } = &self.contained {
            if !self.empty {
                // Dropped with processes in it (an error path): they must
                // not outlive their unit.
                cgroup.kill();
            }
            let _ = std::fs::remove_dir(cgroup.path());
        }
        // A keeper's socket closes with the link: the keeper kills what is
        // left, if anything, and exits.
    }
}
