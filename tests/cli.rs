//! The command line: tokens, exit codes, validation and logs, seen from
//! outside the built binary.

mod common;

use common::{BIN, Sandbox};

#[test]
fn the_token_is_an_integer_that_grows_with_every_term() {
    let sandbox = Sandbox::new();
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let out = sandbox.leaderrun("grow").sh("echo $LEADERRUN_TOKEN").run();
        assert_eq!(out.code, 0, "{}", out.stderr);
        tokens.push(
            out.stdout
                .trim()
                .parse::<u64>()
                .expect("token is an integer"),
        );
    }
    assert_eq!(tokens, [1, 2, 3]);
}

#[test]
fn token_env_names_the_variable() {
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun("env")
        .args(["--token-env", "FENCE"])
        .sh("echo ${FENCE:-unset} ${LEADERRUN_TOKEN:-unset}")
        .run();
    assert_eq!(out.stdout.trim(), "1 unset", "{}", out.stderr);
}

#[test]
fn the_child_gets_key_and_owner_but_not_the_backend_url() {
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun("k1")
        .args(["--owner", "replica-a"])
        .env("LEADERRUN_BACKEND", "file:/should/not/be/used")
        .sh("echo $LEADERRUN_KEY $LEADERRUN_OWNER ${LEADERRUN_BACKEND:-absent}")
        .run();
    assert_eq!(out.stdout.trim(), "k1 replica-a absent", "{}", out.stderr);
}

#[test]
fn the_environment_flag_wins_over_the_variable() {
    let sandbox = Sandbox::new();
    let out = common::Run::new(&sandbox.path(""))
        .env("LEADERRUN_KEY", "from-env")
        .env("LEADERRUN_BACKEND", sandbox.backend())
        .env("LEADERRUN_TTL", "1s")
        .args(["--ttl", "6s"])
        .sh("echo $LEADERRUN_KEY")
        .run();
    assert_eq!(
        (out.code, out.stdout.trim()),
        (0, "from-env"),
        "{}",
        out.stderr
    );
}

#[test]
fn exit_codes_pass_through() {
    let sandbox = Sandbox::new();
    let out = sandbox.leaderrun("code").sh("exit 42").run();
    assert_eq!(out.code, 42);
    let out = sandbox.leaderrun("code").sh("kill -USR1 $$").run();
    assert_eq!(out.code, 128 + 10, "a child dying of SIGUSR1 gives 138");
}

#[test]
fn missing_and_non_executable_commands_take_no_lease() {
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun("cmd")
        .command(["no-such-command-xyz"])
        .run();
    assert_eq!(out.code, 127, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("command not found: no-such-command-xyz"),
        "{}",
        out.stderr
    );

    let script = sandbox.path("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
    let out = sandbox.leaderrun("cmd").command([&script]).run();
    assert_eq!(out.code, 126, "{}", out.stderr);
    assert!(out.stderr.contains("not executable"), "{}", out.stderr);

    assert!(
        !sandbox.state_dir().exists(),
        "no state may be created for a command that cannot run"
    );
}

#[test]
fn the_guards_variable_from_elsewhere_is_refused() {
    // LEADERRUN_GUARD tells leaderrun's binary it is a guard; one set by
    // someone else must not make leaderrun exit 0 having done nothing.
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun("guard-env")
        .env("LEADERRUN_GUARD", "1")
        .sh("touch ran")
        .run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("LEADERRUN_GUARD"), "{}", out.stderr);
    assert!(out.stderr.contains("unset it"), "{}", out.stderr);
    assert!(!sandbox.path("ran").exists(), "the command ran");
    assert!(!sandbox.state_dir().exists(), "state was created");
}

/// Runs leaderrun with `args` and a command that must never run; asserts
/// exit 2, that stderr contains each of `expected`, and that nothing was
/// created or started.
fn refused(args: &[&str], expected: &[&str]) {
    let sandbox = Sandbox::new();
    let out = common::Run::new(&sandbox.path(""))
        .args(args)
        .sh("touch ran")
        .run();
    assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
    for part in expected {
        assert!(
            out.stderr.contains(part),
            "{args:?}: {:?} lacks {part:?}",
            out.stderr
        );
    }
    assert!(!sandbox.path("ran").exists(), "{args:?}: the command ran");
    assert!(!sandbox.state_dir().exists(), "{args:?}: state was created");
}

#[test]
fn the_timing_invariant_is_refused_naming_every_value() {
    let sandbox = Sandbox::new();
    let backend = sandbox.backend();
    refused(
        &["--backend", &backend, "--key", "k", "--ttl", "4s"],
        &[
            "renew_every (2s)",
            "yield_grace (1s)",
            "release_timeout (500ms)",
            "margin (500ms)",
            "= 4s",
            "ttl (4s)",
        ],
    );
}

#[test]
fn bad_values_are_refused_before_anything_happens() {
    let sandbox = Sandbox::new();
    let backend = sandbox.backend();
    let b = backend.as_str();
    refused(
        &["--backend", b, "--key", "two words"],
        &["invalid key \"two words\""],
    );
    refused(
        &["--backend", b, "--key", &"x".repeat(201)],
        &["invalid key"],
    );
    refused(
        &["--backend", b, "--key", "k", "--owner", "a b"],
        &["invalid owner"],
    );
    refused(
        &["--backend", b, "--key", "k", "--yield-signal", "NOPE"],
        &["invalid --yield-signal \"NOPE\""],
    );
    refused(
        &["--backend", b, "--key", "k", "--token-env", "1X"],
        &["invalid --token-env"],
    );
    refused(
        &["--backend", b, "--key", "k", "--ttl", "6"],
        &["invalid value '6' for '--ttl <D>'"],
    );
    refused(
        &["--backend", b, "--key", "k", "--margin", "0s"],
        &["--margin must be greater than zero"],
    );
    refused(
        &["--backend", "bogus://x", "--key", "k"],
        &["invalid backend URL \"bogus://x\""],
    );
    refused(
        &["--backend", "redis://:hunter2@h:nope", "--key", "k"],
        &["invalid backend URL", "redis://:***@h:nope"],
    );
    refused(
        &["--backend", b, "--key", "k", "--no-wait", "--wait", "1s"],
        &["cannot be used with"],
    );
}

#[test]
fn bad_input_never_shows_the_password() {
    let sandbox = Sandbox::new();
    let out = common::Run::new(&sandbox.path(""))
        .args(["--backend", "redis://user:hunter2@host:99999", "--key", "k"])
        .sh("true")
        .run();
    assert_eq!(out.code, 2);
    assert!(!out.stderr.contains("hunter2"), "{}", out.stderr);
}

#[test]
fn an_unsafe_state_directory_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let sandbox = Sandbox::new();
    std::fs::create_dir(sandbox.state_dir()).unwrap();
    std::fs::set_permissions(sandbox.state_dir(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = sandbox.leaderrun("k").sh("touch ran").run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("unsafe state directory"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("chmod 700"), "{}", out.stderr);
    assert!(!sandbox.path("ran").exists());
    assert_eq!(
        std::fs::read_dir(sandbox.state_dir()).unwrap().count(),
        0,
        "a lease file was created"
    );

    // Owned by another user: chown needs root, which CI has.
    if nix::unistd::geteuid().is_root() {
        std::fs::set_permissions(sandbox.state_dir(), std::fs::Permissions::from_mode(0o700))
            .unwrap();
        nix::unistd::chown(
            &sandbox.state_dir(),
            Some(nix::unistd::Uid::from_raw(65534)),
            None,
        )
        .unwrap();
        let out = sandbox.leaderrun("k").sh("touch ran").run();
        assert_eq!(out.code, 2, "{}", out.stderr);
        assert!(out.stderr.contains("owned by uid 65534"), "{}", out.stderr);
    }
}

#[test]
fn the_state_directory_is_private() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let sandbox = Sandbox::new();
    let nested = sandbox.path("a/b/state");
    let out = common::Run::new(&sandbox.path(""))
        .args([
            "--backend",
            &format!("file://{}", nested.display()),
            "--key",
            "weird/../ключ",
        ])
        .sh("true")
        .run();
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        std::fs::metadata(&nested).unwrap().permissions().mode() & 0o777,
        0o700
    );
    let files: Vec<_> = std::fs::read_dir(&nested)
        .unwrap()
        .map(|e| e.unwrap())
        .collect();
    assert_eq!(files.len(), 1, "one file for the key, inside the directory");
    assert_eq!(files[0].metadata().unwrap().mode() & 0o777, 0o600);
}

#[test]
fn the_default_backend_lives_under_xdg_state_home() {
    let sandbox = Sandbox::new();
    let out = common::Run::new(&sandbox.path(""))
        .env("XDG_STATE_HOME", sandbox.path("xdg"))
        .args(["--key", "default-dir"])
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(sandbox.path("xdg/leaderrun").is_dir());
    let status = std::process::Command::new(BIN)
        .env("XDG_STATE_HOME", sandbox.path("xdg"))
        .args(["status", "--key", "default-dir"])
        .output()
        .unwrap();
    assert_eq!(status.status.code(), Some(3), "free after the run");
    assert!(String::from_utf8_lossy(&status.stdout).contains("counter:    1"));
}

#[test]
fn json_logs_parse_line_by_line_and_carry_key_owner_and_token() {
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun("json")
        .args(["--log-format", "json", "--owner", "o1", "-v"])
        .sh("exit 0")
        .run();
    assert_eq!(out.code, 0);
    let events: Vec<serde_json::Value> = out
        .stderr
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}")))
        .collect();
    let messages: Vec<&str> = events.iter().map(|e| e["msg"].as_str().unwrap()).collect();
    for expected in [
        "campaign started",
        "lease acquired",
        "child exited",
        "lease released",
    ] {
        assert!(
            messages.contains(&expected),
            "{messages:?} lacks {expected}"
        );
    }
    for event in &events {
        assert_eq!(event["key"], "json");
        assert_eq!(event["owner"], "o1");
    }
    let acquired = events
        .iter()
        .find(|e| e["msg"] == "lease acquired")
        .unwrap();
    assert_eq!(acquired["token"], 1);
}

#[test]
fn text_logs_go_to_stderr_only() {
    let sandbox = Sandbox::new();
    let out = sandbox.leaderrun("text").sh("echo from-child").run();
    assert_eq!(out.stdout, "from-child\n");
    assert!(
        out.stderr.contains("INFO lease acquired key=text"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("token=1"), "{}", out.stderr);
}

#[test]
fn quiet_silences_info_and_leaderrun_log_takes_a_directive() {
    let sandbox = Sandbox::new();
    let out = sandbox.leaderrun("q").arg("-q").sh("true").run();
    assert_eq!(out.stderr, "");
    let out = sandbox
        .leaderrun("q")
        .env("LEADERRUN_LOG", "warn")
        .sh("true")
        .run();
    assert_eq!(out.stderr, "");
    let out = sandbox
        .leaderrun("q")
        .env("LEADERRUN_LOG", "debug")
        .sh("true")
        .run();
    assert!(out.stderr.contains("DEBUG child started"), "{}", out.stderr);
    let out = sandbox
        .leaderrun("q")
        .env("LEADERRUN_LOG", "[[[")
        .sh("true")
        .run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("invalid LEADERRUN_LOG directive"),
        "{}",
        out.stderr
    );
}

#[test]
fn status_reports_held_and_free() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("st")
        .args(["--owner", "holder-1"])
        .sh("touch started; sleep 30")
        .spawn();
    assert!(common::wait_until(
        std::time::Duration::from_secs(10),
        || sandbox.path("started").exists()
    ));
    let status = |json: bool| {
        let mut cmd = std::process::Command::new(BIN);
        cmd.args(["status", "--backend", &sandbox.backend(), "--key", "st"]);
        if json {
            cmd.arg("--json");
        }
        cmd.output().unwrap()
    };
    let held = status(false);
    assert_eq!(held.status.code(), Some(0));
    let text = String::from_utf8_lossy(&held.stdout);
    assert!(
        text.contains("holder:     holder-1") && text.contains("token:      1"),
        "{text}"
    );
    let held: serde_json::Value = serde_json::from_slice(&status(true).stdout).unwrap();
    assert_eq!(held["held"], true);
    assert_eq!(held["holder"], "holder-1");
    assert_eq!(held["token"], 1);
    assert!(held["expires_in_ms"].as_u64().unwrap() <= 2000);

    leader.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(leader.wait(std::time::Duration::from_secs(10)).is_some());
    let free: serde_json::Value = serde_json::from_slice(&status(true).stdout).unwrap();
    assert_eq!(free["held"], false);
    assert_eq!(free["counter"], 1);
    assert_eq!(status(false).status.code(), Some(3));
}
