//! The backend contract: the same tests against every backend, through the
//! library's `Backend` and `LeaseStore` interface. A backend that passes
//! them works with the supervisor.
//!
//! - file: a private directory; "could not ask" is its mutex byte held by
//!   another open file description;
//! - redis: a real `redis-server` the harness starts on a free port;
//!   "could not ask" is the server stopped (SIGSTOP);
//! - postgres: a real PostgreSQL the harness initdb's and starts on a free
//!   port; "could not ask" is every process of the server stopped (SIGSTOP);
//! - etcd: a real one-member etcd the harness starts on free ports;
//!   "could not ask" is the member stopped (SIGSTOP);
//! - memory: the library's in-memory backend, switched off.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::etcd_server::EtcdCluster;
use common::postgres_server::PostgresServer;
use common::redis_server::RedisServer;
use leaderrun::backend::memory::MemoryBackend;
use leaderrun::backend::{
    Attempt, Backend, BackendOptions, Fatal, Identity, LeaseConfig, LeaseStore, RenewError,
    StoreError,
};

const TTL: Duration = Duration::from_secs(1);
const CALL_TIMEOUT: Duration = Duration::from_millis(500);

/// One backend under test, and the means to cut it off.
trait Harness {
    fn backend(&self) -> Arc<dyn Backend>;
    /// Calls cannot reach the backend until `reachable`.
    fn unreachable(&mut self);
    fn reachable(&mut self);
    /// How long after a lease's ttl the backend lets it go.
    fn lapse_slack(&self) -> Duration {
        Duration::from_millis(200)
    }
}

struct Memory(MemoryBackend);

impl Harness for Memory {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.0.clone())
    }
    fn unreachable(&mut self) {
        self.0.set_reachable(false);
    }
    fn reachable(&mut self) {
        self.0.set_reachable(true);
    }
}

struct Files {
    dir: tempfile::TempDir,
    blocker: Option<std::fs::File>,
}

impl Harness for Files {
    fn backend(&self) -> Arc<dyn Backend> {
        let url = format!("file://{}", self.dir.path().join("state").display());
        leaderrun::backend::parse(Some(&url), &BackendOptions::default()).unwrap()
    }
    fn unreachable(&mut self) {
        // The mutex byte (offset 2^40) held by another open file
        // description, as by a replica stopped mid-write.
        let lease = std::fs::read_dir(self.dir.path().join("state"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "lease"))
            .expect("a lease file");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(lease)
            .unwrap();
        // SAFETY: flock is plain old data.
        let mut lock: libc::flock = unsafe { std::mem::zeroed() };
        lock.l_type = libc::F_WRLCK as libc::c_short;
        lock.l_whence = libc::SEEK_SET as libc::c_short;
        lock.l_start = 1 << 40;
        lock.l_len = 1;
        nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_OFD_SETLK(&lock)).unwrap();
        self.blocker = Some(file);
    }
    fn reachable(&mut self) {
        self.blocker = None;
    }
}

struct Redis(RedisServer);

impl Harness for Redis {
    fn backend(&self) -> Arc<dyn Backend> {
        leaderrun::backend::parse(Some(self.0.url()), &BackendOptions::default()).unwrap()
    }
    fn unreachable(&mut self) {
        self.0.pause();
    }
    fn reachable(&mut self) {
        self.0.resume();
    }
}

struct Postgres(PostgresServer);

impl Harness for Postgres {
    fn backend(&self) -> Arc<dyn Backend> {
        leaderrun::backend::parse(Some(&self.0.url()), &BackendOptions::default()).unwrap()
    }
    fn unreachable(&mut self) {
        self.0.pause();
    }
    fn reachable(&mut self) {
        self.0.resume();
    }
}

struct Etcd(EtcdCluster);

impl Harness for Etcd {
    fn backend(&self) -> Arc<dyn Backend> {
        leaderrun::backend::parse(Some(&self.0.url()), &BackendOptions::default()).unwrap()
    }
    fn unreachable(&mut self) {
        self.0.members[0].pause();
    }
    fn reachable(&mut self) {
        self.0.members[0].resume();
    }
    fn lapse_slack(&self) -> Duration {
        // etcd's lessor looks for expired leases every 500 ms.
        Duration::from_millis(900)
    }
}

fn etcd() -> Etcd {
    Etcd(EtcdCluster::start(1))
}

fn memory() -> Memory {
    Memory(MemoryBackend::new())
}

fn files() -> Files {
    Files {
        dir: tempfile::Builder::new()
            .prefix("leaderrun-contract-")
            .tempdir()
            .unwrap(),
        blocker: None,
    }
}

fn redis() -> Redis {
    let server = RedisServer::start();
    // A server younger than one ttl is held off (it may have lost a lease).
    server.wait_uptime(None, 1);
    Redis(server)
}

fn postgres() -> Postgres {
    let harness = Postgres(PostgresServer::start());
    // What a replica does first: make the tables (it may: superuser).
    let store = replica(&harness, "setup", "setup");
    block_on(store.check()).unwrap();
    harness
}

/// A replica's store for `key` on the harness's backend.
fn replica(harness: &dyn Harness, key: &str, owner: &str) -> Arc<dyn LeaseStore> {
    harness
        .backend()
        .lease(LeaseConfig {
            key: key.into(),
            me: Identity::new(owner),
            ttl: TTL,
            call_timeout: CALL_TIMEOUT,
            hand_over: false,
        })
        .unwrap()
}

fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

fn acquired(attempt: Result<Attempt, StoreError>) -> u64 {
    match attempt {
        Ok(Attempt::Acquired { token }) => token,
        other => panic!("not acquired: {other:?}"),
    }
}

// The contract.

fn tokens_strictly_grow(harness: &mut dyn Harness) {
    block_on(async {
        let a = replica(harness, "grow", "a");
        let b = replica(harness, "grow", "b");
        let mut last = 0;
        for round in 1..=6u64 {
            let store = if round % 2 == 0 { &a } else { &b };
            let token = acquired(store.acquire(round).await);
            assert!(token > last, "token {token} after {last}");
            last = token;
            assert!(store.release(token).await.unwrap());
        }
        // A store opened anew (a restarted replica) continues above.
        let c = replica(harness, "grow", "c");
        assert!(acquired(c.acquire(1).await) > last);
    });
}

fn an_attempt_is_idempotent_and_a_new_attempt_draws_a_new_token(harness: &mut dyn Harness) {
    block_on(async {
        let a = replica(harness, "again", "a");
        let first = acquired(a.acquire(1).await);
        // The reply of attempt 1 was lost; it is repeated.
        assert_eq!(acquired(a.acquire(1).await), first);
        // A new term of the same replica, its lease from the first still
        // unexpired: a strictly greater token (SPEC §5).
        let second = acquired(a.acquire(2).await);
        assert!(second > first, "{second} after {first}");
        assert!(a.renew(second).await.is_ok());
        assert!(matches!(a.renew(first).await, Err(RenewError::Lost(_))));
    });
}

fn held_and_could_not_ask_are_told_apart(harness: &mut dyn Harness) {
    let (a, b) = (
        replica(harness, "apart", "a"),
        replica(harness, "apart", "b"),
    );
    let token = block_on(async { acquired(a.acquire(1).await) });
    block_on(async {
        match b.acquire(1).await {
            Ok(Attempt::Held(holder)) => {
                assert_eq!((holder.owner.as_str(), holder.token), ("a", token));
                let left = holder.expires_in.expect("a known expiry");
                assert!(left <= TTL, "{left:?}");
            }
            other => panic!("not held: {other:?}"),
        }
    });
    harness.unreachable();
    let cut_off = block_on(async { (b.acquire(1).await, a.renew(token).await) });
    harness.reachable();
    assert!(
        matches!(cut_off.0, Err(StoreError::Unreachable(_))),
        "{:?}",
        cut_off.0
    );
    assert!(
        matches!(
            cut_off.1,
            Err(RenewError::Store(StoreError::Unreachable(_)))
        ),
        "a renewal that cannot ask is not a loss: {:?}",
        cut_off.1
    );
}

fn a_renewal_after_loss_is_lost(harness: &mut dyn Harness) {
    block_on(async {
        let a = replica(harness, "loss", "a");
        let b = replica(harness, "loss", "b");
        let token = acquired(a.acquire(1).await);
        // a stops renewing; its lease lapses and b takes it.
        tokio::time::sleep(TTL + harness.lapse_slack()).await;
        let theirs = acquired(b.acquire(1).await);
        assert!(theirs > token);
        match a.renew(token).await {
            Err(RenewError::Lost(Some(holder))) => {
                assert_eq!((holder.owner.as_str(), holder.token), ("b", theirs));
            }
            other => panic!("not lost to b: {other:?}"),
        }
        assert!(
            !a.release(token).await.unwrap(),
            "nothing of a's to release"
        );
        assert!(b.release(theirs).await.unwrap());
        assert!(matches!(a.renew(token).await, Err(RenewError::Lost(None))));
    });
}

/// A lease lasts a ttl from the start of the call that acquired it, also
/// for a follower whose last contact with the backend was most of a ttl
/// before (the supervisor counts the term from the call's start).
fn an_acquired_lease_lasts_a_ttl_from_the_acquisition(harness: &mut dyn Harness) {
    block_on(async {
        let a = replica(harness, "lasts", "a");
        let b = replica(harness, "lasts", "b");
        let c = replica(harness, "lasts", "c");
        let token = acquired(a.acquire(1).await);
        assert!(matches!(b.acquire(1).await, Ok(Attempt::Held(_))));
        tokio::time::sleep(TTL.mul_f64(0.9)).await;
        assert!(a.release(token).await.unwrap());
        let called = tokio::time::Instant::now();
        let theirs = acquired(b.acquire(2).await);
        // The term counts from the call, or from when the lease was last
        // made to last on the server if that was earlier.
        let since = b
            .acquired_since()
            .map_or(called, |at| tokio::time::Instant::from_std(at).min(called));
        tokio::time::sleep_until(since + TTL.mul_f64(0.75)).await;
        match c.acquire(1).await {
            Ok(Attempt::Held(holder)) => assert_eq!(holder.token, theirs),
            other => panic!("b's lease lapsed before its ttl: {other:?}"),
        }
    });
}

fn a_release_wakes_one_waiting_follower(harness: &mut dyn Harness) {
    block_on(async {
        let a = replica(harness, "wake", "a");
        let followers = [replica(harness, "wake", "b"), replica(harness, "wake", "c")];
        let token = acquired(a.acquire(1).await);
        let wakes = Arc::new(AtomicUsize::new(0));
        let waiting: Vec<_> = followers
            .iter()
            .map(|follower| {
                let (follower, wakes) = (follower.clone(), wakes.clone());
                tokio::spawn(async move {
                    loop {
                        follower.notice().await;
                        wakes.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        // A new place in line may wake its follower once: let that pass.
        tokio::time::sleep(Duration::from_millis(500)).await;
        wakes.store(0, Ordering::SeqCst);
        assert!(a.release(token).await.unwrap());
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(wakes.load(Ordering::SeqCst), 1, "one follower woke");
        for task in waiting {
            task.abort();
        }
    });
}

fn the_fence_moves_up_and_tokens_stop_at_the_maximum(harness: &mut dyn Harness) {
    let max = harness.backend().capabilities().max_token;
    block_on(async {
        let a = replica(harness, "fence", "a");
        assert_eq!(a.advance_fence(50).await.unwrap(), 50);
        assert_eq!(a.advance_fence(10).await.unwrap(), 50, "never down");
        let token = acquired(a.acquire(1).await);
        assert_eq!(token, 51);
        assert!(a.release(token).await.unwrap());
        // The largest token works, renewals included; the next is refused
        // for good, and so is a floor above it.
        assert_eq!(a.advance_fence(max - 1).await.unwrap(), max - 1);
        let last = acquired(a.acquire(2).await);
        assert_eq!(last, max);
        assert!(a.renew(last).await.is_ok());
        let observed = a.observe().await.unwrap();
        assert_eq!(observed.holder.unwrap().token, max);
        assert!(a.release(last).await.unwrap());
        let next = a.acquire(3).await;
        assert!(
            matches!(next, Err(StoreError::Fatal(Fatal::CounterExhausted { .. }))),
            "the counter is exhausted: {next:?}"
        );
        assert!(matches!(
            a.advance_fence(max + 1).await,
            Err(StoreError::Fatal(Fatal::FloorOutOfRange { .. }))
        ));
    });
}

fn observe_lists_the_holder_and_the_candidates_and_withdraw_removes_one(harness: &mut dyn Harness) {
    block_on(async {
        let a = replica(harness, "watch", "a");
        let b = replica(harness, "watch", "b");
        let token = acquired(a.acquire(1).await);
        assert!(matches!(b.acquire(1).await, Ok(Attempt::Held(_))));
        let seen = b.observe().await.unwrap();
        let holder = seen.holder.expect("held");
        assert_eq!((holder.owner.as_str(), holder.token), ("a", token));
        assert_eq!(seen.counter, token);
        let mut candidates: Vec<(String, bool)> = seen
            .candidates
            .iter()
            .map(|c| (c.owner.clone(), c.leading))
            .collect();
        candidates.sort();
        assert_eq!(candidates, [("a".into(), true), ("b".into(), false)]);
        b.withdraw().await.unwrap();
        let seen = a.observe().await.unwrap();
        let owners: Vec<&str> = seen.candidates.iter().map(|c| c.owner.as_str()).collect();
        assert_eq!(owners, ["a"]);
        assert!(a.release(token).await.unwrap());
        assert!(a.observe().await.unwrap().holder.is_none());
    });
}

/// The release at the end of a run, then the shutdown notice: whether a
/// backend does both in one call or two, the replica is gone from the
/// candidates and the next replica takes the lease at once with a greater
/// token.
fn the_last_release_and_the_withdrawal_leave_nothing_behind(harness: &mut dyn Harness) {
    block_on(async {
        let a = replica(harness, "last", "a");
        let b = replica(harness, "last", "b");
        let token = acquired(a.acquire(1).await);
        assert!(matches!(b.acquire(1).await, Ok(Attempt::Held(_))));
        assert!(a.release_last(token).await.unwrap());
        a.withdraw().await.unwrap();
        let seen = b.observe().await.unwrap();
        assert!(seen.holder.is_none());
        let owners: Vec<&str> = seen.candidates.iter().map(|c| c.owner.as_str()).collect();
        assert_eq!(owners, ["b"]);
        assert!(acquired(b.acquire(2).await) > token);
    });
}

/// Every contract test, for one backend.
macro_rules! contract {
    ($backend:ident) => {
        mod $backend {
            #[test]
            fn tokens_strictly_grow() {
                super::tokens_strictly_grow(&mut super::$backend());
            }
            #[test]
            fn an_attempt_is_idempotent_and_a_new_attempt_draws_a_new_token() {
                super::an_attempt_is_idempotent_and_a_new_attempt_draws_a_new_token(
                    &mut super::$backend(),
                );
            }
            #[test]
            fn held_and_could_not_ask_are_told_apart() {
                super::held_and_could_not_ask_are_told_apart(&mut super::$backend());
            }
            #[test]
            fn a_renewal_after_loss_is_lost() {
                super::a_renewal_after_loss_is_lost(&mut super::$backend());
            }
            #[test]
            fn an_acquired_lease_lasts_a_ttl_from_the_acquisition() {
                super::an_acquired_lease_lasts_a_ttl_from_the_acquisition(&mut super::$backend());
            }
            #[test]
            fn a_release_wakes_one_waiting_follower() {
                super::a_release_wakes_one_waiting_follower(&mut super::$backend());
            }
            #[test]
            fn the_fence_moves_up_and_tokens_stop_at_the_maximum() {
                super::the_fence_moves_up_and_tokens_stop_at_the_maximum(&mut super::$backend());
            }
            #[test]
            fn the_last_release_and_the_withdrawal_leave_nothing_behind() {
                super::the_last_release_and_the_withdrawal_leave_nothing_behind(
                    &mut super::$backend(),
                );
            }
            #[test]
            fn observe_lists_the_holder_and_the_candidates_and_withdraw_removes_one() {
                super::observe_lists_the_holder_and_the_candidates_and_withdraw_removes_one(
                    &mut super::$backend(),
                );
            }
        }
    };
}

contract!(memory);
contract!(files);
contract!(redis);
contract!(postgres);
contract!(etcd);
