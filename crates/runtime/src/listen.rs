//! The accept loop every listener of the daemon shares (the link's and the services').

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tracing::warn;

/// Accepts connections until `on` returns false; a failed accept (out of descriptors, say) is
/// logged and retried after a pause instead of spinning.
pub(crate) async fn accept_loop(
    listener: &TcpListener,
    what: &str,
    mut on: impl FnMut(TcpStream, SocketAddr) -> bool,
) {
    loop {
        match listener.accept().await {
            Ok((sock, from)) => {
                if !on(sock, from) {
                    return;
                }
            }
            Err(e) => {
                warn!(listener = what, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every connection is handed on, with its peer's address, until the handler says stop.
    #[tokio::test]
    async fn connections_are_handed_on_until_the_handler_stops() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let clients = crate::spawn(async move {
            let mut held = Vec::new();
            for _ in 0..3 {
                held.push(TcpStream::connect(addr).await.expect("connect"));
            }
            held
        });
        let mut seen = Vec::new();
        let run = accept_loop(&l, "test", |_, from| {
            seen.push(from);
            seen.len() < 3
        });
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("stopped after the third");
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|a| a.ip().is_loopback()));
        drop(clients.await);
    }
}
