//! The Redis client: how a URL becomes a client (TLS included), the command
//! connection that is made again after an error, and the one place that
//! sorts the client's errors into "could not ask" and "cannot ever work".

use std::path::PathBuf;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo,
    RedisError, Script,
};
use tokio::sync::Mutex;

use super::url::{Address, RedisUrl};
use crate::backend::{Fatal, StoreError, Unreachable};
use crate::error::ConfigError;

/// The command connection of one replica: one multiplexed connection,
/// dropped after an error that leaves its state unknown and made again on
/// the next call.
pub struct Connection {
    client: Client,
    config: AsyncConnectionConfig,
    slot: Mutex<Option<MultiplexedConnection>>,
    /// The server, for messages (the URL, masked).
    shown: String,
    db: i64,
}

impl Connection {
    pub fn new(client: Client, config: AsyncConnectionConfig, url: &RedisUrl) -> Connection {
        Connection {
            client,
            config,
            slot: Mutex::new(None),
            shown: url.to_string(),
            db: url.db,
        }
    }

    async fn get_raw(&self) -> Result<MultiplexedConnection, RedisError> {
        let mut slot = self.slot.lock().await;
        if let Some(connection) = slot.as_ref() {
            return Ok(connection.clone());
        }
        let connection = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        *slot = Some(connection.clone());
        Ok(connection)
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
        let result = invocation.invoke_async(&mut connection).await;
        if let Err(error) = &result {
            self.forget_after(error);
        }
        result
    }

    /// Runs one plain command.
    pub async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        let mut connection = self.get_raw().await.map_err(|e| self.classify(e))?;
        let result = cmd.query_async(&mut connection).await;
        result.map_err(|e| {
            self.forget_after(&e);
            self.classify(e)
        })
    }

    /// Forgets the connection after an error that leaves its state unknown.
    fn forget_after(&self, error: &RedisError) {
        if error.is_io_error()
            || error.is_timeout()
            || error.is_connection_dropped()
            || error.is_unrecoverable_error()
        {
            // Forget the connection; the next call makes a new one. Never
            // blocks: if another call holds the slot, it will find out too.
            if let Ok(mut slot) = self.slot.try_lock() {
                *slot = None;
            }
        }
    }

    /// Sorts an error: what no retry can fix is `Fatal::Refused`, naming
    /// what is missing; everything else is "could not ask". redis-rs errors
    /// name the server's reply or the OS error, never the URL or password.
    pub fn classify(&self, error: RedisError) -> StoreError {
        let text = error.to_string();
        let code = error.code().unwrap_or_default();
        if error.kind() == redis::ErrorKind::AuthenticationFailed
            || code == "WRONGPASS"
            || code == "NOAUTH"
        {
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

/// The client for a URL: plain, TLS (server certificate verified, against
/// `tls_ca_file` if given) or a unix socket.
pub fn client(url: &RedisUrl, tls_ca_file: Option<&PathBuf>) -> Result<Client, ConfigError> {
    if matches!(url.address, Address::Tcp { tls: true, .. }) {
        // rustls needs a process-wide crypto provider; ring is the one built
        // in. An error only means one is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let address = match &url.address {
        Address::Tcp {
            host,
            port,
            tls: false,
        } => ConnectionAddr::Tcp(host.clone(), *port),
        Address::Tcp {
            host,
            port,
            tls: true,
        } => ConnectionAddr::TcpTls {
            host: host.clone(),
            port: *port,
            insecure: false,
            tls_params: None,
        },
        Address::Unix { path } => ConnectionAddr::Unix(path.clone()),
    };
    let mut settings = RedisConnectionInfo::default().set_db(url.db);
    if let Some(user) = &url.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &url.password {
        settings = settings.set_password(password.expose());
    }
    let refused = |why: String| ConfigError::BackendUrl {
        url: url.to_string(),
        why,
    };
    let info = address
        .into_connection_info()
        .map_err(|e| refused(e.to_string()))?
        .set_redis_settings(settings);
    match (tls_ca_file, &url.address) {
        (Some(ca), Address::Tcp { tls: true, .. }) => {
            let pem = std::fs::read(ca)
                .map_err(|e| refused(format!("cannot read --tls-ca-file {}: {e}", ca.display())))?;
            Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                },
            )
            .map_err(|e| refused(format!("--tls-ca-file {}: {e}", ca.display())))
        }
        (Some(_), _) => Err(refused("--tls-ca-file needs a rediss:// URL".into())),
        (None, _) => Client::open(info).map_err(|e| refused(e.to_string())),
    }
}
