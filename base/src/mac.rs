//! `Mac`: the one MAC address type, with the one parser and formatter.
//!
//! MACs cross tetherd as text in three places (CNI requests, the admin API,
//! stored records) and as bytes in netlink; every conversion between the two
//! goes through here, so that all of them accept and print the same forms.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// A 48-bit MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Mac([u8; 6]);

/// The separator a MAC was written with. Runtimes send both forms and
/// CNI_ARGS and runtimeConfig accept both when they are parsed, but a pod
/// interface's MAC is taken only in the colon form: a request keeps which
/// one it used, so that ADD can refuse the other as it always has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Separator {
    /// "0a:58:0a:f4:00:05", the form `ip link` prints.
    Colon,
    /// "0A-58-0A-F4-00-05", the form podman `--mac-address` may pass on.
    Dash,
}

/// Text that is not a MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseMacError;

impl fmt::Display for ParseMacError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not six two-digit hex octets separated by ':'")
    }
}

impl std::error::Error for ParseMacError {}

impl Mac {
    /// The MAC with these octets; `const` so that fixed MACs can be
    /// constants of this type.
    pub const fn new(octets: [u8; 6]) -> Self {
        Mac(octets)
    }

    /// The address's six octets.
    pub const fn octets(self) -> [u8; 6] {
        self.0
    }

    /// The group bit (the low bit of the first octet) is set: the address
    /// names a multicast group (or broadcast), not one interface.
    pub const fn is_multicast(self) -> bool {
        self.0[0] & 1 == 1
    }

    /// All zero: no address at all.
    pub fn is_zero(self) -> bool {
        self.0 == [0; 6]
    }

    /// Usable as one interface's own address: neither multicast nor zero.
    pub fn is_unicast(self) -> bool {
        !self.is_multicast() && !self.is_zero()
    }

    /// Six two-digit hex octets (either case) separated by ':' or, if the
    /// text has a '-' anywhere, by '-'. The separator is returned because
    /// the callers that accept both still treat them differently.
    pub fn parse_either(s: &str) -> Option<(Mac, Separator)> {
        if s.contains('-') {
            parse_with(s, '-').map(|m| (m, Separator::Dash))
        } else {
            parse_with(s, ':').map(|m| (m, Separator::Colon))
        }
    }

    /// `self` if a pod interface may have it; otherwise the error every
    /// caller has always returned, naming the source (`what`) and the text
    /// as it was given.
    pub fn for_pod(self, text: &str, what: &str) -> Result<Mac> {
        if self.is_unicast() {
            Ok(self)
        } else {
            Err(Error::InvalidConfig(format!(
                "{what}: {text} is a multicast or zero MAC; a pod interface needs a unicast one"
            )))
        }
    }

    /// Parses a MAC for a pod interface: the colon form, unicast, not zero.
    /// Errors are `InvalidConfig` naming `what`.
    pub fn parse_pod(s: &str, what: &str) -> Result<Mac> {
        s.parse::<Mac>()
            .map_err(|_| not_a_mac(s, what))?
            .for_pod(s, what)
    }
}

/// The error for text that is not a MAC where a pod interface's MAC is
/// expected (`what` names where it came from).
pub fn not_a_mac(s: &str, what: &str) -> Error {
    Error::InvalidConfig(format!("{what}: {s:?} is not a MAC address"))
}

/// The one parser: exactly six octets of exactly two hex digits each.
/// `u8::from_str_radix` alone would also take "+a" or "a", hence the digit
/// check.
fn parse_with(s: &str, sep: char) -> Option<Mac> {
    let mut out = [0u8; 6];
    let mut parts = s.split(sep);
    for b in &mut out {
        let part = parts.next()?;
        if part.len() != 2 || !part.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        *b = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(Mac(out))
}

impl FromStr for Mac {
    type Err = ParseMacError;

    /// The colon form, either case: what tether writes and what every
    /// record and API has always stored.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        parse_with(s, ':').ok_or(ParseMacError)
    }
}

impl fmt::Display for Mac {
    /// The way `ip link` prints it, and the form stored everywhere:
    /// "0a:58:0a:01:00:05".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// Records store a MAC in its [`Display`](fmt::Display) form and read it
/// back with [`FromStr`] (either case), as they did when they held strings.
impl serde::Serialize for Mac {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Mac {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        text.parse()
            .map_err(|_| serde::de::Error::custom(format!("{text:?} is not a MAC address")))
    }
}

impl From<[u8; 6]> for Mac {
    fn from(octets: [u8; 6]) -> Self {
        Mac(octets)
    }
}

impl From<Mac> for [u8; 6] {
    fn from(mac: Mac) -> Self {
        mac.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: [u8; 6] = [0x0a, 0x58, 0x0a, 0xf4, 0x00, 0x05];

    #[test]
    fn parses_the_colon_form_in_either_case() {
        assert_eq!("0a:58:0a:f4:00:05".parse::<Mac>(), Ok(Mac(M)));
        assert_eq!("0A:58:0A:F4:00:05".parse::<Mac>(), Ok(Mac(M)));
    }

    #[test]
    fn rejects_anything_else() {
        for bad in [
            "",
            "0a:58:0a:f4:00",
            "0a:58:0a:f4:00:05:06",
            "0a:58:0a:f4:00:05:",
            "0a:58:0a:f4:0:5",
            "0a:58:0a:f4:000:5",
            "zz:58:0a:f4:00:05",
            "+a:58:0a:f4:00:05",
            " 0a:58:0a:f4:00:05",
            "0a-58-0a-f4-00-05",
            "0a:58-0a:f4:00:05",
        ] {
            assert_eq!(bad.parse::<Mac>(), Err(ParseMacError), "{bad:?}");
        }
    }

    #[test]
    fn parse_either_takes_dashes_too_and_says_which() {
        assert_eq!(
            Mac::parse_either("0A-58-0A-F4-00-05"),
            Some((Mac(M), Separator::Dash))
        );
        assert_eq!(
            Mac::parse_either("0a:58:0a:f4:00:05"),
            Some((Mac(M), Separator::Colon))
        );
        for bad in [
            "0a-58:0a:f4:00:05",
            "0a-58-0a-f4-00",
            "0a:58",
            "zz-58-0a-f4-00-05",
        ] {
            assert_eq!(Mac::parse_either(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn display_round_trips_in_lower_case() {
        let mac = Mac::from(M);
        assert_eq!(mac.to_string(), "0a:58:0a:f4:00:05");
        assert_eq!(mac.to_string().parse::<Mac>(), Ok(mac));
        assert_eq!(
            "0A:58:0A:F4:00:05".parse::<Mac>().map(|m| m.to_string()),
            Ok("0a:58:0a:f4:00:05".into())
        );
        assert_eq!(<[u8; 6]>::from(mac), M);
        assert_eq!(mac.octets(), M);
    }

    #[test]
    fn multicast_and_zero() {
        let multicast = Mac::from([0x01, 0x00, 0x5e, 0, 0, 1]);
        assert!(multicast.is_multicast() && !multicast.is_unicast());
        assert!(Mac::from([0xff; 6]).is_multicast());
        let zero = Mac::from([0; 6]);
        assert!(zero.is_zero() && !zero.is_multicast() && !zero.is_unicast());
        let unicast = Mac::from(M);
        assert!(unicast.is_unicast() && !unicast.is_zero() && !unicast.is_multicast());
    }

    #[test]
    fn pod_macs_must_be_unicast_six_octets() {
        assert_eq!(Mac::parse_pod("0a:58:0a:f4:00:05", "m").unwrap(), Mac(M));
        for bad in [
            "0a:58:0a:f4:00",
            "0a:58:0a:f4:00:05:06",
            "0a:58:0a:f4:0:5",
            "zz:58:0a:f4:00:05",
            "01:00:5e:00:00:01",
            "00:00:00:00:00:00",
        ] {
            let err = Mac::parse_pod(bad, "m").unwrap_err();
            assert_eq!(err.code(), 7, "{bad}");
        }
        let err = Mac::parse_pod("01:00:5e:00:00:01", "CNI_ARGS MAC").unwrap_err();
        assert!(err.to_string().contains("multicast or zero"), "{err}");
        let err = Mac::parse_pod("0a:58", "CNI_ARGS MAC").unwrap_err();
        assert!(
            err.to_string().contains("\"0a:58\" is not a MAC address"),
            "{err}"
        );
    }

    #[test]
    fn records_keep_the_text_form_they_always_had() {
        let mac: Mac = "0a:58:0a:01:00:05".parse().unwrap();
        assert_eq!(
            serde_json::to_string(&mac).unwrap(),
            "\"0a:58:0a:01:00:05\""
        );
        // Either case reads back; the colon form only.
        let upper: Mac = serde_json::from_str("\"0A:58:0A:01:00:05\"").unwrap();
        assert_eq!(upper, mac);
        let err = serde_json::from_str::<Mac>("\"0a-58-0a-01-00-05\"").unwrap_err();
        assert!(err.to_string().contains("is not a MAC address"), "{err}");
        assert!(serde_json::from_str::<Mac>("5").is_err());
    }
}
