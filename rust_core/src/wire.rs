//! Protobuf wire encoding of an append's receipts (`contextd.v1.AppendMessagesResponse`).
//!
//! Why here: a 1,000-message append built its response in Python, one `MessageReceipt`
//! and one `Timestamp` per message (about 1 ms), on the store's single writer thread,
//! which encodes the response to record it under the call's request id. Here it is one
//! pass over five integer columns; Python parses the bytes back with the protobuf
//! runtime when it needs the message (upb's C parser: a tenth of the build).
//!
//! Why hand-written rather than `prost`: the message is five integer fields and a nested
//! `Timestamp`; `prost` would need code generation from the .proto (prost-build and
//! protoc at build time) for what is a few lines of varints. The output is exactly the
//! protobuf runtime's serialization (fields in number order, zero scalars omitted, the
//! timestamp always present), which `tests/test_append_receipts.py` checks against it.

use crate::error::{CoreError, CoreResult};

/// Tags (field number << 3 | wire type): varint is 0, length-delimited is 2.
const RECEIPTS: u8 = 1 << 3 | 2; // AppendMessagesResponse.receipts
const ID: u8 = 1 << 3; // MessageReceipt.id
const CREATE_TIME: u8 = 2 << 3 | 2; // MessageReceipt.create_time
const TOKEN_ESTIMATE: u8 = 3 << 3; // MessageReceipt.token_estimate
const TOKEN_COUNT: u8 = 4 << 3; // MessageReceipt.token_count
const SEQUENCE: u8 = 5 << 3; // MessageReceipt.sequence
const SECONDS: u8 = 1 << 3; // Timestamp.seconds
const NANOS: u8 = 2 << 3; // Timestamp.nanos

/// One receipt's columns, as `MessageReceipt` holds them (times in microseconds).
pub struct Receipts<'a> {
    pub ids: &'a [i64],
    pub create_time_us: &'a [i64],
    pub token_estimates: &'a [i64],
    pub token_counts: &'a [i64],
    pub sequences: &'a [i64],
}

pub(crate) fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// An int64 / int32 field: negative values take ten bytes (two's complement), as
/// protobuf encodes them; zero is omitted (proto3 implicit presence).
fn put_int(out: &mut Vec<u8>, tag: u8, value: i64) {
    if value != 0 {
        out.push(tag);
        put_varint(out, value as u64);
    }
}

/// The serialized `AppendMessagesResponse` with one receipt per row, in order. The
/// timestamp splits microseconds as Python's `divmod(us, 1_000_000)` does (floor), so a
/// time before the epoch gets a negative second and non-negative nanos.
pub fn encode_receipts(r: &Receipts<'_>) -> CoreResult<Vec<u8>> {
    let n = r.ids.len();
    for (column, len) in [
        ("create_time_us", r.create_time_us.len()),
        ("token_estimates", r.token_estimates.len()),
        ("token_counts", r.token_counts.len()),
        ("sequences", r.sequences.len()),
    ] {
        if len != n {
            return Err(CoreError::LengthMismatch {
                column,
                expected: n,
                actual: len,
            });
        }
    }
    let mut out = Vec::with_capacity(n * 32);
    let mut body = Vec::with_capacity(64);
    let mut stamp = Vec::with_capacity(16);
    for i in 0..n {
        stamp.clear();
        let us = r.create_time_us[i];
        put_int(&mut stamp, SECONDS, us.div_euclid(1_000_000));
        put_int(&mut stamp, NANOS, us.rem_euclid(1_000_000) * 1_000);
        body.clear();
        put_int(&mut body, ID, r.ids[i]);
        body.push(CREATE_TIME);
        put_varint(&mut body, stamp.len() as u64);
        body.extend_from_slice(&stamp);
        put_int(&mut body, TOKEN_ESTIMATE, r.token_estimates[i]);
        put_int(&mut body, TOKEN_COUNT, r.token_counts[i]);
        put_int(&mut body, SEQUENCE, r.sequences[i]);
        out.push(RECEIPTS);
        put_varint(&mut out, body.len() as u64);
        out.extend_from_slice(&body);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(id: i64, us: i64, e: i64, c: i64, q: i64) -> Vec<u8> {
        encode_receipts(&Receipts {
            ids: &[id],
            create_time_us: &[us],
            token_estimates: &[e],
            token_counts: &[c],
            sequences: &[q],
        })
        .unwrap()
    }

    #[test]
    fn encodes_a_receipt_as_protobuf_does() {
        // id 1, create_time {seconds 2, nanos 3000}, estimate 4, count 5, sequence 300
        // (two varint bytes: 0xac 0x02).
        assert_eq!(
            one(1, 2_000_003, 4, 5, 300),
            vec![
                0x0a, 0x10, 0x08, 0x01, 0x12, 0x05, 0x08, 0x02, 0x10, 0xb8, 0x17, 0x18, 0x04, 0x20,
                0x05, 0x28, 0xac, 0x02
            ]
        );
    }

    #[test]
    fn zeros_are_omitted_but_the_timestamp_is_present() {
        assert_eq!(one(0, 0, 0, 0, 0), vec![0x0a, 0x02, 0x12, 0x00]);
    }

    #[test]
    fn a_time_before_the_epoch_floors_like_python_divmod() {
        // -1 us: seconds -1 (ten bytes), nanos 999_999_000.
        let bytes = one(0, -1, 0, 0, 0);
        let mut stamp = vec![0x08];
        put_varint(&mut stamp, u64::MAX);
        stamp.push(0x10);
        put_varint(&mut stamp, 999_999_000);
        let mut want = vec![0x0a, stamp.len() as u8 + 2, 0x12, stamp.len() as u8];
        want.extend(stamp);
        assert_eq!(bytes, want);
    }

    #[test]
    fn extremes_do_not_panic() {
        for v in [i64::MIN, i64::MAX, -1, 1] {
            let bytes = one(v, v, v, v, v);
            assert_eq!(bytes[0], RECEIPTS);
        }
    }

    #[test]
    fn columns_of_different_lengths_are_an_error() {
        let err = encode_receipts(&Receipts {
            ids: &[1, 2],
            create_time_us: &[1, 2],
            token_estimates: &[1],
            token_counts: &[1, 2],
            sequences: &[1, 2],
        })
        .unwrap_err();
        assert!(matches!(
            err,
            CoreError::LengthMismatch {
                column: "token_estimates",
                ..
            }
        ));
    }

    #[test]
    fn empty_is_empty() {
        let none: &[i64] = &[];
        let r = Receipts {
            ids: none,
            create_time_us: none,
            token_estimates: none,
            token_counts: none,
            sequences: none,
        };
        assert!(encode_receipts(&r).unwrap().is_empty());
    }
}

/// One `contextd.v1.Message` of an AppendMessagesRequest, as the append reads it: the
/// fields it stores, borrowed from the request bytes, and the three things that send a
/// message down the per-message path (a role other than the four, a tool output
/// reference, a source time), which validates it and raises its errors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WireMessage<'a> {
    pub role: i32,
    pub content: &'a str,
    pub tool_calls: &'a str,
    pub tool_call_id: &'a str,
    pub external_id: &'a str,
    pub metadata: &'a str,
    pub tool_output_id: &'a str,
    pub has_source_time: bool,
}

/// What the decoder refuses: bytes that are not a protobuf encoding (cut short, a varint
/// over ten bytes, a length past the end), strings that are not UTF-8, and group wire
/// types (proto2 groups: never produced for these messages; the caller then takes the
/// protobuf runtime's path, which handles them). Never a panic.
fn malformed(what: &str) -> CoreError {
    CoreError::InvalidArgument(format!("malformed AppendMessagesRequest: {what}"))
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn done(&self) -> bool {
        self.pos >= self.buf.len()
    }

    fn varint(&mut self) -> CoreResult<u64> {
        let mut value = 0u64;
        for i in 0..10 {
            let byte = *self
                .buf
                .get(self.pos)
                .ok_or_else(|| malformed("a varint is cut short"))?;
            self.pos += 1;
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte < 0x80 {
                return Ok(value);
            }
        }
        Err(malformed("a varint is longer than ten bytes"))
    }

    fn bytes(&mut self) -> CoreResult<&'a [u8]> {
        let len = self.varint()?;
        let end = usize::try_from(len)
            .ok()
            .and_then(|len| self.pos.checked_add(len))
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| malformed("a length runs past the end"))?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn skip(&mut self, count: usize) -> CoreResult<()> {
        let end = self
            .pos
            .checked_add(count)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| malformed("a fixed-width field is cut short"))?;
        self.pos = end;
        Ok(())
    }

    /// (field number, wire type) of the next field.
    fn tag(&mut self) -> CoreResult<(u64, u8)> {
        let tag = self.varint()?;
        let field = tag >> 3;
        if field == 0 || field > (1 << 29) - 1 {
            return Err(malformed("a field number out of range"));
        }
        Ok((field, (tag & 7) as u8))
    }

    /// Skip a field this decoder does not read (as protobuf skips unknown fields).
    fn skip_value(&mut self, wire: u8) -> CoreResult<()> {
        match wire {
            0 => self.varint().map(|_| ()),
            1 => self.skip(8),
            2 => self.bytes().map(|_| ()),
            5 => self.skip(4),
            3 | 4 => Err(malformed(
                "a group (wire types 3 and 4) is not decoded here",
            )),
            _ => Err(malformed("an invalid wire type")),
        }
    }
}

fn utf8(bytes: &[u8]) -> CoreResult<&str> {
    std::str::from_utf8(bytes).map_err(|_| malformed("a string field is not UTF-8"))
}

fn decode_message(buf: &[u8]) -> CoreResult<WireMessage<'_>> {
    let mut r = Reader { buf, pos: 0 };
    let mut m = WireMessage::default();
    while !r.done() {
        let (field, wire) = r.tag()?;
        // A known field with another wire type is an unknown field to protobuf.
        match (field, wire) {
            // An enum is an int32: protobuf keeps the low 32 bits of the varint.
            (5, 0) => m.role = r.varint()? as u32 as i32,
            (6, 2) => m.content = utf8(r.bytes()?)?,
            (7, 2) => m.tool_calls = utf8(r.bytes()?)?,
            (8, 2) => m.tool_call_id = utf8(r.bytes()?)?,
            (9, 2) => m.external_id = utf8(r.bytes()?)?,
            (10, 2) => m.metadata = utf8(r.bytes()?)?,
            (18, 2) => {
                // Present once it appears, even empty; its fields are the per-message
                // path's to check, but its bytes must still be a valid Timestamp.
                check_message(r.bytes()?)?;
                m.has_source_time = true;
            }
            (21, 2) => m.tool_output_id = utf8(r.bytes()?)?,
            // Strings the append does not read still must be UTF-8, as protobuf checks.
            (2 | 4 | 13 | 20, 2) => {
                utf8(r.bytes()?)?;
            }
            // Sub-messages it does not read must still parse.
            (3 | 12, 2) => check_message(r.bytes()?)?,
            _ => r.skip_value(wire)?,
        }
    }
    Ok(m)
}

/// Walk a sub-message the append does not read (a Scope, a Timestamp): only that it is a
/// well-formed encoding is checked. Its string fields (a Scope's) are not checked for
/// UTF-8 here; see [`decode_append_messages`].
fn check_message(buf: &[u8]) -> CoreResult<()> {
    let mut r = Reader { buf, pos: 0 };
    while !r.done() {
        let (_, wire) = r.tag()?;
        r.skip_value(wire)?;
    }
    Ok(())
}

/// The `messages` (field 4) of a serialized `contextd.v1.AppendMessagesRequest`, in order,
/// borrowing their text from `buf`; every other field is skipped.
///
/// Why hand-written rather than `prost` or `protobuf`: the append reads eight fields of
/// one message, and the point is to read them straight out of the request bytes with no
/// allocation per message; a generated decoder would build an owned struct per message
/// (and need protoc and code generation at build time). Meant for bytes the protobuf
/// runtime has already accepted (the caller serializes its parsed request): its checks
/// are a guard, and any refusal sends the caller back to the runtime's path. Where a
/// field repeats, the last one wins, as protobuf decodes.
pub fn decode_append_messages(buf: &[u8]) -> CoreResult<Vec<WireMessage<'_>>> {
    let mut r = Reader { buf, pos: 0 };
    let mut out = Vec::new();
    while !r.done() {
        let (field, wire) = r.tag()?;
        match (field, wire) {
            (4, 2) => out.push(decode_message(r.bytes()?)?),
            _ => r.skip_value(wire)?,
        }
    }
    Ok(out)
}

#[cfg(test)]
mod decode_tests {
    use super::*;

    fn field(out: &mut Vec<u8>, number: u64, wire: u8, payload: &[u8]) {
        put_varint(out, number << 3 | u64::from(wire));
        if wire == 2 {
            put_varint(out, payload.len() as u64);
        }
        out.extend_from_slice(payload);
    }

    fn varint(value: u64) -> Vec<u8> {
        let mut v = Vec::new();
        put_varint(&mut v, value);
        v
    }

    fn request(messages: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        field(&mut out, 1, 2, b"agent");
        for m in messages {
            field(&mut out, 4, 2, m);
        }
        field(&mut out, 5, 2, b"req-1");
        field(&mut out, 6, 0, &[1]);
        out
    }

    #[test]
    fn decodes_every_field_the_append_reads() {
        let mut m = Vec::new();
        field(&mut m, 5, 0, &varint(3));
        field(&mut m, 6, 2, "épée 🌍".as_bytes());
        field(&mut m, 7, 2, b"[]");
        field(&mut m, 8, 2, b"c1");
        field(&mut m, 9, 2, b"ext");
        field(&mut m, 10, 2, b"{}");
        field(&mut m, 21, 2, b"to_x");
        let mut stamp = Vec::new();
        field(&mut stamp, 1, 0, &varint(5));
        field(&mut m, 18, 2, &stamp);
        let buf = request(&[m, Vec::new()]);
        let got = decode_append_messages(&buf).unwrap();
        assert_eq!(
            got[0],
            WireMessage {
                role: 3,
                content: "épée 🌍",
                tool_calls: "[]",
                tool_call_id: "c1",
                external_id: "ext",
                metadata: "{}",
                tool_output_id: "to_x",
                has_source_time: true,
            }
        );
        assert_eq!(got[1], WireMessage::default());
    }

    #[test]
    fn unknown_fields_and_wrong_wire_types_are_skipped_and_the_last_value_wins() {
        let mut m = Vec::new();
        field(&mut m, 6, 2, b"first");
        field(&mut m, 99, 0, &varint(u64::MAX)); // unknown varint
        field(&mut m, 98, 1, &[0; 8]); // unknown fixed64
        field(&mut m, 97, 5, &[0; 4]); // unknown fixed32
        field(&mut m, 96, 2, b"\xff\xfe"); // unknown bytes: not checked as UTF-8
        field(&mut m, 5, 2, b"x"); // role with the wrong wire type: unknown
        field(&mut m, 6, 2, b"second");
        field(&mut m, 5, 0, &varint((1 << 32) | 2)); // int32: low 32 bits
        let buf = request(&[m]);
        let got = decode_append_messages(&buf).unwrap();
        assert_eq!(got[0].content, "second");
        assert_eq!(got[0].role, 2);
        let mut m = Vec::new();
        field(&mut m, 5, 0, &varint(u64::MAX)); // -1 as a ten-byte varint
        assert_eq!(decode_append_messages(&request(&[m])).unwrap()[0].role, -1);
    }

    #[test]
    fn malformed_bytes_are_errors_never_panics() {
        let mut m = Vec::new();
        field(&mut m, 6, 2, b"hello");
        field(&mut m, 5, 0, &varint(1));
        let good = request(&[m.clone(), m]);
        assert!(decode_append_messages(&good).is_ok());
        // Every truncation, and every byte replaced by every value: an answer, no panic.
        for cut in 0..good.len() {
            let _ = decode_append_messages(&good[..cut]);
        }
        for i in 0..good.len() {
            for b in 0..=255u8 {
                let mut bad = good.clone();
                bad[i] = b;
                let _ = decode_append_messages(&bad);
            }
        }
        let cases: [&[u8]; 7] = [
            &[0x22, 0x05, 0x32],             // a message shorter than its length
            &[0x22, 0x02, 0x32, 0x05],       // a string past its message's end
            &[0x22, 0x03, 0x32, 0x01, 0xff], // content not UTF-8
            &[
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ], // varint > 10
            &[0x0b],                         // a start-group
            &[0x0f],                         // wire type 7
            &[0x00],                         // field number 0
        ];
        for case in cases {
            assert!(
                matches!(
                    decode_append_messages(case),
                    Err(CoreError::InvalidArgument(_))
                ),
                "{case:?}"
            );
        }
        assert!(decode_append_messages(&[0x22, 0x00]).unwrap()[0] == WireMessage::default());
        assert!(decode_append_messages(&[]).unwrap().is_empty());
    }
}
