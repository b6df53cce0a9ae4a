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

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
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
