//! Bit-exact ports of the hash functions PostgreSQL uses for
//! `PARTITION BY HASH`.
//!
//! PostgreSQL routes a row of a hash-partitioned table by calling the
//! partition key's "extended" hash support function (`hashint8extended`,
//! `hashtextextended`, `uuid_hash_extended`, ...) with the fixed seed
//! `HASH_PARTITION_SEED`, folding the per-column results together with
//! `hash_combine64` starting from `0` (`compute_partition_hash_value` in
//! `src/backend/partitioning/partbounds.c`), and taking the result modulo the
//! greatest modulus of the table. Every one of those pieces is reproduced here
//! so that a client can tell, without asking the server, which partition (and
//! therefore which shard laid out as hash partitions) owns a key.
//!
//! Sources the code was ported from:
//!
//! * `src/common/hashfn.c`: `hash_bytes_extended` and
//!   `hash_bytes_uint32_extended` (Bob Jenkins' lookup3, 2006 revision, with
//!   the 64-bit output `((uint64) b << 32) | c`);
//! * `src/backend/access/hash/hashfunc.c`: `hashint4extended`,
//!   `hashint8extended`, `hashtextextended`;
//! * `src/backend/utils/adt/uuid.c`: `uuid_hash_extended`;
//! * `src/include/common/hashfn.h`: `hash_combine64`;
//! * `src/include/catalog/partition.h`: `HASH_PARTITION_SEED`.
//!
//! PostgreSQL's C code has separate big- and little-endian paths; the
//! little-endian one is the one every mainstream server (x86-64, aarch64)
//! runs, and it is the one ported here. The results are independent of the
//! host the Rust code runs on, because every word is loaded with
//! [`u32::from_le_bytes`]. All arithmetic is the wrapping (mod 2^32 / 2^64)
//! arithmetic of C unsigned integers.
//!
//! The unit tests at the bottom pin vectors that were produced by a real
//! PostgreSQL 15 server.

/// Seed PostgreSQL passes to every extended hash function when it computes a
/// row's hash partition.
///
/// Bit-compatible because it is the literal value of `HASH_PARTITION_SEED`
/// (`UINT64CONST(0x7A5B22367996DCFD)`) from
/// `src/include/catalog/partition.h`. In SQL, where `bigint` is signed, the
/// same seed is written `8816678312871386365`.
pub const HASH_PARTITION_SEED: u64 = 0x7A5B_2236_7996_DCFD;

/// Initial value of lookup3's internal state before the key length is added
/// (`0x9e3779b9 + len + 3923095` in `hashfn.c`).
const LOOKUP3_INIT: u32 = 0x9e37_79b9_u32.wrapping_add(3_923_095);

/// lookup3's internal state, the `a`, `b` and `c` of `hashfn.c`.
struct State {
    a: u32,
    b: u32,
    c: u32,
}

impl State {
    /// `a = b = c = 0x9e3779b9 + len + 3923095`.
    const fn new(len: u32) -> Self {
        let v = LOOKUP3_INIT.wrapping_add(len);
        Self { a: v, b: v, c: v }
    }

    /// The `if (seed != 0)` block shared by both extended functions: the seed
    /// is treated as a 12-byte chunk (high word, low word, zero) and mixed in.
    /// A zero seed leaves the state untouched, exactly as in C.
    const fn seed(&mut self, seed: u64) {
        if seed != 0 {
            // Truncating casts are the C `(uint32)` casts of the original.
            self.a = self.a.wrapping_add((seed >> 32) as u32);
            self.b = self.b.wrapping_add(seed as u32);
            self.mix();
        }
    }

    /// `mix(a, b, c)` from `hashfn.c`.
    const fn mix(&mut self) {
        let (mut a, mut b, mut c) = (self.a, self.b, self.c);
        a = a.wrapping_sub(c);
        a ^= c.rotate_left(4);
        c = c.wrapping_add(b);
        b = b.wrapping_sub(a);
        b ^= a.rotate_left(6);
        a = a.wrapping_add(c);
        c = c.wrapping_sub(b);
        c ^= b.rotate_left(8);
        b = b.wrapping_add(a);
        a = a.wrapping_sub(c);
        a ^= c.rotate_left(16);
        c = c.wrapping_add(b);
        b = b.wrapping_sub(a);
        b ^= a.rotate_left(19);
        a = a.wrapping_add(c);
        c = c.wrapping_sub(b);
        c ^= b.rotate_left(4);
        b = b.wrapping_add(a);
        self.a = a;
        self.b = b;
        self.c = c;
    }

    /// `final(a, b, c)` from `hashfn.c`.
    const fn finalize(&mut self) {
        let (mut a, mut b, mut c) = (self.a, self.b, self.c);
        c ^= b;
        c = c.wrapping_sub(b.rotate_left(14));
        a ^= c;
        a = a.wrapping_sub(c.rotate_left(11));
        b ^= a;
        b = b.wrapping_sub(a.rotate_left(25));
        c ^= b;
        c = c.wrapping_sub(b.rotate_left(16));
        a ^= c;
        a = a.wrapping_sub(c.rotate_left(4));
        b ^= a;
        b = b.wrapping_sub(a.rotate_left(14));
        c ^= b;
        c = c.wrapping_sub(b.rotate_left(24));
        self.a = a;
        self.b = b;
        self.c = c;
    }

    /// The 64-bit result of the extended variants: `((uint64) b << 32) | c`.
    const fn output64(&self) -> u64 {
        ((self.b as u64) << 32) | self.c as u64
    }
}

/// Hashes one 32-bit value to 64 bits with a seed, bit-for-bit like
/// PostgreSQL's `hash_bytes_uint32_extended` (`src/common/hashfn.c`, exposed
/// to the backend as `hash_uint32_extended`).
///
/// It is a direct transcription: state initialised for a 4-byte key, the seed
/// mixed in only when non-zero, `k` added to `a`, `final`, and the result
/// `((uint64) b << 32) | c`. With `seed == 0` it equals
/// [`hash_bytes_extended`] of `k`'s four little-endian bytes with seed 0, as
/// in PostgreSQL.
#[must_use]
pub const fn hash_uint32_extended(k: u32, seed: u64) -> u64 {
    let mut s = State::new(4);
    s.seed(seed);
    s.a = s.a.wrapping_add(k);
    s.finalize();
    s.output64()
}

/// Hashes a byte string to 64 bits with a seed, bit-for-bit like
/// PostgreSQL's `hash_bytes_extended` (`src/common/hashfn.c`, called by the
/// backend as `hash_any_extended`).
///
/// Every full 12-byte block is read as three little-endian words added to
/// `a`, `b`, `c` and followed by `mix`, as in the C code (whose aligned and
/// unaligned paths give identical results on little-endian hosts). The last
/// 0..=11 bytes follow the C `switch (len)` with its fall-throughs: bytes
/// `0..4` go into `a` and `4..8` into `b` as little-endian words, while bytes
/// `8..11` go into `c` shifted up by one byte, because the lowest byte of `c`
/// is reserved for the length. Zero-padding the tail to 12 bytes and loading
/// words reproduces those cases exactly, since absent bytes add nothing. The
/// initial state includes the length as a `uint32`, as C's `int keylen` does;
/// PostgreSQL never hashes values of 1 GiB or more, so the truncating cast
/// never matters for values it can store.
#[must_use]
pub fn hash_bytes_extended(k: &[u8], seed: u64) -> u64 {
    // Truncation matches C, where the length is an `int` copied to `uint32`.
    let mut s = State::new(k.len() as u32);
    s.seed(seed);

    let mut blocks = k.chunks_exact(12);
    for block in &mut blocks {
        s.a = s.a.wrapping_add(le_word(block, 0));
        s.b = s.b.wrapping_add(le_word(block, 4));
        s.c = s.c.wrapping_add(le_word(block, 8));
        s.mix();
    }

    let rest = blocks.remainder();
    let mut tail = [0_u8; 12];
    tail[..rest.len()].copy_from_slice(rest);
    s.a = s.a.wrapping_add(le_word(&tail, 0));
    s.b = s.b.wrapping_add(le_word(&tail, 4));
    // `case 11: c += k[10] << 24; case 10: c += k[9] << 16; case 9: c += k[8] << 8;`
    s.c =
        s.c.wrapping_add(u32::from_le_bytes([0, tail[8], tail[9], tail[10]]));

    s.finalize();
    s.output64()
}

/// Little-endian `u32` at `bytes[at..at + 4]`; `bytes` always holds 12 bytes.
fn le_word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// PostgreSQL's `hashint8extended` (`src/backend/access/hash/hashfunc.c`), the
/// extended hash support function of `bigint`.
///
/// Bit-compatible because it performs the same folding as the C code: the
/// low half is XORed with the high half for non-negative values and with the
/// complement of the high half for negative ones, then hashed with
/// [`hash_uint32_extended`]. The folding makes every `bigint` that fits in an
/// `int4` hash like that `int4` ([`hashint4extended`]), which PostgreSQL
/// relies on for cross-type hash joins.
#[must_use]
pub const fn hashint8extended(v: i64, seed: u64) -> u64 {
    // `(uint32) val` and `(uint32) (val >> 32)`: truncation is intended.
    let mut lohalf = v as u32;
    let hihalf = (v >> 32) as u32;
    lohalf ^= if v >= 0 { hihalf } else { !hihalf };
    hash_uint32_extended(lohalf, seed)
}

/// PostgreSQL's `hashint4extended` (`src/backend/access/hash/hashfunc.c`), the
/// extended hash support function of `integer`.
///
/// Bit-compatible because, like the C code, it hashes the value's two's
/// complement bit pattern (`(uint32) int32`) with [`hash_uint32_extended`].
#[must_use]
pub const fn hashint4extended(v: i32, seed: u64) -> u64 {
    hash_uint32_extended(v.cast_unsigned(), seed)
}

/// PostgreSQL's `hashtextextended` (`src/backend/access/hash/hashfunc.c`) for a
/// column with a deterministic collation, the extended hash support function
/// of `text` and `varchar`.
///
/// With a deterministic collation (`"C"`, `"POSIX"`, or any libc/ICU collation
/// not declared `deterministic = false`, i.e. every default database
/// collation) PostgreSQL hashes the raw bytes of the value with
/// `hash_any_extended`; in a UTF-8 database those bytes are the string's
/// UTF-8 encoding, which is what this hashes with [`hash_bytes_extended`].
/// Nondeterministic collations hash a `strxfrm` sort key instead and are not
/// covered.
#[must_use]
pub fn hashtextextended(s: &str, seed: u64) -> u64 {
    hash_bytes_extended(s.as_bytes(), seed)
}

/// PostgreSQL's `uuid_hash_extended` (`src/backend/utils/adt/uuid.c`), the
/// extended hash support function of `uuid`.
///
/// Bit-compatible because PostgreSQL hashes the 16 bytes of the UUID in their
/// storage order, which is the RFC 4122 byte order of the textual form (what
/// `uuid::Uuid::as_bytes` returns), with `hash_any_extended`.
#[must_use]
pub fn uuid_hash_extended(u: &[u8; 16], seed: u64) -> u64 {
    hash_bytes_extended(u, seed)
}

/// Combines two 64-bit hashes, bit-for-bit like PostgreSQL's `hash_combine64`
/// (`src/include/common/hashfn.h`):
/// `a ^= b + 0x49a0f4dd15e5a8e3 + (a << 54) + (a >> 7)` with C's wrapping
/// `uint64` arithmetic.
///
/// `compute_partition_hash_value` folds the hash of each non-null partition
/// key column into a running value that starts at `0` with this function.
#[must_use]
pub const fn hash_combine64(a: u64, b: u64) -> u64 {
    a ^ b
        .wrapping_add(0x49a0_f4dd_15e5_a8e3)
        .wrapping_add(a << 54)
        .wrapping_add(a >> 7)
}

/// The row hash PostgreSQL computes for a hash-partitioned table whose only
/// partition key column is a non-null `bigint` holding `v`.
///
/// This is `compute_partition_hash_value` (`partbounds.c`) specialised to one
/// `int8` column: `hash_combine64(0, hashint8extended(v, HASH_PARTITION_SEED))`.
/// PostgreSQL stores the row in the partition whose remainder is
/// `partition_hash_i64(v) % modulus` when all partitions share the same
/// modulus (in general, the modulus used is the greatest one).
#[must_use]
pub const fn partition_hash_i64(v: i64) -> u64 {
    hash_combine64(0, hashint8extended(v, HASH_PARTITION_SEED))
}

/// The row hash PostgreSQL computes for a hash-partitioned table whose only
/// partition key column is a non-null value hashed as raw bytes.
///
/// This is `compute_partition_hash_value` (`partbounds.c`) specialised to one
/// column whose extended hash is `hash_any_extended` over its bytes:
/// `hash_combine64(0, hash_bytes_extended(k, HASH_PARTITION_SEED))`. Pass the
/// UTF-8 bytes of a `text`/`varchar` key with a deterministic collation (see
/// [`hashtextextended`]) or the 16 bytes of a `uuid` key (see
/// [`uuid_hash_extended`]); the row then lives in the partition whose
/// remainder is `partition_hash_bytes(k) % modulus`.
#[must_use]
pub fn partition_hash_bytes(k: &[u8]) -> u64 {
    hash_combine64(0, hash_bytes_extended(k, HASH_PARTITION_SEED))
}

#[cfg(test)]
mod tests {
    //! Every expected value below was produced by a real PostgreSQL 15.20
    //! server (UTF-8 database, deterministic default collation), e.g.
    //! `SELECT hashint8extended(v, 8816678312871386365)::bigint`, and is
    //! written here as the `u64` reinterpretation of the signed `bigint` the
    //! server returned. Partition remainders come from rows inserted into a
    //! table `PARTITION BY HASH` with 16 partitions of `MODULUS 16`.

    use super::*;

    /// Parses the canonical textual UUID form into its 16 storage bytes.
    fn uuid(text: &str) -> [u8; 16] {
        let hex: Vec<u8> = text.bytes().filter(|b| *b != b'-').collect();
        assert_eq!(hex.len(), 32, "bad uuid literal {text}");
        let mut out = [0_u8; 16];
        for (i, pair) in hex.chunks_exact(2).enumerate() {
            let pair = std::str::from_utf8(pair).expect("ascii");
            out[i] = u8::from_str_radix(pair, 16).expect("hex digit");
        }
        out
    }

    /// PostgreSQL prints the `uint64` hash as a signed `bigint`.
    const fn pg(signed: i64) -> u64 {
        signed.cast_unsigned()
    }

    #[test]
    fn seed_is_the_signed_bigint_used_in_sql() {
        assert_eq!(HASH_PARTITION_SEED.cast_signed(), 8_816_678_312_871_386_365);
    }

    #[test]
    fn int8_matches_postgres() {
        // (v, hashint8extended(v, 8816678312871386365), hashint8extended(v, 0))
        let cases: [(i64, i64, i64); 14] = [
            (0, -4403592609991167795, 4154612158245552303),
            (1, 5968994663651403477, -3670598878359251130),
            (-1, -5017072347659237694, -1888257769727981238),
            (42, 7363975540656877951, 8010225493015854792),
            (-42, 6660635123915733087, 8809670066178192187),
            (2147483647, -6050265599104649060, -9109110466470504941),
            (2147483648, 4938542303000433043, 1977219185673256887),
            (-2147483648, 4938542303000433043, 1977219185673256887),
            (-2147483649, -6050265599104649060, -9109110466470504941),
            (4294967295, -5017072347659237694, -1888257769727981238),
            (4294967296, 5968994663651403477, -3670598878359251130),
            (-4294967297, 2147707635919668551, 495194309054116481),
            (i64::MIN, -6050265599104649060, -9109110466470504941),
            (i64::MAX, 4938542303000433043, 1977219185673256887),
        ];
        for (v, seeded, unseeded) in cases {
            assert_eq!(
                hashint8extended(v, HASH_PARTITION_SEED),
                pg(seeded),
                "v={v}"
            );
            assert_eq!(hashint8extended(v, 0), pg(unseeded), "v={v}, seed 0");
        }
    }

    #[test]
    fn int4_matches_postgres() {
        // (v, hashint4extended(v, 8816678312871386365), hashint4extended(v, 0))
        let cases: [(i32, i64, i64); 5] = [
            (0, -4403592609991167795, 4154612158245552303),
            (1, 5968994663651403477, -3670598878359251130),
            (-1, -5017072347659237694, -1888257769727981238),
            (i32::MAX, -6050265599104649060, -9109110466470504941),
            (i32::MIN, 4938542303000433043, 1977219185673256887),
        ];
        for (v, seeded, unseeded) in cases {
            assert_eq!(
                hashint4extended(v, HASH_PARTITION_SEED),
                pg(seeded),
                "v={v}"
            );
            assert_eq!(hashint4extended(v, 0), pg(unseeded), "v={v}, seed 0");
            // Cross-type compatibility PostgreSQL relies on.
            assert_eq!(
                hashint8extended(i64::from(v), HASH_PARTITION_SEED),
                pg(seeded)
            );
        }
    }

    #[test]
    fn text_matches_postgres() {
        // (s, hashtextextended(s, 8816678312871386365), hashtextextended(s, 0)),
        // covering the empty string, every tail shape around the 12- and
        // 24-byte block boundaries, and multibyte UTF-8.
        let cases: [(&str, i64, i64); 10] = [
            ("", -5700645584453517373, -6939563903564495251),
            ("a", -6705225459120232837, 3591986179850072241),
            ("abc", 3628778498291917250, -6747756470228489321),
            ("hello world!", -1886269529411655687, -2866487628948787489),
            ("hello, world!!", 2340689786818451783, -4964900182117406930),
            (
                "The quick brown fox jumps",
                5652438115739902581,
                -6568008242738964476,
            ),
            (
                "The quick brown fox jumps over the lazy dog",
                5870222023910117606,
                2182139051089226439,
            ),
            (
                "h\u{e9}llo w\u{f6}rld",
                -145319379157667650,
                6639232088034648728,
            ),
            (
                "\u{65e5}\u{672c}\u{8a9e}\u{30c6}\u{30ad}\u{30b9}\u{30c8}",
                3781793241886115942,
                7199576139645017696,
            ),
            (
                "\u{1f600}\u{1f600}\u{1f600}",
                5558714317672374403,
                8724223271110288099,
            ),
        ];
        for (s, seeded, unseeded) in cases {
            assert_eq!(
                hashtextextended(s, HASH_PARTITION_SEED),
                pg(seeded),
                "{s:?}"
            );
            assert_eq!(hashtextextended(s, 0), pg(unseeded), "{s:?}, seed 0");
        }
    }

    #[test]
    fn uuid_matches_postgres() {
        // (u, uuid_hash_extended(u, 8816678312871386365), uuid_hash_extended(u, 0))
        let cases: [(&str, i64, i64); 4] = [
            (
                "00000000-0000-0000-0000-000000000000",
                -5281082146396728638,
                -6859010066814654381,
            ),
            (
                "ffffffff-ffff-ffff-ffff-ffffffffffff",
                -148986464341306210,
                293445543803463785,
            ),
            (
                "123e4567-e89b-12d3-a456-426614174000",
                -1252132692482143582,
                -1647950126005018481,
            ),
            (
                "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
                424513190990560493,
                7543054272012930821,
            ),
        ];
        for (text, seeded, unseeded) in cases {
            let u = uuid(text);
            assert_eq!(
                uuid_hash_extended(&u, HASH_PARTITION_SEED),
                pg(seeded),
                "{text}"
            );
            assert_eq!(uuid_hash_extended(&u, 0), pg(unseeded), "{text}, seed 0");
        }
    }

    #[test]
    fn partition_remainders_match_postgres() {
        // Remainder of the MODULUS 16 partition PostgreSQL routed each key to.
        let int8: [(i64, u64); 9] = [
            (0, 0),
            (42, 2),
            (-42, 2),
            (-1, 5),
            (2147483648, 6),
            (i64::MAX, 6),
            (1, 8),
            (-4294967297, 10),
            (i64::MIN, 15),
        ];
        for (k, remainder) in int8 {
            assert_eq!(partition_hash_i64(k) % 16, remainder, "bigint {k}");
        }

        let text: [(&str, u64); 6] = [
            ("h\u{e9}llo w\u{f6}rld", 1),
            ("", 6),
            ("\u{1f600}\u{1f600}\u{1f600}", 6),
            ("The quick brown fox jumps over the lazy dog", 9),
            ("hello world!", 12),
            ("a", 14),
        ];
        for (k, remainder) in text {
            assert_eq!(
                partition_hash_bytes(k.as_bytes()) % 16,
                remainder,
                "text {k:?}"
            );
        }

        let uuids: [(&str, u64); 3] = [
            ("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", 0),
            ("00000000-0000-0000-0000-000000000000", 5),
            ("123e4567-e89b-12d3-a456-426614174000", 5),
        ];
        for (k, remainder) in uuids {
            assert_eq!(partition_hash_bytes(&uuid(k)) % 16, remainder, "uuid {k}");
        }
    }

    #[test]
    fn partition_hash_is_combine_of_extended_hash() {
        for v in [0_i64, -7, 1 << 40] {
            assert_eq!(
                partition_hash_i64(v),
                hash_combine64(0, hashint8extended(v, HASH_PARTITION_SEED))
            );
        }
        // hash_combine64(0, b) is b plus the constant (wrapping).
        assert_eq!(hash_combine64(0, 0), 0x49a0_f4dd_15e5_a8e3);
        assert_eq!(hash_combine64(0, u64::MAX), 0x49a0_f4dd_15e5_a8e2);
    }
}
