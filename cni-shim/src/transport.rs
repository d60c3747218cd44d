//! The one gRPC call to tetherd over its unix socket, and what its failures
//! mean.
//!
//! The call is made by a small blocking gRPC-over-HTTP/2 client written for
//! this one job: a std `UnixStream` with read and write timeouts, prost for
//! the messages and loona-hpack to decode the daemon's header blocks. The
//! general-purpose client it replaces (tonic on tokio, hyper-util and tower)
//! kept the plugin binary above 1 MiB and cost start-up time on every call,
//! and the runtime starts this binary once per CNI call. Only what one unary
//! call on a fresh connection needs is here: one stream (id 1), flow control
//! for the request, no push, no compression.
//!
//! The request is written right behind the connection preface, without
//! waiting for the daemon's SETTINGS (RFC 9113 3.4 allows it), which saves a
//! round trip. The handshake still ends only when those SETTINGS arrive: an
//! h2 server writes them before it reads anything, so a connection that dies
//! earlier (a daemon that accepts and closes at once, which is how it drops
//! peers by SO_PEERCRED) cannot have delivered the call. It counts as
//! unreachable, as it did with tonic, and ADD may retry it.
//!
//! Only connecting is retried, and only by ADD: a daemon that is restarting
//! comes back within seconds, and ADD is the verb a user waits on. A call
//! that got past the handshake is never retried here; the runtime retries a
//! failed ADD, and the daemon may already have acted on the first try.

use crate::verb::Verb;
use loona_hpack::Decoder;
use prost::Message;
use std::io::{self, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};
use tether_proto::cni::v1::{CniRequest, CniResponse};

/// How long ADD keeps trying to connect; also the bound on a single connect
/// attempt for the other verbs, so a wedged listener cannot hang the shim.
pub const CONNECT_BUDGET: Duration = Duration::from_secs(3);

/// The pause between ADD's connection attempts.
const RETRY_EVERY: Duration = Duration::from_millis(100);

/// Why a call did not produce a `CniResponse`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportFailure {
    /// No connection could be made: no socket, nobody listening, no
    /// permission on the socket, or the connection died in the handshake.
    Unreachable {
        /// The underlying error, outermost first.
        cause: String,
        /// How long the shim kept retrying, when it did.
        waited: Option<Duration>,
    },
    /// Connected, but the call ended without a response: the daemon went
    /// away, the deadline passed, or it answered with a gRPC status instead
    /// of a `CniResponse` (its contract is to always send the latter).
    CallFailed {
        /// The gRPC status, with its source.
        cause: String,
    },
    /// The daemon answered PermissionDenied or Unauthenticated: it is up and
    /// does not accept this caller.
    Refused {
        /// The gRPC status, with its source.
        cause: String,
    },
}

impl TransportFailure {
    /// Whether a DEL that met this failure should go to the pending-DEL queue.
    ///
    /// Not after an explicit refusal. The daemon is up and has judged this
    /// caller; a queued entry would be executed at the next drain without
    /// that judgement, so the queue would become a way around the peer
    /// check, and exiting 0 would hide the misconfiguration. The DEL-hangs
    /// worry does not apply: the runtime, which runs as root, is an allowed
    /// peer. A connection that the daemon closes right after accepting it
    /// (how it drops peers by SO_PEERCRED) cannot be told apart from a
    /// daemon that crashed or restarted at that moment, so it counts as
    /// unreachable and the DEL is queued. That is safe: the queue directory
    /// is root-only (0700), so a refused non-root caller fails to queue and
    /// gets code 11, and a root caller could write the directory anyway.
    pub fn queues_del(&self) -> bool {
        !matches!(self, TransportFailure::Refused { .. })
    }

    /// A one-line message naming the socket and the underlying error.
    pub fn describe(&self, verb: Verb, socket: &Path) -> String {
        let socket = socket.display();
        match self {
            TransportFailure::Unreachable { cause, .. } => {
                format!("tetherd is not reachable on {socket}: {cause}")
            }
            TransportFailure::CallFailed { cause } => format!(
                "tetherd is not reachable on {socket}: the {} call failed: {cause}",
                verb.as_str()
            ),
            TransportFailure::Refused { cause } => {
                format!("tetherd on {socket} refused this caller: {cause}")
            }
        }
    }

    /// Background for the error's `details`, or "".
    pub fn details(&self) -> String {
        match self {
            TransportFailure::Unreachable {
                waited: Some(waited),
                ..
            } => format!(
                "gave up after retrying for {:.1} s; is tetherd running?",
                waited.as_secs_f32()
            ),
            TransportFailure::Unreachable { waited: None, .. } => "is tetherd running?".to_owned(),
            TransportFailure::CallFailed { .. } => String::new(),
            TransportFailure::Refused { .. } => {
                "tetherd accepts only callers whose uid it allows (SO_PEERCRED)".to_owned()
            }
        }
    }
}

/// Forwards `request` to tetherd on `socket` as `verb`, within the verb's
/// deadline (connecting included). ADD retries a failed connection every
/// 100 ms until [`CONNECT_BUDGET`] is spent.
pub fn call(
    verb: Verb,
    socket: &Path,
    request: &CniRequest,
) -> Result<CniResponse, TransportFailure> {
    let started = Instant::now();
    let deadline = started + verb.deadline();
    let give_up = started + CONNECT_BUDGET;
    let retry = verb == Verb::Add;
    let message = grpc_message(request).map_err(CallError::into_failure)?;
    loop {
        let outcome = match UnixStream::connect(socket) {
            Ok(stream) => {
                Connection::new(stream, give_up, deadline).unary(rpc_path(verb), &message)
            }
            Err(e) => Err(CallError::Handshake {
                timed_out: is_timeout(&e),
                cause: e.to_string(),
            }),
        };
        let (cause, out_of_time) = match outcome {
            Err(CallError::Handshake {
                timed_out: true, ..
            }) => (
                format!(
                    "connecting timed out after {} s",
                    CONNECT_BUDGET.as_secs_f32()
                ),
                true,
            ),
            Err(CallError::Handshake { cause, .. }) => (cause, false),
            other => return other.map_err(CallError::into_failure),
        };
        if !retry || out_of_time || Instant::now() + RETRY_EVERY >= give_up {
            return Err(TransportFailure::Unreachable {
                cause,
                waited: retry.then(|| started.elapsed()),
            });
        }
        std::thread::sleep(RETRY_EVERY);
    }
}

/// The gRPC method path of `verb`'s RPC.
fn rpc_path(verb: Verb) -> &'static str {
    match verb {
        Verb::Add => "/tether.cni.v1.Cni/Add",
        Verb::Del => "/tether.cni.v1.Cni/Del",
        Verb::Check => "/tether.cni.v1.Cni/Check",
        Verb::Status => "/tether.cni.v1.Cni/Status",
        Verb::Gc => "/tether.cni.v1.Cni/Gc",
    }
}

/// `request` as a length-prefixed, uncompressed gRPC message.
fn grpc_message(request: &CniRequest) -> Result<Vec<u8>, CallError> {
    let len = request.encoded_len();
    let prefix = u32::try_from(len)
        .map_err(|_| CallError::Failed("Internal: the request exceeds 4 GiB".to_owned()))?;
    let mut message = Vec::with_capacity(5 + len);
    message.push(0);
    message.extend_from_slice(&prefix.to_be_bytes());
    request
        .encode(&mut message)
        .map_err(|e| CallError::Failed(format!("Internal: encoding the request: {e}")))?;
    Ok(message)
}

/// Whether `error` is a read or write timeout (std reports EAGAIN for those).
fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Why a call produced no response.
#[derive(Debug, PartialEq, Eq)]
enum CallError {
    /// The connection failed before the daemon's SETTINGS arrived: it
    /// cannot have read the request, so it is unreachable, not failed.
    Handshake {
        /// The underlying error.
        cause: String,
        /// The connect budget ran out.
        timed_out: bool,
    },
    /// The daemon answered with this gRPC status code and message.
    Status(u32, String),
    /// The connection or the protocol failed; the cause is final.
    Failed(String),
}

impl CallError {
    /// Sorts a failed call into refused or failed.
    fn into_failure(self) -> TransportFailure {
        match self {
            CallError::Status(code, message) => {
                let cause = format!("{}: {message}", code_name(code));
                match code {
                    CODE_PERMISSION_DENIED | CODE_UNAUTHENTICATED => {
                        TransportFailure::Refused { cause }
                    }
                    _ => TransportFailure::CallFailed { cause },
                }
            }
            CallError::Failed(cause) => TransportFailure::CallFailed { cause },
            CallError::Handshake { cause, .. } => TransportFailure::Unreachable {
                cause,
                waited: None,
            },
        }
    }

    /// A protocol violation by the daemon.
    fn protocol(what: &str) -> CallError {
        CallError::Failed(format!("Internal: HTTP/2 protocol error: {what}"))
    }
}

impl From<io::Error> for CallError {
    fn from(e: io::Error) -> CallError {
        CallError::Failed(if is_timeout(&e) {
            "DeadlineExceeded: tetherd did not answer before the deadline".to_owned()
        } else {
            format!("Unavailable: {e}")
        })
    }
}

// The gRPC status codes this client produces or tells apart.
const CODE_CANCELLED: u32 = 1;
const CODE_UNKNOWN: u32 = 2;
const CODE_PERMISSION_DENIED: u32 = 7;
const CODE_RESOURCE_EXHAUSTED: u32 = 8;
const CODE_UNIMPLEMENTED: u32 = 12;
const CODE_INTERNAL: u32 = 13;
const CODE_UNAVAILABLE: u32 = 14;
const CODE_UNAUTHENTICATED: u32 = 16;

/// The gRPC name of a status code, as the old tonic-based client printed it.
fn code_name(code: u32) -> String {
    const NAMES: [&str; 17] = [
        "Ok",
        "Cancelled",
        "Unknown",
        "InvalidArgument",
        "DeadlineExceeded",
        "NotFound",
        "AlreadyExists",
        "PermissionDenied",
        "ResourceExhausted",
        "FailedPrecondition",
        "Aborted",
        "OutOfRange",
        "Unimplemented",
        "Internal",
        "Unavailable",
        "DataLoss",
        "Unauthenticated",
    ];
    match NAMES.get(code as usize) {
        Some(name) => (*name).to_owned(),
        None => format!("Code({code})"),
    }
}

/// The gRPC code for a non-200 HTTP status without a grpc-status, as the
/// gRPC HTTP/2 protocol specification maps it.
fn code_for_http_status(status: u16) -> u32 {
    match status {
        400 => CODE_INTERNAL,
        401 => CODE_UNAUTHENTICATED,
        403 => CODE_PERMISSION_DENIED,
        404 => CODE_UNIMPLEMENTED,
        429 | 502 | 503 | 504 => CODE_UNAVAILABLE,
        _ => CODE_UNKNOWN,
    }
}

/// Undoes grpc-message's percent-encoding; a malformed escape stays as it
/// is, since the message is for people.
fn percent_decode(value: &[u8]) -> String {
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(value.len());
    let mut i = 0;
    while i < value.len() {
        if value[i] == b'%' && i + 2 < value.len() {
            if let (Some(h), Some(l)) = (hex(value[i + 1]), hex(value[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(value[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEAD_LEN: usize = 9;

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PUSH_PROMISE: u8 = 0x5;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;

const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

const SETTINGS_ENABLE_PUSH: u16 = 0x2;
const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;
const SETTINGS_MAX_FRAME_SIZE: u16 = 0x5;

/// The largest flow-control window HTTP/2 allows.
const MAX_WINDOW: u32 = (1 << 31) - 1;
/// Every window's size until SETTINGS or WINDOW_UPDATE say otherwise.
const DEFAULT_WINDOW: u32 = 65_535;
/// The frame size both sides may send until told otherwise; the shim never
/// raises its own, so the daemon's frames stay at most this large.
const DEFAULT_MAX_FRAME: usize = 16_384;
/// The largest frame size a peer may announce.
const LARGEST_MAX_FRAME: u32 = (1 << 24) - 1;
/// tonic's default limit on a decoded message; a CNI result is far smaller.
const MAX_RESPONSE: usize = 4 << 20;
/// A bound on one header block, so a broken peer cannot exhaust memory.
const MAX_HEADER_BLOCK: usize = 64 << 10;
/// The `:authority` the tonic-based shim sent (its endpoint's URI host); the
/// daemon accepts it, and ".invalid" can never name a real host.
const AUTHORITY: &str = "tether.invalid";

/// One HTTP/2 frame as read from the daemon.
#[derive(Debug)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// Appends a frame header for a payload of `len` bytes.
fn frame_head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    // Frames here never exceed the peer's MAX_FRAME_SIZE, itself < 2^24.
    let len = (len as u32).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & MAX_WINDOW).to_be_bytes());
}

/// Appends an HPACK integer with an `prefix_bits`-bit prefix; `first` holds
/// the representation's flag bits above the prefix (RFC 7541, 5.1).
fn hpack_int(out: &mut Vec<u8>, value: usize, prefix_bits: u8, first: u8) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// Encodes header fields as literals without indexing and without Huffman
/// coding: legal, stateless, and the block is a few hundred bytes anyway.
fn encode_headers(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    for (name, value) in fields {
        out.push(0x00);
        for s in [name, value] {
            hpack_int(&mut out, s.len(), 7, 0);
            out.extend_from_slice(s.as_bytes());
        }
    }
    out
}

/// A frame's payload without its padding (PADDED flag).
fn unpad(frame: &Frame) -> Result<&[u8], CallError> {
    if frame.flags & PADDED == 0 {
        return Ok(&frame.payload);
    }
    let (&pad, rest) = frame
        .payload
        .split_first()
        .ok_or_else(|| CallError::protocol("padded frame without a pad length"))?;
    let keep = rest
        .len()
        .checked_sub(pad as usize)
        .ok_or_else(|| CallError::protocol("padding longer than the frame"))?;
    Ok(&rest[..keep])
}

/// What the daemon has sent on stream 1 so far.
#[derive(Default)]
struct Answer {
    /// The response HEADERS arrived.
    headers: bool,
    /// The concatenated DATA payloads.
    body: Vec<u8>,
    /// grpc-status and the decoded grpc-message, from the trailers.
    status: Option<(u32, String)>,
}

impl Answer {
    /// Takes a decoded header block; `end` is its END_STREAM flag.
    fn on_headers(&mut self, fields: Vec<(Vec<u8>, Vec<u8>)>, end: bool) -> Result<(), CallError> {
        let field = |name: &[u8]| {
            fields
                .iter()
                .find(|(n, _)| n.as_slice() == name)
                .map(|(_, v)| v.as_slice())
        };
        let grpc_status = field(b"grpc-status").map(|v| {
            let code = std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(CODE_UNKNOWN);
            (
                code,
                field(b"grpc-message")
                    .map(percent_decode)
                    .unwrap_or_default(),
            )
        });
        if !self.headers {
            self.headers = true;
            let status = field(b":status")
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|s| s.parse::<u16>().ok())
                .ok_or_else(|| CallError::protocol("response without a valid :status"))?;
            if status != 200 {
                return Err(match grpc_status {
                    Some((code, message)) => CallError::Status(code, message),
                    None => CallError::Status(
                        code_for_http_status(status),
                        format!("tetherd answered HTTP status {status}"),
                    ),
                });
            }
            if grpc_status.is_none() {
                let grpc =
                    field(b"content-type").is_some_and(|v| v.starts_with(b"application/grpc"));
                if !grpc {
                    return Err(CallError::Status(
                        CODE_UNKNOWN,
                        "tetherd's response is not gRPC (content-type)".to_owned(),
                    ));
                }
            }
        } else if !end {
            return Err(CallError::protocol("trailers without END_STREAM"));
        }
        if end {
            self.status = grpc_status;
        }
        Ok(())
    }

    /// The call's outcome once the stream has ended.
    fn finish(self) -> Result<CniResponse, CallError> {
        match self.status {
            None => Err(CallError::Status(
                CODE_INTERNAL,
                "tetherd's response ended without a grpc-status".to_owned(),
            )),
            Some((0, _)) => decode_message(&self.body),
            Some((code, message)) => Err(CallError::Status(code, message)),
        }
    }
}

/// The one length-prefixed gRPC message a unary response carries.
fn decode_message(body: &[u8]) -> Result<CniResponse, CallError> {
    let internal = |what: &str| CallError::Status(CODE_INTERNAL, what.to_owned());
    let Some((prefix, message)) = body.split_first_chunk::<5>() else {
        return Err(internal("tetherd's response carried no message"));
    };
    if prefix[0] != 0 {
        return Err(internal(
            "tetherd's response is compressed; none was offered",
        ));
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len != message.len() {
        return Err(internal("tetherd's response is not exactly one message"));
    }
    CniResponse::decode(message)
        .map_err(|e| internal(&format!("tetherd's response does not decode: {e}")))
}

/// A blocking HTTP/2 client connection that carries one unary gRPC call.
struct Connection {
    /// Reads are buffered; writes go to the stream underneath.
    stream: BufReader<UnixStream>,
    /// Frames waiting to be written, sent in one go before the next read.
    out: Vec<u8>,
    /// HPACK state for the daemon's header blocks.
    hpack: Decoder<'static>,
    /// When the handshake must be over: the connect budget.
    handshake_until: Instant,
    /// When the call must be over.
    until: Instant,
    /// The daemon's SETTINGS arrived: the handshake is over.
    settings_seen: bool,
    /// A write failed; nothing more is sent.
    write_failed: bool,
    /// The daemon's MAX_FRAME_SIZE: the largest frame we may send.
    max_frame: usize,
    /// The daemon's INITIAL_WINDOW_SIZE, to apply later changes as deltas.
    initial_window: i64,
    /// How many DATA bytes the daemon accepts on the connection.
    connection_window: i64,
    /// How many DATA bytes the daemon accepts on stream 1 (may go negative
    /// when it lowers INITIAL_WINDOW_SIZE, RFC 9113 6.9.2).
    stream_window: i64,
    /// The daemon's GOAWAY error code, when it sent one that spares stream 1.
    goaway: Option<u32>,
}

impl Connection {
    /// A connection on `stream` with the client preface and SETTINGS
    /// queued. Nothing is awaited here: the request follows the preface at
    /// once (RFC 9113 3.4 allows it), which saves a round trip per call.
    fn new(stream: UnixStream, handshake_until: Instant, until: Instant) -> Connection {
        let mut out = Vec::with_capacity(1024);
        out.extend_from_slice(PREFACE);
        // No push; and windows so large that the daemon never waits for a
        // WINDOW_UPDATE from us, which this client never sends.
        frame_head(&mut out, 12, SETTINGS, 0, 0);
        for (id, value) in [
            (SETTINGS_ENABLE_PUSH, 0),
            (SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW),
        ] {
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&value.to_be_bytes());
        }
        frame_head(&mut out, 4, WINDOW_UPDATE, 0, 0);
        out.extend_from_slice(&(MAX_WINDOW - DEFAULT_WINDOW).to_be_bytes());
        Connection {
            stream: BufReader::with_capacity(DEFAULT_MAX_FRAME + FRAME_HEAD_LEN, stream),
            out,
            hpack: Decoder::new(),
            handshake_until,
            until,
            settings_seen: false,
            write_failed: false,
            max_frame: DEFAULT_MAX_FRAME,
            initial_window: i64::from(DEFAULT_WINDOW),
            connection_window: i64::from(DEFAULT_WINDOW),
            stream_window: i64::from(DEFAULT_WINDOW),
            goaway: None,
        }
    }

    /// Sends `message` (a length-prefixed gRPC message) to `path` on stream
    /// 1 and reads the answer.
    fn unary(&mut self, path: &str, message: &[u8]) -> Result<CniResponse, CallError> {
        let left = self.until.saturating_duration_since(Instant::now());
        // The daemon bounds its own work by this; whole milliseconds, at
        // least one, and at most 8 digits as gRPC requires.
        let timeout = format!("{}m", left.as_millis().clamp(1, 99_999_999));
        let block = encode_headers(&[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", AUTHORITY),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("grpc-timeout", &timeout),
        ]);
        self.queue_headers(&block);

        let mut answer = Answer::default();
        let mut sent = 0;
        while sent < message.len() {
            let allowed = self
                .connection_window
                .min(self.stream_window)
                .min(self.max_frame as i64);
            if allowed <= 0 {
                // Blocked by flow control: what unblocks us is a frame.
                let frame = self.next()?;
                if self.handle(frame, &mut answer)? {
                    // The daemon answered without taking the whole request
                    // (an early error); its answer stands.
                    return answer.finish();
                }
                continue;
            }
            let chunk = (message.len() - sent).min(allowed as usize);
            let flags = if sent + chunk == message.len() {
                END_STREAM
            } else {
                0
            };
            frame_head(&mut self.out, chunk, DATA, flags, 1);
            self.out.extend_from_slice(&message[sent..sent + chunk]);
            sent += chunk;
            self.connection_window -= chunk as i64;
            self.stream_window -= chunk as i64;
        }
        loop {
            let frame = self.next()?;
            if self.handle(frame, &mut answer)? {
                return answer.finish();
            }
        }
    }

    /// The next frame. Until the daemon's SETTINGS, which must come first,
    /// any failure is a handshake failure; after, a lost connection names
    /// the GOAWAY that announced it, if any.
    fn next(&mut self) -> Result<Frame, CallError> {
        if self.settings_seen {
            return self.read_frame().map_err(|e| {
                let mut failure = CallError::from(e);
                if let (CallError::Failed(cause), Some(code)) = (&mut failure, self.goaway) {
                    cause.push_str(&format!(" (after GOAWAY {})", h2_error_name(code)));
                }
                failure
            });
        }
        let handshake = |e: io::Error| {
            let timed_out = is_timeout(&e);
            let cause = match e.kind() {
                io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
                    "the connection was closed before tetherd's SETTINGS".to_owned()
                }
                _ => e.to_string(),
            };
            CallError::Handshake {
                cause: format!("HTTP/2 handshake failed: {cause}"),
                timed_out,
            }
        };
        let frame = self.read_frame().map_err(handshake)?;
        if frame.kind != SETTINGS || frame.flags & ACK != 0 {
            return Err(handshake(io::Error::new(
                io::ErrorKind::InvalidData,
                "tetherd's first frame is not SETTINGS",
            )));
        }
        self.settings_seen = true;
        Ok(frame)
    }

    /// Queues HEADERS for stream 1, split into CONTINUATION frames when the
    /// block exceeds the daemon's frame size.
    fn queue_headers(&mut self, block: &[u8]) {
        let mut chunks = block.chunks(self.max_frame).peekable();
        let mut kind = HEADERS;
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            let flags = if last { END_HEADERS } else { 0 };
            frame_head(&mut self.out, chunk.len(), kind, flags, 1);
            self.out.extend_from_slice(chunk);
            kind = CONTINUATION;
        }
    }

    /// Acts on one frame; true when stream 1 has ended.
    fn handle(&mut self, frame: Frame, answer: &mut Answer) -> Result<bool, CallError> {
        match frame.kind {
            DATA => {
                if frame.stream != 1 {
                    return Err(CallError::protocol("DATA on a stream that was not opened"));
                }
                if !answer.headers {
                    return Err(CallError::protocol("DATA before the response HEADERS"));
                }
                let data = unpad(&frame)?;
                if answer.body.len() + data.len() > MAX_RESPONSE {
                    return Err(CallError::Status(
                        CODE_RESOURCE_EXHAUSTED,
                        "tetherd's response is larger than 4 MiB".to_owned(),
                    ));
                }
                answer.body.extend_from_slice(data);
                Ok(frame.flags & END_STREAM != 0)
            }
            HEADERS => {
                if frame.stream != 1 {
                    return Err(CallError::protocol(
                        "HEADERS on a stream that was not opened",
                    ));
                }
                let end = frame.flags & END_STREAM != 0;
                let block = self.header_block(frame)?;
                let fields = self
                    .hpack
                    .decode(&block)
                    .map_err(|e| CallError::protocol(&format!("HPACK: {e}")))?;
                answer.on_headers(fields, end)?;
                Ok(end)
            }
            RST_STREAM if frame.stream == 1 => {
                let code = frame
                    .payload
                    .first_chunk::<4>()
                    .map(|b| u32::from_be_bytes(*b))
                    .ok_or_else(|| CallError::protocol("short RST_STREAM"))?;
                Err(CallError::Failed(format!(
                    "{}: tetherd reset the stream ({})",
                    code_name(match code {
                        0x7 => CODE_UNAVAILABLE,
                        0x8 => CODE_CANCELLED,
                        _ => CODE_INTERNAL,
                    }),
                    h2_error_name(code)
                )))
            }
            SETTINGS => {
                if frame.flags & ACK == 0 {
                    self.apply_settings(&frame)
                        .map_err(|e| CallError::Failed(format!("Internal: {e}")))?;
                }
                Ok(false)
            }
            PING => {
                if frame.flags & ACK == 0 {
                    if frame.payload.len() != 8 || frame.stream != 0 {
                        return Err(CallError::protocol("malformed PING"));
                    }
                    frame_head(&mut self.out, 8, PING, ACK, 0);
                    self.out.extend_from_slice(&frame.payload);
                }
                Ok(false)
            }
            GOAWAY => {
                let (last, code) = match frame.payload.first_chunk::<8>() {
                    Some(b) => (
                        u32::from_be_bytes([b[0], b[1], b[2], b[3]]) & MAX_WINDOW,
                        u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
                    ),
                    None => return Err(CallError::protocol("short GOAWAY")),
                };
                if last < 1 {
                    return Err(CallError::Failed(format!(
                        "Unavailable: tetherd closed the connection without taking the call (GOAWAY {})",
                        h2_error_name(code)
                    )));
                }
                // Stream 1 will still be answered (a graceful shutdown).
                self.goaway = Some(code);
                Ok(false)
            }
            WINDOW_UPDATE => {
                let increment = frame
                    .payload
                    .first_chunk::<4>()
                    .map(|b| u32::from_be_bytes(*b) & MAX_WINDOW)
                    .ok_or_else(|| CallError::protocol("short WINDOW_UPDATE"))?;
                if increment == 0 {
                    return Err(CallError::protocol("WINDOW_UPDATE of 0"));
                }
                let window = match frame.stream {
                    0 => &mut self.connection_window,
                    1 => &mut self.stream_window,
                    _ => return Ok(false),
                };
                *window += i64::from(increment);
                if *window > i64::from(MAX_WINDOW) {
                    return Err(CallError::protocol("flow-control window above 2^31-1"));
                }
                Ok(false)
            }
            PUSH_PROMISE => Err(CallError::protocol("PUSH_PROMISE though push is off")),
            CONTINUATION => Err(CallError::protocol("CONTINUATION outside a header block")),
            // PRIORITY, RST_STREAM of other streams, and unknown types
            // (RFC 9113 5.5) are ignored.
            _ => Ok(false),
        }
    }

    /// The complete header block that `first` (HEADERS) starts, with its
    /// padding and priority fields removed and CONTINUATIONs appended.
    fn header_block(&mut self, first: Frame) -> Result<Vec<u8>, CallError> {
        let mut fragment = unpad(&first)?;
        if first.flags & PRIORITY != 0 {
            fragment = fragment
                .get(5..)
                .ok_or_else(|| CallError::protocol("HEADERS too short for its priority"))?;
        }
        let mut block = fragment.to_vec();
        let mut ended = first.flags & END_HEADERS != 0;
        while !ended {
            let next = self.next()?;
            if next.kind != CONTINUATION || next.stream != first.stream {
                return Err(CallError::protocol("header block interrupted"));
            }
            if block.len() + next.payload.len() > MAX_HEADER_BLOCK {
                return Err(CallError::protocol("header block larger than 64 KiB"));
            }
            block.extend_from_slice(&next.payload);
            ended = next.flags & END_HEADERS != 0;
        }
        Ok(block)
    }

    /// Applies the daemon's SETTINGS and queues the acknowledgement.
    fn apply_settings(&mut self, frame: &Frame) -> Result<(), String> {
        let protocol = |what: &str| format!("HTTP/2 protocol error: {what}");
        if frame.stream != 0 || !frame.payload.len().is_multiple_of(6) {
            return Err(protocol("malformed SETTINGS"));
        }
        for setting in frame.payload.chunks_exact(6) {
            let id = u16::from_be_bytes([setting[0], setting[1]]);
            let value = u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]);
            match id {
                SETTINGS_INITIAL_WINDOW_SIZE => {
                    if value > MAX_WINDOW {
                        return Err(protocol("INITIAL_WINDOW_SIZE above 2^31-1"));
                    }
                    // A change applies to open streams as a delta.
                    self.stream_window += i64::from(value) - self.initial_window;
                    self.initial_window = i64::from(value);
                }
                SETTINGS_MAX_FRAME_SIZE => {
                    if !(DEFAULT_MAX_FRAME as u32..=LARGEST_MAX_FRAME).contains(&value) {
                        return Err(protocol("MAX_FRAME_SIZE out of range"));
                    }
                    self.max_frame = value as usize;
                }
                _ => {}
            }
        }
        frame_head(&mut self.out, 0, SETTINGS, ACK, 0);
        Ok(())
    }

    /// Writes what is queued, then reads the next frame, both within
    /// [`Connection::time_left`].
    fn read_frame(&mut self) -> io::Result<Frame> {
        if !self.out.is_empty() {
            // A failed write is not reported by itself: the daemon may have
            // answered and closed already, and its answer is still to be
            // read; if not, the read fails too and says why. Nothing more
            // is written then, as a frame may have been cut short.
            if !self.write_failed {
                let left = self.time_left()?;
                let stream = self.stream.get_mut();
                self.write_failed = stream
                    .set_write_timeout(Some(left))
                    .and_then(|()| stream.write_all(&self.out))
                    .is_err();
            }
            self.out.clear();
        }
        // Buffered bytes need no wait; only a read that blocks is bounded.
        if self.stream.buffer().len() < FRAME_HEAD_LEN {
            let left = self.time_left()?;
            self.stream.get_ref().set_read_timeout(Some(left))?;
        }
        // A reset means the same on a unix socket: the daemon closed it
        // with our bytes (an ACK, say) still unread.
        let closed = |e: io::Error| match e.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
                io::Error::new(e.kind(), "tetherd closed the connection")
            }
            _ => e,
        };
        let mut head = [0u8; FRAME_HEAD_LEN];
        self.stream.read_exact(&mut head).map_err(closed)?;
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        if len > DEFAULT_MAX_FRAME {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "HTTP/2 protocol error: frame larger than our MAX_FRAME_SIZE",
            ));
        }
        let mut payload = vec![0u8; len];
        if self.stream.buffer().len() < len {
            let left = self.time_left()?;
            self.stream.get_ref().set_read_timeout(Some(left))?;
        }
        self.stream.read_exact(&mut payload).map_err(closed)?;
        Ok(Frame {
            kind: head[3],
            flags: head[4],
            stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & MAX_WINDOW,
            payload,
        })
    }

    /// The time until `until`, or a timeout error once it has passed (std
    /// rejects a zero timeout).
    fn time_left(&self) -> io::Result<Duration> {
        let until = if self.settings_seen {
            self.until
        } else {
            self.until.min(self.handshake_until)
        };
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        Ok(left)
    }
}

/// The name of an HTTP/2 error code (RFC 9113, 7).
fn h2_error_name(code: u32) -> String {
    const NAMES: [&str; 14] = [
        "NO_ERROR",
        "PROTOCOL_ERROR",
        "INTERNAL_ERROR",
        "FLOW_CONTROL_ERROR",
        "SETTINGS_TIMEOUT",
        "STREAM_CLOSED",
        "FRAME_SIZE_ERROR",
        "REFUSED_STREAM",
        "CANCEL",
        "COMPRESSION_ERROR",
        "CONNECT_ERROR",
        "ENHANCE_YOUR_CALM",
        "INADEQUATE_SECURITY",
        "HTTP_1_1_REQUIRED",
    ];
    match NAMES.get(code as usize) {
        Some(name) => (*name).to_owned(),
        None => format!("error code {code:#x}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use loona_hpack::Encoder;
    use std::thread::JoinHandle;
    use tether_proto::cni::v1::cni_response::Outcome;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    /// The daemon's side of a socket pair, scripted frame by frame.
    struct Peer {
        stream: UnixStream,
        encoder: Encoder<'static>,
    }

    impl Peer {
        fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
            let mut out = Vec::new();
            frame_head(&mut out, payload.len(), kind, flags, stream);
            out.extend_from_slice(payload);
            self.stream.write_all(&out).unwrap();
        }

        fn read(&mut self) -> Frame {
            let mut head = [0u8; FRAME_HEAD_LEN];
            self.stream.read_exact(&mut head).unwrap();
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0; len];
            self.stream.read_exact(&mut payload).unwrap();
            Frame {
                kind: head[3],
                flags: head[4],
                stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]),
                payload,
            }
        }

        fn settings(&mut self, settings: &[(u16, u32)]) {
            let mut payload = Vec::new();
            for (id, value) in settings {
                payload.extend_from_slice(&id.to_be_bytes());
                payload.extend_from_slice(&value.to_be_bytes());
            }
            self.frame(SETTINGS, 0, 0, &payload);
        }

        /// Reads the client's opening and answers with `settings`.
        fn accept(&mut self, settings: &[(u16, u32)]) {
            let mut preface = [0u8; 24];
            self.stream.read_exact(&mut preface).unwrap();
            assert_eq!(preface, PREFACE);
            let client = self.read();
            assert_eq!((client.kind, client.flags, client.stream), (SETTINGS, 0, 0));
            assert_eq!(
                client.payload,
                [0, 2, 0, 0, 0, 0, 0, 4, 0x7f, 0xff, 0xff, 0xff],
                "ENABLE_PUSH 0, INITIAL_WINDOW_SIZE 2^31-1"
            );
            let update = self.read();
            assert_eq!((update.kind, update.stream), (WINDOW_UPDATE, 0));
            let increment = u32::from_be_bytes(update.payload[..4].try_into().unwrap());
            assert_eq!(increment + DEFAULT_WINDOW, MAX_WINDOW);
            self.settings(settings);
        }

        /// Reads the request: its decoded headers and its DATA payloads.
        fn request(&mut self) -> (Vec<(String, String)>, Vec<u8>) {
            let mut decoder = Decoder::new();
            let mut headers = Vec::new();
            let mut body = Vec::new();
            loop {
                let frame = self.read();
                match frame.kind {
                    SETTINGS => assert_eq!(frame.flags, ACK),
                    HEADERS => {
                        assert_eq!(frame.stream, 1);
                        assert_ne!(frame.flags & END_HEADERS, 0);
                        headers = decoder
                            .decode(&frame.payload)
                            .unwrap()
                            .into_iter()
                            .map(|(n, v)| {
                                (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                            })
                            .collect();
                    }
                    DATA => {
                        body.extend_from_slice(&frame.payload);
                        if frame.flags & END_STREAM != 0 {
                            return (headers, body);
                        }
                    }
                    other => panic!("unexpected frame type {other}"),
                }
            }
        }

        fn headers(&mut self, flags: u8, fields: &[(&str, &str)]) {
            let block = self
                .encoder
                .encode(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
            self.frame(HEADERS, flags | END_HEADERS, 1, &block);
        }

        /// A whole successful answer carrying `response`.
        fn answer(&mut self, response: &CniResponse) {
            self.headers(
                0,
                &[(":status", "200"), ("content-type", "application/grpc")],
            );
            self.frame(DATA, 0, 1, &response_message(response));
            self.headers(END_STREAM, &[("grpc-status", "0")]);
        }
    }

    fn response_message(response: &CniResponse) -> Vec<u8> {
        let message = response.encode_to_vec();
        let mut out = vec![0];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(&message);
        out
    }

    fn ok_response() -> CniResponse {
        CniResponse {
            outcome: Some(Outcome::Result(b"{\"ips\":[]}".to_vec())),
        }
    }

    /// Runs `script` as the daemon and one call of `request` as the shim.
    fn exchange(
        request: CniRequest,
        script: impl FnOnce(&mut Peer) + Send + 'static,
    ) -> Result<CniResponse, CallError> {
        let (client, server) = UnixStream::pair().unwrap();
        let daemon: JoinHandle<()> = std::thread::spawn(move || {
            let mut peer = Peer {
                stream: server,
                encoder: Encoder::new(),
            };
            script(&mut peer);
        });
        let message = grpc_message(&request).unwrap();
        let outcome =
            Connection::new(client, soon(), soon()).unary("/tether.cni.v1.Cni/Add", &message);
        daemon.join().unwrap();
        outcome
    }

    #[test]
    fn hpack_integers_follow_rfc_7541() {
        let mut out = Vec::new();
        // The RFC's examples (C.1.1 to C.1.3).
        hpack_int(&mut out, 10, 5, 0);
        hpack_int(&mut out, 1337, 5, 0);
        hpack_int(&mut out, 42, 8, 0);
        assert_eq!(out, [10, 31, 154, 10, 42]);
    }

    #[test]
    fn request_headers_decode_with_an_independent_decoder() {
        let long = "v".repeat(300);
        let block = encode_headers(&[(":method", "POST"), ("x-long", &long)]);
        let decoded = Decoder::new().decode(&block).unwrap();
        assert_eq!(
            decoded,
            [
                (b":method".to_vec(), b"POST".to_vec()),
                (b"x-long".to_vec(), long.into_bytes())
            ]
        );
    }

    #[test]
    fn frame_head_is_length_type_flags_stream() {
        let mut out = Vec::new();
        frame_head(&mut out, 0x01_02_03, DATA, END_STREAM, 1);
        assert_eq!(out, [1, 2, 3, 0, 1, 0, 0, 0, 1]);
    }

    #[test]
    fn grpc_message_is_percent_decoded() {
        assert_eq!(
            percent_decode(b"uid%201000%20is%20not%20allowed"),
            "uid 1000 is not allowed"
        );
        assert_eq!(percent_decode(b"caf%C3%A9 100%25"), "café 100%");
        // Malformed escapes are kept as they came.
        assert_eq!(percent_decode(b"50% %zz %4"), "50% %zz %4");
    }

    #[test]
    fn a_call_sends_grpc_headers_and_reads_the_response() {
        let request = CniRequest {
            command: "ADD".into(),
            stdin: b"{}".to_vec(),
            ..Default::default()
        };
        let expected = request.clone();
        let response = exchange(request, move |peer| {
            peer.accept(&[]);
            let (headers, body) = peer.request();
            let get = |name: &str| {
                headers
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.clone())
                    .unwrap()
            };
            assert_eq!(get(":method"), "POST");
            assert_eq!(get(":scheme"), "http");
            assert_eq!(get(":path"), "/tether.cni.v1.Cni/Add");
            assert_eq!(get(":authority"), AUTHORITY);
            assert_eq!(get("content-type"), "application/grpc");
            assert_eq!(get("te"), "trailers");
            let timeout = get("grpc-timeout");
            let millis: u64 = timeout.strip_suffix('m').unwrap().parse().unwrap();
            assert!((9_000..=10_000).contains(&millis), "{timeout}");
            assert_eq!(body[0], 0);
            let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
            assert_eq!(len, body.len() - 5);
            assert_eq!(CniRequest::decode(&body[5..]).unwrap(), expected);
            peer.answer(&ok_response());
        })
        .unwrap();
        assert_eq!(response, ok_response());
    }

    #[test]
    fn padding_priority_continuation_and_ping_are_handled() {
        // A header block must not be interrupted, not even by PRIORITY.
        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
            let block = peer.encoder.encode([(&b":status"[..], &b"200"[..])]);
            peer.frame(HEADERS, 0, 1, &block);
            peer.frame(PRIORITY_FRAME, 0, 1, &[0, 0, 0, 0, 16]);
        });
        assert!(
            matches!(response, Err(CallError::Failed(ref c)) if c.contains("interrupted")),
            "{response:?}"
        );

        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
            peer.frame(PING, 0, 0, b"abcdefgh");
            let block = peer.encoder.encode([
                (&b":status"[..], &b"200"[..]),
                (b"content-type", b"application/grpc+proto"),
            ]);
            let (first, rest) = block.split_at(block.len() / 2);
            let mut payload = vec![3];
            payload.extend_from_slice(&[0, 0, 0, 0, 16]);
            payload.extend_from_slice(first);
            payload.extend_from_slice(&[0, 0, 0]);
            peer.frame(HEADERS, PADDED | PRIORITY, 1, &payload);
            peer.frame(CONTINUATION, END_HEADERS, 1, rest);
            let message = response_message(&ok_response());
            let (a, b) = message.split_at(4);
            let mut padded = vec![2];
            padded.extend_from_slice(a);
            padded.extend_from_slice(&[0, 0]);
            peer.frame(DATA, PADDED, 1, &padded);
            peer.frame(DATA, 0, 1, b);
            peer.frame(0xfa, 0, 0, b"unknown frame types are ignored");
            peer.headers(END_STREAM, &[("grpc-status", "0")]);
            let pong = loop {
                let frame = peer.read();
                if frame.kind != SETTINGS {
                    break frame;
                }
            };
            assert_eq!(
                (pong.kind, pong.flags, pong.payload.as_slice()),
                (PING, ACK, &b"abcdefgh"[..])
            );
        });
        assert_eq!(response.unwrap(), ok_response());
    }

    const PRIORITY_FRAME: u8 = 0x2;

    #[test]
    fn a_large_request_respects_windows_and_frame_size() {
        let stdin = vec![b'x'; 300_000];
        let request = CniRequest {
            stdin: stdin.clone(),
            ..Default::default()
        };
        let response = exchange(request, move |peer| {
            // A small stream window, the default connection window. The
            // client may use the default stream window until it has seen
            // (and acknowledged) these SETTINGS, so the window is modelled
            // that way: the delta applies at the ACK.
            peer.accept(&[(SETTINGS_INITIAL_WINDOW_SIZE, 1000)]);
            let (mut connection_window, mut stream_window) = (65_535i64, 65_535i64);
            let mut body = Vec::new();
            let mut sizes = Vec::new();
            loop {
                let frame = peer.read();
                match frame.kind {
                    HEADERS => {}
                    SETTINGS => {
                        assert_eq!(frame.flags, ACK);
                        stream_window += 1000 - 65_535;
                    }
                    DATA => {
                        let len = frame.payload.len() as i64;
                        assert!(len <= connection_window && len <= stream_window, "{len}");
                        assert!(frame.payload.len() <= DEFAULT_MAX_FRAME);
                        connection_window -= len;
                        stream_window -= len;
                        sizes.push(len);
                        body.extend_from_slice(&frame.payload);
                        if frame.flags & END_STREAM != 0 {
                            break;
                        }
                    }
                    other => panic!("unexpected frame type {other}"),
                }
                // Open the stream window in uneven steps and the
                // connection's only when it is spent: both must be honoured.
                if stream_window <= 0 {
                    let increment = 40_000 - stream_window;
                    peer.frame(WINDOW_UPDATE, 0, 1, &(increment as u32).to_be_bytes());
                    stream_window += increment;
                }
                if connection_window <= 0 {
                    let increment = 70_000 - connection_window;
                    peer.frame(WINDOW_UPDATE, 0, 0, &(increment as u32).to_be_bytes());
                    connection_window += increment;
                }
            }
            let last = sizes.len() - 1;
            assert!(
                sizes[..last].iter().any(|&s| s < DEFAULT_MAX_FRAME as i64),
                "some frame was cut short by a window: {sizes:?}"
            );
            assert_eq!(CniRequest::decode(&body[5..]).unwrap().stdin, stdin);
            peer.answer(&ok_response());
        });
        assert_eq!(response.unwrap(), ok_response());
    }

    #[test]
    fn a_larger_max_frame_size_is_used() {
        let request = CniRequest {
            stdin: vec![b'y'; 100_000],
            ..Default::default()
        };
        let response = exchange(request, |peer| {
            peer.accept(&[
                (SETTINGS_MAX_FRAME_SIZE, 65_536),
                (SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20),
            ]);
            peer.frame(WINDOW_UPDATE, 0, 0, &(1u32 << 20).to_be_bytes());
            let mut sizes = Vec::new();
            loop {
                let frame = peer.read();
                if frame.kind == DATA {
                    sizes.push(frame.payload.len());
                    if frame.flags & END_STREAM != 0 {
                        break;
                    }
                }
            }
            // Whether the WINDOW_UPDATE arrives before the first DATA is a
            // race; either way frames exceed 16 KiB and stay within 64 KiB.
            assert!(sizes.iter().any(|&s| s > DEFAULT_MAX_FRAME), "{sizes:?}");
            assert!(sizes.iter().all(|&s| s <= 65_536), "{sizes:?}");
            peer.answer(&ok_response());
        });
        assert_eq!(response.unwrap(), ok_response());
    }

    #[test]
    fn trailers_only_errors_become_statuses() {
        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
            peer.headers(
                END_STREAM,
                &[
                    (":status", "200"),
                    ("content-type", "application/grpc"),
                    ("grpc-status", "7"),
                    ("grpc-message", "uid%201000%20is%20not%20allowed"),
                ],
            );
        });
        let failure = response.unwrap_err().into_failure();
        assert_eq!(
            failure,
            TransportFailure::Refused {
                cause: "PermissionDenied: uid 1000 is not allowed".into()
            }
        );

        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
            peer.headers(
                END_STREAM,
                &[
                    (":status", "200"),
                    ("grpc-status", "14"),
                    ("grpc-message", "restarting"),
                ],
            );
        });
        assert_eq!(
            response.unwrap_err().into_failure(),
            TransportFailure::CallFailed {
                cause: "Unavailable: restarting".into()
            }
        );
    }

    #[test]
    fn an_early_answer_stops_the_upload() {
        let request = CniRequest {
            stdin: vec![b'z'; 200_000],
            ..Default::default()
        };
        let response = exchange(request, |peer| {
            // The window stays shut; the daemon answers anyway.
            peer.accept(&[(SETTINGS_INITIAL_WINDOW_SIZE, 10)]);
            loop {
                if peer.read().kind == DATA {
                    break;
                }
            }
            peer.headers(
                END_STREAM,
                &[
                    (":status", "200"),
                    ("grpc-status", "8"),
                    ("grpc-message", "too big"),
                ],
            );
        });
        assert_eq!(
            response.unwrap_err(),
            CallError::Status(8, "too big".into())
        );
    }

    #[test]
    fn non_200_without_grpc_status_maps_like_grpc() {
        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
            peer.headers(END_STREAM, &[(":status", "503")]);
        });
        assert!(
            matches!(response, Err(CallError::Status(14, _))),
            "{response:?}"
        );
    }

    #[test]
    fn rst_stream_and_goaway_fail_the_call() {
        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
            peer.frame(RST_STREAM, 0, 1, &7u32.to_be_bytes());
        });
        assert_eq!(
            response.unwrap_err().into_failure(),
            TransportFailure::CallFailed {
                cause: "Unavailable: tetherd reset the stream (REFUSED_STREAM)".into()
            }
        );

        // GOAWAY with last stream 0: stream 1 was never taken.
        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
            peer.frame(GOAWAY, 0, 0, &[0, 0, 0, 0, 0, 0, 0, 0]);
        });
        let failure = response.unwrap_err().into_failure();
        assert!(
            matches!(&failure, TransportFailure::CallFailed { cause } if cause.contains("GOAWAY NO_ERROR")),
            "{failure:?}"
        );
        assert!(failure.queues_del());

        // GOAWAY that spares stream 1: its answer still counts.
        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
            peer.frame(GOAWAY, 0, 0, &[0, 0, 0, 1, 0, 0, 0, 0]);
            peer.answer(&ok_response());
        });
        assert_eq!(response.unwrap(), ok_response());

        // ... but a close after it, without the answer, fails the call.
        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
            peer.frame(GOAWAY, 0, 0, &[0, 0, 0, 1, 0, 0, 0, 2]);
        });
        assert_eq!(
            response.unwrap_err(),
            CallError::Failed(
                "Unavailable: tetherd closed the connection (after GOAWAY INTERNAL_ERROR)".into()
            )
        );
    }

    #[test]
    fn a_close_before_settings_is_a_handshake_failure() {
        let message = grpc_message(&CniRequest::default()).unwrap();
        let (client, server) = UnixStream::pair().unwrap();
        drop(server);
        let error = Connection::new(client, soon(), soon())
            .unary("/tether.cni.v1.Cni/Check", &message)
            .unwrap_err();
        assert!(
            matches!(
                &error,
                CallError::Handshake {
                    timed_out: false,
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(matches!(
            error.into_failure(),
            TransportFailure::Unreachable { .. }
        ));

        // The peer reads the whole request and closes without SETTINGS,
        // like tetherd refusing a peer by SO_PEERCRED.
        let (client, mut server) = UnixStream::pair().unwrap();
        let slam = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            let _ = server.read(&mut buf);
        });
        let error = Connection::new(client, soon(), soon())
            .unary("/tether.cni.v1.Cni/Check", &message)
            .unwrap_err();
        slam.join().unwrap();
        assert!(
            matches!(
                &error,
                CallError::Handshake {
                    timed_out: false,
                    ..
                }
            ),
            "{error:?}"
        );

        // A daemon that stays silent runs into the connect budget, not the
        // (longer) call deadline.
        let (client, _server) = UnixStream::pair().unwrap();
        let budget = Instant::now() + Duration::from_millis(50);
        let error = Connection::new(client, budget, soon())
            .unary("/tether.cni.v1.Cni/Check", &message)
            .unwrap_err();
        assert!(
            matches!(
                &error,
                CallError::Handshake {
                    timed_out: true,
                    ..
                }
            ),
            "{error:?}"
        );
    }

    #[test]
    fn a_close_after_the_handshake_fails_the_call() {
        let response = exchange(CniRequest::default(), |peer| {
            peer.accept(&[]);
            peer.request();
        });
        assert_eq!(
            response.unwrap_err(),
            CallError::Failed("Unavailable: tetherd closed the connection".into())
        );
    }

    #[test]
    fn refusal_is_told_apart_from_failure() {
        let denied = CallError::Status(7, "uid 1000 is not allowed".into()).into_failure();
        assert_eq!(
            denied,
            TransportFailure::Refused {
                cause: "PermissionDenied: uid 1000 is not allowed".into()
            }
        );
        assert!(!denied.queues_del());
        assert!(!CallError::Status(16, "who?".into())
            .into_failure()
            .queues_del());

        for code in [1, 2, 4, 12, 13, 14, 99] {
            let failure = CallError::Status(code, "x".into()).into_failure();
            assert!(
                matches!(failure, TransportFailure::CallFailed { .. }),
                "{failure:?}"
            );
            assert!(failure.queues_del());
        }
        assert_eq!(code_name(14), "Unavailable");
        assert_eq!(code_name(99), "Code(99)");
    }

    #[test]
    fn missing_socket_is_unreachable_and_names_the_os_error() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("absent.sock");
        let failure = call(Verb::Check, &socket, &CniRequest::default()).unwrap_err();
        match failure {
            TransportFailure::Unreachable { cause, waited } => {
                assert!(cause.contains("No such file or directory"), "{cause}");
                assert_eq!(waited, None);
            }
            other => panic!("expected Unreachable, got {other:?}"),
        }
    }
}
