//! A minimal HTTP/1.1 client for the local registry's API (curl may be absent on a fresh
//! machine, and all we need is the status code of one request).

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use base64::Engine as _;

/// Manifest media types a registry may hold for our images.
const MANIFEST_ACCEPT: &str = "application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, \
     application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json";

/// Sends `method path` to `addr` (plain HTTP), with basic auth if `auth` is given, and returns
/// the response's status code. Fails if nothing answers or the answer is not HTTP.
pub fn status(
    addr: SocketAddr,
    method: &str,
    path: &str,
    auth: Option<(&str, &str)>,
) -> Result<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("nothing answers on {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {MANIFEST_ACCEPT}\r\n\
         User-Agent: dstack-shim-xtask\r\nConnection: close\r\n"
    );
    if let Some((user, password)) = auth {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        request.push_str(&format!("Authorization: Basic {token}\r\n"));
    }
    request.push_str("\r\n");
    stream
        .write_all(request.as_bytes())
        .with_context(|| format!("could not send {method} {path} to {addr}"))?;
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .with_context(|| format!("no answer to {method} {path} from {addr}"))?;
    let code = line
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|code| code.parse::<u16>().ok());
    match code {
        Some(code) => Ok(code),
        None => bail!(
            "{addr} answered {method} {path} with something that is not HTTP: {:?}",
            line.trim()
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;
    use std::net::TcpListener;

    use super::*;

    /// Serves one connection with `response`, returning the request it received.
    fn serve_once(response: &'static str) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let handle = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.ends_with(b"\r\n\r\n") {
                let n = stream.read(&mut buf).unwrap();
                assert!(n > 0, "client closed early");
                request.extend_from_slice(&buf[..n]);
            }
            stream.write_all(response.as_bytes()).unwrap();
            String::from_utf8(request).unwrap()
        });
        (addr, handle)
    }

    #[test]
    fn status_sends_basic_auth_and_reads_the_code() {
        let (addr, server) = serve_once("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
        let code = status(addr, "HEAD", "/v2/x/manifests/1", Some(("u", "p"))).unwrap();
        assert_eq!(code, 404);
        let request = server.join().unwrap();
        assert!(
            request.starts_with("HEAD /v2/x/manifests/1 HTTP/1.1\r\n"),
            "{request}"
        );
        // base64("u:p") = "dTpw"
        assert!(
            request.contains("Authorization: Basic dTpw\r\n"),
            "{request}"
        );
    }

    #[test]
    fn status_rejects_non_http_answers_and_silence() {
        let (addr, server) = serve_once("SSH-2.0-OpenSSH\r\n");
        let err = status(addr, "GET", "/v2/", None).unwrap_err();
        assert!(format!("{err:#}").contains("not HTTP"), "{err:#}");
        server.join().unwrap();

        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(status(closed, "GET", "/v2/", None).is_err());
    }
}
