//! What both servers share: a runtime of their own, a listener bound before `start` returns
//! (so that a bad address is an error there), a background task (the lighthouse's tick, a
//! manager's heartbeats), and a shutdown on drop.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use crate::error::{FtError, FtErrorKind, Result};

/// A server running on its own runtime until dropped.
pub(crate) struct Serving {
    runtime: Option<tokio::runtime::Runtime>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    local_addr: SocketAddr,
}

/// A listener bound on a runtime of its own, not serving yet: its address is known, for the
/// service to advertise.
pub(crate) struct Bound {
    runtime: tokio::runtime::Runtime,
    incoming: TcpIncoming,
    local_addr: SocketAddr,
}

impl Bound {
    /// Binds `bind` (`host:port`, `[::]:0` for any port) on a runtime of two threads; `op`
    /// names the binding in errors (`"lighthouse bind"`).
    pub(crate) fn new(op: &'static str, bind: &str) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tch-dist-ft")
            .enable_all()
            .build()
            .map_err(|e| FtError::new(FtErrorKind::Runtime, op, bind).because(e))?;
        let bind_error = |e: std::io::Error| FtError::new(FtErrorKind::Bind, op, bind).because(e);
        let listener = std::net::TcpListener::bind(bind).map_err(bind_error)?;
        listener.set_nonblocking(true).map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let incoming = {
            let _entered = runtime.enter();
            let listener = tokio::net::TcpListener::from_std(listener).map_err(bind_error)?;
            TcpIncoming::from_listener(listener, true, None)
                .map_err(|e| FtError::new(FtErrorKind::Bind, op, bind).because(e.to_string()))?
        };
        Ok(Bound {
            runtime,
            incoming,
            local_addr,
        })
    }

    /// The address bound (the port chosen for port 0).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The runtime the server will run on.
    pub(crate) fn runtime(&self) -> &tokio::runtime::Handle {
        self.runtime.handle()
    }

    /// Serves `routes`, and runs `background` beside them.
    pub(crate) fn serve(
        self,
        routes: impl Into<Routes>,
        background: impl Future<Output = ()> + Send + 'static,
    ) -> Serving {
        let Bound {
            runtime,
            incoming,
            local_addr,
        } = self;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let routes: Routes = routes.into();
        runtime.spawn(async move {
            // HTTP/1 beside gRPC's HTTP/2: the lighthouse's dashboard is for browsers.
            let _ = Server::builder()
                .accept_http1(true)
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        runtime.spawn(background);
        Serving {
            runtime: Some(runtime),
            stop: Some(stop),
            local_addr,
        }
    }
}

impl Serving {
    /// The address the server listens on.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // Long-polled calls still waiting are cut off: their clients see the connection end.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// This machine's host name (what torchft advertises for a server bound to every interface).
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}
