//! Lets clients that send a unix socket path as `:authority` talk to us.
//!
//! grpcurl before 1.8.10 (the one operators can install here is 1.8.6) sends
//! the socket path, e.g. `/run/tether/tether.sock`, as the HTTP/2 `:authority`
//! of every request on a unix socket. h2 checks `:authority` as a URI
//! authority, finds the '/', and resets the stream with PROTOCOL_ERROR before
//! tonic sees it. h2 has no switch for this, so [`AuthorityFix`] repairs the
//! client's bytes before h2 reads them: it watches the first header block of
//! each connection and, only if that block carries an `:authority` h2 would
//! refuse, re-encodes every header block of the connection with `:authority:
//! localhost` (what grpcurl 1.8.10 and later send). A connection whose first
//! request is well formed, like every one from our own shim, is passed through
//! untouched from then on.
//!
//! HPACK (RFC 7541) makes a block depend on every block before it through the
//! dynamic table, so a rewrite cannot patch one field in place: once a block
//! is rewritten, the server's decoder follows our encoder, not the client's,
//! and every later block of the connection must be decoded with the client's
//! table and re-encoded with ours.

use loona_hpack::{Decoder, Encoder};
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::codegen::http::uri::Authority;
use tonic::transport::server::Connected;

/// The HTTP/2 client connection preface (RFC 7540 section 3.5).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Every HTTP/2 frame starts with a header this long (RFC 7540 section 4.1).
const FRAME_HEAD_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_PUSH_PROMISE: u8 = 0x5;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Stream dependency (4 bytes) and weight (1 byte) of a HEADERS frame with
/// the PRIORITY flag.
const PRIORITY_LEN: usize = 5;
/// The initial SETTINGS_MAX_FRAME_SIZE: every peer accepts frames this big,
/// whatever it advertised, so rewritten blocks are split at it.
const MAX_FRAME_PAYLOAD: usize = 16_384;
/// The initial SETTINGS_HEADER_TABLE_SIZE. Neither tonic nor hyper change
/// h2's default, so the client's encoder may use this much and the server's
/// decoder expects no more from ours.
const HEADER_TABLE_SIZE: usize = 4_096;
/// The most header block bytes buffered while waiting for END_HEADERS. gRPC
/// requests carry a few hundred bytes of headers; the cap bounds what a
/// misbehaving client can make us hold.
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// What replaces an `:authority` that h2 would refuse: what grpcurl 1.8.10
/// and later send on unix sockets.
const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";
/// How much is read from the client at a time while frames are examined.
const READ_CHUNK: usize = 16 * 1024;

/// A server-side connection whose client→server bytes get `:authority`
/// values that h2 refuses replaced by `localhost`; the server→client
/// direction and every connection whose first request is well formed pass
/// through unchanged.
#[derive(Debug)]
pub struct AuthorityFix<S> {
    inner: S,
    rewriter: Rewriter,
    /// Bytes read from the client; `input[start..end]` are not yet examined.
    input: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes for the server; `output[sent..]` are not yet handed out.
    output: Vec<u8>,
    sent: usize,
}

impl<S> AuthorityFix<S> {
    /// Wraps a freshly accepted connection, before any byte was read from it.
    pub fn new(inner: S) -> Self {
        AuthorityFix {
            inner,
            rewriter: Rewriter::new(),
            input: Vec::new(),
            start: 0,
            end: 0,
            output: Vec::new(),
            sent: 0,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.sent < this.output.len() {
                let n = buf.remaining().min(this.output.len() - this.sent);
                buf.put_slice(&this.output[this.sent..this.sent + n]);
                this.sent += n;
                if this.sent == this.output.len() {
                    this.output.clear();
                    this.sent = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let buffered = this.start < this.end;
            if !buffered && matches!(this.rewriter.mode, Mode::Passthrough) {
                if this.input.capacity() > 0 || this.output.capacity() > 0 {
                    // Not needed again: a long-lived connection keeps nothing.
                    this.input = Vec::new();
                    this.output = Vec::new();
                }
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            if !buffered && this.rewriter.verbatim_left > 0 {
                // The payload of a frame we do not change (DATA, mostly):
                // read it straight into the caller's buffer.
                let want = buf.remaining().min(this.rewriter.verbatim_left);
                let mut direct = ReadBuf::new(buf.initialize_unfilled_to(want));
                ready!(Pin::new(&mut this.inner).poll_read(cx, &mut direct))?;
                let n = direct.filled().len();
                buf.advance(n);
                this.rewriter.verbatim_left -= n;
                return Poll::Ready(Ok(()));
            }
            if buffered {
                let consumed = this
                    .rewriter
                    .feed(&this.input[this.start..this.end], &mut this.output)?;
                this.start += consumed;
                if this.start == this.end {
                    this.start = 0;
                    this.end = 0;
                }
                if consumed > 0 || !this.output.is_empty() {
                    continue;
                }
            }
            // Nothing complete is buffered: read more.
            if this.end == this.input.len() {
                if this.start > 0 {
                    this.input.copy_within(this.start..this.end, 0);
                    this.end -= this.start;
                    this.start = 0;
                }
                if this.end == this.input.len() {
                    this.input.resize(this.end + READ_CHUNK, 0);
                }
            }
            let mut fresh = ReadBuf::new(&mut this.input[this.end..]);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut fresh))?;
            let n = fresh.filled().len();
            if n == 0 {
                // The client closed in the middle of a frame (or before the
                // preface ended): what is buffered can never be acted on,
                // so the server just sees the end of the stream.
                this.start = 0;
                this.end = 0;
                return Poll::Ready(Ok(()));
            }
            this.end += n;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: Connected> Connected for AuthorityFix<S> {
    // The inner connection's, so that services see the same peer
    // credentials (UdsConnectInfo for a unix socket) as without the fix.
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Where the client→server stream is.
enum Mode {
    /// Waiting for the 24-byte client preface.
    Preface,
    /// Frames are examined until the first header block decides the mode.
    Deciding(Box<Hpack>),
    /// Every header block is decoded and re-encoded.
    Rewriting(Box<Hpack>),
    /// Everything is forwarded as it comes, for the rest of the connection.
    Passthrough,
    /// A header block could not be handled: nothing more is forwarded.
    Failed,
}

impl std::fmt::Debug for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The HPACK tables hold header values; keep them out of logs.
        f.write_str(match self {
            Mode::Preface => "Preface",
            Mode::Deciding(_) => "Deciding",
            Mode::Rewriting(_) => "Rewriting",
            Mode::Passthrough => "Passthrough",
            Mode::Failed => "Failed",
        })
    }
}

/// The two HPACK contexts of a rewritten connection: the client's encoder
/// (mirrored by `decoder`) and the server's decoder (mirrored by `encoder`).
struct Hpack {
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
}

impl Hpack {
    fn new() -> Self {
        let mut decoder = Decoder::new();
        // A client may not grow its table past what the server allows; h2
        // would refuse a larger size update too.
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        let mut encoder = Encoder::new();
        encoder.set_max_table_size(HEADER_TABLE_SIZE);
        Hpack { decoder, encoder }
    }

    fn decode(&mut self, fragment: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.decoder
            .decode(fragment)
            .map_err(|e| invalid(format!("undecodable header block: {e}")))
    }

    /// Encodes `headers` in order, with every `:authority` replaced.
    fn encode_fixed(&mut self, headers: &[(Vec<u8>, Vec<u8>)]) -> io::Result<Vec<u8>> {
        let mut block = Vec::new();
        for (name, value) in headers {
            let value: &[u8] = if is_authority(name) {
                REPLACEMENT_AUTHORITY
            } else {
                value
            };
            self.encoder.encode_header_into((name, value), &mut block)?;
        }
        Ok(block)
    }
}

/// A header block whose END_HEADERS has not arrived yet.
struct PendingBlock {
    stream_id: u32,
    /// END_STREAM and PRIORITY of the HEADERS frame.
    flags: u8,
    priority: Option<[u8; PRIORITY_LEN]>,
    /// The HPACK fragments, without padding or priority fields.
    fragment: Vec<u8>,
    /// The frames as received, kept only while deciding, to forward them
    /// untouched if the block needs no fix.
    raw: Vec<u8>,
}

/// The 9-byte header of a frame.
#[derive(Debug, Clone, Copy)]
struct FrameHead {
    len: usize,
    kind: u8,
    flags: u8,
    stream_id: u32,
}

impl FrameHead {
    fn parse(bytes: &[u8]) -> Option<Self> {
        let head: &[u8; FRAME_HEAD_LEN] = bytes.get(..FRAME_HEAD_LEN)?.try_into().ok()?;
        Some(FrameHead {
            len: usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]),
            kind: head[3],
            flags: head[4],
            // The top bit is reserved and ignored on receipt.
            stream_id: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
        })
    }

    fn write(&self, out: &mut Vec<u8>) {
        // Callers only build frames of at most MAX_FRAME_PAYLOAD bytes, so
        // the length fits in 24 bits.
        let len = (self.len as u32).to_be_bytes();
        out.extend_from_slice(&len[1..]);
        out.push(self.kind);
        out.push(self.flags);
        out.extend_from_slice(&self.stream_id.to_be_bytes());
    }
}

/// The client→server transformation, free of I/O so that it can be driven
/// by any byte source.
#[derive(Debug)]
struct Rewriter {
    mode: Mode,
    /// Payload bytes of the current frame that are forwarded as they are.
    verbatim_left: usize,
    block: Option<PendingBlock>,
}

impl std::fmt::Debug for PendingBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingBlock")
            .field("stream_id", &self.stream_id)
            .field("fragment_len", &self.fragment.len())
            .finish()
    }
}

impl Rewriter {
    fn new() -> Self {
        Rewriter {
            mode: Mode::Preface,
            verbatim_left: 0,
            block: None,
        }
    }

    /// Consumes a prefix of `input`, appending what the server must see to
    /// `out`, and returns how many bytes it consumed. Whatever it leaves is
    /// an incomplete unit that needs more bytes. After an error every call
    /// fails: a connection whose header blocks went out of sync must not
    /// reach the server.
    fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<usize> {
        if matches!(self.mode, Mode::Failed) {
            return Err(invalid("the connection already failed".into()));
        }
        let result = self.feed_frames(input, out);
        if result.is_err() {
            self.mode = Mode::Failed;
            self.block = None;
        }
        result
    }

    fn feed_frames(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<usize> {
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            match self.mode {
                Mode::Failed => return Err(invalid("the connection already failed".into())),
                Mode::Passthrough => {
                    out.extend_from_slice(rest);
                    return Ok(input.len());
                }
                Mode::Preface => {
                    let n = rest.len().min(PREFACE.len());
                    if rest[..n] != PREFACE[..n] {
                        // Not HTTP/2 with prior knowledge: nothing here to
                        // fix, and the server will say what is wrong.
                        self.mode = Mode::Passthrough;
                        continue;
                    }
                    if n < PREFACE.len() {
                        return Ok(pos);
                    }
                    out.extend_from_slice(PREFACE);
                    pos += PREFACE.len();
                    self.mode = Mode::Deciding(Box::new(Hpack::new()));
                    continue;
                }
                Mode::Deciding(_) | Mode::Rewriting(_) => {}
            }
            if self.verbatim_left > 0 {
                let n = rest.len().min(self.verbatim_left);
                out.extend_from_slice(&rest[..n]);
                pos += n;
                self.verbatim_left -= n;
                if self.verbatim_left > 0 {
                    return Ok(pos);
                }
                continue;
            }
            let Some(head) = FrameHead::parse(rest) else {
                return Ok(pos);
            };
            let pending = self.block.as_ref().map(|b| b.fragment.len());
            match (head.kind, pending) {
                (TYPE_CONTINUATION, None) => {
                    return Err(invalid("CONTINUATION outside a header block".into()));
                }
                (TYPE_CONTINUATION, Some(_)) => {}
                (_, Some(_)) => {
                    // RFC 7540 section 6.2: a header block is contiguous.
                    return Err(invalid("a header block was interrupted".into()));
                }
                (TYPE_PUSH_PROMISE, None) => {
                    // Only servers push, and its header block would change
                    // the HPACK state behind our back.
                    return Err(invalid("PUSH_PROMISE from a client".into()));
                }
                (TYPE_HEADERS, None) => {}
                (_, None) => {
                    out.extend_from_slice(&rest[..FRAME_HEAD_LEN]);
                    pos += FRAME_HEAD_LEN;
                    self.verbatim_left = head.len;
                    continue;
                }
            }
            if head.len > MAX_HEADER_BLOCK.saturating_sub(pending.unwrap_or(0)) {
                return Err(invalid(format!(
                    "header block larger than {MAX_HEADER_BLOCK} bytes"
                )));
            }
            let Some(frame) = rest.get(..FRAME_HEAD_LEN + head.len) else {
                return Ok(pos);
            };
            self.header_frame(head, frame, out)?;
            pos += frame.len();
        }
    }

    /// Takes one complete HEADERS or CONTINUATION frame.
    fn header_frame(&mut self, head: FrameHead, frame: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let payload = &frame[FRAME_HEAD_LEN..];
        let keep_raw = matches!(self.mode, Mode::Deciding(_));
        match self.block.as_mut() {
            None => {
                let (priority, fragment) = split_headers_payload(head.flags, payload)?;
                self.block = Some(PendingBlock {
                    stream_id: head.stream_id,
                    flags: head.flags & (FLAG_END_STREAM | FLAG_PRIORITY),
                    priority,
                    fragment: fragment.to_vec(),
                    raw: if keep_raw { frame.to_vec() } else { Vec::new() },
                });
            }
            Some(block) => {
                if head.stream_id != block.stream_id {
                    return Err(invalid("CONTINUATION on another stream".into()));
                }
                block.fragment.extend_from_slice(payload);
                if keep_raw {
                    block.raw.extend_from_slice(frame);
                }
            }
        }
        if head.flags & FLAG_END_HEADERS != 0 {
            if let Some(block) = self.block.take() {
                self.finish_block(block, out)?;
            }
        }
        Ok(())
    }

    fn finish_block(&mut self, block: PendingBlock, out: &mut Vec<u8>) -> io::Result<()> {
        // Failed until the block is handled, so that an error leaves it so.
        let (mut hpack, deciding) = match std::mem::replace(&mut self.mode, Mode::Failed) {
            Mode::Deciding(hpack) => (hpack, true),
            Mode::Rewriting(hpack) => (hpack, false),
            _ => return Err(invalid("header block in an unexpected state".into())),
        };
        let headers = hpack.decode(&block.fragment)?;
        if deciding
            && !headers
                .iter()
                .any(|(n, v)| is_authority(n) && !is_acceptable(v))
        {
            // The server decodes these very bytes with its own table, in
            // step with the client's encoder: forward them and stop looking.
            out.extend_from_slice(&block.raw);
            self.mode = Mode::Passthrough;
            return Ok(());
        }
        if deciding {
            tracing::debug!("first request has an :authority h2 refuses; rewriting it");
        }
        let encoded = hpack.encode_fixed(&headers)?;
        write_header_frames(out, &block, &encoded);
        self.mode = Mode::Rewriting(hpack);
        Ok(())
    }
}

/// Splits a HEADERS payload into its priority fields and its HPACK fragment,
/// dropping padding (RFC 7540 section 6.2).
fn split_headers_payload(
    flags: u8,
    payload: &[u8],
) -> io::Result<(Option<[u8; PRIORITY_LEN]>, &[u8])> {
    let mut rest = payload;
    let mut pad = 0;
    if flags & FLAG_PADDED != 0 {
        let (&n, after) = rest
            .split_first()
            .ok_or_else(|| invalid("PADDED HEADERS without a pad length".into()))?;
        pad = usize::from(n);
        rest = after;
    }
    let mut priority = None;
    if flags & FLAG_PRIORITY != 0 {
        let fields: [u8; PRIORITY_LEN] =
            rest.get(..PRIORITY_LEN)
                .and_then(|f| f.try_into().ok())
                .ok_or_else(|| invalid("HEADERS too short for its priority".into()))?;
        priority = Some(fields);
        rest = &rest[PRIORITY_LEN..];
    }
    let fragment_len = rest
        .len()
        .checked_sub(pad)
        .ok_or_else(|| invalid("HEADERS padding longer than the frame".into()))?;
    Ok((priority, &rest[..fragment_len]))
}

/// Writes `encoded` as one HEADERS frame, followed by CONTINUATION frames
/// only if it does not fit in the default maximum frame size.
fn write_header_frames(out: &mut Vec<u8>, block: &PendingBlock, encoded: &[u8]) {
    let room = MAX_FRAME_PAYLOAD - block.priority.map_or(0, |p| p.len());
    let (first, mut rest) = encoded.split_at(encoded.len().min(room));
    let mut flags = block.flags;
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    FrameHead {
        len: first.len() + block.priority.map_or(0, |p| p.len()),
        kind: TYPE_HEADERS,
        flags,
        stream_id: block.stream_id,
    }
    .write(out);
    if let Some(priority) = block.priority {
        out.extend_from_slice(&priority);
    }
    out.extend_from_slice(first);
    while !rest.is_empty() {
        let (chunk, after) = rest.split_at(rest.len().min(MAX_FRAME_PAYLOAD));
        rest = after;
        FrameHead {
            len: chunk.len(),
            kind: TYPE_CONTINUATION,
            flags: if rest.is_empty() { FLAG_END_HEADERS } else { 0 },
            stream_id: block.stream_id,
        }
        .write(out);
        out.extend_from_slice(chunk);
    }
}

fn is_authority(name: &[u8]) -> bool {
    name == b":authority"
}

/// Whether h2 accepts `value` as `:authority`: it parses it with exactly
/// this function.
fn is_acceptable(value: &[u8]) -> bool {
    Authority::try_from(value).is_ok()
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const TYPE_DATA: u8 = 0x0;
    const TYPE_SETTINGS: u8 = 0x4;
    const TYPE_WINDOW_UPDATE: u8 = 0x8;
    const TYPE_RST_STREAM: u8 = 0x3;

    type Headers = Vec<(String, String)>;

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        FrameHead {
            len: payload.len(),
            kind,
            flags,
            stream_id,
        }
        .write(&mut out);
        out.extend_from_slice(payload);
        out
    }

    fn grpc_request(authority: Option<&str>, path: &str) -> Headers {
        let mut h = vec![(":method", "POST"), (":scheme", "http"), (":path", path)];
        if let Some(a) = authority {
            h.push((":authority", a));
        }
        h.extend([
            ("content-type", "application/grpc"),
            ("user-agent", "grpcurl/v1.8.6 grpc-go/1.44.1-dev"),
            ("te", "trailers"),
            ("grpc-accept-encoding", "gzip"),
            ("grpc-timeout", "9999m"),
        ]);
        h.into_iter().map(|(n, v)| (n.into(), v.into())).collect()
    }

    fn encode(encoder: &mut Encoder<'static>, headers: &Headers) -> Vec<u8> {
        encoder.encode(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
    }

    /// A client encoder that, like grpc-go's, adds every header to its
    /// dynamic table and refers to it from then on (loona's encoder never
    /// indexes names found in the static table, so it refers to little).
    /// Its table stays far below 4096 bytes in these tests: no eviction.
    #[derive(Default)]
    struct IndexingClient {
        /// Oldest first.
        table: Headers,
    }

    impl IndexingClient {
        fn encode(&mut self, headers: &Headers) -> Vec<u8> {
            let mut out = Vec::new();
            for (name, value) in headers {
                let pair = (name.clone(), value.clone());
                if let Some(at) = self.table.iter().position(|h| *h == pair) {
                    // Newest is 62, right after the 61 static entries.
                    let index = 62 + self.table.len() - 1 - at;
                    assert!(index < 127, "one-byte index");
                    out.push(0x80 | index as u8);
                    continue;
                }
                out.push(0x40);
                for s in [name, value] {
                    assert!(s.len() < 127, "one-byte length");
                    out.push(s.len() as u8);
                    out.extend_from_slice(s.as_bytes());
                }
                self.table.push(pair);
            }
            out
        }
    }

    /// The client's first bytes: preface, SETTINGS, a connection
    /// WINDOW_UPDATE, as grpc-go sends them.
    fn opening() -> Vec<u8> {
        let mut out = PREFACE.to_vec();
        out.extend(frame(TYPE_SETTINGS, 0, 0, &[]));
        out.extend(frame(TYPE_WINDOW_UPDATE, 0, 0, &[0, 0x0e, 0xff, 0x01]));
        out
    }

    /// A gRPC message frame of an empty request (5-byte length prefix).
    fn empty_message(stream_id: u32) -> Vec<u8> {
        frame(TYPE_DATA, FLAG_END_STREAM, stream_id, &[0, 0, 0, 0, 0])
    }

    #[derive(Debug, Clone, PartialEq)]
    struct Frame {
        kind: u8,
        flags: u8,
        stream_id: u32,
        payload: Vec<u8>,
    }

    /// Splits `bytes` into the complete frames it holds and what is left.
    fn split_frames(mut bytes: &[u8]) -> (Vec<Frame>, &[u8]) {
        let mut frames = Vec::new();
        while let Some(head) = FrameHead::parse(bytes) {
            let Some(payload) = bytes.get(FRAME_HEAD_LEN..FRAME_HEAD_LEN + head.len) else {
                break;
            };
            frames.push(Frame {
                kind: head.kind,
                flags: head.flags,
                stream_id: head.stream_id,
                payload: payload.to_vec(),
            });
            bytes = &bytes[FRAME_HEAD_LEN + head.len..];
        }
        (frames, bytes)
    }

    /// The frames a client stream (preface first) consists of.
    fn client_frames(bytes: &[u8]) -> Vec<Frame> {
        let body = bytes
            .strip_prefix(PREFACE)
            .expect("the preface comes first");
        let (frames, rest) = split_frames(body);
        assert!(
            rest.is_empty(),
            "{} stray bytes after the last frame",
            rest.len()
        );
        frames
    }

    /// A decoded header block, as the server sees it.
    #[derive(Debug, PartialEq)]
    struct Block {
        stream_id: u32,
        /// END_STREAM and PRIORITY of its HEADERS frame.
        flags: u8,
        priority: Option<[u8; PRIORITY_LEN]>,
        headers: Headers,
        /// How many frames carried it.
        frames: usize,
    }

    /// Decodes every header block in `frames` with one decoder, as the
    /// server does, and returns them with the other frames.
    fn decode_blocks(frames: &[Frame]) -> (Vec<Block>, Vec<Frame>) {
        let mut decoder = Decoder::new();
        let mut blocks = Vec::new();
        let mut others = Vec::new();
        let mut pending: Option<(Block, Vec<u8>)> = None;
        for f in frames {
            match f.kind {
                TYPE_HEADERS => {
                    assert!(pending.is_none(), "HEADERS inside a header block");
                    let (priority, fragment) = split_headers_payload(f.flags, &f.payload).unwrap();
                    let block = Block {
                        stream_id: f.stream_id,
                        flags: f.flags & (FLAG_END_STREAM | FLAG_PRIORITY),
                        priority,
                        headers: Vec::new(),
                        frames: 1,
                    };
                    pending = Some((block, fragment.to_vec()));
                }
                TYPE_CONTINUATION => {
                    let (block, fragment) = pending.as_mut().expect("CONTINUATION after HEADERS");
                    assert_eq!(block.stream_id, f.stream_id);
                    block.frames += 1;
                    fragment.extend_from_slice(&f.payload);
                }
                _ => {
                    assert!(pending.is_none(), "a header block was interrupted");
                    others.push(f.clone());
                    continue;
                }
            }
            assert!(f.payload.len() <= MAX_FRAME_PAYLOAD, "oversized frame");
            if f.flags & FLAG_END_HEADERS != 0 {
                let (mut block, fragment) = pending.take().unwrap();
                block.headers = decoder
                    .decode(&fragment)
                    .expect("the server can decode the block")
                    .into_iter()
                    .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                    .collect();
                blocks.push(block);
            }
        }
        assert!(pending.is_none(), "unfinished header block");
        (blocks, others)
    }

    fn with_authority(headers: &Headers, authority: &str) -> Headers {
        headers
            .iter()
            .map(|(n, v)| {
                let v = if n == ":authority" { authority } else { v };
                (n.clone(), v.to_string())
            })
            .collect()
    }

    /// Runs `input` through an AuthorityFix over an in-memory pipe whose
    /// capacity `pipe` decides how the bytes arrive in pieces.
    async fn run(input: &[u8], pipe: usize) -> io::Result<Vec<u8>> {
        let (mut client, server) = tokio::io::duplex(pipe);
        let input = input.to_vec();
        let writer = tokio::spawn(async move {
            // The reader may fail first and drop its end.
            let _ = client.write_all(&input).await;
            let _ = client.shutdown().await;
        });
        let mut fixed = AuthorityFix::new(server);
        let mut out = Vec::new();
        let result = fixed.read_to_end(&mut out).await;
        drop(fixed);
        writer.await.expect("writer task");
        result.map(|_| out)
    }

    /// `run` with pipes of several sizes, which must all agree.
    async fn run_all(input: &[u8]) -> io::Result<Vec<u8>> {
        let first = run(input, 1 << 20).await;
        for pipe in [1, 7, 64, 4096] {
            let other = run(input, pipe).await;
            match (&first, &other) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "pipe of {pipe} bytes"),
                (Err(_), Err(_)) => {}
                _ => panic!("pipe of {pipe} bytes: {other:?} vs {first:?}"),
            }
        }
        first
    }

    #[tokio::test]
    async fn path_authority_becomes_localhost_and_nothing_else_changes() {
        let request = grpc_request(
            Some("/run/tether/tether.sock"),
            "/tether.admin.v1.Admin/GetNode",
        );
        let mut input = opening();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &encode(&mut Encoder::new(), &request),
        ));
        input.extend(empty_message(1));

        let output = run_all(&input).await.unwrap();

        let (blocks, others) = decode_blocks(&client_frames(&output));
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].headers, with_authority(&request, "localhost"));
        assert_eq!(blocks[0].stream_id, 1);
        assert_eq!(blocks[0].flags, 0, "no END_STREAM before the DATA");
        let (_, input_others) = decode_blocks(&client_frames(&input));
        assert_eq!(
            others, input_others,
            "SETTINGS, WINDOW_UPDATE and DATA unchanged"
        );
        assert_eq!(others[2].flags, FLAG_END_STREAM);
        assert_eq!(others[2].payload, [0, 0, 0, 0, 0]);
    }

    #[tokio::test]
    async fn acceptable_or_absent_authority_passes_byte_for_byte() {
        for authority in [
            Some("localhost:50051"),
            Some("tether"),
            Some("[::1]:80"),
            None,
        ] {
            let request = grpc_request(authority, "/grpc.health.v1.Health/Check");
            let mut input = opening();
            let mut encoder = Encoder::new();
            input.extend(frame(
                TYPE_HEADERS,
                FLAG_END_HEADERS,
                1,
                &encode(&mut encoder, &request),
            ));
            input.extend(empty_message(1));
            // A second request with a path authority: only the first one
            // decides, and h2 would see this one as the client sent it.
            let odd = grpc_request(Some("/odd"), "/grpc.health.v1.Health/Check");
            input.extend(frame(
                TYPE_HEADERS,
                FLAG_END_HEADERS,
                3,
                &encode(&mut encoder, &odd),
            ));
            input.extend(empty_message(3));

            assert_eq!(run_all(&input).await.unwrap(), input, "{authority:?}");
        }
    }

    #[tokio::test]
    async fn a_block_in_continuation_frames_with_padding_and_priority() {
        let request = grpc_request(
            Some("/run/tether/tether.sock"),
            "/tether.admin.v1.Admin/Stats",
        );
        let block = encode(&mut Encoder::new(), &request);
        let (a, rest) = block.split_at(10);
        let (b, c) = rest.split_at(rest.len() / 2);
        let priority = [0x80, 0, 0, 0, 0x0f];
        let mut payload = vec![3]; // pad length
        payload.extend(priority);
        payload.extend(a);
        payload.extend([0, 0, 0]);
        let mut input = opening();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
            1,
            &payload,
        ));
        input.extend(frame(TYPE_CONTINUATION, 0, 1, b));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, c));

        let output = run_all(&input).await.unwrap();

        let (blocks, _) = decode_blocks(&client_frames(&output));
        assert_eq!(
            blocks,
            [Block {
                stream_id: 1,
                flags: FLAG_END_STREAM | FLAG_PRIORITY,
                priority: Some(priority),
                headers: with_authority(&request, "localhost"),
                frames: 1,
            }]
        );
    }

    #[tokio::test]
    async fn later_requests_with_dynamic_table_references_and_size_updates() {
        let first = grpc_request(
            Some("/run/tether/tether.sock"),
            "/tether.admin.v1.Admin/GetNode",
        );
        let second = grpc_request(
            Some("/run/tether/tether.sock"),
            "/tether.admin.v1.Admin/Stats",
        );
        let mut client = IndexingClient::default();
        let mut input = opening();
        let block1 = client.encode(&first);
        let block2 = client.encode(&second);
        assert!(
            block2.len() < block1.len() / 2,
            "the second block refers to the table"
        );
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block1));
        input.extend(empty_message(1));
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &block2));
        input.extend(empty_message(3));
        // The client empties its table (size update to 0, then back to
        // 4096) and starts over: the fix must follow, or the fourth block's
        // references would resolve to the first blocks' entries.
        let mut restarted = IndexingClient::default();
        let third = grpc_request(
            Some("/run/tether/tether.sock"),
            "/grpc.health.v1.Health/Check",
        );
        let fourth = grpc_request(
            Some("/run/tether/tether.sock"),
            "/grpc.health.v1.Health/Watch",
        );
        let mut block3 = vec![0x20, 0x3f, 0xe1, 0x1f];
        block3.extend(restarted.encode(&third));
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 5, &block3));
        input.extend(empty_message(5));
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            7,
            &restarted.encode(&fourth),
        ));
        // Trailers-only HEADERS ending a stream: no pseudo-headers at all.
        let trailers: Headers = vec![("x-trailer".into(), "1".into())];
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            7,
            &restarted.encode(&trailers),
        ));

        let output = run_all(&input).await.unwrap();

        let (blocks, others) = decode_blocks(&client_frames(&output));
        let headers: Vec<_> = blocks
            .iter()
            .map(|b| (b.stream_id, b.headers.clone()))
            .collect();
        assert_eq!(
            headers,
            [
                (1, with_authority(&first, "localhost")),
                (3, with_authority(&second, "localhost")),
                (5, with_authority(&third, "localhost")),
                (7, with_authority(&fourth, "localhost")),
                (7, trailers),
            ]
        );
        assert_eq!(blocks[4].flags, FLAG_END_STREAM);
        let data: Vec<_> = others
            .iter()
            .filter(|f| f.kind == TYPE_DATA)
            .map(|f| f.stream_id)
            .collect();
        assert_eq!(data, [1, 3, 5]);
    }

    #[tokio::test]
    async fn a_reference_into_a_table_the_client_emptied_is_refused() {
        let request = grpc_request(Some("/s.sock"), "/x/y");
        let mut client = IndexingClient::default();
        let mut input = opening();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &client.encode(&request),
        ));
        // The same request again is all references (62 and up)...
        let again = client.encode(&request);
        assert!(again.iter().all(|b| *b >= 0x80 | 62));
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &again));
        assert!(run_all(&input).await.is_ok());
        // ...which point nowhere once a size update emptied the table: a
        // decoder that missed the update would resolve them to stale
        // entries and forward a block the client never meant.
        let mut emptied = vec![0x20];
        emptied.extend(&again);
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 5, &emptied));
        let err = run_all(&input).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[tokio::test]
    async fn a_table_larger_than_the_server_allows_is_refused() {
        let request = grpc_request(Some("/s.sock"), "/x/y");
        // Size update to 8192, which h2 has not allowed.
        let mut block = vec![0x3f, 0xe1, 0x3f];
        block.extend(encode(&mut Encoder::new(), &request));
        let mut input = opening();
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block));

        let err = run_all(&input).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[tokio::test]
    async fn a_block_larger_than_a_frame_is_split() {
        let mut request = grpc_request(
            Some("/run/tether/tether.sock"),
            "/tether.admin.v1.Admin/GetNode",
        );
        request.push(("x-big".into(), "b".repeat(40_000)));
        let mut client = Encoder::new();
        let block = encode(&mut client, &request);
        let mut input = opening();
        let mut chunks = block.chunks(MAX_FRAME_PAYLOAD).peekable();
        let mut kind = TYPE_HEADERS;
        while let Some(chunk) = chunks.next() {
            let flags = if chunks.peek().is_none() {
                FLAG_END_HEADERS
            } else {
                0
            };
            input.extend(frame(kind, flags, 1, chunk));
            kind = TYPE_CONTINUATION;
        }
        input.extend(empty_message(1));

        let output = run_all(&input).await.unwrap();

        let (blocks, _) = decode_blocks(&client_frames(&output));
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].frames, 3);
        assert_eq!(blocks[0].headers, with_authority(&request, "localhost"));
    }

    #[tokio::test]
    async fn grpcurl_1_8_6_first_request_is_fixed() {
        // The first HEADERS and DATA frames grpcurl v1.8.6 sent for `list`
        // to a unix socket at /tmp/afx-cap.sock: Huffman strings, and
        // `:authority` added to its dynamic table.
        let captured = "000073010400000001838645ad626b2b22f6165a0a4498f52fdc23a2b9c6bee2d9dcb6\
            6d2cb4148931ea63716cee5b36965a0a4498f564aa53ff418d6134d6c0e5f2b1075ae8393aff5f8b1d\
            75d0620d263d4c4d65647a999acac96d9431dc2bbcbb8a4d65645a63b015da6970ad217bff40027465\
            864d833505b11f00000800000000000100000000033a012a";
        let bytes: Vec<u8> = (0..captured.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&captured[i..i + 2], 16).unwrap())
            .collect();
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_SETTINGS, 0, 0, &[]));
        input.extend(frame(TYPE_SETTINGS, 1, 0, &[]));
        input.extend(bytes);

        let output = run_all(&input).await.unwrap();

        let (sent, _) = decode_blocks(&client_frames(&input));
        let (fixed, _) = decode_blocks(&client_frames(&output));
        let authority = |b: &Block| {
            b.headers
                .iter()
                .find(|(n, _)| n == ":authority")
                .map(|(_, v)| v.clone())
        };
        assert_eq!(authority(&sent[0]).as_deref(), Some("/tmp/afx-cap.sock"));
        assert_eq!(
            fixed[0].headers,
            with_authority(&sent[0].headers, "localhost")
        );
        assert!(fixed[0].headers.contains(&(
            ":path".into(),
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo".into()
        )));
    }

    #[tokio::test]
    async fn broken_framing_is_an_error_not_a_forward() {
        let request = grpc_request(Some("/s.sock"), "/x/y");
        let block = encode(&mut Encoder::new(), &request);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("interrupted block", {
                let mut b = frame(TYPE_HEADERS, 0, 1, &block);
                b.extend(empty_message(1));
                b
            }),
            ("CONTINUATION on another stream", {
                let mut b = frame(TYPE_HEADERS, 0, 1, &block);
                b.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 3, &[]));
                b
            }),
            (
                "lone CONTINUATION",
                frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &block),
            ),
            (
                "padding past the end",
                frame(
                    TYPE_HEADERS,
                    FLAG_END_HEADERS | FLAG_PADDED,
                    1,
                    &[200, 0x82],
                ),
            ),
            (
                "short priority",
                frame(TYPE_HEADERS, FLAG_END_HEADERS | FLAG_PRIORITY, 1, &[0, 0]),
            ),
            (
                "bad index",
                frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0xff, 0x7f]),
            ),
            (
                "PUSH_PROMISE",
                frame(TYPE_PUSH_PROMISE, FLAG_END_HEADERS, 1, &[0, 0, 0, 2]),
            ),
            (
                "huge block",
                frame(TYPE_HEADERS, 0, 1, &vec![0; MAX_HEADER_BLOCK + 1]),
            ),
        ];
        for (what, frames) in cases {
            let mut input = opening();
            input.extend(frames);
            let mut rewriter = Rewriter::new();
            let mut out = Vec::new();
            assert!(rewriter.feed(&input, &mut out).is_err(), "{what}");
            // Nothing of the broken block reached the server, and nothing
            // more ever will.
            assert!(
                out.len() <= opening().len() + empty_message(1).len(),
                "{what}"
            );
            assert!(
                rewriter.feed(&empty_message(1), &mut out).is_err(),
                "{what}"
            );
        }
    }

    #[tokio::test]
    async fn not_http2_passes_through() {
        let input = b"GET / HTTP/1.1\r\nHost: /run/tether/tether.sock\r\n\r\n".to_vec();
        assert_eq!(run_all(&input).await.unwrap(), input);
        // A truncated preface is dropped: the server sees the stream end.
        assert_eq!(run_all(&PREFACE[..10]).await.unwrap(), b"");
    }

    /// xorshift64*: reproducible randomness without a dependency.
    struct Random(u64);

    impl Random {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        /// Up to `max` random bytes.
        fn bytes(&mut self, max: usize) -> Vec<u8> {
            let n = self.below(max + 1);
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    /// Feeds `input` in random pieces, as reads would deliver it.
    fn feed_in_pieces(input: &[u8], random: &mut Random) -> io::Result<Vec<u8>> {
        let mut rewriter = Rewriter::new();
        let mut out = Vec::new();
        let mut buffered = Vec::new();
        let mut pos = 0;
        while pos < input.len() {
            let n = (1 + random.below(300)).min(input.len() - pos);
            buffered.extend_from_slice(&input[pos..pos + n]);
            pos += n;
            let consumed = rewriter.feed(&buffered, &mut out)?;
            buffered.drain(..consumed);
        }
        Ok(out)
    }

    #[test]
    fn random_input_never_panics() {
        let mut random = Random(0x7e7e_e7e7_1234_5678);
        let request = grpc_request(
            Some("/run/tether/tether.sock"),
            "/tether.admin.v1.Admin/GetNode",
        );
        let mut valid = opening();
        let mut encoder = Encoder::new();
        for stream_id in [1, 3, 5] {
            valid.extend(frame(
                TYPE_HEADERS,
                FLAG_END_HEADERS,
                stream_id,
                &encode(&mut encoder, &request),
            ));
            valid.extend(empty_message(stream_id));
        }
        let (mut errors, mut fine) = (0, 0);
        for round in 0..20_000 {
            let input = match round % 4 {
                // Noise, with or without a preface in front.
                0 => random.bytes(400),
                1 => {
                    let mut b = PREFACE.to_vec();
                    b.extend(random.bytes(400));
                    b
                }
                // Plausible frames with random types, flags and payloads.
                2 => {
                    let mut b = PREFACE.to_vec();
                    for _ in 0..random.below(6) {
                        let kind = [TYPE_HEADERS, TYPE_CONTINUATION, TYPE_DATA, TYPE_SETTINGS]
                            [random.below(4)];
                        let payload = random.bytes(60);
                        b.extend(frame(
                            kind,
                            random.next() as u8,
                            random.below(4) as u32,
                            &payload,
                        ));
                    }
                    b
                }
                // A valid connection with a few bytes changed.
                _ => {
                    let mut b = valid.clone();
                    for _ in 0..1 + random.below(4) {
                        let at = PREFACE.len() + random.below(b.len() - PREFACE.len());
                        b[at] = random.next() as u8;
                    }
                    b
                }
            };
            match feed_in_pieces(&input, &mut random) {
                Ok(_) => fine += 1,
                Err(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
                    errors += 1;
                }
            }
        }
        // Both outcomes were exercised, not just one.
        assert!(errors > 1000 && fine > 1000, "errors {errors}, fine {fine}");
    }

    #[tokio::test]
    async fn connect_info_is_the_unix_streams() {
        let (a, _b) = tokio::net::UnixStream::pair().unwrap();
        let fixed = AuthorityFix::new(a);
        let info: tonic::transport::server::UdsConnectInfo = fixed.connect_info();
        let cred = info.peer_cred.expect("peer credentials");
        assert_eq!(cred.uid(), nix::unistd::getuid().as_raw());
        assert_eq!(cred.pid(), Some(std::process::id() as i32));
    }

    /// Sends `request` to a real tonic server (health service) through `fix`
    /// or not, and returns the server's answer on stream 1: the decoded
    /// header blocks, or the RST_STREAM error code.
    async fn ask_health_server(request: &Headers, fix: bool) -> Result<Vec<Headers>, u32> {
        let (mut client, server_io) = tokio::io::duplex(64 * 1024);
        let (_reporter, health) = tonic_health::server::health_reporter();
        let server = tonic::transport::Server::builder().add_service(health);
        let server = if fix {
            let incoming =
                futures::stream::iter([Ok::<_, io::Error>(AuthorityFix::new(server_io))]);
            tokio::spawn(server.serve_with_incoming(incoming))
        } else {
            let incoming = futures::stream::iter([Ok::<_, io::Error>(server_io)]);
            tokio::spawn(server.serve_with_incoming(incoming))
        };
        let mut input = opening();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &encode(&mut Encoder::new(), request),
        ));
        input.extend(empty_message(1));
        client.write_all(&input).await.unwrap();

        let mut received = Vec::new();
        let answer = tokio::time::timeout(std::time::Duration::from_secs(20), async {
            loop {
                let mut chunk = [0; 4096];
                let n = client.read(&mut chunk).await.unwrap();
                assert!(n > 0, "the server closed without answering");
                received.extend_from_slice(&chunk[..n]);
                let (frames, _) = split_frames(&received);
                let on_stream: Vec<_> = frames
                    .iter()
                    .filter(|f| f.stream_id == 1)
                    .cloned()
                    .collect();
                if let Some(rst) = on_stream.iter().find(|f| f.kind == TYPE_RST_STREAM) {
                    let code: [u8; 4] = rst.payload[..4].try_into().unwrap();
                    return Err(u32::from_be_bytes(code));
                }
                let done = on_stream
                    .iter()
                    .any(|f| f.kind == TYPE_HEADERS && f.flags & FLAG_END_STREAM != 0);
                if done {
                    let (blocks, _) = decode_blocks(&on_stream);
                    return Ok(blocks.into_iter().map(|b| b.headers).collect());
                }
            }
        })
        .await
        .expect("the server answered in time");
        server.abort();
        answer
    }

    fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    #[tokio::test]
    async fn h2_serves_a_path_authority_only_with_the_fix() {
        let request = grpc_request(
            Some("/run/tether/tether.sock"),
            "/grpc.health.v1.Health/Check",
        );
        const PROTOCOL_ERROR: u32 = 0x1;
        assert_eq!(
            ask_health_server(&request, false).await,
            Err(PROTOCOL_ERROR)
        );

        let blocks = ask_health_server(&request, true).await.expect("served");
        assert_eq!(header(&blocks[0], ":status"), Some("200"));
        assert_eq!(header(blocks.last().unwrap(), "grpc-status"), Some("0"));

        // Well-formed requests are served through the fix as before.
        let request = grpc_request(Some("localhost:50051"), "/grpc.health.v1.Health/Check");
        let blocks = ask_health_server(&request, true).await.expect("served");
        assert_eq!(header(blocks.last().unwrap(), "grpc-status"), Some("0"));
    }
}
