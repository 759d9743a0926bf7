//! JSON answers written byte for byte as upstream writes them: Go's `json.NewEncoder(w).
//! Encode(v)` (upstream `runner/internal/common/api/api.go`, `JSONResponseHandler`), which
//! is compact, escapes `<`, `>`, `&`, U+2028 and U+2029 in strings (`SetEscapeHTML` is on by
//! default) and ends the document with a newline.

use std::io;

use serde::Serialize;
use serde_json::ser::{CompactFormatter, Formatter};

/// `value` as Go's encoder writes it, newline included.
pub(crate) fn to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::with_capacity(128);
    let mut ser = serde_json::Serializer::with_formatter(&mut out, GoFormatter);
    value.serialize(&mut ser)?;
    out.push(b'\n');
    Ok(out)
}

/// serde_json's compact output, plus the escapes Go's encoder adds.
struct GoFormatter;

impl Formatter for GoFormatter {
    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        let mut rest = fragment;
        while let Some(at) = rest.find(['<', '>', '&', '\u{2028}', '\u{2029}']) {
            CompactFormatter.write_string_fragment(writer, &rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or('&');
            write!(writer, "\\u{:04x}", u32::from(c))?;
            rest = &rest[at + c.len_utf8()..];
        }
        CompactFormatter.write_string_fragment(writer, rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes written by Go 1.27's `json.Encoder` for the same values (upstream's encoder).
    #[test]
    fn writes_what_go_writes() {
        let text = |v: &serde_json::Value| String::from_utf8(to_vec(v).unwrap()).unwrap();
        assert_eq!(
            text(&serde_json::json!({"m": "a<b>&c\u{2028}\u{2029}d"})),
            "{\"m\":\"a\\u003cb\\u003e\\u0026c\\u2028\\u2029d\"}\n"
        );
        // Control characters: Go (since 1.22) and serde_json both use \b, \f, \n, \r, \t and
        // \u00XX for the others; quotes and backslashes are escaped; the rest is verbatim.
        assert_eq!(
            text(&serde_json::json!(["\u{8}\u{c}\n\r\t\u{1}\"\\é\u{7f}"])),
            "[\"\\b\\f\\n\\r\\t\\u0001\\\"\\\\é\u{7f}\"]\n"
        );
        assert_eq!(
            text(&serde_json::json!({"dcgm": null})),
            "{\"dcgm\":null}\n"
        );
    }
}
