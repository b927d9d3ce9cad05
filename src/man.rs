//! `leaderrun man`: the manual page, clap's sections and leaderrun's own
//! (COMMANDS, ENVIRONMENT, EXIT STATUS), with no reference to pages that do
//! not exist.

use std::io::{self, Write};

use clap::CommandFactory;

use crate::cli::Cli;

/// Writes the manual page (roff).
pub fn render(out: &mut dyn Write) -> io::Result<()> {
    let man = clap_mangen::Man::new(Cli::command());
    man.render_title(out)?;
    man.render_name_section(out)?;
    man.render_synopsis_section(out)?;
    man.render_description_section(out)?;
    man.render_options_section(out)?;
    out.write_all(roff(SECTIONS).as_bytes())?;
    man.render_version_section(out)
}

/// leaderrun's own sections, as `(heading, [(term, text)])`.
const SECTIONS: &[(&str, &[(&str, &str)])] = &[
    (
        "COMMANDS",
        &[
            (
                "leaderrun status --key KEY [--backend URL] [--json]",
                "Print the holder of the lease, its token, the time left, the counter and the running replicas. Exit 0 when held, 3 when free, 69 when the backend cannot be asked.",
            ),
            (
                "leaderrun completions SHELL",
                "Print a completion script for bash, zsh, fish, elvish or powershell.",
            ),
            ("leaderrun man", "Print this page."),
        ],
    ),
    (
        "ENVIRONMENT",
        &[
            (
                "LEADERRUN_KEY, LEADERRUN_BACKEND, LEADERRUN_OWNER, LEADERRUN_TTL, ...",
                "Every option reads the variable named beside it above; the flag wins. Prefer LEADERRUN_BACKEND to --backend for a URL with a password: a process's arguments are visible to every user of the host.",
            ),
            (
                "LEADERRUN_LOG",
                "An env-filter directive (debug, warn, ...) for the log on stderr, when neither -v nor -q is given.",
            ),
            (
                "The command's environment",
                "leaderrun's own, plus the token (LEADERRUN_TOKEN, or the name --token-env gives), LEADERRUN_KEY, LEADERRUN_OWNER and LEADERRUN_PID (the pid of the leaderrun running it), minus LEADERRUN_BACKEND. A leaderrun run by the command does not take LEADERRUN_KEY as its own key: give it --key.",
            ),
        ],
    ),
    (
        "EXIT STATUS",
        &[
            (
                "the command's status, or 128+N",
                "The command ran (128+N if it died of signal N).",
            ),
            ("0", "Stopped by a signal while not leading."),
            (
                "2",
                "A usage or configuration error: a bad flag, duration, URL, key, an unsafe state directory, credentials or a permission the backend refused, a missing capability. Nothing was started.",
            ),
            ("3", "status: the lease is free."),
            (
                "65",
                "The backend's state cannot be used as it is: a corrupt record, an exhausted token counter, a fence floor above the largest token.",
            ),
            (
                "69",
                "Gave up (--no-wait, --wait) without the backend ever answering; status: the backend cannot be asked.",
            ),
            ("70", "An internal error."),
            (
                "75",
                "Gave up (--no-wait, --wait) because another replica holds the lease.",
            ),
            (
                "126, 127",
                "The command is not executable, or not found; no lease was taken.",
            ),
        ],
    ),
];

fn roff(sections: &[(&str, &[(&str, &str)])]) -> String {
    let escape = |text: &str| text.replace('\\', "\\\\").replace('-', "\\-");
    let mut out = String::new();
    for (heading, items) in sections {
        out.push_str(&format!(".SH \"{heading}\"\n"));
        for (term, text) in *items {
            out.push_str(&format!(
                ".TP\n\\fB{}\\fR\n{}\n",
                escape(term),
                escape(text)
            ));
        }
    }
    out
}
