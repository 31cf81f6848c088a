//! Opening sessions with a test server. Every session a test opens goes through one of
//! these, so a change to how a session starts is made here once:
//!
//! - [`connect`]: a [`ferry_client::Client`] (the library rcp and ferry-mount use);
//! - [`raw_socket`] then [`raw_handshake`]: a [`RawClient`] that writes TCP-transport
//!   frames itself (for what a well-behaved client never sends); [`raw_socket`] alone
//!   is a connection that has not even greeted; [`raw_socket_from`] is one from another
//!   loopback address (127.0.0.2 and the like), which ferryd counts apart.

use std::io::{Read, Write};
use std::net::TcpStream;

use ferry_client::{Client, ClientError};

use ferry_common::msg::{Hello, Message, Request, Response, HELLO_MAGIC, PROTOCOL_VERSION};
use ferry_common::proto::caps::Offer;
use ferry_common::transport::tcp::wire::GREETING;
use ferry_common::transport::TransportChoice;

use crate::raw::{RawClient, RAW_TIMEOUT};
use crate::server::Server;

/// A handshaken client-library session with `server` over the transport `choice`.
pub async fn connect(server: &Server, choice: TransportChoice) -> Result<Client, ClientError> {
    let (host, port) = server
        .addr()
        .rsplit_once(':')
        .expect("a server address is HOST:PORT");
    let port = port.parse().expect("a server port is a number");
    crate::secret::connect_to(host, port, choice).await
}

/// Waits (at most 10 s) until ferryd counts `n` connections, asking over `client`.
#[track_caller]
pub fn wait_connections(rt: &tokio::runtime::Runtime, client: &Client, n: u64) {
    let start = std::time::Instant::now();
    loop {
        let s = rt.block_on(client.server_stats()).unwrap();
        if s.connections == n {
            return;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "ferryd counts {} connections, not {n}",
            s.connections
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Reads from `stream` until ferryd closes it, which it must do `within` this long;
/// returns the bytes read (a reset counts as closing).
#[track_caller]
pub fn read_until_closed(stream: &mut TcpStream, within: std::time::Duration) -> Vec<u8> {
    let mut got = Vec::new();
    stream.set_read_timeout(Some(within)).unwrap();
    match stream.read_to_end(&mut got) {
        Ok(_) => got,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => got,
        Err(e) => panic!("ferryd did not close an idle connection: {e}"),
    }
}

/// A plain TCP connection to `server`'s listener that has sent nothing yet, with read
/// and write timeouts of [`RAW_TIMEOUT`] (so a test that waits for ferryd fails instead
/// of hanging).
pub fn raw_socket(server: &Server) -> TcpStream {
    let stream = TcpStream::connect(server.addr())
        .unwrap_or_else(|e| panic!("cannot connect to ferryd at {}: {e}", server.addr()));
    stream.set_read_timeout(Some(RAW_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(RAW_TIMEOUT)).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

/// Like [`raw_socket`], from `source` (a loopback address other than 127.0.0.1, such
/// as 127.0.0.2: every 127.0.0.0/8 address is loopback on Linux), so that ferryd sees
/// another peer address than rcp's.
pub fn raw_socket_from(server: &Server, source: std::net::Ipv4Addr) -> TcpStream {
    let to: std::net::SocketAddr = server
        .addr()
        .parse()
        .expect("a test server listens on ADDR:PORT");
    // std cannot bind before connecting; tokio's socket can, on a runtime of its own.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("cannot start a runtime");
    let stream = rt
        .block_on(async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind((source, 0).into())?;
            socket.connect(to).await?.into_std()
        })
        .unwrap_or_else(|e| panic!("cannot connect from {source} to ferryd at {to}: {e}"));
    stream.set_nonblocking(false).unwrap();
    stream.set_read_timeout(Some(RAW_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(RAW_TIMEOUT)).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

/// Exchanges the TCP transport's greetings on `stream` (from [`raw_socket`]) without
/// starting a session: what a raw client that breaks the session rules starts from.
pub fn raw_greet(server: &Server, mut stream: TcpStream) -> RawClient {
    stream.write_all(&GREETING).unwrap();
    let mut greeting = [0u8; 8];
    stream
        .read_exact(&mut greeting)
        .unwrap_or_else(|e| panic!("no greeting from ferryd at {}: {e}", server.addr()));
    assert_eq!(greeting, GREETING, "ferryd's greeting");
    RawClient::new(stream)
}

/// Greets and runs the session handshake (`Hello`, then ferryd's `Welcome`) on
/// `stream` (from [`raw_socket`]), then proves [`crate::TEST_SECRET`] for every share
/// of `server`; panics if ferryd does not welcome the session or refuses a proof.
pub fn raw_handshake(server: &Server, stream: TcpStream) -> RawClient {
    let mut raw = raw_greet(server, stream);
    raw.send(&Message::Hello(hello()));
    let welcome = match raw.recv_msg() {
        Message::Welcome(w) => w,
        other => panic!("ferryd at {} did not welcome us: {other:?}", server.addr()),
    };
    for share in server.share_names() {
        let proof = crate::test_secret().client_proof(&share, &RAW_NONCE, &welcome.nonce);
        match raw.call(Request::Auth {
            share: share.clone(),
            proof,
        }) {
            Response::Authenticated { .. } => {}
            other => panic!("ferryd refused the proof for share '{share}': {other:?}"),
        }
    }
    raw
}

/// The nonce a raw client sends (a fixed one does for a test: ferryd's is fresh).
pub const RAW_NONCE: [u8; 32] = [0x7a; 32];

/// The `Hello` a raw client sends: this build's protocol version.
pub fn hello() -> Hello {
    Hello {
        magic: HELLO_MAGIC,
        min_version: PROTOCOL_VERSION,
        max_version: PROTOCOL_VERSION,
        software: "ferry-tests/raw".into(),
        nonce: RAW_NONCE,
        capabilities: Offer::default().to_capabilities(),
    }
}
