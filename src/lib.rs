//! leaderrun: run a command on exactly one replica at a time, behind a
//! renewed lease with fencing tokens.
//!
//! The binary (`main.rs`) parses the command line, calls `run::run` or
//! `status::run`, and maps the outcome to an exit status. Everything else is
//! here:
//!
//! - `cli` (clap) → `spec` (one validated `Spec`) → `run` (the process set
//!   up, the host and the supervisor);
//! - `supervisor`: one lease's life; its term is a state machine with no I/O
//!   (`supervisor::term`), driven by `supervisor::driver`;
//! - `backend`: the lease-store interface, its registry, and the backends
//!   (`file`, `redis`, and `memory` for tests);
//! - `process`: spawning, containment per unit (cgroup or keeper), reaping,
//!   the guard, the terminal;
//! - `timing`: every deadline's arithmetic; `signals`, `metrics`, `log`,
//!   `status`, `man`.

pub mod backend;
pub mod cli;
pub mod error;
pub mod log;
pub mod man;
pub mod metrics;
pub mod process;
pub mod run;
pub mod shard;
pub mod signals;
pub mod spec;
pub mod status;
pub mod supervisor;
pub mod timing;
