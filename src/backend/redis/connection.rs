//! The Redis client: how a URL becomes a target (one server, the primary
//! the sentinels name, or a cluster; TLS included), the command connection
//! that is made again after an error, and the one place that sorts the
//! client's errors into "could not ask" and "cannot ever work".

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo,
    RedisError, RedisFuture, Script, TlsCertificates, Value,
};
use tokio::sync::Mutex;

use super::url::{Address, RedisUrl};
use crate::backend::{Fatal, StoreError, Unreachable};
use crate::error::ConfigError;

/// Where connections go. Behind Sentinel, every new connection asks the
/// sentinels for the primary again (and checks its role), so a failover is
/// followed as soon as the old connection fails; a cluster connection
/// follows redirections and a node's failover itself.
#[derive(Clone)]
pub enum Target {
    Server(Client),
    Sentinel(Arc<Mutex<SentinelClient>>),
    Cluster(redis::cluster::ClusterClient),
}

impl Target {
    /// A new connection, with these timeouts.
    pub async fn connect(&self, connect: Duration, response: Duration) -> Result<Conn, RedisError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect))
            .set_response_timeout(Some(response));
        match self {
            Target::Server(client) => client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map(Conn::Server),
            Target::Sentinel(sentinel) => {
                let primary = sentinel.lock().await.async_get_client().await?;
                primary
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map(Conn::Server)
            }
            Target::Cluster(cluster) => cluster
                .get_async_connection_with_config(
                    ClusterConfig::new()
                        .set_connection_timeout(connect)
                        .set_response_timeout(response),
                )
                .await
                .map(Conn::Cluster),
        }
    }
}

impl Target {
    /// Behind Sentinel: whether the sentinels know the service. `Ok(false)`
    /// when a sentinel answered that it does not; an error when none could
    /// be asked. Elsewhere, `Ok(true)`.
    pub async fn service_known(&self, service: &str) -> Result<bool, RedisError> {
        let Target::Sentinel(sentinel) = self else {
            return Ok(true);
        };
        let client = sentinel.lock().await.async_get_sentinel_client().await?;
        let mut connection = client.get_multiplexed_async_connection().await?;
        let address: Value = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(service)
            .query_async(&mut connection)
            .await?;
        Ok(address != Value::Nil)
    }
}

/// A connection to one server, or to a cluster.
#[derive(Clone)]
pub enum Conn {
    Server(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Server(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Server(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Server(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl Conn {
    /// Runs `cmd` on the server that holds `key`: the connection's one
    /// server, or the primary of the key's slot in a cluster (where `INFO`
    /// and `WAIT` would otherwise go to every node).
    pub async fn on_key_node<T: redis::FromRedisValue>(
        &mut self,
        cmd: Cmd,
        key: &str,
    ) -> Result<T, RedisError> {
        match self {
            Conn::Server(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => {
                let route = Route::with_key(key.as_bytes(), SlotAddr::Master);
                let value = c
                    .route_command(
                        cmd,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await?;
                Ok(redis::from_redis_value(value)?)
            }
        }
    }
}

/// The command connection of one replica: one connection, dropped after an
/// error that leaves its state unknown (or that means a failover) and made
/// again on the next call.
pub struct Connection {
    target: Target,
    connect_timeout: Duration,
    response_timeout: Duration,
    slot: Mutex<Option<Conn>>,
    /// The server, for messages (the URL, masked).
    shown: String,
    db: i64,
}

impl Connection {
    pub fn new(target: Target, call_timeout: Duration, url: &RedisUrl) -> Connection {
        Connection {
            target,
            connect_timeout: call_timeout,
            response_timeout: call_timeout,
            slot: Mutex::new(None),
            shown: url.to_string(),
            db: url.db,
        }
    }

    async fn get_raw(&self) -> Result<Conn, RedisError> {
        let mut slot = self.slot.lock().await;
        if let Some(connection) = slot.as_ref() {
            return Ok(connection.clone());
        }
        let connection = self
            .target
            .connect(self.connect_timeout, self.response_timeout)
            .await?;
        *slot = Some(connection.clone());
        Ok(connection)
    }

    /// Runs `cmd` on the server of `key` (see `Conn::on_key_node`).
    pub async fn on_key_node<T: redis::FromRedisValue>(
        &self,
        cmd: Cmd,
        key: &str,
    ) -> Result<T, StoreError> {
        let mut connection = self.get_raw().await.map_err(|e| self.classify(e))?;
        let unfinished = Unfinished::new(self);
        let result = connection.on_key_node(cmd, key).await;
        unfinished.finished();
        result.map_err(|e| {
            self.forget_after(&e);
            self.classify(e)
        })
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The server, for messages: the URL with the password masked.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// Runs one script (EVALSHA, loaded again if the server forgot it).
    pub async fn run<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[String],
    ) -> Result<T, StoreError> {
        self.run_raw(script, keys, args)
            .await
            .map_err(|e| self.classify(e))
    }

    /// `run`, with the client's own error, for a caller that looks closer.
    pub async fn run_raw<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[String],
    ) -> Result<T, RedisError> {
        let mut connection = match self.get_raw().await {
            Ok(connection) => connection,
            Err(error) => return Err(error),
        };
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(arg);
        }
        let unfinished = Unfinished::new(self);
        let result = invocation.invoke_async(&mut connection).await;
        unfinished.finished();
        if let Err(error) = &result {
            self.forget_after(error);
        }
        result
    }

    /// Forgets the connection; the next call makes a new one. Never blocks:
    /// if another call holds the slot, it will find out too.
    fn forget(&self) {
        if let Ok(mut slot) = self.slot.try_lock() {
            *slot = None;
        }
    }

    /// Forgets the connection after an error that leaves its state unknown,
    /// or that means the server is no longer the primary (a failover).
    fn forget_after(&self, error: &RedisError) {
        let failover = matches!(
            error.code(),
            Some("READONLY" | "MASTERDOWN" | "LOADING" | "CLUSTERDOWN")
        );
        if failover
            || error.is_io_error()
            || error.is_timeout()
            || error.is_connection_dropped()
            || error.is_unrecoverable_error()
        {
            self.forget();
        }
    }

    /// Sorts an error: what no retry can fix is `Fatal::Refused`, naming
    /// what is missing; everything else is "could not ask". redis-rs errors
    /// name the server's reply or the OS error, never the URL or password.
    pub fn classify(&self, error: RedisError) -> StoreError {
        let text = error.to_string();
        let code = error.code().unwrap_or_default();
        if is_auth_error(&error) {
            return Fatal::Refused(format!(
                "backend {} refused the credentials: {text}; check the user and password in the URL",
                self.shown
            ))
            .into();
        }
        if code == "NOPERM" || text.contains("NOPERM") || text.contains("can't run this command") {
            return Fatal::Refused(format!(
                "backend {}: the user lacks a permission: {text}; grant it (the README's ACL line lists every one leaderrun needs)",
                self.shown
            ))
            .into();
        }
        if text.contains("DB index is out of range") {
            return Fatal::Refused(format!(
                "backend {}: database {} does not exist on the server; use a database below its `databases` setting",
                self.shown, self.db
            ))
            .into();
        }
        if text.contains("unknown command") {
            return Fatal::Refused(format!(
                "backend {}: the server does not know a command leaderrun needs: {text}",
                self.shown
            ))
            .into();
        }
        Unreachable::Server(format!("redis: {text}")).into()
    }
}

/// A TCP address, with TLS (the certificate verified) or without.
fn tcp_address(host: &str, port: u16, tls: bool) -> ConnectionAddr {
    if tls {
        ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: false,
            tls_params: None,
        }
    } else {
        ConnectionAddr::Tcp(host.to_owned(), port)
    }
}

/// Whether the server (or a sentinel) refused the credentials.
pub fn is_auth_error(error: &RedisError) -> bool {
    error.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(error.code(), Some("WRONGPASS" | "NOAUTH"))
}

/// A command in flight. Dropped before `finished` (the caller's timeout
/// gave up on it), it forgets the connection: its state is unknown, and a
/// cluster connection may still be chasing a node that is gone.
struct Unfinished<'a>(Option<&'a Connection>);

impl<'a> Unfinished<'a> {
    fn new(connection: &'a Connection) -> Self {
        Unfinished(Some(connection))
    }

    fn finished(mut self) {
        self.0 = None;
    }
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let Some(connection) = self.0 {
            connection.forget();
        }
    }
}

/// The target of a URL: one server (plain, TLS with the server certificate
/// verified, against `tls_ca_file` if given, or a unix socket), the primary
/// of a Sentinel service, or a cluster.
pub fn target(
    url: &RedisUrl,
    tls_ca_file: Option<&PathBuf>,
    sentinel_password: Option<&str>,
) -> Result<Target, ConfigError> {
    let refused = |why: String| ConfigError::BackendUrl {
        url: url.to_string(),
        why,
    };
    if url.address.tls() {
        // rustls needs a process-wide crypto provider; ring is the one built
        // in. An error only means one is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let certificates = match tls_ca_file {
        Some(ca) if url.address.tls() => Some(TlsCertificates {
            client_tls: None,
            root_cert: Some(std::fs::read(ca).map_err(|e| {
                refused(format!("cannot read --tls-ca-file {}: {e}", ca.display()))
            })?),
        }),
        Some(_) => {
            return Err(refused(
                "--tls-ca-file needs TLS: a rediss:// (or rediss+sentinel://, rediss+cluster://) URL"
                    .into(),
            ));
        }
        None => None,
    };
    if sentinel_password.is_some() && !matches!(url.address, Address::Sentinel { .. }) {
        return Err(refused(
            "--sentinel-password needs a redis+sentinel:// URL".into(),
        ));
    }
    let tls_mode = redis::TlsMode::Secure;
    match &url.address {
        Address::Sentinel {
            sentinels,
            service,
            tls,
        } => {
            let addresses = sentinels
                .iter()
                .map(|(host, port)| tcp_address(host, *port, *tls));
            let mut builder =
                SentinelClientBuilder::new(addresses, service, SentinelServerType::Master)
                    .map_err(|e| refused(e.to_string()))?
                    .set_client_to_redis_db(url.db);
            if let Some(user) = &url.username {
                builder = builder.set_client_to_redis_username(user);
            }
            if let Some(password) = &url.password {
                builder = builder.set_client_to_redis_password(password.expose());
            }
            if let Some(password) = sentinel_password {
                builder = builder.set_client_to_sentinel_password(password);
            }
            if *tls {
                builder = builder
                    .set_client_to_redis_tls_mode(tls_mode)
                    .set_client_to_sentinel_tls_mode(tls_mode);
                if let Some(certificates) = certificates {
                    builder = builder
                        .set_client_to_redis_certificates(certificates.clone())
                        .set_client_to_sentinel_certificates(certificates);
                }
            }
            let client = builder.build().map_err(|e| refused(e.to_string()))?;
            Ok(Target::Sentinel(Arc::new(Mutex::new(client))))
        }
        Address::Cluster { nodes, tls } => {
            let nodes: Vec<redis::ConnectionInfo> = nodes
                .iter()
                .map(|(host, port)| ConnectionAddr::Tcp(host.clone(), *port).into_connection_info())
                .collect::<Result<_, _>>()
                .map_err(|e| refused(e.to_string()))?;
            // The client's own retries wait 1.3 s and more by default, past
            // any call's timeout: retry at once, a few times, and leave the
            // rest to leaderrun's own retries (which make a new connection).
            let mut builder = ClusterClientBuilder::new(nodes)
                .retries(3)
                .min_retry_wait(5)
                .max_retry_wait(50)
                .retry_wait_formula(10, 2);
            if let Some(user) = &url.username {
                builder = builder.username(user);
            }
            if let Some(password) = &url.password {
                builder = builder.password(password.expose());
            }
            if *tls {
                builder = builder.tls(tls_mode);
                if let Some(certificates) = certificates {
                    builder = builder.certs(certificates);
                }
            }
            let client = builder.build().map_err(|e| refused(e.to_string()))?;
            Ok(Target::Cluster(client))
        }
        Address::Tcp { host, port, tls } => {
            server(url, tcp_address(host, *port, *tls), certificates).map_err(refused)
        }
        Address::Unix { path } => {
            server(url, ConnectionAddr::Unix(path.clone()), None).map_err(refused)
        }
    }
}

/// One server's client.
fn server(
    url: &RedisUrl,
    address: ConnectionAddr,
    certificates: Option<TlsCertificates>,
) -> Result<Target, String> {
    let mut settings = RedisConnectionInfo::default().set_db(url.db);
    if let Some(user) = &url.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &url.password {
        settings = settings.set_password(password.expose());
    }
    let info = address
        .into_connection_info()
        .map_err(|e| e.to_string())?
        .set_redis_settings(settings);
    let client = match certificates {
        Some(certificates) => Client::build_with_tls(info, certificates),
        None => Client::open(info),
    };
    client.map(Target::Server).map_err(|e| e.to_string())
}
