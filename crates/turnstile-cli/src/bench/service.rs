//! `turnstile bench lock --service URL`: the lock workload through `turnstile serve`
//! (acquire and release as HTTP/1.1 requests on kept-alive connections), with the
//! contended phase's counter in the store the service runs on (`--store`).

use std::net::SocketAddr;
use std::sync::Mutex;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use turnstile::{Error, ErrorKind};

/// A lock taken through the service.
pub(crate) struct ServiceHeld {
    name: String,
    owner: String,
}

/// Kept-alive connections to one service; each request takes one (or opens one) and
/// puts it back after a complete answer.
pub(crate) struct ServiceClient {
    address: SocketAddr,
    idle: Mutex<Vec<BufReader<TcpStream>>>,
}

impl ServiceClient {
    /// For `http://HOST:PORT` (plain HTTP on loopback: the bench measures the service,
    /// not TLS).
    pub(crate) fn new(url: &str) -> Result<ServiceClient, Error> {
        let address = url
            .strip_prefix("http://")
            .map(|rest| rest.trim_end_matches('/'))
            .and_then(|rest| rest.parse::<SocketAddr>().ok())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidUrl,
                    format!("--service takes http://IP:PORT; got {url:?}"),
                )
            })?;
        Ok(ServiceClient {
            address,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// One POST with a JSON body; the status and body of the answer.
    async fn post(&self, path: &str, body: &str) -> Result<(u16, String), String> {
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut connection = match pooled {
            Some(connection) => connection,
            None => {
                let stream = TcpStream::connect(self.address)
                    .await
                    .map_err(|e| format!("cannot reach the service at {}: {e}", self.address))?;
                stream.set_nodelay(true).map_err(|e| e.to_string())?;
                BufReader::new(stream)
            }
        };
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        connection
            .get_mut()
            .write_all(request.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut status = 0u16;
        let mut length = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            if connection
                .read_line(&mut line)
                .await
                .map_err(|e| e.to_string())?
                == 0
            {
                return Err("the service closed the connection".to_owned());
            }
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            if status == 0 {
                status = trimmed
                    .split(' ')
                    .nth(1)
                    .and_then(|code| code.parse().ok())
                    .ok_or_else(|| format!("not an HTTP status line: {trimmed:?}"))?;
            } else if let Some((name, value)) = trimmed.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().map_err(|_| "bad content-length")?;
            }
        }
        let mut body = vec![0; length];
        connection
            .read_exact(&mut body)
            .await
            .map_err(|e| e.to_string())?;
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(connection);
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    /// Acquire with a wait; `Ok(None)` when the lock was still held when it ended.
    pub(crate) async fn acquire(
        &self,
        name: &str,
        ttl_ms: u64,
        wait_ms: u64,
    ) -> Result<Option<ServiceHeld>, String> {
        let path = format!("/v1/locks/{}/acquire", encode(name));
        let body = format!("{{\"ttl_ms\":{ttl_ms},\"wait_ms\":{wait_ms}}}");
        let (status, answer) = self.post(&path, &body).await?;
        match status {
            200 => {
                let lease: serde_json::Value =
                    serde_json::from_str(&answer).map_err(|e| e.to_string())?;
                let owner = lease["owner"]
                    .as_str()
                    .ok_or("no owner in the acquire's answer")?;
                Ok(Some(ServiceHeld {
                    name: name.to_owned(),
                    owner: owner.to_owned(),
                }))
            }
            409 => Ok(None),
            _ => Err(format!("acquire answered {status}: {answer}")),
        }
    }

    pub(crate) async fn release(&self, held: ServiceHeld) -> Result<(), String> {
        let path = format!("/v1/locks/{}/release", encode(&held.name));
        let body = format!("{{\"owner\":\"{}\"}}", held.owner);
        match self.post(&path, &body).await? {
            (200, answer) if answer.contains("\"released\"") => Ok(()),
            (status, answer) => Err(format!("release answered {status}: {answer}")),
        }
    }
}

/// Percent-encodes a lock name for a path segment.
fn encode(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~' | b':') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}
