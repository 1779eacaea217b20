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
