//! Operating leaderrun: status with candidates, metrics and the readiness
//! endpoint, completions and the man page, PID 1, and the recipes in
//! examples/ (cron, systemd, Docker, Kubernetes).

mod common;

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::redis_server::{RedisServer, free_port};
use common::{BIN, FAST, Sandbox, get, wait_until};
use nix::sys::signal::Signal;

const LONG: Duration = Duration::from_secs(20);

fn status_json(backend: &str, key: &str) -> serde_json::Value {
    let out = Command::new(BIN)
        .args(["status", "--backend", backend, "--key", key, "--json"])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

fn owners(status: &serde_json::Value) -> Vec<(String, bool)> {
    status["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["owner"].as_str().unwrap().to_owned(),
                c["leading"].as_bool().unwrap(),
            )
        })
        .collect()
}

/// Two replicas are candidates; a follower that stops gracefully leaves the
/// list at once, one that is killed expires after the ttl, and a leader
/// leaves it with its last release.
fn candidates(backend: &str, sandbox: &Sandbox) {
    let mut leader = sandbox
        .leaderrun_on(backend, "cand")
        .args(["--owner", "a"])
        .sh("touch started; sleep 300")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("started").exists()));
    let mut follower = sandbox
        .leaderrun_on(backend, "cand")
        .args(["--owner", "b"])
        .sh("true")
        .spawn();
    assert!(wait_until(LONG, || owners(&status_json(backend, "cand"))
        .len()
        == 2));
    let status = status_json(backend, "cand");
    assert_eq!(
        owners(&status),
        [("a".to_owned(), true), ("b".to_owned(), false)],
        "{status}"
    );
    let b = &status["candidates"][1];
    assert_eq!(b["pid"].as_u64().unwrap(), follower.pid().as_raw() as u64);
    assert!(b["host"].as_str().is_some_and(|h| !h.is_empty()));
    assert!(b["last_seen_ms"].as_u64().unwrap() >= b["since_ms"].as_u64().unwrap());

    follower.signal(Signal::SIGTERM);
    assert_eq!(follower.wait(LONG), Some(0));
    assert_eq!(
        owners(&status_json(backend, "cand")),
        [("a".to_owned(), true)],
        "a graceful exit leaves at once"
    );

    let killed = sandbox
        .leaderrun_on(backend, "cand")
        .args(["--owner", "c"])
        .sh("true")
        .spawn();
    assert!(wait_until(LONG, || owners(&status_json(backend, "cand"))
        .len()
        == 2));
    let start = Instant::now();
    killed.signal(Signal::SIGKILL);
    assert!(wait_until(LONG, || owners(&status_json(backend, "cand"))
        .len()
        == 1));
    // Expired, not removed: about one ttl (2 s) after its last heartbeat.
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(1200) && took < Duration::from_secs(5),
        "{took:?}"
    );

    leader.signal(Signal::SIGTERM);
    assert!(leader.wait(LONG).is_some());
    let status = status_json(backend, "cand");
    assert_eq!(
        owners(&status),
        [],
        "the last release leaves at once: {status}"
    );
}

#[test]
fn candidates_on_the_file_backend() {
    let sandbox = Sandbox::new();
    candidates(&sandbox.backend(), &sandbox);
}

#[test]
fn candidates_on_redis() {
    let server = RedisServer::start();
    server.wait_uptime(None, 2);
    candidates(server.url(), &Sandbox::new());
}

/// The value of a metric sample line `name{labels} value`.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or_else(|| panic!("no {name} in:\n{metrics}"))
        .parse()
        .unwrap()
}

#[test]
fn metrics_and_the_leader_endpoint_follow_the_lease() {
    let sandbox = Sandbox::new();
    let (port_a, port_b) = (free_port(), free_port());
    let mut a = sandbox
        .leaderrun("metrics")
        .args([
            "--owner",
            "a",
            "--metrics-addr",
            &format!("127.0.0.1:{port_a}"),
        ])
        .sh("touch a-started; while [ ! -e stop-a ]; do sleep 0.01; done")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("a-started").exists()));
    let b = sandbox
        .leaderrun("metrics")
        .args([
            "--owner",
            "b",
            "--metrics-addr",
            &format!("127.0.0.1:{port_b}"),
        ])
        .sh("touch b-started; sleep 300")
        .spawn();
    assert!(b.wait_log("campaign started", LONG));
    assert!(wait_until(LONG, || TcpStream::connect((
        "127.0.0.1",
        port_b
    ))
    .is_ok()));

    let (status, metrics) = get(port_a, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(sample(&metrics, "leaderrun_leading"), 1.0, "{metrics}");
    assert_eq!(sample(&metrics, "leaderrun_token"), 1.0);
    assert_eq!(sample(&metrics, "leaderrun_terms_started_total"), 1.0);
    assert!(
        metrics.contains("key=\"metrics\"") && metrics.contains("owner=\"a\""),
        "{metrics}"
    );
    assert_eq!(sample(&get(port_b, "/metrics").1, "leaderrun_leading"), 0.0);
    assert_eq!(get(port_a, "/leader").0, 200);
    assert_eq!(get(port_b, "/leader").0, 503);
    assert_eq!(get(port_a, "/healthz"), (200, "ok\n".into()));
    assert_eq!(get(port_b, "/healthz").0, 200);
    assert_eq!(get(port_a, "/nope").0, 404);

    // A handover flips /leader within one campaign period (100 ms here).
    std::fs::write(sandbox.path("stop-a"), "").unwrap();
    assert_eq!(a.wait(LONG), Some(0));
    let released = Instant::now();
    assert!(wait_until(LONG, || get(port_b, "/leader").0 == 200));
    assert!(
        released.elapsed() < Duration::from_millis(1000),
        "{:?}",
        released.elapsed()
    );
    let metrics = get(port_b, "/metrics").1;
    assert_eq!(sample(&metrics, "leaderrun_token"), 2.0, "{metrics}");
    assert!(
        sample(&metrics, "leaderrun_last_handover_seconds") < 1.0,
        "{metrics}"
    );
}

#[test]
fn a_metrics_address_that_cannot_be_used_is_refused() {
    let sandbox = Sandbox::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    // A taken port is not an invalid address: say what is wrong.
    for (address, what, says) in [
        ("nonsense", "invalid --metrics-addr", "expected HOST:PORT"),
        (
            &*format!("127.0.0.1:{port}"),
            "cannot listen on --metrics-addr",
            "already in use",
        ),
    ] {
        let out = sandbox
            .leaderrun("m")
            .args(["--metrics-addr", address])
            .sh("touch ran")
            .run();
        assert_eq!(out.code, 2, "{}", out.stderr);
        assert!(out.stderr.contains(what), "{}", out.stderr);
        assert!(
            out.stderr.to_lowercase().contains(&says.to_lowercase()),
            "{}",
            out.stderr
        );
    }
    assert!(!sandbox.path("ran").exists());
}

#[test]
fn completions_for_bash_zsh_and_fish_and_a_man_page() {
    let output = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let bash = output(&["completions", "bash"]);
    let script =
        std::env::temp_dir().join(format!("leaderrun-completion-{}.bash", std::process::id()));
    std::fs::write(&script, &bash).unwrap();
    let loaded = Command::new("bash")
        .args([
            "-c",
            &format!("source {} && complete -p leaderrun", script.display()),
        ])
        .output()
        .unwrap();
    std::fs::remove_file(&script).unwrap();
    assert!(
        String::from_utf8_lossy(&loaded.stdout).contains("leaderrun"),
        "bash did not load it"
    );
    assert!(output(&["completions", "zsh"]).starts_with("#compdef leaderrun"));
    let fish = output(&["completions", "fish"]);
    assert!(
        fish.contains("complete -c leaderrun") && fish.contains("hold-for"),
        "{fish}"
    );
    let man = output(&["man"]);
    assert!(
        man.contains(".TH leaderrun 1") && man.contains("yield\\-grace"),
        "{man}"
    );
}

/// The pid of `parent`'s child (unshare --fork runs leaderrun as one).
fn child_of(parent: u32) -> Option<nix::unistd::Pid> {
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let ppid: u32 = stat[stat.rfind(')')? + 2..]
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == parent).then(|| nix::unistd::Pid::from_raw(pid))
        })
}

#[test]
fn as_pid_1_it_passes_sigterm_on_to_the_command() {
    let sandbox = Sandbox::new();
    let mut unshare = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", BIN, "--backend", &sandbox.backend(), "--key", "pid1-term"])
        .args(FAST)
        .args(["--", "sh", "-c", "trap 'echo term > got; exit 0' TERM; echo $PPID > parent; while :; do sleep 0.02; done"])
        .current_dir(sandbox.path(""))
        .spawn()
        .unwrap();
    assert!(
        wait_until(LONG, || sandbox.read("parent").trim() == "1"),
        "leaderrun is not PID 1"
    );
    // `docker stop` signals PID 1 of the namespace: leaderrun here.
    let leaderrun = child_of(unshare.id()).expect("leaderrun under unshare");
    nix::sys::signal::kill(leaderrun, Signal::SIGTERM).unwrap();
    assert!(wait_until(LONG, || sandbox.read("got").contains("term")));
    let status = unshare.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

fn example(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(path)
}

#[test]
fn the_cron_recipe_runs_the_job_once_per_schedule() {
    let crontab = std::fs::read_to_string(example("cron/nightly-report")).unwrap();
    let line = crontab
        .lines()
        .find(|l| !l.starts_with('#') && !l.trim().is_empty())
        .unwrap();
    // A nightly job, as its name says: minute, hour, then every day.
    let fields: Vec<&str> = line.split(' ').take(5).collect();
    assert_eq!(fields[2..], ["*", "*", "*"], "{line}");
    assert!(
        fields[0].parse::<u8>().is_ok() && fields[1].parse::<u8>().is_ok(),
        "{line}"
    );
    // Five time fields and a user, then the command cron runs with sh.
    let command = line.splitn(7, ' ').nth(6).unwrap();
    // The backend is shared and comes from a root-only file, not the
    // default file backend of each host.
    assert!(
        command.starts_with(". /etc/leaderrun/backend.env && "),
        "{command}"
    );
    assert!(
        crontab.contains("install -m 600"),
        "the file is root's only"
    );
    let sandbox = Sandbox::new();
    let job = sandbox.path("nightly-report");
    std::fs::write(
        &job,
        "#!/bin/sh\necho ran >> \"$SANDBOX/runs\"\nsleep 0.5\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&job, std::fs::Permissions::from_mode(0o755)).unwrap();
    let env_file = sandbox.path("backend.env");
    std::fs::write(
        &env_file,
        format!("export LEADERRUN_BACKEND={}\n", sandbox.backend()),
    )
    .unwrap();
    // The recipe holds the lease for 2 minutes; the test, for 3 seconds.
    assert!(command.contains("--hold-for 2m"));
    let command = command
        .replace("/usr/local/bin/nightly-report", job.to_str().unwrap())
        .replace("/etc/leaderrun/backend.env", env_file.to_str().unwrap())
        .replace("--hold-for 2m", "--hold-for 3s");
    let bin_dir = Path::new(BIN).parent().unwrap();
    let run = || {
        Command::new("sh")
            .args(["-c", &command])
            .env("PATH", format!("{}:/usr/bin:/bin", bin_dir.display()))
            .env_remove("LEADERRUN_BACKEND")
            .env("SANDBOX", sandbox.path(""))
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    // Two replicas' crons fire at once: the job runs once, and the replica
    // that did not run it exits 0 at once.
    let (mut first, mut second) = (run(), run());
    let settled = Instant::now();
    let (done, waiting) = loop {
        if second.try_wait().unwrap().is_some() {
            break (second, first);
        }
        if first.try_wait().unwrap().is_some() {
            break (first, second);
        }
        assert!(settled.elapsed() < LONG);
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut done = done;
    assert!(done.wait().unwrap().success());
    // A replica firing later, within --hold-for of the run, does not run it
    // again: the first still holds the lease after its job finished.
    assert!(wait_until(LONG, || sandbox.lines("runs").len() == 1));
    std::thread::sleep(Duration::from_millis(700));
    assert!(run().wait().unwrap().success());
    let mut waiting = waiting;
    assert!(waiting.wait().unwrap().success());
    assert_eq!(sandbox.lines("runs"), ["ran"]);
}

#[test]
fn the_systemd_unit_lets_leaderrun_do_the_stopping() {
    let unit = std::fs::read_to_string(example("systemd/digest-publisher.service")).unwrap();
    let value = |name: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name}="))
            .to_owned()
    };
    assert_eq!(value("KillMode"), "mixed");
    let stop = humantime::parse_duration(&value("TimeoutStopSec")).unwrap();
    // yield_grace + release_timeout with the defaults, plus a release call.
    assert!(
        stop > Duration::from_millis(1500) + Duration::from_secs(2),
        "{stop:?}"
    );
    assert!(value("SuccessExitStatus").split(' ').any(|s| s == "143"));

    // What systemd does on stop, with KillMode=mixed: SIGTERM to the main
    // process (leaderrun) only. The command gets its yield signal, the lease
    // is released, and leaderrun is gone well within TimeoutStopSec.
    let sandbox = Sandbox::new();
    let exec = value("ExecStart");
    let args: Vec<&str> = exec.split(' ').skip(1).collect();
    let dash = args.iter().position(|a| *a == "--").unwrap();
    let mut service = common::Run::new(&sandbox.path(""));
    service
        .args(&args[..dash])
        .args(["--backend", &sandbox.backend()])
        .sh("trap 'echo yielded > got; exit 0' TERM; touch started; while :; do sleep 0.02; done");
    let mut service = service.spawn();
    assert!(wait_until(LONG, || sandbox.path("started").exists()));
    let stopping = Instant::now();
    service.signal(Signal::SIGTERM);
    let code = service
        .wait(stop)
        .expect("still running after TimeoutStopSec");
    assert!(code == 0 || code == 143, "{code}");
    assert!(stopping.elapsed() < Duration::from_secs(3));
    assert_eq!(sandbox.read("got").trim(), "yielded");
    assert!(service.stderr().contains("lease released"));

    // systemd's own check, when it is installed and the unit's paths exist.
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok()
    {
        let dir = sandbox.path("units");
        std::fs::create_dir(&dir).unwrap();
        let env = sandbox.path("publisher.env");
        std::fs::write(&env, "LEADERRUN_BACKEND=file:/tmp\n").unwrap();
        let local = unit
            .replace("/usr/local/bin/leaderrun", BIN)
            .replace("/usr/local/bin/digest-publisher", "/bin/true")
            .replace("/etc/leaderrun/digest-publisher.env", env.to_str().unwrap());
        let file = dir.join("digest-publisher.service");
        std::fs::write(&file, local).unwrap();
        let verify = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&file)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&verify.stderr);
        assert!(
            !said.contains("digest-publisher.service:"),
            "systemd-analyze found problems in the unit:\n{said}"
        );
    }
}

#[test]
fn the_dockerfile_makes_leaderrun_pid_1() {
    let dockerfile = std::fs::read_to_string(example("docker/Dockerfile")).unwrap();
    let entrypoint = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("ENTRYPOINT "))
        .unwrap();
    // Exec form, so leaderrun is PID 1 and receives `docker stop`'s SIGTERM
    // itself (a shell-form entrypoint would put sh there instead).
    let argv: Vec<String> =
        serde_json::from_str(entrypoint).expect("ENTRYPOINT in exec (JSON) form");
    assert_eq!(argv, ["/usr/local/bin/leaderrun"]);
    let cmd: Vec<String> = serde_json::from_str(
        dockerfile
            .lines()
            .find_map(|l| l.strip_prefix("CMD "))
            .unwrap(),
    )
    .unwrap();
    assert!(cmd.contains(&"--key".to_owned()) && cmd.contains(&"--".to_owned()));
    assert!(
        dockerfile
            .contains("COPY --from=build /src/target/release/leaderrun /usr/local/bin/leaderrun")
    );
}

#[test]
fn the_kubernetes_manifest_routes_traffic_to_the_leader_only() {
    use yaml_rust2::{Yaml, YamlLoader};
    let text = std::fs::read_to_string(example("kubernetes/digest-publisher.yaml")).unwrap();
    let docs = YamlLoader::load_from_str(&text).unwrap();
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| {
                d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name)
            })
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    };
    let app = find("Deployment", "digest-publisher");
    assert_eq!(app["spec"]["replicas"].as_i64(), Some(2));
    let pod = &app["spec"]["template"]["spec"];
    assert!(pod["terminationGracePeriodSeconds"].as_i64().unwrap() > 2);
    let container = &pod["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert!(args.contains(&"--metrics-addr=0.0.0.0:9090"), "{args:?}");
    assert!(args.contains(&"--"));
    let readiness = &container["readinessProbe"]["httpGet"];
    assert_eq!(readiness["path"].as_str(), Some("/leader"));
    assert_eq!(
        container["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    let port = &container["ports"][0];
    assert_eq!(
        (port["name"].as_str(), port["containerPort"].as_i64()),
        (Some("metrics"), Some(9090))
    );
    assert_eq!(readiness["port"].as_str(), Some("metrics"));
    // The backend URL comes from a Secret that points at the Redis Service.
    let secret = find("Secret", "digest-publisher-lease");
    assert_eq!(
        container["envFrom"][0]["secretRef"]["name"].as_str(),
        Some("digest-publisher-lease")
    );
    let url = secret["stringData"]["LEADERRUN_BACKEND"].as_str().unwrap();
    assert!(url.starts_with("redis://leases:6379"), "{url}");
    find("Service", "leases");
    find("Deployment", "leases");
    // The app's Service selects the pods; only the Ready one (the leader)
    // gets traffic.
    let service = find("Service", "digest-publisher");
    assert_eq!(
        service["spec"]["selector"]["app"].as_str(),
        Some("digest-publisher")
    );

    // And the args are ones leaderrun accepts: run them against the file
    // backend with a short command.
    let sandbox = Sandbox::new();
    let dash = args.iter().position(|a| *a == "--").unwrap();
    let out = common::Run::new(&sandbox.path(""))
        .args(
            args[..dash]
                .iter()
                .map(|a| a.replace("0.0.0.0:9090", &format!("127.0.0.1:{}", free_port()))),
        )
        .args(["--backend", &sandbox.backend(), "--claim-cmd", "true"])
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
}
