//! The address a rank's Gloo devices bind and advertise to their peers, found rather than
//! configured.
//!
//! PyTorch's default Gloo device (`createDefaultDevice`, pytorch#26166) binds the address
//! this machine's hostname resolves to, even a loopback one: on hosts whose `/etc/hosts`
//! maps the hostname to `127.0.1.1` (Debian's default), in containers and in network
//! namespaces, every rank advertises loopback and the ranks of other hosts fail in
//! `connectFullMesh` ("timed out connecting ... remote=[127.0.1.1]"), one of PyTorch's
//! most-reported distributed errors, fixed by hand with `GLOO_SOCKET_IFNAME`. tch-dist binds
//! instead the source address of this host's route to `MASTER_ADDR` (what
//! `ip route get MASTER_ADDR` says): the address of the interface the rendezvous is reached
//! through, which the other hosts reach this one by. `GLOO_SOCKET_IFNAME` keeps PyTorch's
//! meaning (one device per listed interface; the shim's `add_gloo_devices`), and a
//! rendezvous on loopback binds 127.0.0.1.
//!
//! | case | Gloo binds |
//! |---|---|
//! | `GLOO_SOCKET_IFNAME=eth0,eth1` | each listed interface (PyTorch's rule) |
//! | `MASTER_ADDR` on loopback | 127.0.0.1 |
//! | otherwise | the source address of the route to `MASTER_ADDR` |
//! | no route (or `MASTER_ADDR` does not resolve) | Gloo's own pick (PyTorch's default device) |

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

use super::env::is_loopback;

/// The address to hand the shim for a group whose rendezvous is at `master_addr`: `""` for
/// Gloo's own pick (its devices then follow `GLOO_SOCKET_IFNAME`, or the hostname).
pub(crate) fn gloo_host(master_addr: &str) -> String {
    if std::env::var_os("GLOO_SOCKET_IFNAME").is_some_and(|v| v.len() > 1) {
        // The shim creates one device per listed interface and ignores the host.
        return String::new();
    }
    if is_loopback(master_addr) {
        return "127.0.0.1".to_string();
    }
    route_source(master_addr).map_or_else(String::new, |ip| ip.to_string())
}

/// The source address of this host's route to `addr` (a name or an IP): a UDP socket
/// connected to it, which sends nothing, has the kernel's pick as its local address. `None`
/// when `addr` does not resolve or no route leads there.
pub(crate) fn route_source(addr: &str) -> Option<IpAddr> {
    // Any port: a UDP connect only picks the route. 9 is the discard service's.
    let targets = (addr, 9).to_socket_addrs().ok()?;
    targets.into_iter().find_map(|target| {
        let unspecified: SocketAddr = match target {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let socket = UdpSocket::bind(unspecified).ok()?;
        socket.connect(target).ok()?;
        let ip = socket.local_addr().ok()?.ip();
        (!ip.is_unspecified()).then_some(ip)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The route to a loopback address starts on loopback; to this machine's own address
    /// too; an address that does not resolve has none.
    #[test]
    fn routes_start_where_the_kernel_says() {
        assert_eq!(
            route_source("127.0.0.1"),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!(route_source("no-such-host.invalid"), None);
        assert_eq!(gloo_host("localhost"), "127.0.0.1");
    }
}
