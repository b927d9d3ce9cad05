//! The README's install command, as shown, in a test binary of its own:
//! it builds the release binary, which should not compete for the CPU with
//! the timing tests of the other test binaries (they run one after another).

use std::path::Path;
use std::process::Command;

const INSTALL: &str = "cargo install --locked --path .";

/// The README's install block, checked against `INSTALL` by `tests/readme.rs`.
const README: &str = include_str!("../README.md");

/// The README's install command, as shown, into a private root (`--root`,
/// so the test leaves `~/.cargo/bin` alone): it builds a binary that runs.
#[test]
fn the_readme_install_command_installs_a_working_binary() {
    assert!(README.contains(&format!("<!-- example: install -->\n```sh\n{INSTALL}\n```")));
    let root = tempfile::tempdir().unwrap();
    let mut words = INSTALL.split(' ');
    let out = Command::new(words.next().unwrap())
        .args(words)
        .arg("--root")
        .arg(root.path())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env(
            "CARGO_TARGET_DIR",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/install"),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let installed = root.path().join("bin/leaderrun");
    let version = Command::new(&installed).arg("--version").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("leaderrun {}", env!("CARGO_PKG_VERSION"))
    );
}
