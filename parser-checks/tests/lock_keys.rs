//! Name → key: the documented formula, pinned; namespaces that separate; bad names and
//! namespaces refused with one-line typed errors. Two versions of dblock that disagreed on
//! one key would both "hold" one lock, so the formula is checked against its
//! documentation (SHA-256 computed here, apart from the crate) for any name, and pinned
//! by values computed independently (Python's `hashlib`).

use dblock::{DEFAULT_NAMESPACE, Key, MAX_NAME_LEN, MAX_NAMESPACE_LEN};
use dblock_parser_checks::{documented_key, lock_name};
use proptest::prelude::*;

/// Computed with Python's `hashlib.sha256`: never change them.
#[test]
fn keys_of_awkward_names_are_pinned() {
    let x1024 = "x".repeat(1024);
    let e512 = "é".repeat(512);
    let vectors: &[(&str, &str, u64)] = &[
        ("public", "a\nb", 0xecc8_5113_8723_5f24),
        ("public", " ", 0x82d6_ad1c_5bf3_767e),
        ("public", &x1024, 0xc139_5745_b59b_aa71),
        (&e512, "n", 0x7cfe_0cde_fc79_9dea),
        ("billing", "autoland:7", 0x59fc_cefc_397a_4c72),
        ("public", "名前", 0x51b0_f0c5_0613_232f),
        ("public", "😀", 0x1646_e360_d276_eab0),
        ("a\x01b", "\x7f", 0x5ff2_e87b_4f2f_35c5),
    ];
    for &(ns, name, want) in vectors {
        let got = Key::new(ns, name)
            .unwrap_or_else(|e| panic!("{e}"))
            .as_i64() as u64;
        assert_eq!(got, want, "key of ({ns:?}, {name:?}) is {got:#018x}");
    }
    let slot = Key::slot("public", "exports", u32::MAX).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(slot.as_i64() as u64, 0x3af6_df80_17f0_edd1);
    assert_eq!(DEFAULT_NAMESPACE, "public");
}

/// A name as users write them, and the awkward ones.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z:_/.0-9-]{1,40}",
        "\\PC{1,30}",
        "[^\\x00]{1,20}",
        Just("x".repeat(MAX_NAME_LEN)),
        Just("é".repeat(MAX_NAME_LEN / 2)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Every valid name keys by the documented formula; the slot keys of a semaphore
    /// differ from the name's key and from each other.
    #[test]
    fn every_name_keys_by_the_documented_formula(ns in name(), n in name(), slot in 0u32..1000) {
        let key = Key::new(&ns, &n).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(key.as_i64(), documented_key(&ns, &n));
        let s = Key::slot(&ns, &n, slot).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let s2 = Key::slot(&ns, &n, slot + 1).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_ne!(s, key);
        prop_assert_ne!(s, s2);
        // The formula of a slot, from its documentation.
        use sha2::{Digest, Sha256};
        let d = Sha256::digest(format!("{ns}\0{n}\0{slot}").as_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&d[..8]);
        prop_assert_eq!(s.as_i64(), i64::from_be_bytes(first));
        lock_name(&ns, &n);
    }

    /// A namespace separates names: the same name in two namespaces, or one text split
    /// differently between namespace and name, gives two keys.
    #[test]
    fn namespaces_separate_equal_names(a in name(), b in name(), n in name(), cut in any::<prop::sample::Index>()) {
        prop_assume!(a != b);
        prop_assert_ne!(Key::new(&a, &n).ok(), Key::new(&b, &n).ok());
        let whole = format!("{a}{n}");
        let mut at = 1 + cut.index(whole.len() - 1);
        while !whole.is_char_boundary(at) { at -= 1; }
        prop_assume!(at > 0 && at != a.len());
        let (x, y) = whole.split_at(at);
        prop_assert_ne!(Key::new(&a, &n).ok(), Key::new(x, y).ok(), "({:?}, {:?}) vs ({:?}, {:?})", a, n, x, y);
    }

    /// Any namespace and name, valid or not: a key exactly when both are valid, else a
    /// one-line `InvalidNamespace` or `InvalidName`; never a panic.
    #[test]
    fn any_name_is_a_key_or_a_one_line_typed_error(
        ns in prop_oneof![name(), Just(String::new()), ".{0,5}\0.{0,5}", Just("n".repeat(MAX_NAMESPACE_LEN + 1))],
        n in prop_oneof![name(), Just(String::new()), ".{0,5}\0.{0,5}", Just("é".repeat(MAX_NAME_LEN / 2 + 1))],
    ) {
        lock_name(&ns, &n);
    }
}
