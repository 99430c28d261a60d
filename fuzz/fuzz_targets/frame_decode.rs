//! Raw bytes from a peer through the frame codec, then each frame through the decoder its
//! type selects (method arguments, content header).
//!
//! Input: byte 0 picks `frame_max` (4096 + n * 64), byte 1 the read size the stream is fed
//! in, the rest is the stream. Checks: no panic; feeding the stream in pieces gives the same
//! frames and the same verdict as feeding it at once; every frame is within `frame_max` and
//! re-encodes to exactly the bytes it was read from; a decoded method re-encodes to bytes
//! that decode to the same encoding again; the configured depth limit
//! (`decode_method_within`, limit = byte 0 % 8) only refuses what is too deep: a method it
//! accepts or finds malformed gets the same answer under the ceiling (`decode_method`).
#![no_main]

use bytes::BytesMut;
use dlx_proxy::amqp::codec::{
    FRAME_HEADER, FRAME_METHOD, FRAME_MIN_SIZE, FrameCodec, MethodError, RawFrame, decode_method,
    decode_method_within, method_ids, put_method, put_raw_frame,
};
use dlx_proxy::amqp::content::parse_content_header;
use libfuzzer_sys::fuzz_target;
use tokio_util::codec::Decoder;

/// Frames decoded from `chunks` fed one after the other, and whether decoding failed.
fn decode_all<'a>(frame_max: u32, chunks: impl Iterator<Item = &'a [u8]>) -> (Vec<RawFrame>, bool) {
    let mut codec = FrameCodec::new(frame_max);
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(frame)) => {
                    assert!(frame.wire_len() <= codec.frame_max());
                    frames.push(frame);
                }
                Ok(None) => break,
                Err(_) => return (frames, true),
            }
        }
    }
    (frames, false)
}

fuzz_target!(|data: &[u8]| {
    let [max_step, read_size, stream @ ..] = data else {
        return;
    };
    let frame_max = FRAME_MIN_SIZE + u32::from(*max_step) * 64;
    let (frames, failed) = decode_all(frame_max, std::iter::once(stream));
    let step = usize::from(*read_size).max(1);
    let (pieces, pieces_failed) = decode_all(frame_max, stream.chunks(step));
    assert_eq!(frames, pieces, "frames depend on how the stream was read");
    assert_eq!(failed, pieces_failed);

    let mut encoded = BytesMut::new();
    for frame in &frames {
        put_raw_frame(&mut encoded, frame.kind, frame.channel, &frame.payload);
    }
    assert_eq!(&encoded[..], &stream[..encoded.len()]);

    for frame in &frames {
        match frame.kind {
            FRAME_METHOD => {
                let _ = method_ids(&frame.payload);
                let within = decode_method_within(&frame.payload, usize::from(*max_step % 8));
                match within {
                    Ok(_) => assert!(decode_method(&frame.payload).is_some()),
                    Err(MethodError::Malformed) => assert!(decode_method(&frame.payload).is_none()),
                    Err(MethodError::TooDeep { .. }) => {}
                }
                if let Some(method) = decode_method(&frame.payload) {
                    let mut once = BytesMut::new();
                    put_method(&mut once, frame.channel, method);
                    let again = decode_method(&once[7..once.len() - 1])
                        .expect("a re-encoded method must decode");
                    let mut twice = BytesMut::new();
                    put_method(&mut twice, frame.channel, again);
                    assert_eq!(once, twice, "method changed on a round trip");
                }
            }
            FRAME_HEADER => {
                let _ = parse_content_header(&frame.payload);
            }
            _ => {}
        }
    }
});
