//! Lock names and the fixed function that turns them into 64-bit keys.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::Error;

/// The longest lock name accepted, in bytes of UTF-8.
pub const MAX_NAME_LEN: usize = 1024;

/// The longest namespace accepted, in bytes of UTF-8.
pub const MAX_NAMESPACE_LEN: usize = 1024;

/// The namespace of a handle that names none: on PostgreSQL unless the server setting
/// [`NAMESPACE_SETTING`] gives one, on the embedded backend, and for `dblock key`
/// without `--namespace`.
///
/// A constant, so that every process on one database keys a name alike whatever its
/// role, `search_path` or the schemas that exist (see `docs/namespaces.md`). It is
/// PostgreSQL's default schema, so keys are those of dblock 0.x handles whose schema in
/// use was `public`.
pub const DEFAULT_NAMESPACE: &str = "public";

/// The PostgreSQL setting that gives a handle's default namespace when
/// [`Builder::namespace`](crate::Builder::namespace) does not: `dblock.namespace`, read
/// once when the handle is built. Set it where every process of a deployment gets it
/// alike: for the database (`ALTER DATABASE app SET dblock.namespace = 'billing'`), the
/// role, or the URL (`?options=-c%20dblock.namespace%3Dbilling`). Unset or empty, the
/// namespace is [`DEFAULT_NAMESPACE`].
pub const NAMESPACE_SETTING: &str = "dblock.namespace";

/// The 64-bit key a lock name maps to: what PostgreSQL's advisory-lock functions take,
/// and (reduced to 63 bits) the byte offset of the embedded backend's file lock.
///
/// # The formula
///
/// ```text
/// key = first 8 bytes, read big-endian as a signed 64-bit integer, of
///       SHA-256( UTF-8(namespace) || 0x00 || UTF-8(name) )
/// ```
///
/// Neither part may contain NUL, so the encoding is unambiguous. The function is fixed
/// for all versions of dblock, platforms and Rust releases; the test vectors below pin
/// it. **Never change it**: two versions that disagree would both "hold" one lock.
///
/// A program in another language takes the same lock by computing the same digest. In
/// PostgreSQL itself (11 or later):
///
/// ```sql
/// SELECT ('x' || left(encode(sha256(
///          convert_to('public', 'UTF8') || '\x00'::bytea || convert_to('autoland:7', 'UTF8')
///        ), 'hex'), 16))::bit(64)::bigint;
/// ```
///
/// ```
/// use dblock::Key;
/// // Pinned: never change these values.
/// assert_eq!(Key::new("public", "autoland:7")?.as_i64(), -5686219459067394536);
/// # Ok::<(), dblock::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(i64);

/// The largest limit a semaphore may have: the slots a name's slot keys run over
/// (`Key::slot(ns, name, 0..MAX_SEMAPHORE_LIMIT)`).
pub const MAX_SEMAPHORE_LIMIT: u32 = 1024;

impl Key {
    /// The key of `name` in `namespace`, after checking both.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] when `name` is empty, longer than [`MAX_NAME_LEN`] bytes or
    /// contains NUL; [`Error::InvalidNamespace`] when `namespace` is empty, longer than
    /// [`MAX_NAMESPACE_LEN`] bytes or contains NUL.
    pub fn new(namespace: &str, name: &str) -> Result<Key, Error> {
        check_namespace(namespace)?;
        check_name(name)?;
        Ok(Key::derive(namespace, name))
    }

    /// The formula itself, for inputs already checked.
    pub(crate) fn derive(namespace: &str, name: &str) -> Key {
        let mut h = Sha256::new();
        h.update(namespace.as_bytes());
        h.update([0u8]);
        h.update(name.as_bytes());
        let digest = h.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        Key(i64::from_be_bytes(first))
    }

    /// The key of slot `slot` (counted from 0) of the semaphore `name` in `namespace`,
    /// after checking both: what [`Locks::semaphore`](crate::Locks::semaphore) locks.
    ///
    /// ```text
    /// slot key = first 8 bytes, read big-endian as a signed 64-bit integer, of
    ///            SHA-256( UTF-8(namespace) || 0x00 || UTF-8(name) || 0x00 || ASCII(slot in decimal) )
    /// ```
    ///
    /// A slot's key depends on the name and the slot's number only, not on the
    /// semaphore's limit; it never equals a lock name's key (its digest input has a
    /// second NUL, which no name contains). Pinned like [`Key::new`]:
    ///
    /// ```
    /// use dblock::Key;
    /// // Pinned: never change these values.
    /// assert_eq!(Key::slot("public", "exports", 1)?.as_i64(), -4993880158896479936);
    /// # Ok::<(), dblock::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Key::new`].
    pub fn slot(namespace: &str, name: &str, slot: u32) -> Result<Key, Error> {
        check_namespace(namespace)?;
        check_name(name)?;
        Ok(Key::derive_slot(namespace, name, slot))
    }

    /// The slot formula itself, for inputs already checked.
    pub(crate) fn derive_slot(namespace: &str, name: &str, slot: u32) -> Key {
        let mut h = Sha256::new();
        h.update(namespace.as_bytes());
        h.update([0u8]);
        h.update(name.as_bytes());
        h.update([0u8]);
        h.update(slot.to_string().as_bytes());
        let digest = h.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        Key(i64::from_be_bytes(first))
    }

    /// A key given directly, for locks shared with programs that chose their own number
    /// (the seed's migration key, say).
    pub const fn from_i64(key: i64) -> Key {
        Key(key)
    }

    /// The key as PostgreSQL's `pg_advisory_lock(bigint)` takes it.
    pub const fn as_i64(self) -> i64 {
        self.0
    }

    /// The `(classid, objid)` pair under which PostgreSQL shows this key in `pg_locks`
    /// (with `locktype = 'advisory'` and `objsubid = 1`): the high and low 32 bits.
    ///
    /// ```
    /// let key = dblock::Key::from_i64(0x4442_4c4f_434b_4d01);
    /// assert_eq!(key.pg_locks_ids(), (0x4442_4c4f, 0x434b_4d01));
    /// ```
    pub const fn pg_locks_ids(self) -> (u32, u32) {
        let k = self.0 as u64;
        ((k >> 32) as u32, k as u32)
    }

    /// The byte offset the embedded backend locks for this key: the key's bits as an
    /// unsigned number, reduced modulo 2^63 − 1 so the offset fits a signed file offset.
    pub const fn file_offset(self) -> u64 {
        // The bits are below 2^64 = 2 × (2^63 − 1) + 2: at most two subtractions reduce
        // them, where `%` by the constant compiled to 11 instructions of multiplying and
        // shifting on every lock and release (and the benchmark floor's every cycle).
        const M: u64 = i64::MAX as u64;
        let k = self.0 as u64;
        let k = if k >= M { k - M } else { k };
        if k >= M { k - M } else { k }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.0)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The key of `name` in `namespace` (a namespace already checked), after checking the
/// name: [`Key::new`] for the paths every request takes. A name keyed on this thread a
/// moment ago is not hashed again (see [`recent`]).
pub(crate) fn key_of(namespace: &str, name: &str) -> Result<Key, Error> {
    recent::key(namespace, name)
}

/// A map by a key or a value derived from one (a lock file's offset). They come from
/// SHA-256 digests, so they need no keyed hash against chosen collisions; SipHash cost
/// as much as a third of an embedded uncontended cycle.
pub(crate) type DigestMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<DigestHasher>>;

/// The hash of a key or offset: its bits mixed by one multiplication, the high half
/// (which every input bit reaches) brought down to the low bits the map indexes by —
/// the low bits of an offset itself are alike within one part of the embedded table.
#[derive(Default)]
pub(crate) struct DigestHasher(u64);

impl std::hash::Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(32)
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only integers are hashed; any other input still hashes, byte by byte.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }

    fn write_i64(&mut self, n: i64) {
        self.0 ^= n as u64;
    }
}

/// The keys of names recently keyed on this thread. A service locks the same names again
/// and again ("autoland:7", a job's name); SHA-256 of one, with the CPU's SHA extensions,
/// was 8 % of an embedded lock cycle (docs/performance.md, 2026-12-05). A table per thread of
/// [`recent::SETS`] sets of [`recent::WAYS`] entries (12 KiB), no lock, no allocation:
/// an entry holds the namespace and name byte for byte (only pairs of up to
/// [`recent::BYTES`] bytes together are kept), so a hit is exactly the pair asked for;
/// a set's oldest entry makes room for a new one. A pair kept was checked when it was
/// first keyed, so a hit skips the name's check too.
pub(crate) mod recent {
    use std::cell::RefCell;

    use super::{Key, check_name};
    use crate::Error;

    /// Sets per thread (a power of two).
    pub(crate) const SETS: usize = 64;
    /// Entries per set.
    pub(crate) const WAYS: usize = 4;
    /// The longest namespace and name, together, an entry keeps.
    pub(crate) const BYTES: usize = 37;

    #[derive(Clone, Copy)]
    struct Entry {
        key: i64,
        /// Bits of the pair's hash, told apart before the bytes are compared.
        tag: u8,
        /// Bytes of the namespace; 0: the entry is empty (a namespace is never empty).
        ns: u8,
        /// Bytes of the name.
        name: u8,
        bytes: [u8; BYTES],
    }

    const EMPTY: Entry = Entry {
        key: 0,
        tag: 0,
        ns: 0,
        name: 0,
        bytes: [0; BYTES],
    };

    thread_local! {
        static TABLE: RefCell<[[Entry; WAYS]; SETS]> =
            const { RefCell::new([[EMPTY; WAYS]; SETS]) };
    }

    /// A multiplicative hash of the pair's bytes, eight at a time. Not keyed: chosen
    /// names can only evict each other, never be taken for one another.
    fn hash(namespace: &[u8], name: &[u8]) -> u64 {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut h = ((namespace.len() as u64) << 8 | name.len() as u64).wrapping_mul(K);
        for part in [namespace, name] {
            let mut chunks = part.chunks_exact(8);
            for c in &mut chunks {
                let mut w = [0u8; 8];
                w.copy_from_slice(c);
                h = (h.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
            }
            let mut w = [0u8; 8];
            w[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
            h = (h.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
        }
        h
    }

    /// The key of `name` in `namespace`, from the table or hashed (and kept).
    pub(crate) fn key(namespace: &str, name: &str) -> Result<Key, Error> {
        let (ns, nm) = (namespace.as_bytes(), name.as_bytes());
        let total = ns.len() + nm.len();
        if total > BYTES || ns.is_empty() {
            check_name(name)?;
            return Ok(Key::derive(namespace, name));
        }
        let h = hash(ns, nm);
        let (set, tag) = ((h >> 58) as usize % SETS, (h >> 50) as u8);
        let hit = TABLE.with(|t| {
            let t = t.borrow();
            t[set]
                .iter()
                .find(|e| {
                    e.tag == tag
                        && usize::from(e.ns) == ns.len()
                        && usize::from(e.name) == nm.len()
                        && e.bytes[..ns.len()] == *ns
                        && e.bytes[ns.len()..total] == *nm
                })
                .map(|e| e.key)
        });
        if let Some(k) = hit {
            return Ok(Key(k));
        }
        check_name(name)?;
        let key = Key::derive(namespace, name);
        TABLE.with(|t| {
            let ways = &mut t.borrow_mut()[set];
            ways.rotate_right(1);
            let e = &mut ways[0];
            e.key = key.0;
            e.tag = tag;
            e.ns = ns.len() as u8;
            e.name = nm.len() as u8;
            e.bytes[..ns.len()].copy_from_slice(ns);
            e.bytes[ns.len()..total].copy_from_slice(nm);
        });
        Ok(key)
    }
}

/// Checks a lock name: non-empty UTF-8 without NUL, at most [`MAX_NAME_LEN`] bytes.
pub(crate) fn check_name(name: &str) -> Result<(), Error> {
    let reason = if name.is_empty() {
        "a lock name must not be empty"
    } else if name.len() > MAX_NAME_LEN {
        "a lock name must be at most 1024 bytes of UTF-8"
    } else if name.contains('\0') {
        "a lock name must not contain NUL"
    } else {
        return Ok(());
    };
    Err(Error::InvalidName {
        name: shorten(name),
        reason,
    })
}

/// Checks a namespace: non-empty UTF-8 without NUL, at most [`MAX_NAMESPACE_LEN`] bytes.
pub(crate) fn check_namespace(namespace: &str) -> Result<(), Error> {
    let reason = if namespace.is_empty() {
        "a namespace must not be empty"
    } else if namespace.len() > MAX_NAMESPACE_LEN {
        "a namespace must be at most 1024 bytes of UTF-8"
    } else if namespace.contains('\0') {
        "a namespace must not contain NUL"
    } else {
        return Ok(());
    };
    Err(Error::InvalidNamespace {
        namespace: shorten(namespace),
        reason,
    })
}

/// A name as it can appear in an error message: NUL shown as `\0`, cut at 80 characters.
fn shorten(s: &str) -> String {
    let mut out: String = s.chars().take(80).collect::<String>().replace('\0', "\\0");
    if s.chars().count() > 80 {
        out.push('…');
    }
    out
}

/// A key serializes (feature `serde`) as its signed 64-bit value, as the servers show it.
#[cfg(feature = "serde")]
impl serde::Serialize for Key {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i64(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread's table of recent keys gives exactly what hashing gives, for every pair
    /// (evicted, split differently, too long to keep), and never lets a bad name by.
    #[test]
    fn recent_keys_are_the_hashed_keys() {
        let mut pairs: Vec<(String, String)> = Vec::new();
        for ns in ["public", "tenant_a", "p"] {
            for i in 0..300 {
                pairs.push((ns.to_string(), format!("job:{i}")));
            }
        }
        // Namespace and name split differently over the same bytes.
        pairs.push(("ab".into(), "c".into()));
        pairs.push(("a".into(), "bc".into()));
        // Around the longest pair kept.
        for len in recent::BYTES - 8..recent::BYTES + 3 {
            pairs.push(("public".into(), "n".repeat(len - 6)));
        }
        for round in 0..3 {
            for (ns, name) in &pairs {
                let want = Key::derive(ns, name);
                assert_eq!(
                    key_of(ns, name).unwrap(),
                    want,
                    "{ns}/{name}, round {round}"
                );
                // Again at once: the kept entry.
                assert_eq!(key_of(ns, name).unwrap(), want, "{ns}/{name} again");
            }
        }
        assert_ne!(key_of("ab", "c").unwrap(), key_of("a", "bc").unwrap());
        for bad in ["", "a\0b"] {
            key_of("public", "a").unwrap();
            assert!(matches!(
                key_of("public", bad),
                Err(Error::InvalidName { .. })
            ));
            assert!(matches!(
                key_of("public", bad),
                Err(Error::InvalidName { .. })
            ));
        }
        let long = "x".repeat(MAX_NAME_LEN + 1);
        assert!(matches!(
            key_of("public", &long),
            Err(Error::InvalidName { .. })
        ));
    }

    /// The pinned vectors, computed independently (Python's `hashlib.sha256`). If one of these changes, every deployment mixing versions
    /// would grant one lock twice: never change them.
    #[test]
    fn the_key_function_is_pinned_by_test_vectors() {
        let vectors: &[(&str, &str, u64)] = &[
            ("public", "autoland:7", 0xb116_7d87_635f_c618),
            ("public", "autoland:8", 0x1145_a2b8_0b6c_bb18),
            ("public", "diffusion:3:src/lib.rs", 0xdb6c_21fa_1493_f11b),
            ("tenant_a", "autoland:7", 0x327c_97b8_0574_c2f4),
            ("public", "x", 0xd727_28ad_d7a9_fa31),
            ("public", "ünïcødé ✓", 0x1033_a49d_8e60_1ba2),
        ];
        for &(ns, name, want) in vectors {
            let got = Key::new(ns, name).unwrap().as_i64() as u64;
            assert_eq!(got, want, "key of ({ns:?}, {name:?}) is {got:#018x}");
        }
    }

    /// Computed independently (Python's `hashlib.sha256`, and PostgreSQL's `sha256`):
    /// never change them.
    #[test]
    fn slot_keys_are_pinned_and_distinct_from_name_keys() {
        let vectors: &[(&str, &str, u32, u64)] = &[
            ("public", "exports", 0, 0xe048_815b_63e8_09e2),
            ("public", "exports", 1, 0xbab2_2c74_461a_a140),
            ("public", "exports", 2, 0xbaa0_326d_6013_ddc3),
            ("tenant_a", "exports", 0, 0x2919_0c4c_c996_cd8b),
        ];
        for &(ns, name, slot, want) in vectors {
            let got = Key::slot(ns, name, slot).unwrap().as_i64() as u64;
            assert_eq!(
                got, want,
                "slot {slot} of ({ns:?}, {name:?}) is {got:#018x}"
            );
        }
        assert_ne!(
            Key::slot("public", "exports", 0).unwrap(),
            Key::new("public", "exports").unwrap()
        );
        assert!(Key::slot("public", "", 0).is_err());
    }

    #[test]
    fn namespaces_separate_keys() {
        assert_ne!(Key::new("a", "n").unwrap(), Key::new("b", "n").unwrap());
        // The separator makes ("ab", "c") and ("a", "bc") distinct.
        assert_ne!(Key::new("ab", "c").unwrap(), Key::new("a", "bc").unwrap());
    }

    #[test]
    fn bad_names_are_typed_errors() {
        for bad in ["", "a\0b", &"x".repeat(MAX_NAME_LEN + 1)] {
            match Key::new("public", bad) {
                Err(Error::InvalidName { .. }) => {}
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        assert!(Key::new("public", &"x".repeat(MAX_NAME_LEN)).is_ok());
        // Multi-byte characters count in bytes.
        assert!(Key::new("public", &"é".repeat(MAX_NAME_LEN / 2 + 1)).is_err());
        for bad in ["", "n\0s"] {
            assert!(matches!(
                Key::new(bad, "n"),
                Err(Error::InvalidNamespace { .. })
            ));
        }
    }

    #[test]
    fn pg_locks_ids_split_the_key_in_halves() {
        assert_eq!(Key::from_i64(-1).pg_locks_ids(), (u32::MAX, u32::MAX));
        assert_eq!(Key::from_i64(1).pg_locks_ids(), (0, 1));
        assert_eq!(Key::from_i64(i64::MIN).pg_locks_ids(), (0x8000_0000, 0));
    }

    #[test]
    fn file_offsets_fit_a_signed_offset() {
        for k in [i64::MIN, -1, 0, 1, i64::MAX] {
            assert!(Key::from_i64(k).file_offset() < i64::MAX as u64);
        }
        assert_eq!(Key::from_i64(5).file_offset(), 5);
    }

    /// The offset is the key's bits modulo 2^63 − 1, whatever computes it: checked
    /// against `%` at every edge of the two subtractions and across the range.
    #[test]
    fn file_offsets_are_the_bits_modulo_2_63_minus_1() {
        const M: u64 = i64::MAX as u64;
        let edges = [0, 1, M - 1, M, M + 1, 2 * M - 1, 2 * M, 2 * M + 1, u64::MAX];
        let spread = (0..10_000u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for bits in edges.into_iter().chain(spread) {
            assert_eq!(Key::from_i64(bits as i64).file_offset(), bits % M, "{bits}");
        }
    }
}
