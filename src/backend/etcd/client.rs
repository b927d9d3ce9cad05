//! The etcd client: etcd's documented v3 JSON gateway (`POST /v3/…`, served
//! by etcd 3.4 and later) over hyper's HTTP/1.1 client, so a plain
//! `cargo build` needs no protobuf compiler and no system library.
//!
//! Every call goes to the member that answered last and, when that one
//! cannot answer within its share of the call timeout (down, stopped, cut
//! off, or without a leader: every request asks for one), to the next. A
//! connection is kept per member and dropped after any error or a call
//! given up on, so a half-read reply never meets the next request. With a
//! user, the client authenticates on first use and again when the server
//! forgets its token.
//!
//! A watch is a long POST whose reply is a stream of JSON lines.

use std::sync::Mutex as StdMutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use crate::backend::url::Secret;

/// gRPC status codes the gateway passes on in `code`.
pub mod code {
    pub const PERMISSION_DENIED: i64 = 7;
    pub const UNAVAILABLE: i64 = 14;
    pub const UNAUTHENTICATED: i64 = 16;
}

/// A call that got no usable answer.
#[derive(Debug, Clone)]
pub enum EtcdError {
    /// No member could be asked: every one was down, slow, cut off or
    /// without a leader.
    Unreachable(String),
    /// A member answered with an error.
    Server { code: i64, message: String },
}

impl EtcdError {
    pub fn is_auth(&self) -> bool {
        matches!(self, EtcdError::Server { code, message }
            if *code == code::UNAUTHENTICATED
                || *code == code::PERMISSION_DENIED
                || message.contains("authentication failed")
                || message.contains("permission denied")
                || message.contains("user name is empty"))
    }
}

impl std::fmt::Display for EtcdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EtcdError::Unreachable(why) => f.write_str(why),
            EtcdError::Server { code, message } => write!(f, "etcd: {message} (code {code})"),
        }
    }
}

/// How to reach the members.
pub struct Client {
    endpoints: Vec<(String, u16)>,
    tls: Option<tokio_rustls::TlsConnector>,
    login: Option<(String, Secret)>,
    token: StdMutex<Option<String>>,
    /// The member that answered last.
    preferred: AtomicUsize,
    /// Each member's share of a call's time.
    per_member: Duration,
    /// An idle connection per member.
    idle: Vec<Mutex<Option<SendRequest<Full<Bytes>>>>>,
}

impl Client {
    pub fn new(
        endpoints: Vec<(String, u16)>,
        tls: Option<tokio_rustls::TlsConnector>,
        login: Option<(String, Secret)>,
        call_timeout: Duration,
    ) -> Client {
        let members = endpoints.len().max(1) as u32;
        Client {
            idle: endpoints.iter().map(|_| Mutex::new(None)).collect(),
            endpoints,
            tls,
            login,
            token: StdMutex::new(None),
            preferred: AtomicUsize::new(0),
            per_member: (call_timeout / members).max(Duration::from_millis(50)),
        }
    }

    /// `POST /v3/{path}` with `body`; the reply's JSON.
    pub async fn call(&self, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let members = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed);
        let mut why = Vec::new();
        for k in 0..members {
            let i = (first + k) % members;
            let (host, port) = &self.endpoints[i];
            let asked = tokio::time::timeout(self.per_member, self.call_on(i, path, body)).await;
            match asked {
                Ok(Ok(value)) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(value);
                }
                // A member that cannot serve (no leader, shutting down):
                // the next may.
                Ok(Err(EtcdError::Server { code, message })) if code == code::UNAVAILABLE => {
                    why.push(format!("{host}:{port}: {message}"));
                }
                Ok(Err(error @ EtcdError::Server { .. })) => return Err(error),
                Ok(Err(EtcdError::Unreachable(e))) => why.push(format!("{host}:{port}: {e}")),
                Err(_) => why.push(format!(
                    "{host}:{port}: no answer within {} ms",
                    self.per_member.as_millis()
                )),
            }
        }
        Err(EtcdError::Unreachable(format!(
            "etcd: no member answered ({})",
            why.join("; ")
        )))
    }

    /// One call to member `i`, authenticating first if it must.
    async fn call_on(&self, i: usize, path: &str, body: &Value) -> Result<Value, EtcdError> {
        if self.login.is_some() && self.token.lock().unwrap().is_none() {
            self.authenticate(i).await?;
        }
        match self.request(i, path, body).await {
            Err(EtcdError::Server { code, message })
                if self.login.is_some()
                    && (code == code::UNAUTHENTICATED
                        || message.contains("invalid auth token")) =>
            {
                // The server forgot the token (restart, expiry): once more.
                self.authenticate(i).await?;
                self.request(i, path, body).await
            }
            other => other,
        }
    }

    async fn authenticate(&self, i: usize) -> Result<(), EtcdError> {
        let Some((name, password)) = &self.login else {
            return Ok(());
        };
        *self.token.lock().unwrap() = None;
        let reply = self
            .request(
                i,
                "auth/authenticate",
                &json!({"name": name, "password": password.expose()}),
            )
            .await?;
        let token = reply["token"].as_str().unwrap_or_default().to_owned();
        *self.token.lock().unwrap() = Some(token);
        Ok(())
    }

    async fn request(&self, i: usize, path: &str, body: &Value) -> Result<Value, EtcdError> {
        // The idle connection is taken out while in use: a call given up on
        // drops it with the future, and it is never used half-read.
        let idle = self.idle[i].lock().await.take();
        let mut sender = match idle {
            Some(sender) if !sender.is_closed() => sender,
            _ => self.connect(i).await?,
        };
        sender
            .ready()
            .await
            .map_err(|e| EtcdError::Unreachable(e.to_string()))?;
        let response = sender
            .send_request(self.post(i, path, body))
            .await
            .map_err(|e| EtcdError::Unreachable(e.to_string()))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| EtcdError::Unreachable(e.to_string()))?
            .to_bytes();
        *self.idle[i].lock().await = Some(sender);
        reply(status, &bytes)
    }

    fn post(&self, i: usize, path: &str, body: &Value) -> Request<Full<Bytes>> {
        let (host, port) = &self.endpoints[i];
        let mut request = Request::post(format!("/v3/{path}"))
            .header(hyper::header::HOST, format!("{host}:{port}"))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            // A member without a leader refuses at once instead of waiting.
            .header("grpc-metadata-hasleader", "true");
        if let Some(token) = self.token.lock().unwrap().as_deref() {
            request = request.header(hyper::header::AUTHORIZATION, token);
        }
        request
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("a well-formed request")
    }

    async fn connect(&self, i: usize) -> Result<SendRequest<Full<Bytes>>, EtcdError> {
        let (host, port) = &self.endpoints[i];
        let unreachable = |e: &dyn std::fmt::Display| EtcdError::Unreachable(e.to_string());
        let tcp = TcpStream::connect((host.as_str(), *port))
            .await
            .map_err(|e| unreachable(&e))?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => {
                let (sender, connection) = http1::handshake(TokioIo::new(tcp))
                    .await
                    .map_err(|e| unreachable(&e))?;
                tokio::spawn(connection);
                Ok(sender)
            }
            Some(tls) => {
                let name = rustls::pki_types::ServerName::try_from(host.clone())
                    .map_err(|e| unreachable(&e))?;
                let stream = tls
                    .connect(name, tcp)
                    .await
                    .map_err(|e| unreachable(&format!("TLS: {e}")))?;
                let (sender, connection) = http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| unreachable(&e))?;
                tokio::spawn(connection);
                Ok(sender)
            }
        }
    }

    /// Opens a watch (`create_request`) on a member: the stream of its
    /// replies.
    pub async fn watch(&self, create: Value) -> Result<WatchStream, EtcdError> {
        let members = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed);
        let mut why = Vec::new();
        for k in 0..members {
            let i = (first + k) % members;
            let opened = tokio::time::timeout(self.per_member, async {
                if self.login.is_some() && self.token.lock().unwrap().is_none() {
                    self.authenticate(i).await?;
                }
                let mut sender = self.connect(i).await?;
                let body = json!({ "create_request": create });
                sender
                    .send_request(self.post(i, "watch", &body))
                    .await
                    .map_err(|e| EtcdError::Unreachable(e.to_string()))
            })
            .await;
            match opened {
                Ok(Ok(response)) if response.status() == StatusCode::OK => {
                    return Ok(WatchStream {
                        response,
                        buffer: Vec::new(),
                    });
                }
                Ok(Ok(response)) => why.push(format!("HTTP {}", response.status())),
                Ok(Err(e)) => why.push(e.to_string()),
                Err(_) => why.push("no answer".into()),
            }
        }
        Err(EtcdError::Unreachable(format!(
            "etcd watch: no member answered ({})",
            why.join("; ")
        )))
    }
}

/// The replies of one watch, a JSON object a line.
pub struct WatchStream {
    response: Response<Incoming>,
    buffer: Vec<u8>,
}

impl WatchStream {
    /// The next reply's `result`; an error when the stream ends or breaks.
    pub async fn next(&mut self) -> Result<Value, EtcdError> {
        loop {
            if let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                let value: Value = serde_json::from_slice(&line)
                    .map_err(|e| EtcdError::Unreachable(format!("etcd watch: {e}")))?;
                if let Some(error) = value.get("error") {
                    return Err(server_error(error));
                }
                return Ok(value["result"].clone());
            }
            match self.response.body_mut().frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Err(EtcdError::Unreachable(e.to_string())),
                None => return Err(EtcdError::Unreachable("etcd watch ended".into())),
            }
        }
    }
}

fn reply(status: StatusCode, bytes: &[u8]) -> Result<Value, EtcdError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        EtcdError::Unreachable(format!(
            "etcd: HTTP {status}, not a gateway reply ({e}); is this an etcd 3.4+ client URL?"
        ))
    })?;
    if status.is_success() {
        Ok(value)
    } else {
        Err(server_error(&value))
    }
}

fn server_error(value: &Value) -> EtcdError {
    EtcdError::Server {
        code: value["code"].as_i64().unwrap_or(-1),
        message: value["message"]
            .as_str()
            .or(value["error"].as_str())
            .unwrap_or("error")
            .to_owned(),
    }
}

/// Bytes as the gateway wants them: base64.
pub fn b64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// A base64 field of a reply, decoded (empty if absent).
pub fn unb64(value: &Value) -> Vec<u8> {
    value
        .as_str()
        .and_then(|s| STANDARD.decode(s).ok())
        .unwrap_or_default()
}

/// An int64 field of a reply (the gateway writes them as strings, and
/// leaves zeros out).
pub fn int(value: &Value) -> i64 {
    match value {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}
