//! Which launcher hosts the rendezvous: the one told so (`--rdzv-conf is_host=1`), else the
//! one on whose host the endpoint's address is (one of its interfaces' addresses, or
//! loopback), first to bind it. torchrun compares the endpoint with what the *hostname*
//! resolves to, which fails where hosts share a hostname (network namespaces, some
//! containers); an interface's address does not.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};

/// The addresses of this host's interfaces (getifaddrs), up or not.
pub fn local_addresses() -> Vec<IpAddr> {
    let mut found = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs(3) fills `list`, which is freed below with freeifaddrs(3); every
    // entry and address read is one it returned, read only while the list lives, and each
    // address is read as the type its family says.
    unsafe {
        if libc::getifaddrs(&mut list) != 0 {
            return found;
        }
        let mut entry = list;
        while !entry.is_null() {
            let addr = (*entry).ifa_addr;
            if !addr.is_null() {
                match i32::from((*addr).sa_family) {
                    libc::AF_INET => {
                        let v4 = &*(addr as *const libc::sockaddr_in);
                        found.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr))));
                    }
                    libc::AF_INET6 => {
                        let v6 = &*(addr as *const libc::sockaddr_in6);
                        found.push(IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            entry = (*entry).ifa_next;
        }
        libc::freeifaddrs(list);
    }
    found
}

/// The listener this launcher serves the rendezvous on, if it is the host: `addrs` are the
/// endpoint's addresses, `is_host` the explicit choice. Without one, a launcher hosts when
/// an endpoint address is its own and it binds it first; another launcher of this host that
/// bound it already (two nodes on one machine) leaves this one a client, as torchrun's
/// second try does.
pub fn listen_if_host(
    endpoint: &str,
    addrs: &[SocketAddr],
    is_host: Option<bool>,
) -> Result<Option<TcpListener>, String> {
    let bind = |a: &SocketAddr| TcpListener::bind(a);
    match is_host {
        Some(false) => Ok(None),
        Some(true) => {
            let mut last = None;
            for a in addrs {
                match bind(a) {
                    Ok(l) => return Ok(Some(l)),
                    Err(e) => last = Some((*a, e)),
                }
            }
            Err(match last {
                Some((a, e)) => format!(
                    "--rdzv-conf is_host=1, but this launcher cannot listen at {a} (the \
                     endpoint {endpoint}): {e}"
                ),
                None => format!("the endpoint {endpoint} has no address"),
            })
        }
        None => {
            let mine = local_addresses();
            for a in addrs {
                if !(a.ip().is_loopback() || mine.contains(&a.ip())) {
                    continue;
                }
                return match bind(a) {
                    Ok(l) => Ok(Some(l)),
                    Err(e) if e.kind() == io::ErrorKind::AddrInUse => Ok(None),
                    Err(e) => Err(format!(
                        "cannot listen at {a}, the rendezvous endpoint {endpoint} (an address \
                         of this host): {e}"
                    )),
                };
            }
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_among_the_local_addresses() {
        assert!(local_addresses().contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)));
    }

    /// The first launcher to bind its own address hosts; the second becomes a client; an
    /// address of another host is never hosted without is_host, and with is_host=1 a bind
    /// that fails is an error.
    #[test]
    fn the_first_launcher_of_the_endpoints_host_hosts() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let here = [SocketAddr::from(([127, 0, 0, 1], port))];
        let first = listen_if_host("e", &here, None).expect("no error");
        assert!(first.is_some());
        assert!(listen_if_host("e", &here, None)
            .expect("no error")
            .is_none());
        assert!(listen_if_host("e", &here, Some(false))
            .expect("no error")
            .is_none());
        let e = listen_if_host("e", &here, Some(true)).expect_err("already bound");
        assert!(
            e.contains("is_host=1, but this launcher cannot listen at 127.0.0.1:"),
            "{e}"
        );
        // TEST-NET-1: never an address of this host.
        let elsewhere = [SocketAddr::from(([192, 0, 2, 1], port))];
        assert!(listen_if_host("e", &elsewhere, None)
            .expect("no error")
            .is_none());
        drop(first);
    }
}
