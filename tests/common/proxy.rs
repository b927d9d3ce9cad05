//! A TCP proxy for tests, between leaderrun and Redis: it can drop every
//! connection, black-hole the traffic (stop forwarding, keep the sockets
//! open, as a network partition does), or send new connections elsewhere
//! (a failover to another server).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Proxy {
    pub port: u16,
    black_hole: Arc<AtomicBool>,
    target: Arc<AtomicU16>,
    connections: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `target`.
    pub fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let black_hole = Arc::new(AtomicBool::new(false));
        let target = Arc::new(AtomicU16::new(target));
        let connections: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (hole, to, conns) = (black_hole.clone(), target.clone(), connections.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", to.load(Ordering::SeqCst)))
                else {
                    continue;
                };
                let mut registry = conns.lock().unwrap();
                registry.push(client.try_clone().unwrap());
                registry.push(server.try_clone().unwrap());
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let hole = hole.clone();
                    std::thread::spawn(move || pump(from, to, &hole));
                }
            }
        });
        Proxy {
            port,
            black_hole,
            target,
            connections,
        }
    }

    pub fn drop_connections(&self) {
        for stream in self.connections.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    pub fn black_hole(&self, on: bool) {
        self.black_hole.store(on, Ordering::SeqCst);
    }

    /// New connections go to `port` from now on.
    pub fn retarget(&self, port: u16) {
        self.target.store(port, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, black_hole: &AtomicBool) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
    let mut buf = [0u8; 16384];
    loop {
        if black_hole.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
