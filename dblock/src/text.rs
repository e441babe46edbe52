//! Short text kept without an allocation: a guard's copy of its lock's name, a server's
//! answer to a lock request (`t`, a fencing token). Every lock cycle makes one of each, and
//! most are short.

/// Text kept inline when it is short ([`ShortText::INLINE`] bytes or fewer), as most lock
/// names and answers are, so that keeping it allocates nothing; boxed when it is longer.
/// As large as a `(Box<str>, u64)` (24 bytes, a `String`'s size).
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum ShortText {
    /// `len` bytes of `bytes`, copied whole from a `&str`.
    Inline {
        len: u8,
        bytes: [u8; ShortText::INLINE],
    },
    Boxed(Box<str>),
}

impl ShortText {
    /// The longest text kept inline, in bytes.
    pub(crate) const INLINE: usize = 22;

    pub(crate) fn new(text: &str) -> ShortText {
        let mut bytes = [0; ShortText::INLINE];
        match (bytes.get_mut(..text.len()), u8::try_from(text.len())) {
            (Some(head), Ok(len)) => {
                head.copy_from_slice(text.as_bytes());
                ShortText::Inline { len, bytes }
            }
            _ => ShortText::Boxed(text.into()),
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        match self {
            // Copied from a `&str` whole, so always valid UTF-8: the fallback is never taken.
            ShortText::Inline { len, bytes } => bytes
                .get(..usize::from(*len))
                .and_then(|b| std::str::from_utf8(b).ok())
                .unwrap_or_default(),
            ShortText::Boxed(text) => text,
        }
    }
}

impl std::fmt::Debug for ShortText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::ShortText;

    /// Every text comes back as given, on either side of the inline limit, with a
    /// character of several bytes across it too.
    #[test]
    fn text_comes_back_as_given_inline_or_boxed() {
        let at_limit = "n".repeat(ShortText::INLINE);
        let over = "n".repeat(ShortText::INLINE + 1);
        let straddling = format!("{}é", "n".repeat(ShortText::INLINE - 1));
        for text in [
            "",
            "t",
            "job",
            "ü€😀",
            "-9223372036854775808",
            &at_limit,
            &over,
            &straddling,
        ] {
            let kept = ShortText::new(text);
            assert_eq!(kept.as_str(), text);
            assert_eq!(kept.clone().as_str(), text);
            let inline = matches!(kept, ShortText::Inline { .. });
            assert_eq!(inline, text.len() <= ShortText::INLINE, "{text:?}");
        }
        assert_eq!(format!("{:?}", ShortText::new("t")), "\"t\"");
        assert_eq!(
            std::mem::size_of::<ShortText>(),
            std::mem::size_of::<(Box<str>, u64)>()
        );
        // A lock request's pair of answers is no larger than a pair of `String`s.
        assert!(
            std::mem::size_of::<[Option<ShortText>; 2]>()
                <= std::mem::size_of::<[Option<String>; 2]>()
        );
    }
}
