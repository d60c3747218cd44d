//! A test double of an API server on loopback, for the client's unit
//! tests: plain HTTP, one request per connection, answers chosen by the
//! test. It proves what tetherd's client and tasks do with the answers a
//! server gives (or holds back); it cannot prove how a real kube-apiserver
//! gives them, which the end-to-end suites do.

use super::Source;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A request as the double read it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub body: String,
}

/// A kubeconfig for `http://127.0.0.1:<port>`, in a directory that lives
/// as long as the returned guard.
pub fn kubeconfig(port: u16) -> (tempfile::TempDir, Source) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
             clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n\
             users: [{{name: u, user: {{token: t}}}}]\n\
             contexts: [{{name: c, context: {{cluster: c, user: u}}}}]\n"
        ),
    )
    .unwrap();
    (dir, Source::Kubeconfig(path))
}

/// Serves each request with `answer(request)`: a status and a JSON body.
/// Returns the kubeconfig and every request seen, in order.
pub async fn serve(
    answer: fn(&Seen) -> (u16, String),
) -> (tempfile::TempDir, Source, Arc<Mutex<Vec<Seen>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let Some(req) = read_request(&mut conn).await else {
                    return;
                };
                let (code, body) = answer(&req);
                log.lock().unwrap().push(req);
                let reply = format!(
                    "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
            });
        }
    });
    let (dir, source) = kubeconfig(port);
    (dir, source, seen)
}

/// One request: its line, its headers, and a body of `Content-Length`.
async fn read_request(conn: &mut tokio::net::TcpStream) -> Option<Seen> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let mut first = head.lines().next()?.split(' ');
    Some(Seen {
        method: first.next()?.to_owned(),
        path: first.next()?.to_owned(),
        body: String::from_utf8_lossy(&buf[head_end..]).to_string(),
    })
}
