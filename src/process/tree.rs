//! The process tree, from a scan of /proc (the per-task `children` files are
//! not compiled into every kernel).

use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::unistd::Pid;

/// Whether `pid` is a live process (there, and not a zombie).
pub fn alive(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None) != Err(Errno::ESRCH) && living_parent(pid).is_some()
}

/// The parent of `pid` if it is a live process (not a zombie), from
/// `/proc/<pid>/stat`: "pid (comm) state ppid ...", where comm may hold
/// spaces and parentheses.
fn living_parent(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    fields.next()?.parse().ok()
}

/// Every living descendant of `root`.
pub fn descendants(root: Pid) -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(i32, i32)> = entries
        .filter_map(|entry| {
            let pid: i32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            Some((pid, living_parent(pid)?))
        })
        .collect();
    let mut found = Vec::new();
    let mut frontier = vec![root.as_raw()];
    while let Some(parent) = frontier.pop() {
        for &(pid, ppid) in &parents {
            if ppid == parent && !found.contains(&Pid::from_raw(pid)) {
                found.push(Pid::from_raw(pid));
                frontier.push(pid);
            }
        }
    }
    found
}
