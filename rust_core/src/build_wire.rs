//! Protobuf wire encoding of the bulky parts of a `contextd.v1.BuildContextResponse`: its
//! kept messages (field 4, `ContextMessage`) and a packed list of ids (`BuildStats`'s
//! `dropped_ids`).
//!
//! Why here: every LLM call an agent makes is a BuildContext, and its response was built
//! in Python one `ContextMessage` and two `Timestamp`s per kept message, then up to
//! 10,000 dropped ids packed and merged into the stats, then the whole message
//! serialized again by the protobuf runtime; for a 10,000-message thread that was about
//! as much of the server's interpreter time as the build itself. Here the messages and
//! the ids are written once, as bytes, and the caller joins them with the small fields
//! the protobuf runtime serializes (see `contextd.api.convert.build_response_bytes`).
//! The output is exactly what the runtime writes (fields in number order, zero scalars
//! and empty strings omitted, a timestamp present whenever the message has one), which
//! `tests/test_build_response_bytes.py` checks against it.

use crate::wire::put_varint;

/// `BuildContextResponse.messages` (field 4, length-delimited).
const MESSAGES: u8 = 4 << 3 | 2;
const ID: u8 = 1 << 3;
const ROLE: u8 = 2 << 3;
const CONTENT: u8 = 3 << 3 | 2;
const TOOL_CALLS: u8 = 4 << 3 | 2;
const TOOL_CALL_ID: u8 = 5 << 3 | 2;
const TOKEN_COUNT: u8 = 6 << 3;
const TRUNCATED: u8 = 7 << 3;
const ELIDED: u8 = 8 << 3;
const IS_SUMMARY: u8 = 9 << 3;
const CREATE_TIME: u8 = 10 << 3 | 2;
const SOURCE_TIME: u8 = 11 << 3 | 2;
const SEQUENCE: u8 = 12 << 3;
const SECONDS: u8 = 1 << 3; // Timestamp.seconds
const NANOS: u8 = 2 << 3; // Timestamp.nanos

/// One `contextd.v1.ContextMessage` (times in microseconds; None: the field is unset).
#[derive(Debug, Clone, Default)]
pub struct ContextMessage<'a> {
    pub id: i64,
    pub role: i64,
    pub content: &'a str,
    pub tool_calls: &'a str,
    pub tool_call_id: &'a str,
    pub token_count: i64,
    pub truncated: bool,
    pub elided: bool,
    pub is_summary: bool,
    pub create_time_us: Option<i64>,
    pub source_time_us: Option<i64>,
    pub sequence: i64,
}

/// An int64 or enum field; zero is omitted (proto3 implicit presence), a negative value
/// takes ten bytes (two's complement, as protobuf writes int32 and int64 alike).
fn put_int(out: &mut Vec<u8>, tag: u8, value: i64) {
    if value != 0 {
        out.push(tag);
        put_varint(out, value as u64);
    }
}

fn put_bool(out: &mut Vec<u8>, tag: u8, value: bool) {
    if value {
        out.push(tag);
        out.push(1);
    }
}

fn put_str(out: &mut Vec<u8>, tag: u8, value: &str) {
    if !value.is_empty() {
        out.push(tag);
        put_varint(out, value.len() as u64);
        out.extend_from_slice(value.as_bytes());
    }
}

/// A Timestamp, present even at the epoch; microseconds split as Python's
/// `divmod(us, 1_000_000)` splits them (floor: a time before the epoch has a negative
/// second and non-negative nanos).
fn put_time(out: &mut Vec<u8>, tag: u8, us: Option<i64>) {
    let Some(us) = us else { return };
    let mut stamp = [0u8; 32];
    let mut len = 0;
    for (field, value) in [
        (SECONDS, us.div_euclid(1_000_000)),
        (NANOS, us.rem_euclid(1_000_000) * 1_000),
    ] {
        if value != 0 {
            stamp[len] = field;
            len = write_varint(&mut stamp, len + 1, value as u64);
        }
    }
    out.push(tag);
    out.push(len as u8); // at most 22 bytes: one byte of length
    out.extend_from_slice(&stamp[..len]);
}

/// Appends `m` to `out` as one entry of `BuildContextResponse.messages` (its tag, its
/// length, its fields); `body` is scratch space, reused between calls.
pub fn put_context_message(out: &mut Vec<u8>, body: &mut Vec<u8>, m: &ContextMessage<'_>) {
    body.clear();
    put_int(body, ID, m.id);
    put_int(body, ROLE, m.role);
    put_str(body, CONTENT, m.content);
    put_str(body, TOOL_CALLS, m.tool_calls);
    put_str(body, TOOL_CALL_ID, m.tool_call_id);
    put_int(body, TOKEN_COUNT, m.token_count);
    put_bool(body, TRUNCATED, m.truncated);
    put_bool(body, ELIDED, m.elided);
    put_bool(body, IS_SUMMARY, m.is_summary);
    put_time(body, CREATE_TIME, m.create_time_us);
    put_time(body, SOURCE_TIME, m.source_time_us);
    put_int(body, SEQUENCE, m.sequence);
    out.push(MESSAGES);
    put_varint(out, body.len() as u64);
    out.extend_from_slice(body);
}

/// `value`'s varint written into `buf` from `at` (which must have room: at most ten
/// bytes); returns the index after it. By index into a sized buffer rather than pushed
/// (`put_varint`'s capacity check per byte).
#[inline]
fn write_varint(buf: &mut [u8], mut at: usize, mut value: u64) -> usize {
    while value >= 0x80 {
        buf[at] = (value as u8) | 0x80;
        at += 1;
        value >>= 7;
    }
    buf[at] = value as u8;
    at + 1
}

/// A packed repeated int64 field numbered `field`: its key, the payload's length and
/// each value's varint; nothing when `values` is empty (the runtime writes no empty
/// packed field).
pub fn packed_int64(field: u32, values: &[i64]) -> Vec<u8> {
    if values.is_empty() {
        return Vec::new();
    }
    let payload: usize = values.iter().map(|&v| varint_len(v as u64)).sum();
    let mut out = Vec::with_capacity(payload + 16);
    put_varint(&mut out, u64::from(field) << 3 | 2);
    put_varint(&mut out, payload as u64);
    // Written into the sized buffer by index rather than pushed (a capacity check per
    // byte).
    let start = out.len();
    out.resize(start + payload, 0);
    let mut at = start;
    for &v in values {
        at = write_varint(&mut out, at, v as u64);
    }
    debug_assert_eq!(at, start + payload);
    out
}

fn varint_len(value: u64) -> usize {
    // 1 byte per 7 significant bits, at least one.
    let bits = 64 - (value | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(m: &ContextMessage<'_>) -> Vec<u8> {
        let (mut out, mut body) = (Vec::new(), Vec::new());
        put_context_message(&mut out, &mut body, m);
        out
    }

    #[test]
    fn an_empty_message_is_its_key_and_a_zero_length() {
        assert_eq!(encode(&ContextMessage::default()), vec![MESSAGES, 0]);
    }

    #[test]
    fn encodes_a_message_as_protobuf_does() {
        let m = ContextMessage {
            id: 300,
            role: 2,
            content: "hi",
            tool_calls: "",
            tool_call_id: "c",
            token_count: 1,
            truncated: true,
            elided: false,
            is_summary: true,
            create_time_us: Some(2_000_003),
            source_time_us: Some(0),
            sequence: 5,
        };
        let want = vec![
            0x08, 0xac, 0x02, // id 300
            0x10, 0x02, // role 2
            0x1a, 0x02, b'h', b'i', // content
            0x2a, 0x01, b'c', // tool_call_id
            0x30, 0x01, // token_count
            0x38, 0x01, // truncated
            0x48, 0x01, // is_summary
            0x52, 0x05, 0x08, 0x02, 0x10, 0xb8, 0x17, // create_time {2 s, 3000 ns}
            0x5a, 0x00, // source_time at the epoch: present, empty
            0x60, 0x05, // sequence
        ];
        let mut full = vec![MESSAGES, want.len() as u8];
        full.extend(want);
        assert_eq!(encode(&m), full);
    }

    #[test]
    fn a_time_before_the_epoch_floors_like_python_divmod() {
        let m = ContextMessage {
            create_time_us: Some(-1),
            ..Default::default()
        };
        let mut stamp = vec![SECONDS];
        put_varint(&mut stamp, u64::MAX);
        stamp.push(NANOS);
        put_varint(&mut stamp, 999_999_000);
        let mut body = vec![CREATE_TIME, stamp.len() as u8];
        body.extend(stamp);
        let mut want = vec![MESSAGES, body.len() as u8];
        want.extend(body);
        assert_eq!(encode(&m), want);
    }

    #[test]
    fn extremes_do_not_panic() {
        for v in [i64::MIN, i64::MAX, -1, 1] {
            let m = ContextMessage {
                id: v,
                role: v,
                token_count: v,
                create_time_us: Some(v),
                source_time_us: Some(v),
                sequence: v,
                ..Default::default()
            };
            assert_eq!(encode(&m)[0], MESSAGES);
        }
    }

    #[test]
    fn packed_ids_are_the_varints_one_by_one() {
        let mut values: Vec<i64> = vec![0, 1, -1, i64::MIN, i64::MAX];
        for shift in 0..64 {
            let p = 1u64 << shift;
            values.extend([
                p as i64,
                (p - 1) as i64,
                p.wrapping_add(1) as i64,
                (p as i64).wrapping_neg(),
            ]);
        }
        values.extend(
            (0..2_000).map(|i: i64| i.wrapping_mul(0x9E37_79B9_7F4A_7C15_u64 as i64) >> (i % 64)),
        );
        let got = packed_int64(10, &values);
        let mut payload = Vec::new();
        for &v in &values {
            put_varint(&mut payload, v as u64);
        }
        let mut want = vec![0x52];
        put_varint(&mut want, payload.len() as u64);
        want.extend(payload);
        assert_eq!(got, want);
    }

    #[test]
    fn packed_ids_are_key_length_and_varints() {
        assert!(packed_int64(10, &[]).is_empty());
        assert_eq!(
            packed_int64(10, &[1, 300]),
            vec![0x52, 0x03, 0x01, 0xac, 0x02]
        );
        let neg = packed_int64(10, &[-1]);
        assert_eq!(neg.len(), 12); // key, length 10, ten bytes
        assert_eq!(neg[1], 10);
        for v in [0u64, 1, 127, 128, 16_383, 16_384, u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out.len(), varint_len(v));
        }
    }
}
