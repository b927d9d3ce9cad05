//! Every example the README shows is run here. An example is a ```sh block
//! preceded by `<!-- example: NAME -->`; each NAME has an expectation below,
//! and a block without a name fails the test (only `scripts/test` itself is
//! exempt, since it would run this very test).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const README: &str = include_str!("../README.md");

/// (name, script) for every named example, in README order.
fn examples() -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut name: Option<String> = None;
    let mut lines = README.lines();
    while let Some(line) = lines.next() {
        if let Some(rest) = line.strip_prefix("<!-- example: ") {
            name = Some(rest.trim_end_matches("-->").trim().to_owned());
        } else if line == "```sh" {
            let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
            let script = body.join("\n");
            match name.take() {
                Some(name) => found.push((name, script)),
                None => assert_eq!(
                    script, "scripts/test",
                    "README sh block without an example name:\n{script}"
                ),
            }
        }
    }
    found
}

/// Runs a README example with `leaderrun` on PATH (and `cargo run --release
/// --` meaning the same binary), in a fresh state directory.
///
/// Examples run from the repository root, as a reader would. The seed run
/// gets the test timing (2 s ttl, 20 ms campaign period) so that its
/// fifty refused claims take a second, not half a minute.
fn run(script: &str) -> (i32, String, String) {
    let sandbox = tempfile::tempdir().unwrap();
    let bin_dir = Path::new(common::BIN).parent().unwrap();
    let script = script.replace("cargo run --release --", "leaderrun");
    let mut command = Command::new("sh");
    if script.contains("examples/publisher/run.sh") {
        command
            .envs(common::fast_env())
            .env("LEADERRUN_CAMPAIGN_EVERY", "20ms");
    }
    let out = command
        .args(["-c", &script])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env(
            "PATH",
            format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap()),
        )
        .env("XDG_STATE_HOME", sandbox.path().join("state"))
        .env_remove("LEADERRUN_BACKEND")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The install command, run by `tests/install.rs` (alone: it builds the
/// release binary).
const INSTALL: &str = "cargo install --locked --path .";

#[test]
fn every_readme_example_runs_as_shown() {
    let examples: BTreeMap<String, String> = examples().into_iter().collect();
    let expected = [
        "install",
        "quickstart",
        "two-replicas",
        "cron",
        "status",
        "token-env",
        "invariant",
        "graceful-stop",
        "seed-run",
        "shards",
    ];
    assert_eq!(
        examples
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .len(),
        expected.len(),
        "README examples {:?} vs tested {expected:?}",
        examples.keys()
    );
    for name in expected {
        let script = examples
            .get(name)
            .unwrap_or_else(|| panic!("README has no example {name}"));
        if name == "install" {
            // Run on its own below: it builds the release binary.
            assert_eq!(script, INSTALL);
            continue;
        }
        let (code, stdout, stderr) = run(script);
        let context = format!("example {name}: exit {code}\nstdout: {stdout}\nstderr: {stderr}");
        match name {
            "quickstart" => {
                assert_eq!(code, 0, "{context}");
                assert_eq!(stdout, "leading with token 1\n", "{context}");
            }
            "two-replicas" => {
                assert_eq!(code, 0, "{context}");
                let mut tokens: Vec<&str> = stdout
                    .lines()
                    .map(|l| l.rsplit(' ').next().unwrap())
                    .collect();
                tokens.sort();
                assert_eq!(tokens, ["1", "2"], "{context}");
                assert!(
                    stdout.contains("first:") && stdout.contains("second:"),
                    "{context}"
                );
            }
            "cron" => assert_eq!(stdout, "report done\nexit status 0\n", "{context}"),
            "status" => {
                assert_eq!(code, 3, "{context}");
                assert!(stdout.contains("none (the lease is free)"), "{context}");
            }
            "token-env" => assert_eq!(stdout, "writing with fence 1\n", "{context}"),
            "shards" => {
                assert_eq!(code, 0, "{context}");
                assert_eq!(
                    stdout, "shard 0 of 3, token 1\nshard 1 of 3, token 1\nshard 2 of 3, token 1\n",
                    "{context}"
                );
            }
            "invariant" => {
                assert_eq!(code, 2, "{context}");
                let shown = script.lines().find_map(|l| l.strip_prefix("# ")).unwrap();
                assert_eq!(stderr.trim(), shown, "{context}");
            }
            "seed-run" => {
                assert_eq!(code, 0, "{context}");
                for backend in ["file", "redis"] {
                    assert!(
                        stdout.contains(&format!("== {backend} backend\n")),
                        "{context}"
                    );
                }
                assert_eq!(
                    stdout.matches("pod-b took over with token 2").count(),
                    2,
                    "{context}"
                );
                assert_eq!(
                    stdout.matches("the first term drew token 51").count(),
                    2,
                    "{context}"
                );
                assert_eq!(
                    stdout
                        .matches("refused up to token 50; token 51 published")
                        .count(),
                    2,
                    "{context}"
                );
            }
            "graceful-stop" => {
                assert_eq!(code, 0, "{context}");
                assert_eq!(stdout, "finishing up\n", "{context}");
            }
            other => panic!("no expectation for README example {other}"),
        }
    }
}
