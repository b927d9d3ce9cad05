//! `--metrics-addr HOST:PORT`: what a replica is doing, for Prometheus and
//! for Kubernetes.
//!
//! - `/metrics`: OpenMetrics text (which Prometheus scrapes natively);
//! - `/leader`: 200 while this replica leads, 503 otherwise: a readiness
//!   probe, so that a Service sends traffic to the leader only;
//! - `/healthz`: 200 while the supervisor loop is alive.
//!
//! The supervisor writes the figures (atomics, no locks); the HTTP server is
//! hyper on the same runtime, and only reads them.

use std::borrow::Cow;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use crate::error::ConfigError;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

/// The figures of one replica. Always kept; served only with --metrics-addr.
pub struct Metrics {
    registry: Registry,
    leading: Gauge,
    token: Gauge,
    terms_started: Counter,
    term_ends: Family<Reason, Counter>,
    renewal_failures: Counter,
    backend_errors: Counter,
    backend_calls: Counter,
    last_handover: Gauge<f64, AtomicU64>,
    /// When the supervisor loop last woke, in ms since `started`.
    alive_ms: AtomicU64,
    started: Instant,
    /// The longest the supervisor can sleep between wake-ups; twice that
    /// without one means it is stuck.
    longest_sleep: Duration,
    /// Shard mode: each shard's figures (this replica leads while any does).
    shards: Vec<Arc<Metrics>>,
}

impl Metrics {
    pub fn new(key: &str, owner: &str, longest_sleep: Duration) -> Arc<Metrics> {
        let mut registry = Self::registry(key, owner);
        let metrics = Self::figures(longest_sleep);
        metrics.register(&mut registry);
        Arc::new(Metrics {
            registry,
            ..metrics
        })
    }

    /// Shard mode: the replica's figures (its backend calls for the split)
    /// and each shard's, served together with a `shard` label on the
    /// shards' figures. `/leader` is 200 while any shard's command runs.
    pub fn sharded(
        key: &str,
        owner: &str,
        longest_sleep: Duration,
        shards: u32,
    ) -> (Arc<Metrics>, Vec<Arc<Metrics>>) {
        let mut registry = Self::registry(key, owner);
        let mut each = Vec::new();
        for shard in 0..shards {
            let figures = Self::figures(longest_sleep);
            let label = (Cow::Borrowed("shard"), Cow::Owned(shard.to_string()));
            figures.register(registry.sub_registry_with_label(label));
            each.push(Arc::new(figures));
        }
        let replica = Self::figures(longest_sleep);
        registry.register(
            "backend_calls",
            "Calls made to the backend (attempts, renewals, releases, heartbeats)",
            replica.backend_calls.clone(),
        );
        let replica = Arc::new(Metrics {
            registry,
            shards: each.clone(),
            ..replica
        });
        (replica, each)
    }

    fn registry(key: &str, owner: &str) -> Registry {
        let labels = [
            (Cow::Borrowed("key"), Cow::Owned(key.to_owned())),
            (Cow::Borrowed("owner"), Cow::Owned(owner.to_owned())),
        ];
        Registry::with_prefix_and_labels("leaderrun", labels.into_iter())
    }

    fn figures(longest_sleep: Duration) -> Metrics {
        Metrics {
            registry: Registry::default(),
            leading: Gauge::default(),
            token: Gauge::default(),
            terms_started: Counter::default(),
            term_ends: Family::default(),
            renewal_failures: Counter::default(),
            backend_errors: Counter::default(),
            backend_calls: Counter::default(),
            last_handover: Gauge::default(),
            alive_ms: AtomicU64::new(0),
            started: Instant::now(),
            longest_sleep,
            shards: Vec::new(),
        }
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "leading",
            "1 while this replica leads, else 0",
            self.leading.clone(),
        );
        registry.register(
            "token",
            "The fencing token of the current term (0 when not leading)",
            self.token.clone(),
        );
        registry.register(
            "terms_started",
            "Terms this replica has begun (acquisitions); each also ends once, by reason",
            self.terms_started.clone(),
        );
        registry.register(
            "term_ends",
            "Terms ended, by reason",
            self.term_ends.clone(),
        );
        registry.register(
            "renewal_failures",
            "Renewals that could not reach the backend",
            self.renewal_failures.clone(),
        );
        registry.register(
            "backend_errors",
            "Backend calls that could not reach the backend",
            self.backend_errors.clone(),
        );
        registry.register(
            "backend_calls",
            "Calls made to the backend (attempts, renewals, releases, heartbeats)",
            self.backend_calls.clone(),
        );
        registry.register(
            "last_handover_seconds",
            "From the wake-up that led to the last acquisition to its command's start",
            self.last_handover.clone(),
        );
    }

    /// A term began: the lease was acquired with `token`. Every term that
    /// begins also ends, and is counted by its reason then.
    pub fn term_began(&self, token: u64) {
        self.terms_started.inc();
        self.token.set(token as i64);
    }

    /// The term's command runs: this replica leads. `handover` is from the
    /// wake-up that led to the acquisition to now.
    pub fn command_started(&self, handover: Duration) {
        self.leading.set(1);
        self.last_handover.set(handover.as_secs_f64());
    }

    pub fn term_ended(&self, reason: &'static str) {
        self.leading.set(0);
        self.token.set(0);
        self.term_ends.get_or_create(&Reason { reason }).inc();
    }

    pub fn renewal_failed(&self) {
        self.renewal_failures.inc();
    }

    pub fn backend_error(&self) {
        self.backend_errors.inc();
    }

    /// The counter of backend calls, for the store's `Counted` layer.
    pub fn backend_calls(&self) -> Counter {
        self.backend_calls.clone()
    }

    /// The supervisor loop is alive.
    pub fn beat(&self) {
        self.alive_ms
            .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn leads(&self) -> bool {
        self.leading.get() == 1 || self.shards.iter().any(|shard| shard.leads())
    }

    fn healthy(&self) -> bool {
        let last = Duration::from_millis(self.alive_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last)
            <= 2 * self.longest_sleep + Duration::from_secs(1)
    }

    fn respond(&self, path: &str) -> Response<Full<Bytes>> {
        let (status, content_type, body) = match path {
            "/metrics" => {
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &self.registry) {
                    Ok(()) => (
                        StatusCode::OK,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        text,
                    ),
                    Err(_) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "text/plain",
                        "cannot encode\n".into(),
                    ),
                }
            }
            "/leader" if self.leads() => (StatusCode::OK, "text/plain", "leader\n".into()),
            "/leader" => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                "follower\n".into(),
            ),
            "/healthz" if self.healthy() => (StatusCode::OK, "text/plain", "ok\n".into()),
            "/healthz" => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                "supervisor stalled\n".into(),
            ),
            _ => (
                StatusCode::NOT_FOUND,
                "text/plain",
                "try /metrics, /leader or /healthz\n".into(),
            ),
        };
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        if let Ok(value) = content_type.parse() {
            response
                .headers_mut()
                .insert(hyper::header::CONTENT_TYPE, value);
        }
        response
    }
}

/// Binds the metrics address (before anything else happens, so a taken port
/// is a configuration error) and serves it on the current runtime.
pub fn serve(address: &str, metrics: Arc<Metrics>) -> Result<(), ConfigError> {
    let refused = |why: String| ConfigError::MetricsAddr {
        address: address.to_owned(),
        why,
    };
    let socket: SocketAddr = address.parse().map_err(|_| {
        refused(
            "expected HOST:PORT with an IP address, such as 0.0.0.0:9090 or 127.0.0.1:9090".into(),
        )
    })?;
    let cannot = |e: std::io::Error| ConfigError::MetricsBind {
        address: address.to_owned(),
        why: match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                "the address is already in use (another process listens there); choose another port"
                    .into()
            }
            std::io::ErrorKind::AddrNotAvailable => {
                "no interface of this host has that IP address; use 0.0.0.0 or one of its own"
                    .into()
            }
            std::io::ErrorKind::PermissionDenied => {
                "permission denied (ports below 1024 need privileges); choose a port above 1023"
                    .into()
            }
            _ => e.to_string(),
        },
    };
    let listener = std::net::TcpListener::bind(socket).map_err(cannot)?;
    listener.set_nonblocking(true).map_err(cannot)?;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(cannot)?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                    let response = metrics.respond(request.uri().path());
                    async move { Ok::<_, Infallible>(response) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(())
}
