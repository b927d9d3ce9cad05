//! leaderrun: run a command on exactly one replica at a time.
//!
//! The edge of the program: parse and validate, set up the process
//! (guard, subreaper, runtime, signals), open the backend, and hand over to
//! the supervisor. Errors become exit codes here and nowhere else.

mod backend;
mod cli;
mod error;
mod log;
mod metrics;
mod process;
mod signals;
mod spec;
mod status;
mod supervisor;
mod timeline;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::{CommandFactory, Parser};
use tracing::{error, warn};

use crate::backend::Backend;
use crate::cli::{Cli, RunArgs, SubcommandArgs};
use crate::error::{ConfigError, Exit};
use crate::spec::Spec;

fn main() -> ExitCode {
    ensure_standard_fds();
    std::panic::set_hook(Box::new(|info| {
        eprintln!("leaderrun: internal error: {info}");
        std::process::exit(Exit::INTERNAL.into());
    }));
    let cli = Cli::parse();
    let result = match cli.subcommand {
        Some(SubcommandArgs::Status(args)) => status::run(args),
        Some(SubcommandArgs::Completions { shell }) => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "leaderrun",
                &mut std::io::stdout(),
            );
            Ok(Exit::Child(0))
        }
        Some(SubcommandArgs::Man) => {
            match clap_mangen::Man::new(Cli::command()).render(&mut std::io::stdout()) {
                // A reader that stopped early (`| head`) is not an error.
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    Err(Failure::Internal(e.into()))
                }
                _ => Ok(Exit::Child(0)),
            }
        }
        None => run(cli.run),
    };
    match result {
        Ok(exit) => exit.into(),
        Err(Failure::Config(e)) => {
            eprintln!("leaderrun: error: {e:#}");
            ExitCode::from(Exit::USAGE)
        }
        Err(Failure::Internal(e)) => {
            eprintln!("leaderrun: internal error: {e:#}");
            ExitCode::from(Exit::INTERNAL)
        }
    }
}

/// How a run fails before the supervisor has an exit status to give.
pub enum Failure {
    /// Exit 2: the operator's input or environment is wrong.
    Config(ConfigError),
    /// Exit 70.
    Internal(anyhow::Error),
}

impl From<ConfigError> for Failure {
    fn from(e: ConfigError) -> Self {
        Failure::Config(e)
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Internal(e)
    }
}

fn run(args: RunArgs) -> Result<Exit, Failure> {
    let log_args = args.lease.log.clone();
    let spec = Spec::from_args(args)?;
    log::init(
        &log_args,
        vec![("key", spec.key.clone()), ("owner", spec.owner.clone())],
    )?;
    // Checked before campaigning: a command that cannot run takes no lease.
    let program = match process::resolve(&spec.command[0]) {
        Ok(program) => program,
        Err(e) => {
            error!(error = %e, "cannot run the command");
            return Ok(Exit::Child(e.exit_code()));
        }
    };
    // The guard must be forked while the process still has one thread. As
    // PID 1 it is not needed: the kernel kills the whole namespace with us.
    let guard = if std::process::id() == 1 {
        None
    } else {
        process::Guard::start()
            .inspect_err(|e| warn!(error = %e, "cannot start the guard process; the child's group may outlive a killed leaderrun"))
            .ok()
    };
    if let Err(e) = process::become_subreaper() {
        warn!(error = %e, "cannot become a child subreaper; double-forked descendants may outlive a term");
    }
    // A current-thread runtime on the main thread: the child is spawned from
    // this thread, which lives as long as leaderrun (see process::spawn).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(4)
        .build()
        .context("cannot start the runtime")?;
    let exit = runtime.block_on(async {
        let signals = signals::Signals::register().context("cannot register signal handlers")?;
        let metrics = metrics::Metrics::new(&spec.key, &spec.owner, spec.timing.longest_sleep());
        if let Some(address) = &spec.metrics_addr {
            metrics::serve(address, metrics.clone())?;
        }
        let backend = Backend::open(&spec).await?;
        let supervisor =
            supervisor::Supervisor::new(spec, program, backend, signals, guard, metrics);
        Ok::<_, Failure>(supervisor.run().await)
    });
    // A backend call abandoned at its timeout may still occupy a blocking
    // thread; exiting must not wait for it.
    runtime.shutdown_background();
    exit
}

/// Opens /dev/null on any of fds 0–2 that is closed, so no file leaderrun
/// opens later (a lease file, a pipe) can land on a standard descriptor and
/// be handed to the child.
fn ensure_standard_fds() {
    for fd in 0..3 {
        // SAFETY: F_GETFD only inspects the descriptor table.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
            // SAFETY: open returns the lowest free descriptor, which is `fd`.
            unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) };
        }
    }
}
