//! Opening sessions with a test server. Every session a test opens goes through one of
//! these, so a change to how a session starts is made here once:
//!
//! - [`connect`]: a [`ferry_client::Client`] (the library rcp and ferry-mount use);
//! - [`raw_socket`] then [`raw_handshake`]: a [`RawClient`] that writes TCP-transport
//!   frames itself (for what a well-behaved client never sends); [`raw_socket`] alone
//!   is a connection that has not even greeted.

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
