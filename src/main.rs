//! leaderrun: run a command on exactly one replica at a time.
//!
//! The edge of the program: parse, run, and turn the outcome into an exit
//! status. Everything else is in the library.
//!
//! `main` is the C entry point, not std's: std's start-up reads
//! /proc/self/maps to place a guard for the main thread's stack overflow
//! message and installs SIGSEGV and SIGBUS handlers for it, which every
//! leaderrun process (the supervisor, its guard) paid at its start, and each
//! spawned child then had two more handlers to set back. Of what std's
//! start-up does, leaderrun keeps SIGPIPE ignored (a write to a closed pipe
//! is an error, not death) and fds 0–2 open (`ensure_standard_fds`); a stack
//! overflow still kills the process, by SIGSEGV, without std's message.
//! Only with glibc, which hands the arguments to std (`std::env::args`, that
//! clap and the guard read) from its own start-up; elsewhere (musl) std's
//! `main` stays, as std needs it for them.

#![cfg_attr(target_env = "gnu", no_main)]

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};

use leaderrun::cli::{Cli, SubcommandArgs};
use leaderrun::error::Exit;
use leaderrun::process::{Aftermath, GUARD_ENV, KEEPER_ENV, keeper_main};
use leaderrun::run::Failure;
use leaderrun::spec::KeySource;
use leaderrun::{man, run, status};

/// The command line, and where the key came from.
fn parse() -> Result<(Cli, KeySource), clap::Error> {
    let matches = Cli::command().try_get_matches()?;
    let cli = Cli::from_arg_matches(&matches)?;
    let key_source = match matches.value_source("key") {
        Some(ValueSource::EnvVariable) => KeySource::Environment,
        _ => KeySource::Flag,
    };
    Ok((cli, key_source))
}

/// The guard's exec: leaderrun, run with the same command line, is gone.
fn guard_main(setting: &std::ffi::OsStr) -> ! {
    let Some(aftermath) = Aftermath::begin(setting) else {
        // Not a guard's setting: the variable came from elsewhere.
        eprintln!(
            "leaderrun: error: {GUARD_ENV} is set in the environment but is leaderrun's own, for its guard process; unset it"
        );
        std::process::exit(Exit::USAGE.into());
    };
    if aftermath.releases() {
        if let Ok((cli, key_source)) = parse() {
            run::stand_in(cli.run, key_source, aftermath);
        }
    }
    std::process::exit(0)
}

#[cfg(target_env = "gnu")]
#[unsafe(no_mangle)]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    // SAFETY: at the start, before any thread: SIGPIPE ignored, as std's
    // start-up would have it (the arguments are read through std::env,
    // which has them from the C runtime).
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    // std::process::exit flushes stdout, as returning from std's main does.
    std::process::exit(leaderrun_main().into())
}

#[cfg(not(target_env = "gnu"))]
fn main() {
    std::process::exit(leaderrun_main().into())
}

fn leaderrun_main() -> u8 {
    // This binary is also each term's keeper, where cgroups cannot be had.
    if let Some(setting) = std::env::var_os(KEEPER_ENV) {
        keeper_main(&setting.to_string_lossy());
    }
    // And the guard, once leaderrun is gone (see process::guard).
    if let Some(setting) = std::env::var_os(GUARD_ENV) {
        guard_main(&setting);
    }
    // Before any thread starts: SIGCHLD is read from a signalfd.
    if let Err(e) = leaderrun::signals::block_child_signal() {
        eprintln!("leaderrun: error: cannot block SIGCHLD: {e}");
        return Exit::INTERNAL;
    }
    ensure_standard_fds();
    std::panic::set_hook(Box::new(|info| {
        eprintln!("leaderrun: internal error: {info}");
        std::process::exit(Exit::INTERNAL.into());
    }));
    let (cli, key_source) = match parse() {
        Ok(parsed) => parsed,
        Err(error) => return usage_error(error),
    };
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
        Some(SubcommandArgs::Man) => match man::render(&mut std::io::stdout()) {
            // A reader that stopped early (`| head`) is not an error.
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                Err(Failure::Internal(e.into()))
            }
            _ => Ok(Exit::Child(0)),
        },
        None => run::run(cli.run, key_source),
    };
    match result {
        Ok(exit) => exit.code(),
        Err(failure) => {
            let kind = if failure.exit_code() == Exit::INTERNAL {
                "internal error"
            } else {
                "error"
            };
            eprintln!("leaderrun: {kind}: {failure:#}");
            failure.exit_code()
        }
    }
}

/// clap's errors in leaderrun's own style (`leaderrun: error: …`), with a
/// hint for the most common mistake: a command without `--` before it.
fn usage_error(error: clap::Error) -> u8 {
    use clap::error::ErrorKind;
    if matches!(
        error.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
    ) {
        error.exit();
    }
    let text = error.render().to_string();
    let text = text.strip_prefix("error: ").unwrap_or(&text).trim_end();
    eprintln!("leaderrun: error: {text}");
    let dashes = std::env::args_os().any(|arg| arg == "--");
    if error.kind() == ErrorKind::UnknownArgument && !dashes {
        eprintln!(
            "\nleaderrun: hint: put the command after `--`, as in: leaderrun --key KEY -- COMMAND [ARGS]..."
        );
    }
    Exit::USAGE
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
